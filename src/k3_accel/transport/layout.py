"""Where a step's context rows go in a staging slot, and the copies that put them there.

A step's rows are split into two messages that each need contiguous rows:
an ``ingest`` (requests that only ship context) followed by a ``propose``
(requests that want drafts). The slot holds the ingest group's rows first,
then the propose group's, each in input order; the copies are merged into
as few contiguous runs as the input allows (usually one or two).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class RowPlan:
    """Slot placement of the staged requests (indices into the step's request list)."""
    counts: list[int]
    src: list[int]                            # input row offset of every request
    ingest: list[int]                         # requests in the ingest message, input order
    propose: list[int]                        # requests in the propose message, input order
    dst: dict[int, int] = field(default_factory=dict)   # slot row offset of each staged request
    hidden: bool = False                      # hidden rows were staged too

    @property
    def ingest_rows(self) -> int:
        return sum(self.counts[i] for i in self.ingest)

    @property
    def propose_rows(self) -> int:
        return sum(self.counts[i] for i in self.propose)

    @property
    def total_rows(self) -> int:
        return self.ingest_rows + self.propose_rows

    def staged(self) -> list[int]:
        return self.ingest + self.propose


def plan_rows(counts: list[int], ingest: list[int], propose: list[int], hidden: bool = False) -> RowPlan:
    """Offsets for ``ingest`` then ``propose`` requests, packed from slot row 0."""
    src, at = [], 0
    for c in counts:
        src.append(at)
        at += c
    plan = RowPlan(list(counts), src, list(ingest), list(propose), hidden=hidden)
    at = 0
    for i in plan.staged():
        plan.dst[i] = at
        at += counts[i]
    return plan


def copy_runs(plan: RowPlan) -> list[tuple[int, int, int]]:
    """``(src_row, dst_row, rows)`` copies, adjacent requests merged."""
    runs: list[list[int]] = []
    for i in plan.staged():
        n = plan.counts[i]
        if n == 0:
            continue
        s, d = plan.src[i], plan.dst[i]
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += n
        else:
            runs.append([s, d, n])
    return [tuple(r) for r in runs]


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``: asynchronous from a CUDA source into pinned memory;
    a plain single-threaded memcpy between same-dtype contiguous CPU tensors
    (torch's intra-op thread pool makes large CPU copies slow on a busy host)."""
    if (src.device.type == "cpu" and src.dtype == dst.dtype and src.is_contiguous()
            and dst.is_contiguous() and src.numel()):
        np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
    else:
        dst.copy_(src, non_blocking=True)


def stage(slot, plan: RowPlan, positions: torch.Tensor, token_ids: torch.Tensor,
          hidden: torch.Tensor | None) -> None:
    """Issue the device->slot copies (asynchronous for CUDA sources into pinned slots).

    Hidden rows go first: issuing the small copies then overlaps the big transfer.
    """
    runs = copy_runs(plan)
    if plan.hidden:
        for s, d, n in runs:
            copy_rows(slot.hidden[d:d + n], hidden[s:s + n])
    for s, d, n in runs:
        copy_rows(slot.positions[d:d + n], positions[s:s + n])
        copy_rows(slot.token_ids[d:d + n], token_ids[s:s + n])


_EVENTS: dict[torch.device, "torch.cuda.Event"] = {}


def wait_for_copies(*tensors: torch.Tensor | None) -> None:
    """Block until copies queued on the current streams of the given tensors' devices are done."""
    devices = {t.device for t in tensors if t is not None and t.device.type == "cuda"}
    for device in devices:
        event = _EVENTS.get(device)
        if event is None:
            event = _EVENTS[device] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        event.synchronize()


def _move(buf: torch.Tensor | None, src: int, dst: int, n: int) -> None:
    if buf is None or n == 0 or src == dst:
        return
    chunk = buf[src:src + n]
    buf[dst:dst + n].copy_(chunk.clone() if src - dst < n else chunk)


def compact(slot, plan: RowPlan, drop: set[int]) -> RowPlan:
    """Remove ``drop`` requests from the plan, closing the holes in the slot (rare path)."""
    kept = RowPlan(plan.counts, plan.src, [i for i in plan.ingest if i not in drop],
                   [i for i in plan.propose if i not in drop], hidden=plan.hidden)
    at = 0
    for i in kept.staged():
        n = plan.counts[i]
        old = plan.dst[i]
        _move(slot.positions, old, at, n)
        _move(slot.token_ids, old, at, n)
        _move(slot.hidden if plan.hidden else None, old, at, n)
        kept.dst[i] = at
        at += n
    return kept
