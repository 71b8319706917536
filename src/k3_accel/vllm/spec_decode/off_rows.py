"""The rows of steps that draft nothing, held on the host and shipped as one ingest.

While the adaptive controller keeps speculation off and no probe is due
(:meth:`~.controller.Controller.stays_off`), a step's rows are only context for
a later draft: nothing waits for them. Shipping each such step on its own costs a
message and a server ingest per target step; on a CPU target sharing its cores
with the draft server that cost was most of what a useless draft still cost
(``benchmarks/adaptive_cpu.py``). :class:`OffRows` keeps them instead and hands
back one :class:`~k3_accel.transport.api.StepInput` with every request's rows
in order, which the draft thread ships before anything else reaches the server
(a proposing step, a flush, a step while the link is down). The rows of a
request that finished (or was aborted; V1 keeps a preempted request's state) are
forgotten instead (:meth:`OffRows.drop`): nothing drafts from them, and shipping
them at the free made every request's end cost the server an ingest of all that
was held, for every request.

It takes only host rows (a target on CPU: copies are cheap and no device memory
vLLM did not count is held), only rows that continue where the request's held
rows end (a rewind ships what is held first), and at most ``max_rows`` rows and
``max_bytes`` bytes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from k3_accel.transport.api import StepInput

MAX_BYTES = 64 << 20


@dataclass
class _Held:
    req_ids: list[str]
    counts: np.ndarray
    positions: torch.Tensor
    token_ids: torch.Tensor
    hidden: torch.Tensor | None
    anchor_tokens: np.ndarray
    anchor_positions: np.ndarray
    accepted: list[int] | None


class OffRows:
    """Off steps' rows, merged request by request (see the module docstring)."""

    def __init__(self, max_rows: int, max_bytes: int = MAX_BYTES):
        self.max_rows, self.max_bytes = max_rows, max_bytes
        self._steps: list[_Held] = []
        self._end: dict[str, int] = {}          # request -> position right after its held rows
        self._prompts: dict[str, Any] = {}
        self.rows = self.bytes = 0
        self.counters = {"held_steps": 0, "shipped_ingests": 0, "dropped_rows": 0}

    def __len__(self) -> int:
        return len(self._steps)

    @staticmethod
    def host_only(inp: StepInput) -> bool:
        """Every row of ``inp`` is on the host (the only rows ever held)."""
        return all(t.device.type == "cpu" for t in (inp.positions, inp.token_ids, inp.hidden) if t is not None)

    @staticmethod
    def own(inp: StepInput) -> StepInput:
        """``inp`` with copies of its rows and anchors (host rows: see :meth:`host_only`), for a step
        handed to the draft thread without waiting: the runner reuses its buffers at the next step."""
        tokens, positions = inp.anchors()
        return dataclasses.replace(inp, positions=inp.positions.clone(), token_ids=inp.token_ids.clone(),
                                   hidden=None if inp.hidden is None else inp.hidden.clone(),
                                   anchor_tokens=tokens.copy(), anchor_positions=positions.copy())

    def fits(self, inp: StepInput) -> bool:
        """Whether ``inp`` (an ingest) may be held: see the module docstring."""
        if inp.k != 0 or not self.host_only(inp) or \
                (self._steps and (self._steps[0].hidden is None) != (inp.hidden is None)):
            return False
        n = int(sum(inp.counts))
        size = sum(map(_nbytes, (inp.positions, inp.token_ids, inp.hidden)))
        if self.rows + n > self.max_rows or self.bytes + size > self.max_bytes:
            return False
        _, positions = inp.anchors()
        return all(self._end.get(rid, a - c) == a - c for rid, c, a in zip(inp.req_ids, inp.counts, positions) if c)

    def add(self, inp: StepInput, owned: bool = False) -> None:
        """Hold ``inp`` (copies its rows: the runner reuses its buffers; ``owned``: :meth:`own` made
        them already); call only when :meth:`fits`."""
        if not owned:
            inp = self.own(inp)
        tokens, positions = inp.anchors()
        counts = np.fromiter(inp.counts, dtype=np.int64, count=len(inp.req_ids))
        held = _Held(list(inp.req_ids), counts, inp.positions, inp.token_ids, inp.hidden, tokens, positions,
                     None if inp.num_accepted is None else [int(a) for a in inp.num_accepted])
        self._steps.append(held)
        for rid, c, a in zip(held.req_ids, counts.tolist(), positions.tolist()):
            if c:
                self._end[rid] = a
        self.rows += int(counts.sum())
        self.bytes += sum(_nbytes(t) for t in (held.positions, held.token_ids, held.hidden) if t is not None)
        self.counters["held_steps"] += 1
        for rid, prompt in (inp.prompt_token_ids or {}).items():
            self._prompts.setdefault(rid, prompt)

    def take(self) -> StepInput | None:
        """Everything held as one ingest (None when nothing is), and forget it."""
        if not self._steps:
            return None
        steps, prompts = self._steps, self._prompts
        self._steps, self._end, self._prompts = [], {}, {}
        self.rows = self.bytes = 0
        self.counters["shipped_ingests"] += 1
        order: dict[str, list[np.ndarray]] = {}                  # request -> its row indices, step by step
        last: dict[str, tuple[int, int]] = {}
        accepted: dict[str, int] = {}
        base = 0
        for s in steps:
            starts = base + np.cumsum(s.counts) - s.counts
            for i, (rid, c) in enumerate(zip(s.req_ids, s.counts.tolist())):
                if s.accepted is not None:
                    accepted[rid] = accepted.get(rid, 0) + s.accepted[i]
                if c:
                    order.setdefault(rid, []).append(np.arange(starts[i], starts[i] + c))
                    last[rid] = (int(s.anchor_tokens[i]), int(s.anchor_positions[i]))
            base += int(s.counts.sum())
        ids = list(order)
        index = torch.from_numpy(np.concatenate([np.concatenate(order[rid]) for rid in ids])) if ids else \
            torch.empty(0, dtype=torch.int64)

        def merged(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(parts).index_select(0, index)

        hidden = None if steps[0].hidden is None else merged([s.hidden for s in steps])
        return StepInput(
            req_ids=ids, counts=[int(sum(len(a) for a in order[rid])) for rid in ids],
            positions=merged([s.positions for s in steps]), token_ids=merged([s.token_ids for s in steps]),
            sampled=[False] * len(ids), anchor_tokens=[last[rid][0] for rid in ids],
            anchor_positions=[last[rid][1] for rid in ids], k=0, hidden=hidden,
            prompt_token_ids={rid: prompts[rid] for rid in ids if rid in prompts} or None,
            num_accepted=[accepted.get(rid, 0) for rid in ids] if accepted else None)

    def drop(self, req_ids: list[str]) -> int:
        """Forget the held rows of ``req_ids`` (requests that finished: their free follows, so nothing
        of theirs may be shipped after it); the other requests' rows stay held, in order. Returns
        how many rows went."""
        gone = {rid for rid in req_ids if rid in self._end}
        if not gone:
            return 0
        before, kept = self.rows, []
        for held in self._steps:
            stay = np.fromiter((rid not in gone for rid in held.req_ids), dtype=bool, count=len(held.req_ids))
            if stay.all():
                kept.append(held)
            elif stay.any():
                kept.append(_without(held, stay))
        self._steps = kept
        for rid in gone:
            del self._end[rid]
            self._prompts.pop(rid, None)
        self.rows = sum(int(h.counts.sum()) for h in kept)
        self.bytes = sum(_nbytes(t) for h in kept for t in (h.positions, h.token_ids, h.hidden))
        self.counters["dropped_rows"] += before - self.rows
        return before - self.rows

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "held_now": len(self._steps), "rows_now": self.rows}


def _without(held: _Held, stay: np.ndarray) -> _Held:
    """``held`` with only the requests ``stay`` marks (and their rows)."""
    rows = torch.from_numpy(np.repeat(stay, held.counts))
    pick = np.flatnonzero(stay).tolist()
    return _Held([held.req_ids[i] for i in pick], held.counts[stay], held.positions[rows], held.token_ids[rows],
                 None if held.hidden is None else held.hidden[rows], held.anchor_tokens[stay],
                 held.anchor_positions[stay], None if held.accepted is None else [held.accepted[i] for i in pick])


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


__all__ = ["OffRows"]
