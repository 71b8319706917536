"""The rank harness (:func:`helpers.ranks.run_ranks`) really joins a gloo group."""
from __future__ import annotations

from helpers.ranks import run_ranks


def _sum_ranks(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    return t.tolist()


def test_harness_runs_a_real_gloo_group():
    out = run_ranks(_sum_ranks, 3)
    assert out == [[6.0] * 4] * 3
