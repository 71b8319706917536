"""The ops backend as fused Triton kernels (CUDA; the interpreter runs them on a CPU).

Same functions and numerics as :mod:`.ops_torch` (fp32 reductions, values
rounded to the model dtype where vLLM rounds them), one launch each: a norm
(optionally fused with the residual add), the per-head q/k norm + RoPE done in
place on the fused q/k/v projection, SiLU-and-multiply, and the context K/V
store (k_norm of its layer, RoPE, value scale, scatter into the pool) for all
layers at once. Attention lives in :mod:`.triton_attention`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import DFlashConfig
from .triton_attention import attention  # noqa: F401  (part of this backend)


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
def _norm_rope_head(src, dst, w_ptr, cs_ptr, pos, eps, HD: tl.constexpr, ROT: tl.constexpr,
                    NEOX: tl.constexpr):
    """RMSNorm one head vector at ``src`` (weight ``w_ptr``), rotate it at ``pos`` and
    write it at ``dst`` (may equal ``src``)."""
    half = tl.arange(0, ROT // 2)
    if NEOX:
        i1 = half
        i2 = half + ROT // 2
    else:
        i1 = 2 * half
        i2 = 2 * half + 1
    d = tl.arange(0, HD)
    rest = d >= ROT
    x1 = tl.load(src + i1).to(tl.float32)
    x2 = tl.load(src + i2).to(tl.float32)
    xr = tl.load(src + d, mask=rest, other=0.0).to(tl.float32)
    ss = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0) + tl.sum(xr * xr, axis=0)
    rstd = tl.rsqrt(ss / HD + eps)
    dt = dst.dtype.element_ty
    n1 = ((x1 * rstd).to(dt) * tl.load(w_ptr + i1)).to(dt).to(tl.float32)
    n2 = ((x2 * rstd).to(dt) * tl.load(w_ptr + i2)).to(dt).to(tl.float32)
    nr = (xr * rstd).to(dt) * tl.load(w_ptr + d, mask=rest, other=0.0)
    cos = tl.load(cs_ptr + pos * ROT + half).to(tl.float32)
    sin = tl.load(cs_ptr + pos * ROT + ROT // 2 + half).to(tl.float32)
    tl.store(dst + i1, (n1 * cos - n2 * sin).to(dt))
    tl.store(dst + i2, (n2 * cos + n1 * sin).to(dt))
    tl.store(dst + d, nr.to(dt), mask=rest)


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, cs_ptr, pos_ptr, row_stride, eps,
                         NH: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr, NEOX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    ptr = qkv_ptr + row * row_stride + head * HD       # k heads follow the q heads
    if head < NH:
        _norm_rope_head(ptr, ptr, qw_ptr, cs_ptr, pos, eps, HD, ROT, NEOX)
    else:
        _norm_rope_head(ptr, ptr, kw_ptr, cs_ptr, pos, eps, HD, ROT, NEOX)


def qk_norm_rope(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                 cos_sin: torch.Tensor, positions: torch.Tensor, cfg: DFlashConfig
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on ``qkv``; returns the ``q`` and ``k`` column views."""
    n = qkv.shape[0]
    if n:
        _qk_norm_rope_kernel[(n, cfg.num_heads + cfg.num_kv_heads)](
            qkv, q_norm, k_norm, cos_sin, positions, qkv.stride(0), cfg.rms_norm_eps,
            NH=cfg.num_heads, HD=cfg.head_dim, ROT=cfg.rotary_dim, NEOX=cfg.is_neox_style,
            num_warps=1)
    return qkv[:, :cfg.q_size], qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size]


# ------------------------------------------------------------ context store ---

@triton.jit
def _store_context_kernel(proj_ptr, kw_ptr, cs_ptr, pos_ptr, slot_ptr, kv_ptr, proj_stride,
                          layer_stride, eps, v_scale, L: tl.constexpr, NKV: tl.constexpr,
                          HD: tl.constexpr, ROT: tl.constexpr, NEOX: tl.constexpr,
                          HAS_VSCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    stride = layer_stride.to(tl.int64)
    src = proj_ptr + row * proj_stride + layer * (2 * NKV * HD) + head * HD
    k_dst = kv_ptr + layer * stride + slot * (NKV * HD) + head * HD
    _norm_rope_head(src, k_dst, kw_ptr + layer * HD, cs_ptr, pos, eps, HD, ROT, NEOX)
    d = tl.arange(0, HD)
    v = tl.load(src + NKV * HD + d)
    if HAS_VSCALE:
        v = (v.to(tl.float32) * v_scale).to(v.dtype)
    tl.store(k_dst + L * stride + d, v)             # kv[1] follows kv[0]


def store_context(kv_proj: torch.Tensor, k_norms: torch.Tensor, cos_sin: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor,
                  cfg: DFlashConfig) -> None:
    n = kv_proj.shape[0]
    if n:
        _store_context_kernel[(n, cfg.num_layers, cfg.num_kv_heads)](
            kv_proj, k_norms, cos_sin, positions, slots, kv, kv_proj.stride(0), kv.stride(1),
            cfg.rms_norm_eps, 1.0 if cfg.v_scale is None else cfg.v_scale, L=cfg.num_layers,
            NKV=cfg.num_kv_heads, HD=cfg.head_dim, ROT=cfg.rotary_dim, NEOX=cfg.is_neox_style,
            HAS_VSCALE=cfg.v_scale is not None, num_warps=1)


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
