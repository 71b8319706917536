"""A tiny DSpark draft for a tiny target: the distilled DFlash backbone plus a trained Markov head.

:func:`distill_tiny_dspark` takes the DFlash draft :mod:`.distill` trained for the target (its
backbone, in DFlash's ``1 + K`` fill-in layout, which DSpark checkpoints use with
``sample_from_anchor: false``), keeps it frozen and trains DSpark's Markov head on the target's
own greedy continuations: ``logits_j = base_j + markov_w2(markov_w1[prev_j])`` with ``prev_j``
the token before draft ``j`` (the anchor first), cross-entropy to the target's token (teacher
forcing; plain PyTorch, CPU, seeded). No confidence head is trained, so the checkpoint has none.

It writes the checkpoint in the layout vLLM 0.33's ``Qwen3DSparkForCausalLM`` loads and
``dspark.json`` with held-out acceptance of simulated greedy speculative decoding at K, with the
Markov head and without it (the bias switched off), drafting sequentially as the engine does
(each draft conditions the next).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from k3_accel.testing.distill import greedy_walk
from k3_accel.testing.draft_model import TrainableDFlash
from k3_accel.testing.target_data import TargetData, one_thread, target_sequences
from k3_accel.testing.tiny import write_dflash
from k3_accel.testing.tiny_dspark import tiny_dspark_weights

REPORT = "dspark.json"


@dataclass
class DSparkReport:
    path: str
    k: int
    markov_rank: int
    acceptance: float                 # held-out, greedy speculative decoding at k, with the Markov head
    acceptance_backbone: float        # the same with the Markov bias off (the DFlash backbone alone)
    accepted_per_step: float
    loss_first: float
    loss_last: float
    total_s: float


def distill_tiny_dspark(out_dir: str | Path, target_dir: str | Path, dflash_dir: str | Path, k: int = 4,
                        rank: int = 16, steps: int = 150, sequences: int = 96, seed: int = 0) -> DSparkReport:
    """Write a DSpark draft (the backbone of ``dflash_dir`` + a trained Markov head) to ``out_dir``."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    cfg = json.loads((Path(dflash_dir) / "config.json").read_text())
    backbone = load_file(str(Path(dflash_dir) / "model.safetensors"))
    layer_ids = cfg["dflash_config"]["target_layer_ids"]
    with one_thread():
        torch.manual_seed(seed)
        data = target_sequences(target_dir, layer_ids, (8, 24), sequences, 40, seed=seed)
        held_out = target_sequences(target_dir, layer_ids, (8, 24), 32, 40, seed=seed + 1_000_003)
        model = TrainableDFlash(backbone, cfg, data.embed, data.lm_head).requires_grad_(False)
        w1 = torch.nn.Parameter(torch.randn(cfg["vocab_size"], rank) * 0.1)
        w2 = torch.nn.Parameter(torch.zeros(cfg.get("draft_vocab_size", cfg["vocab_size"]), rank))
        history = _train(model, data, w1, w2, k, steps, seed)
        with_head, per_step = acceptance(model, held_out, k, w1.detach(), w2.detach())
        without, _ = acceptance(model, held_out, k, w1.detach(), torch.zeros_like(w2))
    tensors, config = tiny_dspark_weights(target_dir, markov_rank=rank, confidence=False, sample_from_anchor=False,
                                          block_size=cfg["dflash_config"]["block_size"],
                                          target_layer_ids=tuple(layer_ids))
    assert set(backbone) <= set(tensors), "the backbone's tensors are DSpark's"
    tensors.update(backbone)
    tensors["markov_head.markov_w1.weight"], tensors["markov_head.markov_w2.weight"] = w1.detach(), w2.detach()
    config["mask_token_id"] = cfg["dflash_config"]["mask_token_id"]
    write_dflash(out, tensors, config)
    report = DSparkReport(str(out), k, rank, with_head, without, per_step, history[0], history[-1],
                          time.perf_counter() - t0)
    (out / REPORT).write_text(json.dumps(asdict(report), indent=1) + "\n")
    return report


def _train(model: TrainableDFlash, data: TargetData, w1, w2, k: int, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    base = []                                   # per group: backbone logits, previous tokens, labels
    for group in data.groups:
        anchors = group.anchors(k)
        at = anchors[:, None] + torch.arange(k)
        base.append((model(group.aux, group.tokens, anchors, k), group.tokens[:, at], group.tokens[:, at + 1]))
    opt = torch.optim.Adam([w1, w2], lr=3e-2)
    history = []
    for step in range(steps):
        logits, prev, labels = base[step % len(base)]
        rows = torch.randperm(logits.shape[0], generator=gen)[:32]
        biased = logits[rows] + F.linear(F.embedding(prev[rows], w1), w2)
        loss = F.cross_entropy(biased.flatten(0, -2), labels[rows].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        history.append(round(float(loss.detach()), 4))
    return history


@torch.no_grad()
def acceptance(model: TrainableDFlash, data: TargetData, k: int, w1: torch.Tensor, w2: torch.Tensor
               ) -> tuple[float, float]:
    """``(accepted / drafted, accepted per step)`` of greedy speculative decoding at ``k``, the
    drafts sequential through the Markov head as the engine drafts them."""
    accepted = steps = 0
    for group in data.groups:
        anchors = group.anchors(k)
        base = model(group.aux, group.tokens, anchors, k)                 # [B, A, k, V]
        prev, drafts = group.tokens[:, anchors], []
        for j in range(k):
            prev = (base[:, :, j] + F.linear(F.embedding(prev, w1), w2)).argmax(-1)
            drafts.append(prev)
        drafts = torch.stack(drafts, -1)
        a, s = greedy_walk(group.tokens.tolist(), drafts.tolist(), int(anchors[0]), k)
        accepted, steps = accepted + a, steps + s
    return (accepted / (steps * k), accepted / steps) if steps else (0.0, 0.0)
