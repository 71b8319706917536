"""DFlash draft math over a paged K/V cache, batched over requests.

Weights are fused once at start (:func:`fuse`): q/k/v of a layer in one
matrix, gate/up in one, and the context K/V projections of *all* layers in
one, so a context chunk costs one fc GEMM, one norm and one K/V GEMM. The
small elementwise steps (norms, RoPE, SiLU, the K/V scatter, attention) come
from an ops backend: :mod:`.ops_torch` (pure PyTorch, CPU and reference) or
:mod:`.ops_triton` (fused CUDA kernels). See notes/dflash.md for the math.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .config import DFlashConfig
from .weights import DFlashWeights


@dataclass
class FusedLayer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor                 # [(nh + 2 nkv) hd, H]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor              # [hd]
    k_norm: torch.Tensor              # [hd]
    o: torch.Tensor                   # [H, nh hd]
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor             # [2 F, H]
    down: torch.Tensor                # [H, F]


@dataclass
class FusedWeights:
    config: DFlashConfig
    embed: torch.Tensor               # [V, H]
    lm_head: torch.Tensor             # [draft_V, H]
    d2t: torch.Tensor | None          # [draft_V] int64
    norm: torch.Tensor
    fc: torch.Tensor                  # [H, A Ht]
    hidden_norm: torch.Tensor
    context_kv: torch.Tensor          # [L * 2 * nkv * hd, H]: per layer k_proj rows then v_proj rows
    context_kv_bias: torch.Tensor | None
    k_norms: torch.Tensor             # [L, hd]
    layers: list[FusedLayer]
    cos_sin: torch.Tensor             # [positions, rotary_dim]: cos | sin, fp32-built, model dtype

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.device


def rope_table(cfg: DFlashConfig, positions: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``[positions, rotary_dim]`` = cos | sin, built in fp32 and cast (as vLLM does)."""
    rot = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device=device, dtype=dtype)


def _cat_bias(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if parts[0] is None else torch.cat(parts)


def fuse(w: DFlashWeights, positions: int | None = None) -> FusedWeights:
    """The engine's weight layout (copies; ``w`` may be dropped afterwards)."""
    cfg = w.config
    layers = [FusedLayer(
        input_norm=lw.input_layernorm, post_norm=lw.post_attention_layernorm,
        qkv=torch.cat([lw.q_proj, lw.k_proj, lw.v_proj]),
        qkv_bias=_cat_bias([lw.q_bias, lw.k_bias, lw.v_bias]),
        q_norm=lw.q_norm, k_norm=lw.k_norm, o=lw.o_proj, o_bias=lw.o_bias,
        gate_up=torch.cat([lw.gate_proj, lw.up_proj]), down=lw.down_proj) for lw in w.layers]
    kv_rows = [t for lw in w.layers for t in (lw.k_proj, lw.v_proj)]
    kv_bias = [t for lw in w.layers for t in (lw.k_bias, lw.v_bias)]
    return FusedWeights(
        config=cfg, embed=w.embed_tokens, lm_head=w.lm_head, d2t=w.d2t, norm=w.norm, fc=w.fc,
        hidden_norm=w.hidden_norm, context_kv=torch.cat(kv_rows), context_kv_bias=_cat_bias(kv_bias),
        k_norms=torch.stack([lw.k_norm for lw in w.layers]), layers=layers,
        cos_sin=rope_table(cfg, positions or cfg.max_position_embeddings, w.dtype, w.device))


# ------------------------------------------------------------------ ingest ---

def context_projection(fw: FusedWeights, ops: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``[N, L * 2 * nkv * hd]``: every layer's k/v projection of ``hidden_norm(fc(rows))``."""
    x = ops.rms_norm(F.linear(hidden, fw.fc), fw.hidden_norm, fw.config.rms_norm_eps)
    return F.linear(x, fw.context_kv, fw.context_kv_bias)


# ----------------------------------------------------------------- propose ---

@dataclass
class BlockBatch:
    """Device inputs of one propose: ``R`` query blocks of ``T = k + 1`` rows (DFlash's fill-in
    layout: offsets 1..k are the drafts), or of ``T = k`` rows with ``from_anchor`` (DSpark's
    default: every row predicts the next token)."""
    anchors: torch.Tensor             # [R] int
    ctx_lens: torch.Tensor            # [R] int32: context rows of each request
    tables: torch.Tensor              # [R, W] int32: block ids (entries past a context unread)
    k: int
    from_anchor: bool = False
    temperature: torch.Tensor | None = None   # [R] float32 (DSpark sampling; None: greedy)
    seeds: torch.Tensor | None = None         # [R] int64

    @property
    def rows(self) -> int:
        return self.k if self.from_anchor else self.k + 1


def block_logits(fw: FusedWeights, ops: Any, kv: torch.Tensor, batch: BlockBatch, splits: int
                 ) -> torch.Tensor:
    """Logits ``[R, k, draft_V]`` (model dtype, ``logit_scale`` applied) of the draft rows
    of :func:`block_hidden`."""
    logits = F.linear(block_hidden(fw, ops, kv, batch, splits), fw.lm_head)
    if fw.config.logit_scale != 1.0:
        logits = logits * fw.config.logit_scale
    return logits.view(batch.anchors.shape[0], batch.k, -1)


def block_hidden(fw: FusedWeights, ops: Any, kv: torch.Tensor, batch: BlockBatch, splits: int
                 ) -> torch.Tensor:
    """Final-normed hidden states ``[R * k, H]`` of the draft rows: the blocks ``[anchor,
    mask * (T - 1)]`` at positions ``L_r .. L_r + T - 1`` through the draft layers, each
    attending to its paged context (``kv [2, L, blocks, rows, nkv, hd]``) and its own block;
    the rows kept are offsets 1..k (fill-in) or 0..k-1 (``from_anchor``)."""
    cfg = fw.config
    r, t = batch.anchors.shape[0], batch.rows
    ids, positions = ops.block_inputs(batch.anchors, batch.ctx_lens, t, cfg.mask_token_id)
    eps, q_size, kv_size = cfg.rms_norm_eps, cfg.q_size, cfg.kv_size
    x = F.embedding(ids, fw.embed)
    residual = x
    for li, lw in enumerate(fw.layers):
        if li == 0:
            x = ops.rms_norm(x, lw.input_norm, eps)
        else:
            x, residual = ops.add_rms_norm(x, residual, lw.input_norm, eps)
        qkv = F.linear(x, lw.qkv, lw.qkv_bias)
        q, k = ops.qk_norm_rope(qkv, lw.q_norm, lw.k_norm, fw.cos_sin, positions, cfg)
        v = qkv[:, q_size + kv_size:]
        if cfg.v_scale is not None:
            v = v * cfg.v_scale
        attn = ops.attention(q, k, v, kv[0, li], kv[1, li], batch.ctx_lens, batch.tables, t, cfg,
                             splits)
        x = F.linear(attn, lw.o, lw.o_bias)
        x, residual = ops.add_rms_norm(x, residual, lw.post_norm, eps)
        x = F.linear(ops.silu_mul(F.linear(x, lw.gate_up)), lw.down)
    # Only the draft rows go through the final norm (fill-in: each block's anchor row is skipped).
    first = 0 if batch.from_anchor else 1
    keep = lambda z: z.view(r, t, -1)[:, first:].reshape(r * batch.k, -1)   # noqa: E731
    h, _ = ops.add_rms_norm(keep(x), keep(residual), fw.norm, eps)
    return h


def greedy(fw: FusedWeights, ops: Any, logits: torch.Tensor) -> torch.Tensor:
    """Argmax target ids ``[R, k]`` int64 (through ``d2t`` for a reduced draft vocab)."""
    ids = ops.argmax(logits.reshape(-1, logits.shape[-1])).view(logits.shape[:-1])
    return ids if fw.d2t is None else ids + fw.d2t[ids]


def target_logits(fw: FusedWeights, logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits over the target vocabulary (columns the draft cannot emit are -inf)."""
    if fw.d2t is None:
        return logits.float()
    cfg = fw.config
    full = logits.new_full((*logits.shape[:-1], cfg.vocab_size), float("-inf"), dtype=torch.float)
    full[..., torch.arange(cfg.draft_vocab_size, device=fw.d2t.device) + fw.d2t] = logits.float()
    return full
