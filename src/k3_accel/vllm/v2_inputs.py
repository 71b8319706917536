"""Turning vLLM V2 ``propose(...)`` arguments into a transport :class:`StepInput`.

Pure functions over tensors and numpy arrays, no vLLM import: the V2
speculator (:mod:`k3_accel.vllm.speculator_v2`) calls them, tests call them
with CPU tensors shaped exactly as vLLM 0.33's V2 model runner passes them:

* ``input_batch`` (``vllm.v1.worker.gpu.input_batch.InputBatch``): request
  ``i``'s rows are ``query_start_loc_np[i] .. query_start_loc_np[i+1]`` of
  ``positions`` / ``input_ids`` (and of every aux hidden-state tensor);
  ``idx_mapping`` maps batch index -> request-state slot.
* ``num_sampled`` / ``num_rejected``: ``[num_reqs]`` device tensors. The last
  ``num_rejected[i]`` rows of a verify block are rejected drafts, not context.
* ``last_sampled``: ``[max_num_reqs, 1]`` (or ``[max_num_reqs]``) by slot;
  ``next_prefill_tokens``: ``[num_prefill_lookahead, max_num_reqs]`` by slot
  (row 0 is the next prompt token).

The anchor rule is the one of vLLM's own DFlash input kernel
(``spec_decode/dflash/speculator.py``, ``_prepare_dflash_inputs_kernel``):
the last sampled token when the request sampled, else the next prompt token
(mid-prefill); its position is the last valid context position + 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from k3_accel.transport.api import StepInput


@dataclass(frozen=True)
class BatchCounts:
    """Host-side view of one step: what every rank can decide without the network."""
    starts: np.ndarray        # [R] first row of each request in the target batch
    scheduled: np.ndarray     # [R] rows scheduled (context + drafts being verified)
    sampled: np.ndarray       # [R] bool: the request sampled a token this step
    valid: np.ndarray         # [R] valid context rows = scheduled - rejected


def batch_counts(input_batch: Any, num_sampled: torch.Tensor, num_rejected: torch.Tensor) -> BatchCounts:
    """Read per-request row counts; one small device->host copy (sampled, rejected)."""
    r = int(input_batch.num_reqs)
    qsl = np.asarray(input_batch.query_start_loc_np[: r + 1], dtype=np.int64)
    both = torch.stack([num_sampled[:r].to(torch.int64), num_rejected[:r].to(torch.int64)])
    host = both.cpu().numpy()
    scheduled = qsl[1:] - qsl[:-1]
    rejected = np.clip(host[1], 0, None)
    valid = scheduled - rejected
    if (valid < 1).any():
        bad = int(np.flatnonzero(valid < 1)[0])
        raise ValueError(f"request {input_batch.req_ids[bad]!r}: {scheduled[bad]} rows scheduled, "
                         f"{rejected[bad]} rejected: no valid context row")
    return BatchCounts(starts=qsl[:-1], scheduled=scheduled, sampled=host[0] > 0, valid=valid)


def finishes_after_prefill(input_batch: Any, req_states: Any) -> np.ndarray:
    """``[R]`` bool: requests with ``max_tokens <= 1`` (they sample once, at the end of prefill, and stop).

    Reads vLLM's host-side request state (``RequestState.max_seq_len`` =
    prompt_len + max_tokens, ``RequestState.prompt_len.np``). Returns all
    False when that state is not available.
    """
    r = int(input_batch.num_reqs)
    max_seq_len = getattr(req_states, "max_seq_len", None)
    prompt_len = getattr(getattr(req_states, "prompt_len", None), "np", None)
    if max_seq_len is None or prompt_len is None:
        return np.zeros(r, dtype=bool)
    slots = np.asarray(input_batch.idx_mapping_np[:r], dtype=np.int64)
    max_tokens = np.asarray(max_seq_len)[slots].astype(np.int64) - np.asarray(prompt_len)[slots].astype(np.int64)
    return max_tokens <= 1


def row_index(counts: BatchCounts, keep: np.ndarray) -> np.ndarray | slice:
    """Target-batch rows of the kept requests' valid context, request by request.

    A plain slice when that is every row of the batch in order (no rejected
    drafts, nothing dropped): the common prefill case gathers nothing.
    """
    starts, valid = counts.starts[keep], counts.valid[keep]
    total = int(valid.sum())
    if len(keep) == len(counts.starts) and (counts.valid == counts.scheduled).all():
        first = int(counts.starts[0]) if len(starts) else 0
        return slice(first, first + total)
    offsets = np.repeat(starts - (np.cumsum(valid) - valid), valid)
    return offsets + np.arange(total, dtype=np.int64)


def _rows(t: torch.Tensor, rows: np.ndarray | slice, index: torch.Tensor | None) -> torch.Tensor:
    return t[rows] if index is None else t.index_select(0, index)


def _by_slot(t: torch.Tensor) -> torch.Tensor:
    """``last_sampled`` is ``[max_num_reqs, 1]`` in 0.33: read it flat like vLLM's kernels do."""
    return t.reshape(-1) if t.dim() > 1 and t.shape[-1] == 1 else t


def build_step_input(
    input_batch: Any,
    aux_hidden_states: Sequence[torch.Tensor] | None,
    counts: BatchCounts,
    keep: np.ndarray,
    last_sampled: torch.Tensor,
    next_prefill_tokens: torch.Tensor,
    k: int,
    *,
    ship_hidden: bool = True,
    prompt_of: Callable[[int], torch.Tensor | None] | None = None,
    first_seen: Callable[[str], bool] | None = None,
) -> StepInput:
    """The :class:`StepInput` of the kept requests (``keep``: batch indices, ascending).

    ``hidden`` is the aux hidden states of the valid rows, concatenated on the
    last dim in the order vLLM lists them (ascending layer id); None when
    ``ship_hidden`` is False or vLLM produced none. ``prompt_of(i)`` gives
    batch request ``i``'s known tokens; it is asked only for requests seen for
    the first time (``first_seen``) whose context does not start at 0
    (prefix-cache hit, resumed request), so the transport can reconnect them.
    """
    keep = np.asarray(keep, dtype=np.int64)
    device = input_batch.positions.device
    rows = row_index(counts, keep)
    index = None if isinstance(rows, slice) else torch.from_numpy(rows).to(device, non_blocking=True)

    positions = _rows(input_batch.positions, rows, index)
    token_ids = _rows(input_batch.input_ids, rows, index)
    hidden = None
    if ship_hidden and aux_hidden_states:
        parts = [_rows(h, rows, index) for h in aux_hidden_states]
        hidden = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=-1)

    valid = counts.valid[keep]
    last_rows = torch.from_numpy(counts.starts[keep] + valid - 1).to(device, non_blocking=True)
    anchor_positions = input_batch.positions.index_select(0, last_rows).to(torch.int64) + 1
    slots = input_batch.idx_mapping[: int(input_batch.num_reqs)].index_select(
        0, torch.from_numpy(keep).to(device, non_blocking=True))
    sampled = counts.sampled[keep]
    next_prompt = next_prefill_tokens[0] if next_prefill_tokens.dim() > 1 else next_prefill_tokens
    if sampled.all():
        anchor_tokens = _by_slot(last_sampled).index_select(0, slots).to(torch.int64)
    elif not sampled.any():
        anchor_tokens = next_prompt.index_select(0, slots).to(torch.int64)
    else:
        anchor_tokens = torch.where(torch.from_numpy(sampled).to(device, non_blocking=True),
                                    _by_slot(last_sampled).index_select(0, slots).to(torch.int64),
                                    next_prompt.index_select(0, slots).to(torch.int64))

    req_ids = [input_batch.req_ids[i] for i in keep.tolist()]
    prompts: dict[str, torch.Tensor] | None = None
    if prompt_of is not None:
        computed = getattr(input_batch, "num_computed_tokens_np", None)
        for j, i in enumerate(keep.tolist()):
            if computed is None or int(computed[i]) <= 0:
                continue
            if first_seen is not None and not first_seen(req_ids[j]):
                continue
            prompt = prompt_of(i)
            if prompt is not None:
                prompts = prompts or {}
                prompts[req_ids[j]] = prompt
    return StepInput(req_ids=req_ids, counts=[int(c) for c in valid], positions=positions,
                     token_ids=token_ids, sampled=[bool(s) for s in sampled],
                     anchor_tokens=anchor_tokens, anchor_positions=anchor_positions, k=int(k),
                     hidden=hidden, prompt_token_ids=prompts)


__all__ = ["BatchCounts", "batch_counts", "build_step_input",
           "finishes_after_prefill", "row_index"]
