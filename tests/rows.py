"""Building context-row tensors for protocol messages in tests."""
from __future__ import annotations

import torch


def rows(*spans: tuple[int, list[int]], width: int = 0, dtype=torch.float32, seed: int = 0) -> dict:
    """Tensors for consecutive spans given as (start_position, token_ids)."""
    positions = torch.cat([torch.arange(s, s + len(t)) for s, t in spans]) if spans else torch.empty(0, dtype=torch.int64)
    tokens = torch.tensor([x for _, t in spans for x in t], dtype=torch.int64)
    out = {"positions": positions.to(torch.int64), "token_ids": tokens}
    if width:
        g = torch.Generator().manual_seed(seed)
        out["hidden"] = torch.randn(len(tokens), width, generator=g).to(dtype)
    return out
