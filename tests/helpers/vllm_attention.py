"""For the CPU oracles that run vLLM's DFlash/DSpark draft modules: one gloo rank of vLLM's
distributed state, and stand-ins for the attention where no attention kernel runs (the context
K/V write is captured; each layer attends over the captured context K/V plus its own block,
non-causally, SDPA in float32)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

def init_world() -> None:
    """vLLM's distributed state for one rank (gloo, a free local port); inside a vLLM config context."""
    import socket

    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)


captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


class Capture:
    """Stands in for the attention impl's cache write."""

    def __init__(self, i):
        self.i = i

    def do_kv_cache_update(self, attn, key, value, kv_cache, slot_mapping):
        captured[self.i] = (key.clone(), value.clone())


class Attend(torch.nn.Module):
    """Context K/V (captured) + block K/V, non-causal."""

    def __init__(self, i, sa):
        super().__init__()
        self.i, self.nh, self.nkv, self.hd = i, sa.num_heads, sa.num_kv_heads, sa.head_dim

    def forward(self, q, key, value):
        n, g = q.shape[0], self.nh // self.nkv
        ck, cv = captured[self.i]
        kk = torch.cat([ck.view(-1, self.nkv, self.hd), key.view(n, self.nkv, self.hd)])
        vv = torch.cat([cv.view(-1, self.nkv, self.hd), value.view(n, self.nkv, self.hd)])
        o = F.scaled_dot_product_attention(
            q.view(n, self.nh, self.hd).transpose(0, 1).float(),
            kk.transpose(0, 1).repeat_interleave(g, 0).float(),
            vv.transpose(0, 1).repeat_interleave(g, 0).float())
        return o.transpose(0, 1).reshape(n, self.nh * self.hd).to(q.dtype)


def stand_in(model) -> None:
    """Replace every draft layer's attention (``model.model.layers``) by the stand-ins."""
    for i, (layer, attn) in enumerate(zip(model.model.layers, model.model._attn_layers)):
        attn.impl = Capture(i)
        layer.self_attn.attn = Attend(i, layer.self_attn)
