"""A stand-in for b12x ``DmaAllReduce`` on machines without GPUs (CPU tests, gloo).

Not part of the serving path: only tests and CPU benchmarks use it, through the
router's injection hooks. It implements the surface
:class:`~k3_accel.comm.dma.DmaBackend` uses — constructor
``(exchange_group=, device=, max_bytes=, fp8=)`` that exchanges "handles"
collectively like the real one, ``all_reduce(inp, plan=, out=)``, ``close()``
with barriers, ``rank``/``world_size``/``device``/``max_bytes``/``shard_capacity``
— but reduces with ``torch.distributed`` over the exchange group instead of copy
engines. It holds a real slab laid out like b12x's (flag slots + 2(N−1) shards),
counted in :attr:`held_bytes`, so memory release can be checked. It proves
nothing about the ring itself.

Faults, per rank, for the fault tests (:meth:`with_faults`):

* ``init_before_exchange`` — construction raises before the handle exchange
  (like a failed ``cudaMalloc``): peers are left waiting in the exchange;
* ``init_after_exchange`` — raises after it (like a failed ``cudaIpcOpenMemHandle``);
* ``close_before_barrier`` / ``close_after_barrier`` — ``close()`` raises before
  its first barrier (peers wait there) or between its barriers.
"""
from __future__ import annotations

from typing import ClassVar, Dict, FrozenSet, Iterable, Optional

import torch
import torch.distributed as dist

FAULT_POINTS = ("init_before_exchange", "init_after_exchange", "close_before_barrier", "close_after_barrier")
_FLAG_BYTES = 256 * 128  # b12x FLAG_SLOTS * FLAG_STRIDE


class LoopbackDmaRuntime:
    faults: ClassVar[Dict[str, FrozenSet[int]]] = {}
    instances: ClassVar[list] = []
    held_bytes: ClassVar[int] = 0  # slab bytes held by this process's open rings

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
        self._fault("init_before_exchange")
        handles: list = [None] * self.world_size
        dist.all_gather_object(handles, ("handle", self.rank), group=exchange_group)
        self.peers = handles
        self._fault("init_after_exchange")
        self.slab: Optional[torch.Tensor] = torch.zeros(
            _FLAG_BYTES + 2 * (self.world_size - 1) * self.shard_capacity, dtype=torch.uint8
        )
        self._account(self.slab.numel())
        self.calls = 0
        self.closed = False
        type(self).instances.append(self)

    @classmethod
    def with_faults(cls, **points: Iterable[int]) -> type:
        """A subclass whose listed ranks fail at the named points (see the module doc)."""
        unknown = set(points) - set(FAULT_POINTS)
        if unknown:
            raise ValueError(f"unknown fault point(s) {sorted(unknown)}; known: {FAULT_POINTS}")
        faults = {name: frozenset(ranks) for name, ranks in points.items()}
        return type("FaultyLoopbackDmaRuntime", (cls,), {"faults": faults, "instances": []})

    @classmethod
    def failing_on(cls, ranks: Iterable[int]) -> type:
        """Construction fails on ``ranks`` after the exchange (a failed IPC open)."""
        return cls.with_faults(init_after_exchange=ranks)

    def _fault(self, point: str) -> None:
        if self.rank in self.faults.get(point, ()):
            raise RuntimeError(f"loopback: injected {point} on rank {self.rank}")

    @classmethod
    def _account(cls, delta: int) -> None:
        LoopbackDmaRuntime.held_bytes += delta

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
        self._fault("close_before_barrier")
        dist.barrier(group=self.group)
        self._fault("close_after_barrier")
        self.closed = True
        if self.slab is not None:
            self._account(-self.slab.numel())
            self.slab = None
        dist.barrier(group=self.group)


def loopback_planner(runtime: object, numel: int, dtype: torch.dtype) -> tuple:
    return ("loopback-plan", int(numel), dtype)


__all__ = ["FAULT_POINTS", "LoopbackDmaRuntime", "loopback_planner"]
