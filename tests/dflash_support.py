"""Helpers for the DFlash engine tests: a request mirror and the two oracles.

:class:`Mirror` drives a :class:`DFlashEngine` through the contract's batched
calls and keeps, per request, the context rows the engine should hold (what the
server would have accepted), so any oracle can recompute from scratch.
"""
from __future__ import annotations

from pathlib import Path

import torch

from k3_accel.server.engines.base import IngestBatch, Proposal, ProposeBatch
from k3_accel.server.engines.dflash import DFlashEngine
from k3_accel.testing.dflash_eager import reference_propose
from k3_accel.testing.dflash_reference import DFlashReference
from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target

WIDTH = 256          # tiny draft: 2 aux layers x hidden 128


def checkpoint(root: Path, target: Path | None = None, name: str = "draft", **kw) -> tuple[Path, Path]:
    target = target or write_tiny_target(root / "target")
    return write_tiny_dflash(root / name, target, **kw), target


def random_rows(gen: torch.Generator, n: int, width: int = WIDTH) -> torch.Tensor:
    """Aux hidden rows as a target sends them (bf16 values)."""
    return torch.randn(n, width, generator=gen).to(torch.bfloat16)


class Mirror:
    def __init__(self, engine: DFlashEngine):
        self.engine = engine
        self.rows: dict[object, torch.Tensor] = {}

    def new(self):
        state = self.engine.new_state()
        self.rows[state] = torch.empty(0, self.engine.caps.context_width, dtype=torch.bfloat16)
        return state

    def ingest(self, items: list[tuple[object, int, torch.Tensor]]) -> None:
        """One batched ingest: each item rewinds ``state`` to ``start`` and appends ``rows``."""
        batch = IngestBatch(
            states=[s for s, _, _ in items], starts=[start for _, start, _ in items],
            counts=[len(r) for _, _, r in items],
            positions=torch.cat([torch.arange(start, start + len(r)) for _, start, r in items]),
            token_ids=torch.zeros(sum(len(r) for _, _, r in items), dtype=torch.long),
            hidden=torch.cat([r for _, _, r in items]))
        self.engine.ingest(batch)
        for state, start, rows in items:
            self.rows[state] = torch.cat([self.rows[state][:start], rows])

    def fork(self, state, length: int):
        new = self.engine.fork(state, length)
        self.rows[new] = self.rows[state][:length]
        return new

    def release(self, state) -> None:
        self.engine.release(state)
        del self.rows[state]

    def propose(self, states: list, anchors: list[int], k: int, logits: str = "full",
                topk: int = 0) -> Proposal:
        return self.engine.propose(ProposeBatch(
            states=states, histories=[[0] * self.engine.length(s) for s in states],
            anchors=torch.tensor(anchors, dtype=torch.long), k=k, logits=logits, topk=topk)).wait()

    def check_lengths(self) -> None:
        for state, rows in self.rows.items():
            assert self.engine.length(state) == len(rows)


def reference(ref: DFlashReference, rows: torch.Tensor, anchor: int, k: int) -> torch.Tensor:
    """Independent float64 logits ``[k, V]``."""
    return ref.logits(rows.double(), anchor, k)


def eager(engine_weights, rows: torch.Tensor, anchor: int, k: int) -> torch.Tensor:
    """The old engine's logits ``[k, V]`` (fp32) over the same rows."""
    return reference_propose(engine_weights, rows, torch.arange(len(rows)), anchor, k)[1]
