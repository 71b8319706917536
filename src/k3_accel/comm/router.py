"""Per-tensor all-reduce routing: one-shot → DMA ring → the next backend.

:class:`AllReduceRouter` is the hot path (a couple of attribute loads and
metadata comparisons per call) plus the ring's lifecycle: teardown
(:meth:`~AllReduceRouter.close`, bounded, never raises) and sleep mode
(:meth:`~AllReduceRouter.suspend` / :meth:`~AllReduceRouter.resume`, collective
and agreed). :func:`k3_accel.comm.build.build_router` decides at start-up
whether the ring runs at all and from which size.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Tuple

import torch

from .consensus import any_rank_failed, describe_error
from .crossover import CrossoverDecision
from .dma import DmaBackend
from .oneshot import OneShotBackend
from .ring import RingSource
from .threshold import format_bytes

log = logging.getLogger(__name__)

AllReduceFn = Callable[[torch.Tensor], torch.Tensor]
ONESHOT, DMA, NEXT = "oneshot", "dma", "next"


class AllReduceRouter:
    """Routes each tensor to exactly one backend; all results are out-of-place."""

    def __init__(
        self,
        *,
        fallback: AllReduceFn,
        oneshot: Optional[OneShotBackend] = None,
        dma: Optional[DmaBackend] = None,
        next_name: str = "NCCL",
        decision: Optional["RouterDecision"] = None,
        ring: Optional[RingSource] = None,
    ) -> None:
        self.fallback = fallback
        self.oneshot = oneshot
        self.dma = dma
        self.next_name = next_name
        self.decision = decision
        self.ring = ring  # how to release and rebuild the ring (sleep mode, teardown)
        self._suspended_min: Optional[int] = None  # the ring's threshold while suspended

    # hot path -----------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        oneshot = self.oneshot
        if oneshot is not None and oneshot.should_use(t):
            return oneshot.all_reduce(t)
        dma = self.dma
        if dma is not None and dma.should_use(t):
            return dma.all_reduce(t)
        return self.fallback(t)

    def choose(self, t: torch.Tensor) -> str:
        """Which backend :meth:`all_reduce` would use: ``oneshot``/``dma``/``next``."""
        if self.oneshot is not None and self.oneshot.should_use(t):
            return ONESHOT
        if self.dma is not None and self.dma.should_use(t):
            return DMA
        return NEXT

    # lifecycle ------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        return backend_name(self.oneshot is not None, self.dma is not None, self.next_name)

    @property
    def dma_min_bytes(self) -> Optional[int]:
        return None if self.dma is None else self.dma.min_bytes

    def prepare_capture(self, sizes: Iterable[Tuple[int, torch.dtype]]) -> int:
        """Collective: prepare the ring's plans for ``(numel, dtype)`` sizes ≥ the crossover."""
        dma = self.dma
        if dma is None:
            return 0
        wanted = [(n, d) for n, d in sizes if n * _itemsize(d) >= dma.min_bytes]
        return dma.prepare(dma.capture_plan(wanted))

    def close(self) -> Optional[str]:
        """Teardown; every rank should call it. Bounded in time and never raises.

        Returns None when the ring was closed (or there was none), else why it
        was abandoned (a peer dead or absent, a failing close).
        """
        dma, self.dma = self.dma, None
        oneshot, self.oneshot = self.oneshot, None
        self._suspended_min = None
        error = None
        if dma is not None:
            error = self.ring.release(dma) if self.ring is not None else _close_or_abandon(dma)
        if oneshot is not None:
            try:
                oneshot.close()
            except Exception as exc:  # noqa: BLE001
                log.warning("k3-accel: one-shot close failed: %s", describe_error(exc))
        return error

    def suspend(self) -> str:
        """Collective (sleep mode): release the ring's memory; :meth:`resume` rebuilds it.

        Kept instead when a CUDA graph on any rank holds the ring's addresses
        (freeing it would corrupt those replays); the decision is agreed.
        Returns what happened, for the log.
        """
        dma = self.dma
        if dma is None or self.ring is None:
            return "no DMA ring to release"
        if any_rank_failed(self.ring.group, dma.captured):
            return "DMA ring kept: CUDA graphs were captured through it"
        self._suspended_min = dma.min_bytes
        self.dma = None
        error = self.ring.release(dma)
        return "DMA ring released" + (f" (abandoned on this rank: {error})" if error else "")

    def resume(self) -> str:
        """Collective (sleep mode): rebuild a ring released by :meth:`suspend`, on every rank or none."""
        min_bytes, self._suspended_min = self._suspended_min, None
        if min_bytes is None or self.ring is None:
            return "no DMA ring to restore"
        built = self.ring.build()
        if not built.ok:
            return f"DMA ring not restored, {self.next_name} keeps every size ({built.failure})"
        dma = built.value
        assert dma is not None
        dma.min_bytes = min_bytes
        warmed = self.ring.warm(dma)
        if not warmed.ok:
            self.ring.release(dma)
            return f"DMA ring not restored, {self.next_name} keeps every size ({warmed.failure})"
        self.dma = dma
        return f"DMA ring restored ({format_bytes(dma.workspace_bytes)})"


def _close_or_abandon(dma: DmaBackend) -> Optional[str]:
    try:
        dma.close()
        return None
    except Exception as exc:  # noqa: BLE001
        dma.abandon()
        return describe_error(exc)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def backend_name(oneshot: bool, dma: bool, next_name: str = "NCCL") -> str:
    if oneshot and dma:
        return "FLASHINFER_PCIE_IPC_B12X_DMA"
    if dma:
        return "B12X_DMA"
    if oneshot:
        return "FLASHINFER_PCIE_IPC"
    return next_name


@dataclass(frozen=True)
class RouterDecision:
    """What start-up decided and why; :attr:`summary` is the one line logged."""

    backend: str
    dma_min_bytes: Optional[int]
    reason: str
    threshold: str
    max_bytes: Optional[int] = None
    workspace_bytes: int = 0
    crossover: Optional[CrossoverDecision] = None
    prepared_sizes: int = 0
    threshold_source: str = "dma_min_bytes"  # where the threshold was set (config key, env var, default)
    seconds: float = 0.0                     # start-up time spent deciding (probe, build, measure)
    failed: bool = False                     # a fault (not a rule) kept the next backend

    def with_reason(self, reason: str) -> "RouterDecision":
        return dataclasses.replace(self, reason=reason)

    @property
    def summary(self) -> str:
        parts = [f"all-reduce backend {self.backend}"]
        if self.dma_min_bytes is not None:
            parts.append(f"DMA from {format_bytes(self.dma_min_bytes)} to {format_bytes(self.max_bytes or 0)}")
            parts.append(
                f"ring workspace {format_bytes(self.workspace_bytes)} raw cudaMalloc outside the torch allocator"
            )
            if self.prepared_sizes:
                parts.append(f"{self.prepared_sizes} capture size(s) prepared")
        parts.append(f"threshold {self.threshold} ({self.threshold_source})")
        if self.seconds >= 0.01:
            parts.append(f"decided in {self.seconds:.2f} s")
        parts.append(f"why: {self.reason}")
        return "; ".join(parts)


__all__ = [
    "AllReduceRouter", "DMA", "NEXT", "ONESHOT", "RouterDecision", "backend_name",
]
