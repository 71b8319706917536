"""The ops backend in plain PyTorch: runs anywhere (the CPU path, CI) and is the
correctness reference for :mod:`.ops_triton`.

Numerics follow vLLM's native ops: RMSNorm in fp32, the normalised value cast
to the model dtype and then scaled by the weight; the fused add+norm keeps the
residual rounded to the model dtype but normalises the fp32 sum; RoPE in the
model dtype; attention scores, softmax and the weighted sum of values in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import gumbel
from .config import DFlashConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf.to(weight.dtype) * weight).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.float() + residual.float()
    normed = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed.to(weight.dtype) * weight).to(x.dtype), s.to(x.dtype)


def rope(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, cfg: DFlashConfig
         ) -> torch.Tensor:
    """Rotate ``x [N, ..., hd]`` at ``positions [N]`` (neox halves or interleaved pairs)."""
    cos, sin = cos_sin.index_select(0, positions.long()).chunk(2, dim=-1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    rot, rest = x[..., :cfg.rotary_dim], x[..., cfg.rotary_dim:]
    x1, x2 = rot.chunk(2, dim=-1) if cfg.is_neox_style else (rot[..., 0::2], rot[..., 1::2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.cat((o1, o2), dim=-1) if cfg.is_neox_style else torch.stack((o1, o2), -1).flatten(-2)
    return torch.cat((out, rest), dim=-1)


def qk_norm_rope(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                 cos_sin: torch.Tensor, positions: torch.Tensor, cfg: DFlashConfig
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q/k RMSNorm then RoPE of the fused projection ``qkv [N, (nh+2nkv) hd]``;
    returns ``q [N, nh hd]`` and ``k [N, nkv hd]``."""
    n, hd = qkv.shape[0], cfg.head_dim
    q = qkv[:, :cfg.q_size].reshape(n, cfg.num_heads, hd)
    k = qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].reshape(n, cfg.num_kv_heads, hd)
    q = rope(rms_norm(q, q_norm, cfg.rms_norm_eps), cos_sin, positions, cfg)
    k = rope(rms_norm(k, k_norm, cfg.rms_norm_eps), cos_sin, positions, cfg)
    return q.reshape(n, -1), k.reshape(n, -1)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum of each row of ``x [N, V]`` (int64)."""
    return x.argmax(dim=-1)


def gumbel_argmax(x: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, ctx_lens: torch.Tensor,
                  step: int, keys: torch.Tensor | None = None) -> torch.Tensor:
    """Seeded Gumbel-max sample of draft step ``step`` (:mod:`.gumbel`): indices ``[N]`` int64."""
    return gumbel.sample(x, temperature, gumbel.step_seeds(seeds, step),
                         ctx_lens.to(torch.int64) + (step + gumbel.SALT), keys)


def markov_pick(base: torch.Tensor, e: torch.Tensor, w: torch.Tensor, scale: float,
                temperature: torch.Tensor | None = None, seeds: torch.Tensor | None = None,
                ctx_lens: torch.Tensor | None = None, step: int = 0,
                keys: torch.Tensor | None = None) -> torch.Tensor:
    """One step of DSpark's Markov head: indices ``[R]`` of ``base [R, V] + F.linear(e, w) * scale``
    (each stored in the dtype): the argmax, or with ``temperature`` the seeded sample of draft ``step``."""
    add = F.linear(e, w)
    logits = base + (add * scale if scale != 1.0 else add)
    if temperature is None:
        return argmax(logits)
    return gumbel_argmax(logits, temperature, seeds, ctx_lens, step, keys)


def markov_drafts(base: torch.Tensor, anchors: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  scale: float, d2t: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
                  seeds: torch.Tensor | None = None, ctx_lens: torch.Tensor | None = None,
                  keys: torch.Tensor | None = None) -> torch.Tensor:
    """DSpark's Markov head over ``base [R, k, V]`` from ``anchors [R]`` (target ids): target ids
    ``[R, k]`` (int64); step ``i`` picks with ``e = w1[prev]`` (:func:`markov_pick`), ``prev`` the
    last draft mapped by ``d2t`` (draft id + offset)."""
    prev, drafts = anchors.long(), []
    for i in range(base.shape[1]):
        pick = markov_pick(base[:, i], F.embedding(prev, w1), w2, scale, temperature, seeds, ctx_lens, i, keys)
        prev = pick if d2t is None else pick + d2t[pick]
        drafts.append(prev)
    return torch.stack(drafts, dim=1) if drafts else anchors.new_empty(anchors.shape[0], 0, dtype=torch.int64)


def block_inputs(anchors: torch.Tensor, ctx_lens: torch.Tensor, rows: int, mask_id: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and positions ``[R * rows]`` (int64) of the query blocks ``[anchor, mask * (rows - 1)]``
    at positions ``ctx_lens[r] + 0 .. rows - 1``."""
    offsets = torch.arange(rows, device=ctx_lens.device)
    ids = torch.where(offsets[None] == 0, anchors[:, None].long(), mask_id)
    return ids.reshape(-1), (ctx_lens[:, None].long() + offsets[None]).reshape(-1)


def markov_confidence(h: torch.Tensor, anchors: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor | None,
                      w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """DSpark's confidence ``[R, k]`` (float32): ``sigmoid(F.linear([h | w1[prev]].float(), w, b))`` per
    draft row ``h [R*k, H]`` (request, step), ``prev`` the step's previous token (the anchor, then the
    drafts ``ids [R, k]``); without ``w1``, of ``h`` alone."""
    r, k = ids.shape
    x = h
    if w1 is not None:
        prevs = torch.cat([anchors.long()[:, None], ids[:, :-1]], 1)
        x = torch.cat([h, F.embedding(prevs, w1).flatten(0, 1)], -1)
    return torch.sigmoid(F.linear(x.float(), w, b).squeeze(-1)).view(r, k)


def store_context(kv_proj: torch.Tensor, k_norms: torch.Tensor, cos_sin: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor,
                  cfg: DFlashConfig) -> None:
    """Write context K (k_norm of its layer, RoPE) and V (value scale) of every layer
    from ``kv_proj [N, L*2*nkv*hd]`` into ``kv [2, L, blocks, rows, nkv, hd]`` at the
    flat ``slots [N]`` (block * rows + row)."""
    n, layers = kv_proj.shape[0], cfg.num_layers
    proj = kv_proj.view(n, layers, 2, cfg.num_kv_heads, cfg.head_dim)
    k = rms_norm(proj[:, :, 0], k_norms[None, :, None, :], cfg.rms_norm_eps)
    k = rope(k, cos_sin, positions, cfg)
    v = proj[:, :, 1] if cfg.v_scale is None else proj[:, :, 1] * cfg.v_scale
    flat = kv.view(2, layers, -1, cfg.num_kv_heads, cfg.head_dim)
    flat[:, :, slots.long()] = torch.stack([k, v]).transpose(1, 2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
              v_pool: torch.Tensor, ctx_lens: torch.Tensor, tables: torch.Tensor, rows: int,
              cfg: DFlashConfig, splits: int = 1) -> torch.Tensor:
    """Each request's ``rows`` block queries over its paged context then its own block.

    ``q [R*rows, nh*hd]``, block ``k``/``v [R*rows, nkv*hd]`` (any row stride), the
    layer's pool ``[blocks, block_rows, nkv, hd]``; context of request r: rows
    ``0..ctx_lens[r]-1`` in blocks ``tables[r]``. Non-causal blocks see every block key;
    causal ones keys 0..i. GQA head h reads kv head h // (nh/nkv); scale hd^-0.5.
    ``splits`` is accepted for the Triton signature and ignored. Returns ``[R*rows, nh*hd]``.
    """
    r, nkv, hd = ctx_lens.shape[0], cfg.num_kv_heads, cfg.head_dim
    group, block_rows = cfg.num_heads // nkv, k_pool.shape[1]
    keys_per_req = tables.shape[1] * block_rows
    j = torch.arange(keys_per_req, device=q.device)
    in_ctx = j[None] < ctx_lens[:, None]                                            # [R, W*rows]
    pages = torch.where(in_ctx, tables.long()[:, j // block_rows], 0)   # entries past a context: never read
    slots = pages * block_rows + j % block_rows
    ctx_k = k_pool.reshape(-1, nkv, hd)[slots]
    ctx_v = v_pool.reshape(-1, nkv, hd)[slots]
    keys = torch.cat([ctx_k, k.reshape(r, rows, nkv, hd)], 1).float()              # [R, S, nkv, hd]
    values = torch.cat([ctx_v, v.reshape(r, rows, nkv, hd)], 1).float()
    ctx_ok = in_ctx.unsqueeze(1).expand(r, rows, keys_per_req)
    block_ok = torch.ones(rows, rows, dtype=torch.bool, device=q.device)
    if cfg.causal:
        block_ok = block_ok.tril()
    allowed = torch.cat([ctx_ok, block_ok.expand(r, rows, rows)], -1)               # [R, rows, S]
    qf = q.reshape(r, rows, nkv, group, hd).float()
    scores = torch.einsum("rtkgd,rskd->rkgts", qf, keys) * (hd ** -0.5)
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    out = torch.einsum("rkgts,rskd->rtkgd", torch.softmax(scores, dim=-1), values)
    return out.reshape(r * rows, cfg.q_size).to(q.dtype)
