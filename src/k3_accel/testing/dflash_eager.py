"""The first DFlash engine (eager, one request at a time): a test oracle and the
"old engine" of ``benchmarks/draft_step.py``. Not on the serving path.

Each request owns growing K/V tensors; a proposal runs the batch through the
projections together but attends request by request, and returns the full
fp32 logits on the CPU. The math follows vLLM's native ops: RMSNorm in fp32
then cast (the fused add+norm keeps the residual rounded to the model dtype),
RoPE with an fp32 cos/sin table cast to the model dtype, attention in fp32,
logits ``lm_head(h) * logit_scale`` in the model dtype.

No input validation: callers pass well-formed rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3_accel.server.engines.dflash.config import DFlashConfig
from k3_accel.server.engines.dflash.weights import DFlashWeights, LayerWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf.to(weight.dtype) * weight).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    s = x.float() + residual.float()
    normed = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed.to(weight.dtype) * weight).to(x.dtype), s.to(x.dtype)


class Rope:
    """Rotary embedding with a cos/sin table built like vLLM's (fp32, then cast)."""

    def __init__(self, cfg: DFlashConfig, dtype: torch.dtype, device: torch.device | str):
        self.rotary_dim, self.theta, self.neox = cfg.rotary_dim, cfg.rope_theta, cfg.is_neox_style
        self.dtype, self.device = dtype, torch.device(device)
        self.table = self._build(cfg.max_position_embeddings)

    def _build(self, n: int) -> torch.Tensor:
        rot = self.rotary_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
        freqs = torch.einsum("i,j -> ij", torch.arange(n, dtype=torch.float), inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device=self.device, dtype=self.dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.table.shape[0]:
            self.table = self._build(max(need, 2 * self.table.shape[0]))
        cos, sin = self.table.index_select(0, positions).chunk(2, dim=-1)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        x1, x2 = rot.chunk(2, dim=-1) if self.neox else (rot[..., 0::2], rot[..., 1::2])
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        out = torch.cat((o1, o2), dim=-1) if self.neox else torch.stack((o1, o2), -1).flatten(-2)
        return torch.cat((out, rest), dim=-1)


def _heads(x: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    return x.view(x.shape[0], n_heads, head_dim)


def project_kv(cfg: DFlashConfig, lw: LayerWeights, rope: Rope, x: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = _heads(F.linear(x, lw.k_proj, lw.k_bias), cfg.num_kv_heads, cfg.head_dim)
    v = _heads(F.linear(x, lw.v_proj, lw.v_bias), cfg.num_kv_heads, cfg.head_dim)
    k = rope.apply(rms_norm(k, lw.k_norm, cfg.rms_norm_eps), positions)
    return k, (v if cfg.v_scale is None else v * cfg.v_scale)


def context_kv(w: DFlashWeights, rope: Rope, hidden: torch.Tensor, positions: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[layers, n, nkv, hd]`` K and V of aux rows ``hidden [n, A*Ht]``."""
    cfg = w.config
    normed = rms_norm(F.linear(hidden, w.fc), w.hidden_norm, cfg.rms_norm_eps)
    ks, vs = zip(*(project_kv(cfg, lw, rope, normed, positions) for lw in w.layers))
    return torch.stack(ks), torch.stack(vs)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int, causal: bool
           ) -> torch.Tensor:
    """Block queries ``q [B, nh, hd]`` over ``k, v [ctx_len + B, nkv, hd]``, fp32 math."""
    b, nh, hd = q.shape
    nkv = k.shape[1]
    qf = q.float().view(b, nkv, nh // nkv, hd).permute(1, 2, 0, 3)
    kf = k.float().permute(1, 2, 0).unsqueeze(1)
    vf = v.float().permute(1, 0, 2).unsqueeze(1)
    scores = torch.matmul(qf, kf) * (hd ** -0.5)
    if causal:
        allowed = torch.arange(k.shape[0])[None, :] <= ctx_len + torch.arange(b)[:, None]
        scores = scores.masked_fill(~allowed.to(q.device), float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)
    return out.permute(2, 0, 1, 3).reshape(b, nh * hd).to(q.dtype)


def block_forward(w: DFlashWeights, rope: Rope, token_ids: torch.Tensor, positions: torch.Tensor,
                  contexts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Query blocks ``token_ids [R, B]`` at ``positions [R, B]``; request r attends to
    ``contexts[r] = (k, v)`` (``[layers, L_r, nkv, hd]``) plus its own block.
    Returns the final-norm hidden states ``[R, B, H]``."""
    cfg = w.config
    n_req, b = token_ids.shape
    flat_pos = positions.reshape(-1)
    x = F.embedding(token_ids.reshape(-1), w.embed_tokens)
    residual = x
    x = rms_norm(x, w.layers[0].input_layernorm, cfg.rms_norm_eps)
    for li, lw in enumerate(w.layers):
        if li > 0:
            x, residual = add_rms_norm(x, residual, lw.input_layernorm, cfg.rms_norm_eps)
        q = _heads(F.linear(x, lw.q_proj, lw.q_bias), cfg.num_heads, cfg.head_dim)
        q = rope.apply(rms_norm(q, lw.q_norm, cfg.rms_norm_eps), flat_pos)
        k, v = project_kv(cfg, lw, rope, x, flat_pos)
        outs = []
        for r, (ck, cv) in enumerate(contexts):
            rows = slice(r * b, (r + 1) * b)
            outs.append(attend(q[rows], torch.cat([ck[li], k[rows]]), torch.cat([cv[li], v[rows]]),
                               ck.shape[1], cfg.causal))
        x = F.linear(torch.cat(outs), lw.o_proj, lw.o_bias)
        x, residual = add_rms_norm(x, residual, lw.post_attention_layernorm, cfg.rms_norm_eps)
        x = F.linear(F.silu(F.linear(x, lw.gate_proj)) * F.linear(x, lw.up_proj), lw.down_proj)
    x, _ = add_rms_norm(x, residual, w.norm, cfg.rms_norm_eps)
    return x.view(n_req, b, cfg.hidden_size)


def compute_logits(w: DFlashWeights, h: torch.Tensor) -> torch.Tensor:
    """``lm_head(h) * logit_scale``, scattered to target ids with ``d2t`` (others -inf); fp32."""
    logits = F.linear(h, w.lm_head)
    if w.config.logit_scale != 1.0:
        logits = logits * w.config.logit_scale
    if w.d2t is not None:
        cfg = w.config
        full = logits.new_full((*logits.shape[:-1], cfg.vocab_size), float("-inf"))
        full[..., torch.arange(cfg.draft_vocab_size, device=w.d2t.device) + w.d2t] = logits
        logits = full
    return logits.float()


@dataclass
class EagerState:
    """Context K/V ``[layers, rows, nkv, hd]`` of one request (rows 0..length-1)."""
    k: torch.Tensor
    v: torch.Tensor

    @property
    def length(self) -> int:
        return self.k.shape[1]


class EagerDFlashEngine:
    """The per-request engine over loaded :class:`DFlashWeights` (any device/dtype)."""

    def __init__(self, weights: DFlashWeights):
        self.weights, self.config = weights, weights.config
        self.rope = Rope(self.config, weights.dtype, weights.device)

    def new_state(self) -> EagerState:
        cfg, w = self.config, self.weights
        empty = torch.empty(cfg.num_layers, 0, cfg.num_kv_heads, cfg.head_dim, dtype=w.dtype,
                            device=w.device)
        return EagerState(empty, empty.clone())

    @torch.inference_mode()
    def append(self, state: EagerState, hidden: torch.Tensor) -> None:
        """Context K/V of ``hidden [n, A*Ht]`` at the next ``n`` positions."""
        pos = torch.arange(state.length, state.length + hidden.shape[0], device=self.weights.device)
        k, v = context_kv(self.weights, self.rope,
                          hidden.to(device=self.weights.device, dtype=self.weights.dtype), pos)
        state.k, state.v = torch.cat([state.k, k], 1), torch.cat([state.v, v], 1)

    def truncate(self, state: EagerState, length: int) -> None:
        state.k, state.v = state.k[:, :length].clone(), state.v[:, :length].clone()

    def fork(self, state: EagerState, length: int) -> EagerState:
        return EagerState(state.k[:, :length].clone(), state.v[:, :length].clone())

    @torch.inference_mode()
    def propose(self, states: list[EagerState], anchors: list[int], k: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafts ``[R, k]`` int64 and logits ``[R, k, V]`` fp32, both on the CPU."""
        cfg, dev = self.config, self.weights.device
        ids = torch.tensor([[a] + [cfg.mask_token_id] * k for a in anchors], device=dev)
        starts = torch.tensor([s.length for s in states], device=dev)
        positions = starts[:, None] + torch.arange(k + 1, device=dev)[None]
        h = block_forward(self.weights, self.rope, ids, positions, [(s.k, s.v) for s in states])
        logits = compute_logits(self.weights, h[:, 1:]).cpu()
        return logits.argmax(dim=-1), logits


def reference_propose(weights: DFlashWeights, ctx_hidden: torch.Tensor, ctx_positions: torch.Tensor,
                      anchor: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft ``k`` tokens for one request from its whole context (``ctx_positions``
    must be ``0..L-1``): ``(tokens [k], logits [k, V])`` on the CPU."""
    if not torch.equal(ctx_positions.cpu().long(), torch.arange(len(ctx_positions))):
        raise ValueError("reference_propose needs context positions 0..L-1")
    engine = EagerDFlashEngine(weights)
    state = engine.new_state()
    if len(ctx_hidden):
        engine.append(state, ctx_hidden)
    tokens, logits = engine.propose([state], [anchor], k)
    return tokens[0], logits[0]
