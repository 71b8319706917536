"""How one TP group builds, warms and releases its DMA ring: collectively, agreed, bounded.

:class:`RingSource` is used at start-up (:mod:`.build`) and again by sleep mode
(:meth:`~.router.AllReduceRouter.resume`). Its rules:

* **Build on every rank or on none** (:func:`~.consensus.create_on_all_ranks`).
  The ring exchanges IPC handles over a dedicated gloo group from
  :func:`~.consensus.bounded_group`: a rank that fails before its exchange
  makes its peers' exchange time out instead of hanging, and vLLM's own CPU
  group is never left inside a collective. Whether to (re)create that group is
  itself agreed, so all ranks always use the same one.
* **Warm the capture sizes in two agreed stages**: allocate one buffer, then run
  the ring, so no rank fails alone between the ring's collectives.
* **Release never blocks and never raises**: the collective close runs on the
  bounded group; if a peer is dead or absent it fails after the timeout, the
  ring is abandoned locally (its slab leaks until the process exits, logged)
  and the exchange group is dropped. No collective on vLLM's groups runs here,
  so teardown finishes whatever the peers do.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence, Tuple

import torch

from .consensus import (
    Outcome,
    StageHook,
    any_rank_failed,
    bounded_group,
    create_on_all_ranks,
    describe_error,
    run_agreed,
)
from .dma import DmaBackend, Planner

log = logging.getLogger(__name__)

DEFAULT_EXCHANGE_TIMEOUT_S = 60.0


class RingSource:
    def __init__(
        self,
        group,
        *,
        device: torch.device,
        max_bytes: int,
        world_size: int,
        runtime_cls: Optional[Callable[..., object]] = None,
        planner: Optional[Planner] = None,
        capturable: bool = True,
        capture_sizes: Sequence[Tuple[int, torch.dtype]] = (),
        exchange_timeout_s: float = DEFAULT_EXCHANGE_TIMEOUT_S,
        hook: Optional[StageHook] = None,
    ) -> None:
        self.group = group
        self.device = device
        self.max_bytes = int(max_bytes)
        self.world_size = int(world_size)
        self.runtime_cls = runtime_cls
        self.planner = planner
        self.capturable = capturable
        self.capture_sizes = tuple(capture_sizes)
        self.exchange_timeout_s = float(exchange_timeout_s)
        self.hook = hook
        self._exchange = None  # the bounded gloo group the ring exchanges over

    # ------------------------------------------------------------ build
    def build(self) -> Outcome[DmaBackend]:
        """Collective over ``group``: the ring on every rank, or a failure on every rank."""
        if any_rank_failed(self.group, self._exchange is None):
            self._exchange = None  # every rank makes a fresh exchange group
        outcome = create_on_all_ranks(
            self.group, self._create, abandon=self._abandon, stage="ring", hook=self.hook
        )
        if not outcome.ok:
            self._exchange = None  # it may hold a timed-out operation: never reuse it
        return outcome

    def _create(self) -> DmaBackend:
        if self._exchange is None:
            self._exchange = bounded_group(self.group, self.exchange_timeout_s)
        return DmaBackend.create(
            exchange_group=self._exchange,
            device=self.device,
            max_bytes=self.max_bytes,
            world_size=self.world_size,
            runtime_cls=self.runtime_cls,
            planner=self.planner,
            capturable=self.capturable,
        )

    @staticmethod
    def _abandon(dma: DmaBackend) -> None:
        dma.abandon()

    # ------------------------------------------------------------- warm
    def warm(self, dma: DmaBackend) -> Outcome[int]:
        """Collective: prepare the capture sizes at or above the ring's threshold."""
        wanted = [(n, d) for n, d in self.capture_sizes if n * _itemsize(d) >= dma.min_bytes]
        plan = dma.capture_plan(wanted)
        buffer = run_agreed(
            self.group, lambda: dma.warmup_buffer(plan), stage="capture-alloc", hook=self.hook
        )
        if not buffer.ok:
            return Outcome(None, buffer.failure)
        return run_agreed(
            self.group, lambda: dma.prepare(plan, buffer.value), stage="capture", hook=self.hook
        )

    # ---------------------------------------------------------- release
    def release(self, dma: DmaBackend) -> Optional[str]:
        """Close the ring (collective on the bounded group); never raises.

        Returns None when closed, else why it was abandoned instead.
        """
        try:
            dma.close()
            return None
        except Exception as exc:  # noqa: BLE001 - a dead or absent peer must not stop teardown
            reason = describe_error(exc)
        self._exchange = None
        dma.abandon()
        log.warning("k3-accel: DMA ring close failed (%s); abandoned locally", reason)
        return reason


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


__all__ = ["DEFAULT_EXCHANGE_TIMEOUT_S", "RingSource"]
