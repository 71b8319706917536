"""DFlash draft math in plain PyTorch (no vLLM), following notes/dflash.md.

Numerics follow vLLM's native ops: RMSNorm in fp32 then cast (the fused
add+norm normalises the fp32 sum and keeps the residual rounded to the model
dtype), RoPE with an fp32 cos/sin table cast to the model dtype, attention
scores/softmax/PV in fp32, logits ``lm_head(h) * logit_scale`` in the model
dtype.

Two entry points share these functions: :func:`context_kv` (context rows ->
per-layer K/V) and :func:`block_forward` (the query block attending to
context + block K/V, handed to it by a :class:`KVSource`).
:func:`reference_propose` recomputes everything for one request without any
cache; the engine must agree with it.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from .checkpoint import DFlashConfig, DFlashWeights, LayerWeights


# ---------------------------------------------------------------- norms ---

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32, returned in ``x.dtype``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf.to(weight.dtype) * weight).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``; the sum is taken in fp32 and the
    returned residual is rounded to ``x.dtype`` (vLLM's fused_add_rms_norm)."""
    s = x.float() + residual.float()
    normed = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed.to(weight.dtype) * weight).to(x.dtype), s.to(x.dtype)


# ----------------------------------------------------------------- rope ---

class Rope:
    """Rotary embedding with a cos/sin table built like vLLM's (fp32, then cast).

    The table covers ``max_position_embeddings`` and grows on demand; rows for
    a position never change when it grows.
    """

    def __init__(self, cfg: DFlashConfig, dtype: torch.dtype, device: torch.device | str):
        self.rotary_dim = cfg.rotary_dim
        self.theta = cfg.rope_theta
        self.neox = cfg.is_neox_style
        self.dtype, self.device = dtype, torch.device(device)
        self.table = self._build(cfg.max_position_embeddings)

    def _build(self, n: int) -> torch.Tensor:
        rot = self.rotary_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
        t = torch.arange(n, dtype=torch.float)
        freqs = torch.einsum("i,j -> ij", t, inv_freq)
        table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        return table.to(device=self.device, dtype=self.dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [n, heads, head_dim]`` at ``positions [n]`` (new tensor)."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.table.shape[0]:
            self.table = self._build(max(need, 2 * self.table.shape[0]))
        cos, sin = self.table.index_select(0, positions).chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        if self.neox:
            x1, x2 = rot.chunk(2, dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        out = torch.cat((o1, o2), dim=-1) if self.neox else torch.stack((o1, o2), -1).flatten(-2)
        return torch.cat((out, rest), dim=-1)


# ------------------------------------------------------------ attention ---

def _heads(x: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    return x.view(x.shape[0], n_heads, head_dim)


def project_kv(cfg: DFlashConfig, lw: LayerWeights, rope: Rope, x: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K (k_norm, RoPE) and V (value scale) of rows ``x [n, H]``: each ``[n, nkv, hd]``."""
    k = _heads(F.linear(x, lw.k_proj, lw.k_bias), cfg.num_kv_heads, cfg.head_dim)
    v = _heads(F.linear(x, lw.v_proj, lw.v_bias), cfg.num_kv_heads, cfg.head_dim)
    k = rope.apply(rms_norm(k, lw.k_norm, cfg.rms_norm_eps), positions)
    if cfg.v_scale is not None:
        v = v * cfg.v_scale
    return k, v


def context_kv(w: DFlashWeights, rope: Rope, hidden: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Context K/V for aux rows ``hidden [n, A*Ht]`` at ``positions [n]``.

    ``c = fc(hidden)``, ``n = hidden_norm(c)`` (no input_layernorm), then per
    layer ``k = rope(k_norm(k_proj(n)))``, ``v = v_proj(n)``. Returns
    ``k, v`` of shape ``[layers, n, nkv, head_dim]``. Each row depends only on
    its own input row and position.
    """
    cfg = w.config
    normed = rms_norm(F.linear(hidden, w.fc), w.hidden_norm, cfg.rms_norm_eps)
    ks, vs = zip(*(project_kv(cfg, lw, rope, normed, positions) for lw in w.layers))
    return torch.stack(ks), torch.stack(vs)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int, causal: bool
           ) -> torch.Tensor:
    """Attention of block queries ``q [B, nh, hd]`` over keys/values
    ``[ctx_len + B, nkv, hd]`` (context then block), GQA head h -> kv head
    h // (nh/nkv), scale hd^-0.5, fp32 math. Non-causal: every query sees every
    key; causal: block query i sees context and block keys 0..i.
    Returns ``[B, nh*hd]`` in ``q.dtype``."""
    b, nh, hd = q.shape
    nkv = k.shape[1]
    qf = q.float().view(b, nkv, nh // nkv, hd).permute(1, 2, 0, 3)       # [nkv, g, B, hd]
    kf = k.float().permute(1, 2, 0).unsqueeze(1)                         # [nkv, 1, hd, T]
    vf = v.float().permute(1, 0, 2).unsqueeze(1)                         # [nkv, 1, T, hd]
    scores = torch.matmul(qf, kf) * (hd ** -0.5)                         # [nkv, g, B, T]
    if causal:
        t = k.shape[0]
        allowed = torch.arange(t, device=q.device)[None, :] <= (
            ctx_len + torch.arange(b, device=q.device)[:, None])
        scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)                # [nkv, g, B, hd]
    return out.permute(2, 0, 1, 3).reshape(b, nh * hd).to(q.dtype)


class KVSource(Protocol):
    """Where a request's context K/V live during a block forward."""

    def keys_values(self, layer: int, req: int, k_block: torch.Tensor, v_block: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Return ``(K, V, ctx_len)``: context rows then the given block rows,
        each ``[ctx_len + B, nkv, hd]``."""
        ...


def _attention(w: DFlashWeights, li: int, rope: Rope, x: torch.Tensor, positions: torch.Tensor,
               kv: KVSource, n_req: int) -> torch.Tensor:
    cfg, lw = w.config, w.layers[li]
    q = _heads(F.linear(x, lw.q_proj, lw.q_bias), cfg.num_heads, cfg.head_dim)
    q = rope.apply(rms_norm(q, lw.q_norm, cfg.rms_norm_eps), positions)
    k, v = project_kv(cfg, lw, rope, x, positions)
    b = x.shape[0] // n_req
    outs = []
    for r in range(n_req):
        rows = slice(r * b, (r + 1) * b)
        keys, values, ctx_len = kv.keys_values(li, r, k[rows], v[rows])
        outs.append(attend(q[rows], keys, values, ctx_len, cfg.causal))
    return F.linear(torch.cat(outs), lw.o_proj, lw.o_bias)


def _mlp(lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, lw.gate_proj)) * F.linear(x, lw.up_proj), lw.down_proj)


def block_forward(w: DFlashWeights, rope: Rope, token_ids: torch.Tensor, positions: torch.Tensor,
                  kv: KVSource) -> torch.Tensor:
    """Run the query blocks ``token_ids [R, B]`` at ``positions [R, B]`` through
    the draft layers (Qwen3 pre-norm; attention over context + block from
    ``kv``) and the final norm. Returns hidden states ``[R, B, H]``."""
    cfg = w.config
    n_req, b = token_ids.shape
    flat_pos = positions.reshape(-1)
    x = F.embedding(token_ids.reshape(-1), w.embed_tokens)
    residual = x
    x = rms_norm(x, w.layers[0].input_layernorm, cfg.rms_norm_eps)
    for li, lw in enumerate(w.layers):
        if li > 0:
            x, residual = add_rms_norm(x, residual, lw.input_layernorm, cfg.rms_norm_eps)
        x = _attention(w, li, rope, x, flat_pos, kv, n_req)
        x, residual = add_rms_norm(x, residual, lw.post_attention_layernorm, cfg.rms_norm_eps)
        x = _mlp(lw, x)
    x, _ = add_rms_norm(x, residual, w.norm, cfg.rms_norm_eps)
    return x.view(n_req, b, cfg.hidden_size)


def compute_logits(w: DFlashWeights, h: torch.Tensor) -> torch.Tensor:
    """``lm_head(h) * logit_scale`` (model dtype), scattered to target ids when
    the draft has its own vocab (``d2t``; other columns -inf). Returns fp32."""
    logits = F.linear(h, w.lm_head)
    if w.config.logit_scale != 1.0:
        logits = logits * w.config.logit_scale
    if w.d2t is not None:
        cfg = w.config
        full = logits.new_full((*logits.shape[:-1], cfg.vocab_size), float("-inf"))
        full[..., torch.arange(cfg.draft_vocab_size, device=w.d2t.device) + w.d2t] = logits
        logits = full
    return logits.float()


def query_block(cfg: DFlashConfig, anchor: int, k: int) -> list[int]:
    """The block's input ids: ``[anchor] + [mask_token_id] * k``."""
    return [anchor] + [cfg.mask_token_id] * k


# ------------------------------------------------------------ reference ---

class _ConcatKV:
    """KVSource over precomputed context K/V: concatenates the block (no cache)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    def keys_values(self, layer, req, k_block, v_block):
        return (torch.cat([self.k[layer], k_block]), torch.cat([self.v[layer], v_block]),
                self.k.shape[1])


@torch.inference_mode()
def reference_propose(weights: DFlashWeights, ctx_hidden: torch.Tensor,
                      ctx_positions: torch.Tensor, anchor: int, k: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft ``k`` tokens for one request from scratch (no cache, no reuse).

    ``ctx_hidden [L, A*Ht]`` are all accepted context rows at
    ``ctx_positions [L]``; the block ``[anchor, mask*k]`` sits at positions
    ``P..P+k`` with ``P = ctx_positions[-1] + 1`` (0 if L == 0). Returns
    ``(tokens [k] int64, logits [k, V] fp32)`` on CPU; offset i+1 of the block
    gives draft i (greedy argmax).
    """
    w = weights
    dev, dt = w.device, w.dtype
    rope = Rope(w.config, dt, dev)
    hidden = ctx_hidden.to(device=dev, dtype=dt)
    pos = ctx_positions.to(device=dev, dtype=torch.long)
    ck, cv = context_kv(w, rope, hidden, pos)
    start = int(pos[-1]) + 1 if pos.numel() else 0
    ids = torch.tensor([query_block(w.config, anchor, k)], device=dev)
    block_pos = torch.arange(start, start + k + 1, device=dev)[None]
    h = block_forward(w, rope, ids, block_pos, _ConcatKV(ck, cv))
    logits = compute_logits(w, h[0, 1:]).cpu()
    return logits.argmax(dim=-1), logits
