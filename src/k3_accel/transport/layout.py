"""A step's rows: which requests ship what, where the rows sit in a staging slot,
the copies that put them there, and how they are cut into messages.

The slot holds the ingest group's rows first, then the propose group's, each
in input order. On CUDA the rows are gathered into a private device buffer
on the compute stream (the buffer the target's next forward writes is never
the one being copied) and copied to the pinned slot on a side stream; the
returned event says when the slot is filled. Without CUDA the copy is a
plain memcpy on the calling thread.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class RowPlan:
    """Requests (indexes into the step's inputs) in slot order, and their rows."""
    ingest: np.ndarray        # requests that only ship rows
    propose: np.ndarray       # requests that want drafts
    starts: np.ndarray        # [R] position of each request's first row (anchor - count)
    counts: np.ndarray        # [R]

    def __post_init__(self) -> None:
        self.order = np.concatenate((self.ingest, self.propose)) if self.ingest.size else self.propose
        c = self.counts[self.order]
        self.ends = np.cumsum(c)                      # slot row after each request in ``order``
        self.dst = self.ends - c                      # slot row offset of each request in ``order``
        self.total_rows = int(self.ends[-1]) if len(c) else 0
        self.ingest_rows = int(self.ends[self.ingest.size - 1]) if self.ingest.size else 0

    def row_index(self) -> np.ndarray | None:
        """Input row of every slot row (None: the slot takes the input rows as they are)."""
        # each group is in input order: all of them, ingest before propose, is the input as it is
        if len(self.order) == len(self.counts) and (
                not self.ingest.size or not self.propose.size or self.ingest[-1] < self.propose[0]):
            return None
        src = np.cumsum(self.counts) - self.counts
        c = self.counts[self.order]
        return np.repeat(src[self.order] - self.dst, c) + np.arange(self.total_rows)

    def without(self, drop: list[int]) -> "RowPlan":
        keep = lambda idx: idx[~np.isin(idx, drop)]  # noqa: E731
        return RowPlan(keep(self.ingest), keep(self.propose), self.starts, self.counts)


def plan_rows(counts: np.ndarray, anchor_positions: np.ndarray, ingest: np.ndarray, propose: np.ndarray) -> RowPlan:
    return RowPlan(ingest, propose, anchor_positions - counts, counts)


_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    return stream


def stage(slot, index: np.ndarray | None, total: int, token_ids: torch.Tensor,
          hidden: torch.Tensor | None, private: bool):
    """Copy the rows into ``slot``; returns a CUDA event that completes when they are there
    (None: already there). ``private``: the step returns before the copy is done, so the
    rows are first gathered into a buffer that nothing else writes."""
    if total == 0:
        return None
    sources = {"token_ids": token_ids, "hidden": hidden} if hidden is not None else {"token_ids": token_ids}
    on_cpu = {name: src for name, src in sources.items() if src.device.type != "cuda"}
    for name, src in on_cpu.items():           # a plain memcpy on this thread
        dst = getattr(slot, name)[:total]
        if index is not None and src.dtype == dst.dtype:     # gathered straight into the slot
            torch.index_select(src, 0, torch.from_numpy(index), out=dst)
        else:
            _copy_cpu(dst, src if index is None else src.index_select(0, torch.from_numpy(index)))
    on_gpu = {name: src for name, src in sources.items() if name not in on_cpu}
    if not on_gpu:
        return None
    dev = next(iter(on_gpu.values())).device
    compute, side = torch.cuda.current_stream(dev), _side_stream(dev)
    idx = torch.from_numpy(index).to(dev, non_blocking=True) if index is not None else None
    srcs = []
    for name, src in on_gpu.items():
        if private:                      # gather into the slot's own device buffer (no allocation)
            buf = slot.device_buffer(name, src)[:total]
            torch.index_select(src, 0, idx, out=buf) if idx is not None else buf.copy_(src)
            src = buf
        elif idx is not None:
            src = src.index_select(0, idx)
        srcs.append((name, src))
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        for name, src in srcs:
            getattr(slot, name)[:total].copy_(src, non_blocking=True)
            if not private:
                src.record_stream(side)
        done = torch.cuda.Event()
        done.record(side)
    return done


def _copy_cpu(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A plain single-threaded memcpy (torch's intra-op pool is slow on a busy host)."""
    if src.dtype == dst.dtype and src.is_contiguous():
        np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
    else:
        dst.copy_(src)


# --------------------------------------------------------------- splitting
@dataclass
class Part:
    """One message's share: rows ``lo..hi-1`` of the slot, and per request (``index`` into
    the group) its ``starts`` and ``counts`` in this message."""
    index: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    lo: int
    hi: int


def split(starts: np.ndarray, counts: np.ndarray, base: int, max_rows: int) -> list[Part]:
    """Cut a group's rows (slot rows ``base..``) into messages of at most ``max_rows`` rows.

    Requests keep their order; a request's rows may span messages. Every request
    appears in at least one part (with 0 rows if it has none).
    """
    total = int(counts.sum())
    if total <= max_rows:
        return [Part(np.arange(len(counts)), starts, counts, base, base + total)]
    parts, cur, at, lo = [], ([], [], []), base, base
    for i, (s, c) in enumerate(zip(starts.tolist(), counts.tolist())):
        placed = False
        while c > 0 or not placed:
            if at - lo == max_rows:
                parts.append(_part(cur, lo, at))
                cur, lo = ([], [], []), at
            take = min(c, max_rows - (at - lo))
            for col, v in zip(cur, (i, s, take)):
                col.append(v)
            s, c, at, placed = s + take, c - take, at + take, True
    parts.append(_part(cur, lo, at))
    return parts


def _part(cols, lo: int, hi: int) -> Part:
    return Part(*(np.asarray(c, dtype=np.int64) for c in cols), lo, hi)


def tail(starts: np.ndarray, counts: np.ndarray, base: int, lo: int) -> Part:
    """Every request of a group with only its rows at slot rows ``lo..`` (a propose after
    the group's earlier rows went out as ingests): requests done earlier get 0 rows."""
    row_start = base + np.cumsum(counts) - counts
    keep = np.clip(row_start + counts - np.maximum(lo, row_start), 0, counts)
    return Part(np.arange(len(counts)), starts + counts - keep, keep, lo, base + int(counts.sum()))
