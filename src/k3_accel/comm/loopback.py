"""A stand-in for b12x ``DmaAllReduce`` on machines without GPUs (CPU tests, gloo).

It implements the surface :class:`~k3_accel.comm.dma.DmaBackend` uses —
constructor ``(exchange_group=, device=, max_bytes=, fp8=)`` that exchanges
"handles" collectively like the real one, ``all_reduce(inp, plan=, out=)``,
``close()`` with barriers, ``rank``/``world_size``/``device``/``max_bytes``/
``shard_capacity`` — but reduces with ``torch.distributed`` instead of copy
engines. It exists so the *same* router and backend code paths run on CPU that
run with the real ring on GPUs; it proves nothing about the ring itself.

``fail_on_ranks`` makes construction raise on those ranks *after* the collective
exchange, as a real ``cudaIpcOpenMemHandle`` failure would.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist


class LoopbackDmaRuntime:
    fail_on_ranks: frozenset = frozenset()
    instances: list = []

    def __init__(self, *, exchange_group, device, max_bytes: int, fp8: Optional[str] = None, ext_module=None):
        del ext_module
        self.group = exchange_group
        self.rank = dist.get_rank(exchange_group)
        self.world_size = dist.get_world_size(exchange_group)
        self.device = torch.device(device)
        self.max_bytes = int(max_bytes)
        self.fp8 = fp8
        shard = -(-self.max_bytes // self.world_size)
        self.shard_capacity = -(-shard // 256) * 256
        handles: list = [None] * self.world_size
        dist.all_gather_object(handles, ("handle", self.rank), group=exchange_group)
        self.peers = handles
        if self.rank in self.fail_on_ranks:
            raise RuntimeError(f"loopback: cannot open peer handles on rank {self.rank}")
        self.calls = 0
        self.closed = False
        type(self).instances.append(self)

    @classmethod
    def failing_on(cls, ranks: Iterable[int]) -> type:
        return type("FailingLoopbackDmaRuntime", (cls,), {"fail_on_ranks": frozenset(ranks), "instances": []})

    def all_reduce(self, inp: torch.Tensor, *, plan, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.closed:
            raise RuntimeError("loopback ring is closed")
        if not (isinstance(plan, tuple) and plan[:1] == ("loopback-plan",)):
            raise TypeError("loopback ring needs a loopback plan")
        if plan[1] != inp.numel() or plan[2] != inp.dtype:
            raise ValueError(f"plan {plan} does not match input {inp.numel()} {inp.dtype}")
        if out is None:
            out = torch.empty_like(inp)
        out.copy_(inp)
        dist.all_reduce(out, group=self.group)
        self.calls += 1
        return out

    def close(self) -> None:
        dist.barrier(group=self.group)
        self.closed = True
        dist.barrier(group=self.group)


def loopback_planner(runtime: object, numel: int, dtype: torch.dtype) -> tuple:
    return ("loopback-plan", int(numel), dtype)


__all__ = ["LoopbackDmaRuntime", "loopback_planner"]
