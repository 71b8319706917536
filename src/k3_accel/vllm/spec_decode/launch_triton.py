"""A V2 step's launch in two kernels (CUDA): the per-request meta columns, then the row scatter.

:func:`.v2_launch.scatter_torch` does the same with about 30 small torch operations, each launched
from Python on vLLM's step thread (about 1 ms of that thread's time per step on the H200). Here:

* ``_meta_kernel`` (one program over every request): ``ran = qsl[j+1] - qsl[j]``, ``valid = (ran -
  rejected) * kept``, ``sampled = num_sampled > 0``, the anchor (the last sampled token, else the next
  prefill token, by slot), the first position, into meta rows 0, 1, 2, 3, 6; the exclusive prefix sum
  of ``valid`` into ``excl``.
* ``_rows_kernel`` (rows in blocks): each row's request by binary search over the device's
  ``query_start_loc`` (vLLM's adaptive verification may have trimmed it below the host's count, the
  rows past its end belong to no request); a valid row of a kept request goes to ``excl[req] +
  offset``, any other to the dump row ``capacity``; valid rows' token ids are stored. The
  destinations are returned for the hidden rows' ``index_copy_``.

Integer sizes are not specialised (no compile per batch shape in the middle of serving); the request
block is the largest batch's, fixed when the rows are built. The interpreter runs them on the CPU in
the tests (``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ROW_BLOCK = 128


@triton.jit(do_not_specialize=["r", "meta_stride"])
def _meta_kernel(qsl_ptr, rej_ptr, kept_ptr, ns_ptr, last_ptr, nxt_ptr, slot_ptr, pos_ptr, meta_ptr, excl_ptr,
                 r, meta_stride, BLOCK_R: tl.constexpr):
    j = tl.arange(0, BLOCK_R)
    ok = j < r
    q0 = tl.load(qsl_ptr + j, mask=ok, other=0).to(tl.int64)
    q1 = tl.load(qsl_ptr + j + 1, mask=ok, other=0).to(tl.int64)
    ran = q1 - q0
    valid = (ran - tl.load(rej_ptr + j, mask=ok, other=0).to(tl.int64)) * tl.load(kept_ptr + j, mask=ok, other=0)
    sampled = (tl.load(ns_ptr + j, mask=ok, other=0) > 0).to(tl.int64)
    slot = tl.load(slot_ptr + j, mask=ok, other=0).to(tl.int64)
    last = tl.load(last_ptr + slot, mask=ok, other=0).to(tl.int64)
    nxt = tl.load(nxt_ptr + slot, mask=ok, other=0).to(tl.int64)
    first = tl.load(pos_ptr + q0, mask=ok, other=0).to(tl.int64)
    tl.store(meta_ptr + j, valid, mask=ok)
    tl.store(meta_ptr + meta_stride + j, sampled, mask=ok)
    tl.store(meta_ptr + 2 * meta_stride + j, tl.where(sampled > 0, last, nxt), mask=ok)
    tl.store(meta_ptr + 3 * meta_stride + j, first, mask=ok)
    tl.store(meta_ptr + 6 * meta_stride + j, ran, mask=ok)
    tl.store(excl_ptr + j, tl.cumsum(valid, 0) - valid, mask=ok)


@triton.jit(do_not_specialize=["n", "r", "capacity"])
def _rows_kernel(qsl_ptr, valid_ptr, excl_ptr, ids_ptr, tokens_ptr, dst_ptr, n, r, capacity,
                 STEPS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    lo = tl.zeros([BLOCK], dtype=tl.int64)           # the first request whose end is past row i
    hi = tl.zeros([BLOCK], dtype=tl.int64) + r
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        end = tl.load(qsl_ptr + 1 + mid, mask=ok & active, other=0).to(tl.int64)
        right = active & (end <= i)
        left = active & (end > i)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(left, mid, hi)
    req = tl.minimum(lo, r - 1)
    offset = i - tl.load(qsl_ptr + req, mask=ok, other=0).to(tl.int64)
    # a row past the device's end (trimmed) lands past the last request's rows: offset >= ran >= valid
    keep = ok & (offset < tl.load(valid_ptr + req, mask=ok, other=0))
    dst = tl.where(keep, tl.load(excl_ptr + req, mask=ok, other=0) + offset, capacity)
    tl.store(dst_ptr + i, dst, mask=ok)
    tl.store(tokens_ptr + dst, tl.load(ids_ptr + i, mask=keep, other=0).to(tl.int64), mask=keep)


def scatter(rows, r: int, n: int, qsl: torch.Tensor, num_rejected: torch.Tensor, kept: torch.Tensor,
            num_sampled: torch.Tensor, last: torch.Tensor, nxt: torch.Tensor, slot_idx: torch.Tensor,
            positions: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """As :func:`.v2_launch.scatter_torch` (same arguments, same writes): meta rows 0, 1, 2, 3, 6 of
    ``rows.meta``, ``rows.token_ids`` of the kept rows; returns the ``[n]`` destinations."""
    meta, block_r = rows.meta, rows.meta.shape[1]
    excl = rows.excl
    _meta_kernel[(1,)](qsl, num_rejected, kept, num_sampled, last, nxt, slot_idx, positions, meta, excl,
                       r, meta.stride(0), BLOCK_R=triton.next_power_of_2(block_r))
    dst = rows.dst[:n]
    if n:
        _rows_kernel[(triton.cdiv(n, ROW_BLOCK),)](qsl, meta[0], excl, input_ids, rows.token_ids, dst, n, r,
                                                   rows.capacity, STEPS=max(1, block_r.bit_length() + 1),
                                                   BLOCK=ROW_BLOCK)
    return dst


def warm(rows) -> None:
    """Compile both kernels now, for the argument types vLLM 0.33's V2 runner passes (query_start_loc,
    num_sampled, num_rejected, next_prefill_tokens and input_ids int32; idx_mapping, last_sampled_tokens,
    positions int64): called when the buffers are built, so the first real step does not compile in
    the middle of serving (vLLM's JIT monitor warns about that)."""
    dev = rows.device

    def t(values, dtype):
        return torch.tensor(values, dtype=dtype, device=dev)

    i32, i64 = torch.int32, torch.int64
    scatter(rows, 1, 1, t([0, 1], i32), t([0], i32), t([1], i64), t([1], i32), t([0], i64), t([0], i32),
            t([0], i64), t([0], i64), t([0], i32))


__all__ = ["scatter", "warm"]
