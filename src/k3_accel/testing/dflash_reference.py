"""An independent DFlash reference for tests: plain per-token math in float64.

Written apart from the engines on purpose: it shares no function with
``server/engines/dflash`` or ``testing/dflash_eager`` and reads the checkpoint
files itself (``config.json`` and the safetensors), so a slip in the engine's
math *or* its loader shows up as a difference. Everything is the textbook
Qwen3 pre-norm decoder of notes/dflash.md, one token and one head at a time:

    context row c:   n = RMSNorm_hidden(fc @ aux(c));  per layer  k = rope(RMSNorm_k(Wk n)),  v = Wv n
    block [anchor, mask * k] at positions P..P+k, P = number of context rows:
        h = embed(token); per layer: a = attention(RMSNorm_in(h)); h += Wo a;
        h += down(silu(gate(RMSNorm_post(h))) * up(RMSNorm_post(h)))
        logits of offsets 1..k = lm_head @ RMSNorm_final(h) * logit_scale

Slow by design (tiny checkpoints only). Supports what the tiny builders
write: one safetensors file per directory, plain RoPE, optional biases,
causal blocks, value scale, logit scale and a reduced draft vocabulary (d2t).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

F64 = torch.float64


def _load_dir(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


class DFlashReference:
    def __init__(self, draft_dir: str | Path, target_dir: str | Path):
        draft_dir, target_dir = Path(draft_dir), Path(target_dir)
        cfg = json.loads((draft_dir / "config.json").read_text())
        tcfg = json.loads((target_dir / "config.json").read_text())
        dcfg = cfg["dflash_config"]
        self.hidden = cfg["hidden_size"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg["num_key_value_heads"]
        self.head_dim = cfg["head_dim"]
        self.n_layers = cfg["num_hidden_layers"]
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        self.theta = cfg.get("rope_theta", 1e4)
        self.neox = cfg.get("is_neox_style", True)
        self.mask_id = dcfg["mask_token_id"]
        self.causal = bool(cfg.get("is_causal", dcfg.get("causal", False)))
        self.v_scale = dcfg.get("attention_value_scale")
        self.logit_scale = cfg.get("logit_scale", 1.0) or 1.0
        self.vocab = cfg["vocab_size"]
        w = {k: v.to(F64) if v.is_floating_point() else v for k, v in _load_dir(draft_dir).items()}
        t = _load_dir(target_dir)
        self.w = w
        self.embed = w["embed_tokens.weight"] if "embed_tokens.weight" in w else \
            t["model.embed_tokens.weight"].to(F64)
        if "lm_head.weight" in w:
            self.lm_head = w["lm_head.weight"]
        elif "lm_head.weight" in t:
            self.lm_head = t["lm_head.weight"].to(F64)
        else:                                   # tied target
            assert tcfg.get("tie_word_embeddings"), "target has no lm_head and is not tied"
            self.lm_head = t["model.embed_tokens.weight"].to(F64)
        self.d2t = w.get("d2t")

    # ------------------------------------------------------------ pieces ---
    def _lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        y = self.w[name + ".weight"] @ x
        bias = self.w.get(name + ".bias")
        return y if bias is None else y + bias

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x / math.sqrt(float((x * x).mean()) + self.eps) * weight

    def _rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        d = self.head_dim
        out = x.clone()
        for i in range(d // 2):
            angle = pos / (self.theta ** (2 * i / d))
            a, b = (i, i + d // 2) if self.neox else (2 * i, 2 * i + 1)
            out[a] = x[a] * math.cos(angle) - x[b] * math.sin(angle)
            out[b] = x[b] * math.cos(angle) + x[a] * math.sin(angle)
        return out

    def _head(self, vec: torch.Tensor, i: int) -> torch.Tensor:
        return vec[i * self.head_dim:(i + 1) * self.head_dim]

    def _k_v(self, layer: int, x: torch.Tensor, pos: int) -> tuple[list, list]:
        p = f"layers.{layer}.self_attn."
        k_all, v_all = self._lin(p + "k_proj", x), self._lin(p + "v_proj", x)
        ks = [self._rope(self._rms(self._head(k_all, h), self.w[p + "k_norm.weight"]), pos)
              for h in range(self.n_kv)]
        vs = [self._head(v_all, h) * (self.v_scale if self.v_scale is not None else 1.0)
              for h in range(self.n_kv)]
        return ks, vs

    def context_kv(self, row: torch.Tensor, pos: int) -> list[tuple[list, list]]:
        """Per layer ``(k heads, v heads)`` of one context row (its aux hidden row)."""
        n = self._rms(self.w["fc.weight"] @ row.to(F64), self.w["hidden_norm.weight"])
        return [self._k_v(layer, n, pos) for layer in range(self.n_layers)]

    # ----------------------------------------------------------- propose ---
    def logits(self, context: torch.Tensor, anchor: int, k: int) -> torch.Tensor:
        """Draft logits ``[k, vocab]`` (float64; -inf where a reduced vocab cannot draft)
        for the block after ``context [P, A*Ht]`` (rows at positions 0..P-1)."""
        start = context.shape[0]
        ctx = [self.context_kv(row, pos) for pos, row in enumerate(context)]
        tokens = [anchor] + [self.mask_id] * k
        h = [self.embed[tok].clone() for tok in tokens]
        group = self.n_heads // self.n_kv
        for layer in range(self.n_layers):
            p = f"layers.{layer}."
            x = [self._rms(v, self.w[p + "input_layernorm.weight"]) for v in h]
            q = [[self._rope(self._rms(self._head(self._lin(p + "self_attn.q_proj", xi), hh),
                                       self.w[p + "self_attn.q_norm.weight"]), start + i)
                  for hh in range(self.n_heads)] for i, xi in enumerate(x)]
            block_kv = [self._k_v(layer, xi, start + i) for i, xi in enumerate(x)]
            for i in range(len(tokens)):
                heads = []
                for hh in range(self.n_heads):
                    kv = hh // group
                    seen = range(i + 1) if self.causal else range(len(tokens))
                    keys = [c[layer][0][kv] for c in ctx] + [block_kv[j][0][kv] for j in seen]
                    vals = [c[layer][1][kv] for c in ctx] + [block_kv[j][1][kv] for j in seen]
                    scores = [float(q[i][hh] @ key) / math.sqrt(self.head_dim) for key in keys]
                    top = max(scores)
                    weights = [math.exp(s - top) for s in scores]
                    total = sum(weights)
                    heads.append(sum(wt / total * val for wt, val in zip(weights, vals)))
                h[i] = h[i] + self._lin(p + "self_attn.o_proj", torch.cat(heads))
            for i in range(len(tokens)):
                y = self._rms(h[i], self.w[p + "post_attention_layernorm.weight"])
                gate, up = self._lin(p + "mlp.gate_proj", y), self._lin(p + "mlp.up_proj", y)
                h[i] = h[i] + self._lin(p + "mlp.down_proj", gate * torch.sigmoid(gate) * up)
        out = torch.stack([self.lm_head @ self._rms(h[i], self.w["norm.weight"]) * self.logit_scale
                           for i in range(1, len(tokens))])
        if self.d2t is None:
            return out
        full = torch.full((k, self.vocab), float("-inf"), dtype=F64)
        full[:, torch.arange(out.shape[1]) + self.d2t.long()] = out
        return full
