"""Distil a tiny DFlash draft from a tiny target, so that its drafts get accepted.

:func:`distill_tiny_dflash` starts from the random draft
:func:`~k3_accel.testing.tiny.write_tiny_dflash` would write and trains it
(plain PyTorch, CPU, seeded) on the block-drafting task exactly as the
engines run it: the target's own greedy continuations of short prompts and
its auxiliary hidden states (HF ``output_hidden_states[id + 1]`` for each
``target_layer_ids`` entry, computed with ``transformers``) are the context;
the block ``[anchor, mask * K]`` at positions ``P..P+K`` learns to predict
the target's tokens ``P+1..P+K`` (cross-entropy to the target's
distribution at each of those positions, earlier offsets weighted more). The
result is an ordinary DFlash checkpoint in the same layout (loadable by
``k3-draft-server --engine dflash`` and by vLLM's DFlash proposer), plus
``distill.json`` with what was trained and measured.

On a random target this reaches a few percent at most: a random network's
next token hangs on its whole context (see :mod:`k3_accel.testing.tiny_lm`);
on the tiny language-model target it reaches about 45 % at K = 4 in about
half a minute of one CPU thread.

The acceptance it reports is simulated greedy speculative decoding at K on
held-out prompts (different seed): per step the target accepts the longest
matching prefix of the K drafts, then the next block starts after it. A
later call with the same target and settings on the same directory reuses
the checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from k3_accel.testing.draft_model import TrainableDFlash
from k3_accel.testing.target_data import Group, TargetData, one_thread, target_sequences
from k3_accel.testing.tiny import tiny_dflash_weights, write_dflash

REPORT = "distill.json"


class DistillError(ValueError):
    """The target or the settings cannot be distilled from; the message says why."""


@dataclass(frozen=True)
class DistillSettings:
    k: int = 4                        # draft tokens per block (the demo's num_speculative_tokens)
    seed: int = 0                     # data and training order
    draft_seed: int = 1               # the initial random draft (write_tiny_dflash's seed)
    steps: int = 250
    batch: int = 16                   # sequences per step
    blocks: int = 12                  # blocks per sequence per step (random anchors)
    lr: float = 1e-2                  # AdamW peak, one-cycle schedule
    sequences: int = 320              # training sequences per prompt length
    prompt_lens: tuple[int, ...] = (8, 24)
    new_tokens: int = 40              # greedy continuation per prompt
    eval_sequences: int = 32          # held-out sequences per prompt length
    offset_decay: float = 0.7         # loss weight of block offset k: decay ** (k - 1)
    soft_labels: float = 1.0          # 1: cross-entropy to the target's distribution; 0: to its greedy token
    norm_init_scale: float = 0.1      # start the final norm small: near-uniform first guesses

    def check(self) -> None:
        if self.k < 1 or self.new_tokens <= self.k or self.steps < 0 or min(self.batch, self.blocks) < 1:
            raise DistillError(f"need k >= 1, new_tokens > k, steps >= 0, batch and blocks >= 1: {self}")
        if not self.prompt_lens or min(self.prompt_lens) < 1 or self.sequences < 1 or self.eval_sequences < 1:
            raise DistillError(f"need prompt lengths >= 1 and at least one sequence: {self}")


@dataclass
class DistillReport:
    path: str
    settings: dict
    acceptance: float                 # held-out, simulated greedy speculative decoding at k
    acceptance_untrained: float       # the same for the initial (random) draft
    accepted_per_step: float          # mean accepted draft tokens per step (held-out)
    loss_first: float | None
    loss_last: float | None
    total_s: float                    # wall time on this machine (target data, training, evaluation)
    cpu_s: float                      # CPU time of this process meanwhile (one torch thread)
    cached: bool = False
    fingerprint: str = ""
    history: list[float] = field(default_factory=list)


def distill_tiny_dflash(out_dir: str | Path, target_dir: str | Path,
                        settings: DistillSettings = DistillSettings(),
                        log: Callable[[str], None] | None = None) -> DistillReport:
    """Train the tiny DFlash draft for the target in ``target_dir`` and write
    it to ``out_dir``; returns what was measured (also in ``out_dir/distill.json``)."""
    t0, c0 = time.perf_counter(), time.process_time()
    settings.check()
    target_dir, out = Path(target_dir), Path(out_dir)
    if not (target_dir / "config.json").is_file() or not (target_dir / "model.safetensors").is_file():
        raise DistillError(f"{target_dir}: not a tiny target checkpoint (config.json, model.safetensors)")
    fingerprint = _fingerprint(target_dir, settings)
    cached = _cached(out, fingerprint)
    if cached is not None:
        return cached
    with one_thread():
        report = _distill(out, target_dir, settings, log)
    report.fingerprint = fingerprint
    report.total_s, report.cpu_s = time.perf_counter() - t0, time.process_time() - c0
    (out / REPORT).write_text(json.dumps(asdict(report), indent=1) + "\n")
    if log:
        log(f"distilled in {report.total_s:.1f} s: held-out acceptance at K={settings.k} "
            f"{report.acceptance_untrained:.1%} -> {report.acceptance:.1%}")
    return report


def _distill(out: Path, target_dir: Path, settings: DistillSettings,
             log: Callable[[str], None] | None) -> DistillReport:
    torch.manual_seed(settings.seed)
    tensors, config = tiny_dflash_weights(target_dir, seed=settings.draft_seed)
    tensors["norm.weight"] = tensors["norm.weight"] * settings.norm_init_scale
    layer_ids = config["dflash_config"]["target_layer_ids"]
    data = target_sequences(target_dir, layer_ids, settings.prompt_lens, settings.sequences,
                            settings.new_tokens, seed=settings.seed)
    held_out = target_sequences(target_dir, layer_ids, settings.prompt_lens, settings.eval_sequences,
                                settings.new_tokens, seed=settings.seed + 1_000_003)
    model = TrainableDFlash(tensors, config, data.embed, data.lm_head)
    untrained = acceptance(model, held_out, settings.k)
    history = _train(model, data, settings, log)
    accepted = acceptance(model, held_out, settings.k)
    write_dflash(out, model.tensors(), config)
    return DistillReport(
        path=str(out), settings=_jsonable(settings), acceptance=accepted[0], acceptance_untrained=untrained[0],
        accepted_per_step=accepted[1], loss_first=history[0] if history else None,
        loss_last=history[-1] if history else None, total_s=0.0, cpu_s=0.0, history=history)


def _train(model: TrainableDFlash, data: TargetData, s: DistillSettings,
           log: Callable[[str], None] | None) -> list[float]:
    gen = torch.Generator().manual_seed(s.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=s.lr, total_steps=max(s.steps, 1), pct_start=0.1)
    weights = torch.tensor([s.offset_decay ** i for i in range(s.k)])
    history = []
    for step in range(s.steps):
        group = data.groups[step % len(data.groups)]
        rows = torch.randperm(len(group.tokens), generator=gen)[:s.batch]
        anchors = group.anchors(s.k)
        anchors = anchors[torch.randperm(len(anchors), generator=gen)[:s.blocks].sort().values]
        loss = _loss(model, group, rows, anchors, s) * weights
        loss = loss.sum() / (weights.sum() * loss[..., 0].numel())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        history.append(round(float(loss.detach()), 4))
        if log and (step + 1) % 100 == 0:
            log(f"step {step + 1}/{s.steps}: loss {loss.item():.3f}")
    return history


def _loss(model: TrainableDFlash, group: Group, rows: torch.Tensor, anchors: torch.Tensor,
          s: DistillSettings) -> torch.Tensor:
    """Per block and offset ``[B, n_anchors, k]``: cross-entropy of the draft's
    logits at offset j (position P+j) to the target's greedy token there and,
    weighted by ``soft_labels``, to the target's distribution at P+j-1."""
    at = anchors[:, None] + torch.arange(1, s.k + 1)
    logq = model(group.aux[rows], group.tokens[rows], anchors, s.k).log_softmax(-1)
    hard = -logq.gather(-1, group.tokens[rows][:, at, None])[..., 0]
    if not s.soft_labels:
        return hard
    soft = -(group.logp[rows][:, at - 1].exp() * logq).sum(-1)
    return (1 - s.soft_labels) * hard + s.soft_labels * soft


def greedy_walk(seqs: list[list[int]], drafts: list[list[list[int]]], first: int, k: int) -> tuple[int, int]:
    """``(accepted drafts, steps)`` of greedy speculative decoding over ``seqs``: ``drafts[i][a]``
    are sequence ``i``'s ``k`` drafts for the block anchored at position ``first + a``; each step
    drafts at the position after the last accepted token."""
    accepted = steps = 0
    for seq, draft in zip(seqs, drafts):
        p = first
        while p + k < len(seq):
            guess, truth = draft[p - first], seq[p + 1:p + 1 + k]
            run = next((i for i, (a, b) in enumerate(zip(guess, truth)) if a != b), k)
            accepted, steps, p = accepted + run, steps + 1, p + run + 1
    return accepted, steps


@torch.no_grad()
def acceptance(model: TrainableDFlash, data: TargetData, k: int) -> tuple[float, float]:
    """``(accepted / drafted, accepted per step)`` of greedy speculative decoding
    at ``k`` over ``data``'s continuations (first block anchored at the
    first generated token, each next one after the accepted run)."""
    accepted = steps = 0
    for group in data.groups:
        anchors = group.anchors(k)
        drafts = model(group.aux, group.tokens, anchors, k).argmax(-1)     # [B, n_anchors, k]
        a, s = greedy_walk(group.tokens.tolist(), drafts.tolist(), int(anchors[0]), k)
        accepted, steps = accepted + a, steps + s
    return (accepted / (steps * k), accepted / steps) if steps else (0.0, 0.0)


def _fingerprint(target_dir: Path, settings: DistillSettings) -> str:
    h = hashlib.sha256(json.dumps(_jsonable(settings), sort_keys=True).encode())
    for name in ("config.json", "model.safetensors"):
        h.update((target_dir / name).read_bytes())
    return h.hexdigest()[:16]


def _cached(out: Path, fingerprint: str) -> DistillReport | None:
    try:
        data = json.loads((out / REPORT).read_text())
    except (OSError, ValueError):
        return None
    if data.get("fingerprint") != fingerprint or not (out / "model.safetensors").is_file():
        return None
    try:
        return DistillReport(**{**data, "cached": True})
    except TypeError:                      # written by another version: train again
        return None


def _jsonable(settings: DistillSettings) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()}
