"""Turning what the V1 runner hands its drafter into a transport :class:`StepInput`.

Pure tensor/list code (no vLLM import), so it is unit-tested on its own.
The runner lays a step's target rows out request after request; request
``i`` owns rows ``starts[i] .. starts[i] + scheduled[i]``, of which the
first ``counts[i]`` are valid context (the rest are rejected drafts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from k3_accel.transport.api import StepInput


def needs_no_drafts(sampling_params: Any) -> bool:
    """A request that emits at most one token: it finishes with the step that
    samples its first token, so it needs neither drafts nor remote context."""
    max_tokens = getattr(sampling_params, "max_tokens", None)
    return max_tokens is not None and max_tokens <= 1


@dataclass(frozen=True)
class DraftBatch:
    """One step's requests as the adapter sees them (CPU values)."""
    req_ids: list[str]
    starts: np.ndarray     # int64 [R]: first target row of each request
    counts: np.ndarray     # int64 [R]: valid context rows of each request
    sampled: np.ndarray    # bool [R]: the request sampled a token this step

    @classmethod
    def from_runner(cls, req_ids: Sequence[str], query_start_loc: torch.Tensor,
                    num_rejected: torch.Tensor | None, discard: np.ndarray) -> "DraftBatch":
        r = len(req_ids)
        qsl = query_start_loc[: r + 1].to("cpu", torch.int64).numpy()
        counts = qsl[1:] - qsl[:-1]
        if num_rejected is not None:
            counts = counts - num_rejected[:r].to("cpu", torch.int64).numpy()
        return cls(list(req_ids), qsl[:-1].copy(), counts, ~np.asarray(discard[:r], dtype=bool))

    def select(self, keep: Sequence[int]) -> "DraftBatch":
        idx = np.asarray(keep, dtype=np.int64)
        return DraftBatch([self.req_ids[i] for i in keep], self.starts[idx], self.counts[idx],
                          self.sampled[idx])


def row_index(starts: np.ndarray, counts: np.ndarray) -> slice | torch.Tensor:
    """Rows of the listed segments, in order: a slice when they are one contiguous run."""
    total = int(counts.sum())
    if len(starts) == 0 or (starts[0] == 0 and np.array_equal(starts[1:], np.cumsum(counts)[:-1])):
        start = int(starts[0]) if len(starts) else 0
        return slice(start, start + total)
    offsets = np.cumsum(counts) - counts
    shift = np.repeat(starts - offsets, counts)
    return torch.from_numpy(np.arange(total, dtype=np.int64) + shift)


def _take(t: torch.Tensor, rows: slice | torch.Tensor) -> torch.Tensor:
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows.to(t.device))


def dflash_step(batch: DraftBatch, keep: Sequence[int], *, token_ids: torch.Tensor,
                positions: torch.Tensor, hidden: torch.Tensor | None, next_token_ids: torch.Tensor,
                k: int, prompts: Mapping[str, Any] | None = None) -> StepInput:
    """The step input for the kept requests of a DFlash-style ``propose`` call.

    ``positions`` is ``[N]`` (or ``[3, N]`` with M-RoPE: the first row is used);
    ``next_token_ids`` ``[R]`` holds each request's anchor token (just sampled,
    or the next prompt token mid-prefill).
    """
    sub = batch.select(keep)
    if positions.dim() == 2:
        positions = positions[0]
    rows = row_index(sub.starts, sub.counts)
    kept = torch.as_tensor(np.asarray(keep, dtype=np.int64))
    last = torch.from_numpy(sub.starts + sub.counts - 1).to(positions.device)
    return StepInput(
        req_ids=sub.req_ids, counts=[int(c) for c in sub.counts],
        positions=_take(positions, rows), token_ids=_take(token_ids, rows),
        hidden=None if hidden is None else _take(hidden, rows),
        sampled=[bool(s) for s in sub.sampled],
        anchor_tokens=next_token_ids.index_select(0, kept.to(next_token_ids.device)),
        anchor_positions=positions.index_select(0, last) + 1,
        k=k, prompt_token_ids=dict(prompts) if prompts else None)


def token_step(req_ids: Sequence[str], rows: Sequence[int], *, computed: np.ndarray, scheduled: np.ndarray,
               num_tokens: np.ndarray, token_ids: np.ndarray, sampled: Sequence[bool], k: int,
               prompts: Mapping[str, Any] | None = None) -> StepInput:
    """The step input for token-only drafting (no hidden rows), from the runner's CPU state.

    ``req_ids[j]`` is batch row ``rows[j]``. Per row: ``computed`` tokens were
    done before this step, ``scheduled`` were scheduled in it and
    ``token_ids[row, :num_tokens]`` are known now (a request that sampled
    ends with its new token). A request that sampled ships rows
    ``computed .. num_tokens - 1`` (the rest of what it verified) and anchors
    on its last token; a mid-prefill one ships its chunk and anchors on the
    next prompt token.
    """
    counts, pos, toks, anchors, anchor_pos = [], [], [], [], []
    for row, did_sample in zip(rows, sampled):
        start = int(computed[row])
        end = int(num_tokens[row]) - 1 if did_sample else start + int(scheduled[row])
        counts.append(end - start)
        pos.append(np.arange(start, end, dtype=np.int64))
        toks.append(np.asarray(token_ids[row, start:end], dtype=np.int64))
        anchors.append(int(token_ids[row, end]))
        anchor_pos.append(end)
    cat = (lambda parts: torch.from_numpy(np.concatenate(parts)) if parts
           else torch.empty(0, dtype=torch.int64))
    return StepInput(req_ids=list(req_ids), counts=counts, positions=cat(pos), token_ids=cat(toks),
                     sampled=[bool(s) for s in sampled], anchor_tokens=anchors, anchor_positions=anchor_pos,
                     k=k, prompt_token_ids=dict(prompts) if prompts else None)


def scatter_drafts(drafts: torch.Tensor, keep: Sequence[int], num_requests: int, k: int) -> torch.Tensor:
    """Drafts of the kept requests placed in a ``[num_requests, k]`` tensor (-1 elsewhere)."""
    if len(keep) == num_requests:
        return drafts
    out = torch.full((num_requests, k), -1, dtype=torch.int64, device=drafts.device)
    if len(keep):
        out[torch.as_tensor(list(keep), device=drafts.device)] = drafts
    return out


def draft_lists(drafts: torch.Tensor) -> list[list[int]]:
    """Per-request draft lists, each cut at its first -1 (no draft)."""
    out = []
    for row in drafts.tolist():
        cut = row.index(-1) if -1 in row else len(row)
        out.append(row[:cut])
    return out


class KnownRequests:
    """Request ids the client has been told about, to free them when they leave."""

    def __init__(self) -> None:
        self.ids: set[str] = set()

    def new(self, req_ids: Iterable[str]) -> list[str]:
        fresh = [r for r in req_ids if r not in self.ids]
        self.ids.update(fresh)
        return fresh

    def departed(self, live: Iterable[str]) -> list[str]:
        gone = self.ids.difference(live)
        self.ids.difference_update(gone)
        return sorted(gone)
