"""The ops backend as fused Triton kernels (CUDA; the interpreter runs them on a CPU).

Same functions and numerics as :mod:`.ops_torch` (fp32 reductions, values
rounded to the model dtype where vLLM rounds them), one launch each: a norm
(optionally fused with the residual add), the per-head q/k norm + RoPE done in
place on the fused q/k/v projection, SiLU-and-multiply, and the context K/V
store (k_norm of its layer, RoPE, value scale, scatter into the pool) for all
layers at once. Attention lives in :mod:`.triton_attention`, the argmax and the
seeded samples of the drafts (and DSpark's fused Markov step) in :mod:`.triton_sampling`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import DFlashConfig
from .triton_attention import attention  # noqa: F401  (part of this backend)
from .triton_sampling import argmax, gumbel_argmax, markov_drafts, markov_pick  # noqa: F401  (part of this backend)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def unsupported(cfg: DFlashConfig, block_rows: int, dtype: torch.dtype) -> str | None:
    """Why these kernels cannot run a draft (None when they can)."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {dtype}"
    if not (_pow2(cfg.head_dim) and cfg.head_dim >= 16):
        return f"head_dim {cfg.head_dim} is not a power of two >= 16"
    if not _pow2(cfg.rotary_dim // 2):
        return f"rotary_dim {cfg.rotary_dim} is not twice a power of two"
    if not _pow2(block_rows):
        return f"block size {block_rows} is not a power of two"
    return None


# -------------------------------------------------------------------- norms ---

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, x_stride, res_stride,
                     eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * n_cols + cols, x.to(res_out_ptr.dtype.element_ty), mask=mask)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (x * rstd).to(w.dtype) * w
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    n, cols = x.shape
    out = torch.empty(n, cols, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    if n:
        block = triton.next_power_of_2(cols)
        _rms_norm_kernel[(n,)](x, residual if residual is not None else x, weight, out, res_out, cols,
                               x.stride(0), (residual if residual is not None else x).stride(0), eps,
                               HAS_RES=residual is not None, BLOCK=block,
                               num_warps=max(1, min(16, block // 256)))
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm(x, residual, weight, eps)


# ------------------------------------------------------------- norm + rope ---

@triton.jit
def _norm_rope_heads(src, dst, w_q, w_k, is_q, ok, cs_ptr, pos, eps, HD: tl.constexpr,
                     ROT: tl.constexpr, NEOX: tl.constexpr):
    """RMSNorm the head vectors at ``src [H, 1]`` (weight ``w_q`` where ``is_q``, else
    ``w_k``), rotate them at ``pos`` and write them at ``dst [H, 1]`` (may equal ``src``);
    rows where ``ok`` is false are left alone."""
    half = tl.arange(0, ROT // 2)[None, :]
    if NEOX:
        i1 = half
        i2 = half + ROT // 2
    else:
        i1 = 2 * half
        i2 = 2 * half + 1
    d = tl.arange(0, HD)[None, :]
    tail = d >= ROT
    rest = tail & ok
    x1 = tl.load(src + i1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2, mask=ok, other=0.0).to(tl.float32)
    xr = tl.load(src + d, mask=rest, other=0.0).to(tl.float32)
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xr * xr, axis=1)
    rstd = tl.rsqrt(ss / HD + eps)[:, None]
    dt = dst.dtype.element_ty
    w1 = tl.where(is_q, tl.load(w_q + i1), tl.load(w_k + i1))
    w2 = tl.where(is_q, tl.load(w_q + i2), tl.load(w_k + i2))
    wr = tl.where(is_q, tl.load(w_q + d, mask=tail, other=0.0), tl.load(w_k + d, mask=tail, other=0.0))
    n1 = ((x1 * rstd).to(dt) * w1).to(dt).to(tl.float32)
    n2 = ((x2 * rstd).to(dt) * w2).to(dt).to(tl.float32)
    nr = (xr * rstd).to(dt) * wr
    cos = tl.load(cs_ptr + pos * ROT + half).to(tl.float32)
    sin = tl.load(cs_ptr + pos * ROT + ROT // 2 + half).to(tl.float32)
    tl.store(dst + i1, (n1 * cos - n2 * sin).to(dt), mask=ok)
    tl.store(dst + i2, (n2 * cos + n1 * sin).to(dt), mask=ok)
    tl.store(dst + d, nr.to(dt), mask=rest)


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, cs_ptr, pos_ptr, row_stride, eps,
                         NH: tl.constexpr, NKV: tl.constexpr, HEADS_P2: tl.constexpr,
                         HD: tl.constexpr, ROT: tl.constexpr, NEOX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, HEADS_P2)[:, None]              # q heads, then the k heads
    pos = tl.load(pos_ptr + row).to(tl.int64)
    ptr = qkv_ptr + row * row_stride + head * HD
    _norm_rope_heads(ptr, ptr, qw_ptr, kw_ptr, head < NH, head < NH + NKV, cs_ptr, pos, eps,
                     HD, ROT, NEOX)


def qk_norm_rope(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                 cos_sin: torch.Tensor, positions: torch.Tensor, cfg: DFlashConfig
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on ``qkv`` (one program per row, all heads); returns the q and k views."""
    n = qkv.shape[0]
    if n:
        heads = triton.next_power_of_2(cfg.num_heads + cfg.num_kv_heads)
        _qk_norm_rope_kernel[(n,)](
            qkv, q_norm, k_norm, cos_sin, positions, qkv.stride(0), cfg.rms_norm_eps,
            NH=cfg.num_heads, NKV=cfg.num_kv_heads, HEADS_P2=heads, HD=cfg.head_dim,
            ROT=cfg.rotary_dim, NEOX=cfg.is_neox_style, num_warps=4 if heads * cfg.head_dim <= 4096 else 8)
    return qkv[:, :cfg.q_size], qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size]


# ------------------------------------------------------------ context store ---

@triton.jit
def _store_context_kernel(proj_ptr, kw_ptr, cs_ptr, pos_ptr, slot_ptr, kv_ptr, proj_stride,
                          layer_stride, eps, v_scale, L: tl.constexpr, NKV: tl.constexpr,
                          NKV_P2: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr,
                          NEOX: tl.constexpr, HAS_VSCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    head = tl.arange(0, NKV_P2)[:, None]
    ok = head < NKV
    pos = tl.load(pos_ptr + row).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    stride = layer_stride.to(tl.int64)
    src = proj_ptr + row * proj_stride + layer * (2 * NKV * HD) + head * HD
    k_dst = kv_ptr + layer * stride + slot * (NKV * HD) + head * HD
    w = kw_ptr + layer * HD
    _norm_rope_heads(src, k_dst, w, w, head < 0, ok, cs_ptr, pos, eps, HD, ROT, NEOX)
    d = tl.arange(0, HD)[None, :]
    v = tl.load(src + NKV * HD + d, mask=ok, other=0.0)
    if HAS_VSCALE:
        v = (v.to(tl.float32) * v_scale).to(v.dtype)
    tl.store(k_dst + L * stride + d, v, mask=ok)       # kv[1] follows kv[0]


def store_context(kv_proj: torch.Tensor, k_norms: torch.Tensor, cos_sin: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor,
                  cfg: DFlashConfig) -> None:
    n = kv_proj.shape[0]
    if n:
        _store_context_kernel[(n, cfg.num_layers)](
            kv_proj, k_norms, cos_sin, positions, slots, kv, kv_proj.stride(0), kv.stride(1),
            cfg.rms_norm_eps, 1.0 if cfg.v_scale is None else cfg.v_scale, L=cfg.num_layers,
            NKV=cfg.num_kv_heads, NKV_P2=triton.next_power_of_2(cfg.num_kv_heads),
            HD=cfg.head_dim, ROT=cfg.rotary_dim, NEOX=cfg.is_neox_style,
            HAS_VSCALE=cfg.v_scale is not None, num_warps=4)


# --------------------------------------------------------------- SiLU * up ---

@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * n_cols + cols, (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype),
             mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    n, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, cols, dtype=gate_up.dtype, device=gate_up.device)
    if n:
        block = min(1024, triton.next_power_of_2(cols))
        _silu_mul_kernel[(n, triton.cdiv(cols, block))](gate_up, out, cols, BLOCK=block, num_warps=4)
    return out


# ---------------------------------------------------- block inputs (ids, positions) ---

@triton.jit
def _block_inputs_kernel(anchor_ptr, len_ptr, ids_ptr, pos_ptr, n, rows, mask_id, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < n
    r, o = idx // rows, idx % rows
    anchor = tl.load(anchor_ptr + r, mask=ok, other=0).to(tl.int64)
    start = tl.load(len_ptr + r, mask=ok, other=0).to(tl.int64)
    tl.store(ids_ptr + idx, tl.where(o == 0, anchor, tl.cast(mask_id, tl.int64)), mask=ok)
    tl.store(pos_ptr + idx, start + o, mask=ok)


def block_inputs(anchors: torch.Tensor, ctx_lens: torch.Tensor, rows: int, mask_id: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and positions ``[R * rows]`` (int64) of the query blocks, one launch
    (:func:`.ops_torch.block_inputs`)."""
    n = anchors.shape[0] * rows
    ids = torch.empty(n, dtype=torch.int64, device=anchors.device)
    positions = torch.empty(n, dtype=torch.int64, device=anchors.device)
    if n:
        block = min(1024, triton.next_power_of_2(n))
        _block_inputs_kernel[(triton.cdiv(n, block),)](anchors, ctx_lens, ids, positions, n, rows, mask_id,
                                                       BLOCK=block, num_warps=4)
    return ids, positions


# ------------------------------------------------------ DSpark's confidence head ---

@triton.jit
def _confidence_kernel(h_ptr, anchor_ptr, ids_ptr, w1_ptr, w_ptr, b_ptr, out_ptr, k, h_stride, H, RANK,
                       MARKOV: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)              # request * k + step
    c = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, H, BLOCK):
        ok = c0 + c < H
        x = tl.load(h_ptr + row * h_stride + c0 + c, mask=ok, other=0.0).to(tl.float32)
        acc += x * tl.load(w_ptr + c0 + c, mask=ok, other=0.0)
    if MARKOV:
        step = row % k
        if step == 0:
            prev = tl.load(anchor_ptr + row // k).to(tl.int64)
        else:
            prev = tl.load(ids_ptr + row - 1)
        for c0 in range(0, RANK, BLOCK):
            ok = c0 + c < RANK
            e = tl.load(w1_ptr + prev * RANK + c0 + c, mask=ok, other=0.0).to(tl.float32)
            acc += e * tl.load(w_ptr + H + c0 + c, mask=ok, other=0.0)
    tl.store(out_ptr + row, tl.sigmoid(tl.sum(acc, axis=0) + tl.load(b_ptr)))


def markov_confidence(h: torch.Tensor, anchors: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor | None,
                      w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:func:`.ops_torch.markov_confidence` in one launch (float32 sums in another order)."""
    r, k = ids.shape
    out = torch.empty(r, k, dtype=torch.float32, device=h.device)
    if r * k:
        hidden, rank = h.shape[1], 0 if w1 is None else w1.shape[1]
        assert h.stride(1) == 1 and ids.is_contiguous() and w.is_contiguous()
        _confidence_kernel[(r * k,)](h, anchors, ids, h if w1 is None else w1, w, b, out, k, h.stride(0),
                                     hidden, rank, MARKOV=w1 is not None, BLOCK=1024, num_warps=4)
    return out
