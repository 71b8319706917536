"""A step's rows in the target batch, and the transport :class:`StepInput` gathered from them.

Both runners lay a step's target rows out request after request: request
``i`` owns rows ``starts[i] .. starts[i] + scheduled[i]``, of which the first
``valid[i]`` are context and the last ``scheduled[i] - valid[i]`` are drafts
the target rejected (not context). The anchor is the token right after the
valid rows (just sampled, or the next prompt token mid-prefill); its position
is the last valid position + 1 — the rule of vLLM's own DFlash input kernels.

Pure tensor / numpy code, no vLLM import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from k3_accel.transport.api import StepInput


@dataclass(frozen=True)
class BatchRows:
    """Host-side view of one step: what every rank can decide without the network."""
    req_ids: list[str]
    starts: np.ndarray        # int64 [R]: first row of each request in the target batch
    scheduled: np.ndarray     # int64 [R]: rows scheduled (context + drafts being verified)
    valid: np.ndarray         # int64 [R]: valid context rows = scheduled - rejected
    sampled: np.ndarray       # bool [R]: the request sampled a token this step

    @classmethod
    def from_counts(cls, req_ids: Sequence[str], query_start_loc: Any, num_rejected: Any,
                    sampled: Any) -> "BatchRows":
        """From the batch's ``query_start_loc`` ``[R+1]``, rejected drafts per request (None: none)
        and the sampled mask (host arrays); raises ValueError for a request without a valid row."""
        r = len(req_ids)
        qsl = np.asarray(query_start_loc[: r + 1], dtype=np.int64)
        scheduled = qsl[1:] - qsl[:-1]
        rejected = 0 if num_rejected is None else np.clip(np.asarray(num_rejected[:r], dtype=np.int64), 0, None)
        valid = scheduled - rejected
        if (valid < 1).any():
            bad = int(np.flatnonzero(valid < 1)[0])
            raise ValueError(f"request {req_ids[bad]!r}: {scheduled[bad]} rows scheduled, "
                             f"{scheduled[bad] - valid[bad]} rejected: no valid context row")
        return cls(list(req_ids), qsl[:-1].copy(), scheduled, valid, np.asarray(sampled[:r], dtype=bool))

    def row_index(self, keep: np.ndarray) -> slice | np.ndarray:
        """Target-batch rows of the kept requests' valid context, request by request:
        a plain slice when they are one contiguous run (the common prefill case gathers nothing)."""
        starts, valid = self.starts[keep], self.valid[keep]
        total = int(valid.sum())
        if len(starts) == 0 or np.array_equal(starts[1:], (starts + valid)[:-1]):
            first = int(starts[0]) if len(starts) else 0
            return slice(first, first + total)
        return np.repeat(starts - (np.cumsum(valid) - valid), valid) + np.arange(total, dtype=np.int64)


def gather_step(batch: BatchRows, keep: np.ndarray, *, positions: torch.Tensor, token_ids: torch.Tensor,
                hidden: Sequence[torch.Tensor] | None, anchor_tokens: Any, k: int,
                prompts: Mapping[str, Any] | None = None) -> StepInput:
    """The :class:`StepInput` of the kept requests (``keep``: batch indices, ascending).

    ``positions`` is ``[N]`` (or ``[3, N]`` with M-RoPE: the first row is used).
    ``hidden``: the aux hidden-state tensors ``[N, H]`` to ship, concatenated on
    the last dim in the order given (vLLM's: ascending layer id); None ships none.
    ``anchor_tokens``: one per kept request. ``prompts``: prompt tokens of
    requests the server may have to reconnect (prefix-cache hit, resumed request).
    """
    keep = np.asarray(keep, dtype=np.int64)
    if positions.dim() == 2:
        positions = positions[0]
    device = positions.device
    rows = batch.row_index(keep)
    index = None if isinstance(rows, slice) else torch.from_numpy(rows).to(device, non_blocking=True)

    def take(t: torch.Tensor) -> torch.Tensor:
        return t[rows] if index is None else t.index_select(0, index.to(t.device))

    gathered = None
    if hidden:
        parts = [take(h) for h in hidden]
        gathered = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=-1)
    valid = batch.valid[keep]
    last = torch.from_numpy(batch.starts[keep] + valid - 1).to(device, non_blocking=True)
    return StepInput(
        req_ids=[batch.req_ids[i] for i in keep.tolist()], counts=[int(c) for c in valid],
        positions=take(positions), token_ids=take(token_ids), sampled=[bool(s) for s in batch.sampled[keep]],
        anchor_tokens=anchor_tokens, anchor_positions=positions.index_select(0, last).to(torch.int64) + 1,
        k=int(k), hidden=gathered, prompt_token_ids=dict(prompts) if prompts else None)


__all__ = ["BatchRows", "gather_step"]
