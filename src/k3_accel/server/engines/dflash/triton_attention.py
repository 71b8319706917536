"""Paged block attention in Triton: each request's query block over its own paged
context, then over the block's own keys (non-causal, or causal within the block).

One program per (request, kv head, context split). It packs the ``G`` query
heads that share the kv head and the block's ``T`` rows into one ``G*T``-row
tile, so every key row is read once per kv head (grouped queries, like a
decode kernel) and both products run on tensor cores. Keys stream in tiles of
``BLOCK_N`` rows gathered through the block table; an online softmax keeps
fp32 running max / sum / accumulator. With several splits (few requests), each
split covers a contiguous share of the context pages and writes a normalised
partial result plus its log-sum-exp; :func:`_combine_kernel` merges them. The
last split also takes the block keys.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import DFlashConfig

_LOG2E = 1.4426950408889634
MAX_SPLITS = 64


@triton.jit
def _online_update(q, k, v, allowed, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
        q_ptr, kb_ptr, vb_ptr, kp_ptr, vp_ptr, ctx_ptr, tbl_ptr, out_ptr, part_ptr, lse_ptr,
        q_stride, kb_stride, vb_stride, tbl_stride, T, n_rows, scale, splits,
        NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, ONE_SPLIT: tl.constexpr,
        CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    G: tl.constexpr = NH // NKV
    m = tl.arange(0, BLOCK_M)
    t = m // G
    head = kh * G + m % G
    row_ok = t < T
    d = tl.arange(0, HD)
    q_rows = b * T + t
    q = tl.load(q_ptr + q_rows[:, None] * q_stride + head[:, None] * HD + d[None, :],
                mask=row_ok[:, None], other=0.0)

    ctx = tl.load(ctx_ptr + b)
    pages = tl.cdiv(ctx, BS)
    per_split = tl.cdiv(pages, splits)
    lo = split * per_split * BS
    hi = tl.minimum((split + 1) * per_split * BS, ctx)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        j = start + n
        j_ok = j < hi
        page = tl.load(tbl_ptr + b * tbl_stride + j // BS, mask=j_ok, other=0).to(tl.int64)
        off = (page * BS + j % BS)[:, None] * (NKV * HD) + kh * HD + d[None, :]
        k = tl.load(kp_ptr + off, mask=j_ok[:, None], other=0.0)
        v = tl.load(vp_ptr + off, mask=j_ok[:, None], other=0.0)
        m_i, l_i, acc = _online_update(q, k, v, j_ok[None, :], m_i, l_i, acc, scale, PRECISION)

    if split == splits - 1:                       # the block's own keys
        jb = tl.arange(0, BLOCK_T)
        jb_ok = jb < T
        cols = kh * HD + d[None, :]
        k = tl.load(kb_ptr + (b * T + jb)[:, None] * kb_stride + cols, mask=jb_ok[:, None], other=0.0)
        v = tl.load(vb_ptr + (b * T + jb)[:, None] * vb_stride + cols, mask=jb_ok[:, None], other=0.0)
        allowed = jb_ok[None, :]
        if CAUSAL:
            allowed = allowed & (jb[None, :] <= t[:, None])
        m_i, l_i, acc = _online_update(q, k, v, allowed, m_i, l_i, acc, scale, PRECISION)

    out_off = q_rows[:, None] * (NH * HD) + head[:, None] * HD + d[None, :]
    if ONE_SPLIT:
        out = acc / l_i[:, None]
        tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        has = l_i > 0
        out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        base = split.to(tl.int64) * n_rows * NH
        tl.store(part_ptr + base * HD + out_off, out, mask=row_ok[:, None])
        tl.store(lse_ptr + base + q_rows * NH + head, lse, mask=row_ok)


@triton.jit
def _combine_kernel(part_ptr, lse_ptr, out_ptr, n_rows, splits, NH: tl.constexpr,
                    HD: tl.constexpr, SPLITS_P2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P2).to(tl.int64)
    s_ok = s < splits
    lse = tl.load(lse_ptr + s * n_rows * NH + row * NH + head, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    w = tl.where(s_ok, w, 0.0)
    d = tl.arange(0, HD)
    part = tl.load(part_ptr + (s * n_rows * NH + row * NH + head)[:, None] * HD + d[None, :],
                   mask=s_ok[:, None], other=0.0)
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + (row * NH + head) * HD + d, out.to(out_ptr.dtype.element_ty))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
              v_pool: torch.Tensor, ctx_lens: torch.Tensor, tables: torch.Tensor, rows: int,
              cfg: DFlashConfig, splits: int = 1, tuning: dict | None = None) -> torch.Tensor:
    """Same contract as :func:`.ops_torch.attention` (``splits`` context splits);
    ``tuning`` overrides ``block_n``, ``num_warps``, ``num_stages`` (benchmarks)."""
    r, nh, nkv, hd = ctx_lens.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    n_rows = r * rows
    out = torch.empty(n_rows, nh * hd, dtype=q.dtype, device=q.device)
    if n_rows == 0:
        return out
    for x in (q, k, v):
        assert x.stride(1) == 1, "head dimension must be contiguous"
    assert 1 <= splits <= MAX_SPLITS, f"splits must be in 1..{MAX_SPLITS}, got {splits}"
    if splits > 1:
        part = torch.empty(splits, n_rows, nh, hd, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, n_rows, nh, dtype=torch.float32, device=q.device)
    else:
        part = lse = out
    group = nh // nkv
    block_m = max(16, triton.next_power_of_2(group * rows))
    block_t = max(16, triton.next_power_of_2(rows))
    narrow = q.element_size() == 2 and hd <= 128      # measured on an H200 (draft_step.py sweep)
    tune = {"block_n": 128 if narrow else (64 if hd <= 128 else 32),
            "num_warps": 4 if block_m <= 32 else 8, "num_stages": 3 if narrow else 2, **(tuning or {})}
    precision = "ieee" if q.dtype == torch.float32 else None
    _paged_attention_kernel[(r, nkv, splits)](
        q, k, v, k_pool, v_pool, ctx_lens, tables, out, part, lse,
        q.stride(0), k.stride(0), v.stride(0), tables.stride(0), rows, n_rows, (hd ** -0.5) * _LOG2E,
        splits,
        NH=nh, NKV=nkv, HD=hd, BS=k_pool.shape[1], BLOCK_M=block_m, BLOCK_N=tune["block_n"],
        BLOCK_T=block_t, ONE_SPLIT=splits == 1, CAUSAL=cfg.causal, PRECISION=precision,
        num_warps=tune["num_warps"], num_stages=tune["num_stages"])
    if splits > 1:
        _combine_kernel[(n_rows, nh)](part, lse, out, n_rows, splits, NH=nh, HD=hd,
                                      SPLITS_P2=triton.next_power_of_2(splits), num_warps=4)
    return out
