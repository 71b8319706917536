"""The b12x copy-engine DMA ring (``b12x.comm.pcie.DmaAllReduce``) as a router backend.

Surface: ``should_use(t)`` (metadata only, no host sync), ``all_reduce(t)``
(out-of-place), ``prepare(sizes)`` (collective, before CUDA-graph capture) and
``close()`` (collective). b12x is imported lazily, only when a ring is built.

Plans: b12x prepares one plan per (shape, dtype). The ring only cares about the
flat element count, so tensors are reduced as 1-D views and plans are keyed by
``(numel, dtype)``. A plan materialises on its first run (b12x's lazy path); that
first run happens either in :meth:`prepare` (all ranks together, before capture)
or on the first eager call of a new size — both collective by construction,
because every rank of a TP group issues the same all-reduces in the same order.
During CUDA-graph capture an unprepared size is *declined* (the router then uses
the next backend) instead of failing the capture. A ring built with
``capturable=False`` declines every size during capture, so no graph ever holds
its addresses and sleep mode may free and rebuild it; :attr:`captured` records
whether a graph did take the ring.

Memory: the ring's slab is a raw ``cudaMalloc`` outside PyTorch's allocator,
``256·128 + 2(N−1)·ceil(max_bytes/N)`` bytes per rank; :attr:`workspace_bytes`
reports it.
"""
from __future__ import annotations

import importlib
import logging
from typing import Callable, Iterable, List, Optional, Tuple

import torch

from .eligibility import SUPPORTED_DTYPES, shard_multiple, world_size_supported

log = logging.getLogger(__name__)

PlanKey = Tuple[int, torch.dtype]
Planner = Callable[[object, int, torch.dtype], object]

_FLAG_BYTES = 256 * 128  # b12x FLAG_SLOTS * FLAG_STRIDE
_SCRATCH_ALIGN = 256


def b12x_runtime_class():
    """``b12x.comm.pcie.DmaAllReduce`` (imports b12x; raises ImportError without it)."""
    from b12x.comm.pcie import DmaAllReduce

    return DmaAllReduce


def b12x_planner(runtime: object, numel: int, dtype: torch.dtype) -> object:
    """Declare b12x's plan for a 1-D tensor of ``numel`` elements."""
    prep = importlib.import_module("b12x.comm.pcie._dma_preparation")
    query = prep.query_from_metadata(runtime, shape=(int(numel),), dtype=dtype)
    return prep.plan(query, runtime=runtime)


class _DropLazyPlanWarning(logging.Filter):
    """b12x warns when a plan materialises on first use; for the ring that is the design."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if "was not prepared before its first use" in msg and record.args:
            first = record.args[0] if isinstance(record.args, tuple) else None
            if isinstance(first, str) and first.startswith("comm.pcie"):
                return False
        return True


_FILTER_INSTALLED = False


def _install_lazy_plan_filter() -> None:
    global _FILTER_INSTALLED
    if not _FILTER_INSTALLED:
        logging.getLogger("b12x.preparation").addFilter(_DropLazyPlanWarning())
        _FILTER_INSTALLED = True


def ring_workspace_bytes(max_bytes: int, world_size: int) -> int:
    shard = -(-int(max_bytes) // int(world_size))
    shard = -(-shard // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
    return _FLAG_BYTES + 2 * (int(world_size) - 1) * shard


class DmaBackend:
    name = "B12X_DMA"

    def __init__(
        self,
        runtime: object,
        *,
        world_size: int,
        min_bytes: int = 0,
        planner: Optional[Planner] = None,
        capturable: bool = True,
    ) -> None:
        if not world_size_supported(world_size):
            raise ValueError(f"DMA ring does not support world size {world_size}")
        self.runtime = runtime
        self.world_size = int(world_size)
        self.device = torch.device(getattr(runtime, "device"))
        self.max_bytes = int(getattr(runtime, "max_bytes"))
        self.min_bytes = int(min_bytes)
        self._multiple = shard_multiple(world_size)
        self._planner: Planner = planner or b12x_planner
        self._plans: dict = {}
        self._ready: set = set()  # keys whose plan has run at least once
        self._closed = False
        self.capturable = bool(capturable)
        self.captured = False  # a CUDA graph holds this ring's addresses
        if planner is None:
            _install_lazy_plan_filter()

    # ------------------------------------------------------------------ build
    @classmethod
    def create(
        cls,
        *,
        exchange_group,
        device: torch.device,
        max_bytes: int,
        world_size: int,
        runtime_cls: Optional[Callable[..., object]] = None,
        planner: Optional[Planner] = None,
        capturable: bool = True,
    ) -> "DmaBackend":
        """Build the ring (collective: exchanges IPC handles over ``exchange_group``)."""
        if runtime_cls is None:
            runtime_cls = b12x_runtime_class()
        # fp8="off": always the lossless ring, whatever B12X_PCIE_DMA_FP8 says.
        runtime = runtime_cls(
            exchange_group=exchange_group, device=device, max_bytes=int(max_bytes), fp8="off"
        )
        return cls(runtime, world_size=world_size, planner=planner, capturable=capturable)

    # --------------------------------------------------------------- surface
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def workspace_bytes(self) -> int:
        """Raw device bytes held outside the torch allocator."""
        shard = getattr(self.runtime, "shard_capacity", None)
        if isinstance(shard, int):
            return _FLAG_BYTES + 2 * (self.world_size - 1) * shard
        return ring_workspace_bytes(self.max_bytes, self.world_size)

    def accepts(self, t: torch.Tensor) -> bool:
        """Ring requirements only (no threshold): size ≤ max, dtype, layout, device."""
        nbytes = t.numel() * t.element_size()
        return (
            not self._closed
            and 0 < nbytes <= self.max_bytes
            and t.numel() % self._multiple == 0
            and t.dtype in SUPPORTED_DTYPES
            and t.device == self.device
            and t.is_contiguous()
        )

    def should_use(self, t: torch.Tensor) -> bool:
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or not self.accepts(t):
            return False
        if _capturing(self.device):
            if not self.capturable or (t.numel(), t.dtype) not in self._ready:
                return False  # never materialise a plan inside a capture
            self.captured = True
        return True

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Out-of-place sum; returns a new tensor of ``t``'s shape."""
        flat = t.view(-1)
        key = (flat.numel(), t.dtype)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._planner(self.runtime, key[0], key[1])
            self._plans[key] = plan
        out = torch.empty_like(flat)
        self.runtime.all_reduce(flat, plan=plan, out=out)
        self._ready.add(key)
        return out.view(t.shape)

    def capture_plan(self, sizes: Iterable[Tuple[int, torch.dtype]]) -> List[PlanKey]:
        """The ``(numel, dtype)`` sizes :meth:`prepare` would warm up (none if not capturable).

        Sizes the ring cannot take or has already run are skipped; the result is
        sorted, so it is the same on every rank for the same input.
        """
        if not self.capturable:
            return []
        keep = []
        for numel, dtype in sorted(set(sizes), key=lambda item: (item[0], str(item[1]))):
            numel = int(numel)
            if dtype not in SUPPORTED_DTYPES or numel <= 0 or numel % self._multiple:
                continue
            if numel * _itemsize(dtype) > self.max_bytes or (numel, dtype) in self._ready:
                continue
            keep.append((numel, dtype))
        return keep

    def warmup_buffer(self, plan: Iterable[PlanKey]) -> Optional[torch.Tensor]:
        """One byte buffer large enough for every size of ``plan`` (allocated before any ring call)."""
        need = max((n * _itemsize(d) for n, d in plan), default=0)
        return torch.ones(need, dtype=torch.uint8, device=self.device) if need else None

    def prepare(self, plan: Iterable[PlanKey], buffer: Optional[torch.Tensor] = None) -> int:
        """Collective: materialise plans for ``plan``'s sizes (from :meth:`capture_plan`) before capture.

        Each size runs once on a slice of ``buffer`` (see :meth:`warmup_buffer`), so the
        inputs are allocated before the first ring call, not between them (each call
        still allocates its small output). Returns the count.
        """
        plan = list(plan)
        if buffer is None:
            buffer = self.warmup_buffer(plan)
        for numel, dtype in plan:
            self.all_reduce(buffer[: numel * _itemsize(dtype)].view(dtype))
        if plan and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(plan)

    def prepared_sizes(self) -> frozenset:
        return frozenset(self._ready)

    def close(self) -> None:
        """Collective: every rank must call it (b12x barriers inside)."""
        if self._closed:
            return
        self._closed = True
        self._plans.clear()
        self._ready.clear()
        self.runtime.close()

    def abandon(self) -> None:
        """Local release after a failed consensus: nothing collective may run.

        The slab stays mapped (peers may still reference it) and is leaked; the
        amount is logged so the operator sees it.
        """
        self._closed = True
        log.warning(
            "k3-accel: DMA ring abandoned without collective close; %d raw device bytes leaked",
            self.workspace_bytes,
        )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


__all__ = ["DmaBackend", "b12x_planner", "b12x_runtime_class", "ring_workspace_bytes"]
