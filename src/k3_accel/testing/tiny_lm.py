"""A tiny target that is a language model: the random tiny Qwen3, trained on its tokenizer's text.

A random network continues any prompt chaotically: its next token hangs on
every earlier token, so no small draft can guess it (a draft distilled from
the random tiny target reaches a few percent; an oracle that copies the
continuation of the anchor's last occurrence gets about 5 %). Real targets are
predictable because language is. :func:`write_tiny_lm_target` writes
:func:`~k3_accel.testing.tiny.write_tiny_target`'s random checkpoint and
trains it for a few seconds (CPU, seeded) on the built-in text its tokenizer
was trained on, so that it continues that text as a real model would. Same
architecture, files and tokenizer; only the weights differ. ``tiny_lm.json``
records how it was trained.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from k3_accel.testing.target_data import load_target, one_thread
from k3_accel.testing.tiny import _TEXT, _save, write_tiny_target

RECORD = "tiny_lm.json"


def corpus_ids(target_dir: str | Path) -> torch.Tensor:
    """The built-in text as token ids of the target's tokenizer."""
    from tokenizers import Tokenizer
    tok_file = Path(target_dir) / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{tok_file}: the tiny LM needs the tiny tokenizer (pip install tokenizers)")
    return torch.tensor(Tokenizer.from_file(str(tok_file)).encode(_TEXT).ids, dtype=torch.long)


def write_tiny_lm_target(dir: str | Path, *, steps: int = 60, batch: int = 16, window: int = 48,
                         lr: float = 3e-3, seed: int = 0, **target: Any) -> Path:
    """Write the tiny target (``target`` are :func:`write_tiny_target`'s
    options) and train it ``steps`` steps on random windows of the built-in
    text (next-token cross-entropy, AdamW); returns the path."""
    t0 = time.perf_counter()
    out = write_tiny_target(dir, seed=seed, **target)
    text = corpus_ids(out)
    if len(text) <= window:
        raise ValueError(f"the built-in text has {len(text)} tokens; window {window} is too long")
    with one_thread():
        model, losses = _train(out, text, steps, batch, window, lr, seed)
    dtype = json.loads((out / "config.json").read_text())["torch_dtype"]
    _save(out, {k: v.detach() for k, v in model.state_dict().items()}, dtype)
    (out / RECORD).write_text(json.dumps({
        "steps": steps, "batch": batch, "window": window, "lr": lr, "seed": seed, "corpus_tokens": len(text),
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "train_s": round(time.perf_counter() - t0, 2)}, indent=1) + "\n")
    return out


def _train(target: Path, text: torch.Tensor, steps: int, batch: int, window: int, lr: float, seed: int):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = load_target(target).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(text) - window, (batch,), generator=gen).tolist()
        x = torch.stack([text[s:s + window] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(round(float(loss.detach()), 4))
    return model, losses
