"""Per-tensor all-reduce routing: one-shot → DMA ring → the next backend.

:class:`AllReduceRouter` is the hot path (a couple of attribute loads and
metadata comparisons per call). :func:`build_router` is the collective
start-up that decides whether the ring runs at all and from which size:

1. ``VLLM_PCIE_DMA_MIN_BYTES`` off → next backend only.
2. World size must be one b12x supports; ``max_bytes`` must be known.
3. Capability, fail closed (:mod:`.eligibility`): the one-shot runtime's explicit
   all-peer report, else the plugin's own P2P probe agreed by all ranks.
4. ``auto`` with a cached decision for this topology/world size/versions that
   says "never" → done, the ring is not even allocated.
5. The ring is built on every rank or on none (:mod:`.consensus`).
6. ``auto`` without a cached decision → crossover measured, merged across
   ranks and cached (:mod:`.crossover`); no winning size → the ring is closed
   (collectively) and its memory released.
7. Sizes that will be graph-captured are prepared before capture.

Every failure keeps the next backend and carries its reason into the one
log line reported at start (:attr:`RouterDecision.summary`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .consensus import agree, create_on_all_ranks, describe_error
from .crossover import (
    DEFAULT_MARGIN,
    CrossoverCache,
    CrossoverDecision,
    environment_fields,
    ladder_sizes,
    load_agreed,
    make_event_measure,
    run_auto,
)
from .dma import DmaBackend, Planner
from .eligibility import (
    ProbeResult,
    decide_capability,
    probe_all_peer,
    world_size_supported,
)
from .oneshot import OneShotBackend
from .threshold import DmaThreshold, format_bytes

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
    ) -> None:
        self.fallback = fallback
        self.oneshot = oneshot
        self.dma = dma
        self.next_name = next_name
        self.decision = decision

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
        return dma.prepare(wanted)

    def close(self) -> None:
        """Collective: every rank must call it."""
        dma, self.dma = self.dma, None
        oneshot, self.oneshot = self.oneshot, None
        if dma is not None:
            dma.close()
        if oneshot is not None:
            oneshot.close()


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
    backend: str
    dma_min_bytes: Optional[int]
    reason: str
    threshold: str
    max_bytes: Optional[int] = None
    workspace_bytes: int = 0
    crossover: Optional[CrossoverDecision] = None
    prepared_sizes: int = 0

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
        parts.append(f"VLLM_PCIE_DMA_MIN_BYTES={self.threshold}")
        parts.append(f"why: {self.reason}")
        return "; ".join(parts)


@dataclass
class RouterHooks:
    """Injection points for hardware this process may lack (tests, benchmarks).

    ``runtime_cls`` builds the ring (default b12x ``DmaAllReduce``), ``planner``
    declares its plans, ``probe`` is the P2P probe, ``measure_factory(dma,
    fallback, device, dtype)`` returns the crossover measurement.
    """

    runtime_cls: Optional[Callable[..., object]] = None
    planner: Optional[Planner] = None
    probe: Optional[Callable[[object, torch.device], ProbeResult]] = None
    measure_factory: Optional[Callable[..., Callable[[int], Tuple[float, float]]]] = None
    cache: Optional[CrossoverCache] = field(default_factory=CrossoverCache)
    margin: float = DEFAULT_MARGIN


def _default_measure_factory(dma: DmaBackend, fallback: AllReduceFn, device, dtype):
    return make_event_measure(fallback, dma.all_reduce, device=device, dtype=dtype)


def build_router(
    *,
    group,
    device: torch.device,
    threshold: DmaThreshold,
    max_bytes: Optional[int],
    fallback: AllReduceFn,
    oneshot: Optional[OneShotBackend] = None,
    next_name: str = "NCCL",
    capture_sizes: Sequence[Tuple[int, torch.dtype]] = (),
    measure_dtype: torch.dtype = torch.bfloat16,
    exchange_group=None,
    hooks: Optional[RouterHooks] = None,
    cache_fields: Optional[dict] = None,
) -> AllReduceRouter:
    """Collective over ``group`` (a gloo group of the TP ranks). See the module doc.

    Every branch that can differ between ranks goes through consensus, so all
    ranks return routers with the same backends and the same crossover.
    """
    hooks = hooks or RouterHooks()
    world = dist.get_world_size(group)
    threshold_text = str(threshold)

    def keep_next(reason: str, crossover: Optional[CrossoverDecision] = None) -> AllReduceRouter:
        name = backend_name(oneshot is not None, False, next_name)
        decision = RouterDecision(name, None, reason, threshold_text, max_bytes, 0, crossover)
        return AllReduceRouter(
            fallback=fallback, oneshot=oneshot, dma=None, next_name=next_name, decision=decision
        )

    if threshold.is_off:
        return keep_next("DMA disabled by setting")
    if not world_size_supported(world):
        return keep_next(f"world size {world} not supported by the DMA ring")
    if not max_bytes or max_bytes <= 0:
        return keep_next("ring size unknown (max batched tokens x hidden size)")
    if threshold.min_bytes is not None and threshold.min_bytes > max_bytes:
        return keep_next(
            f"threshold {format_bytes(threshold.min_bytes)} above the largest reduce "
            f"{format_bytes(max_bytes)}"
        )

    # 3. capability, fail closed
    report = oneshot.all_peer_report() if oneshot is not None else None
    probe_result: Optional[ProbeResult] = None
    if report is None:
        probe = hooks.probe or probe_all_peer
        try:
            probe_result = probe(group, device)
        except Exception as exc:  # noqa: BLE001 - the default probe agrees internally
            probe_result = ProbeResult(False, describe_error(exc))
    capability = decide_capability(report, probe_result)
    if not capability.capable:
        return keep_next(capability.reason)

    # 4. auto: a cached decision for this topology/world size/versions, agreed by all ranks
    crossover: Optional[CrossoverDecision] = None
    sizes: Tuple[int, ...] = ()
    fields: dict = {}
    if threshold.is_auto:
        error: Optional[str] = None
        try:
            itemsize = _itemsize(measure_dtype)
            sizes = ladder_sizes(max_bytes, world, itemsize)
            topology = probe_result.signature if probe_result is not None else ("runtime-report",)
            fields = environment_fields(
                world, topology, dtype=str(measure_dtype), next=next_name, **(cache_fields or {})
            )
        except Exception as exc:  # noqa: BLE001
            error = describe_error(exc)
        failure = agree(group, error)
        if failure is not None:
            return keep_next(f"auto crossover set-up failed ({failure})")
        crossover = load_agreed(group, sizes, margin=hooks.margin, cache=hooks.cache, fields=fields)
        if crossover is not None and crossover.min_bytes is None:
            # the ring never won here: do not even allocate it
            return keep_next(f"auto ({crossover.source}): {crossover.reason}", crossover)

    # 5. build the ring on every rank or none
    created = create_on_all_ranks(
        group,
        lambda: DmaBackend.create(
            exchange_group=exchange_group if exchange_group is not None else group,
            device=device,
            max_bytes=max_bytes,
            world_size=world,
            runtime_cls=hooks.runtime_cls,
            planner=hooks.planner,
        ),
        abandon=lambda backend: backend.abandon(),
    )
    if not created.ok:
        return keep_next(f"DMA ring initialisation failed ({created.reason})", crossover)
    dma: DmaBackend = created.value  # type: ignore[assignment]

    # 6. threshold: fixed, cached, or measured now
    if threshold.is_auto:
        if crossover is None:
            error = None
            try:
                factory = hooks.measure_factory or _default_measure_factory
                measure = factory(dma, fallback, device, measure_dtype)
                crossover = run_auto(
                    group, measure, sizes, margin=hooks.margin, cache=hooks.cache, fields=fields,
                    use_cache=False,
                )
            except Exception as exc:  # noqa: BLE001
                error = describe_error(exc)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # hand the measurement's buffers back before vLLM profiles memory
            failure = agree(group, error)
            if failure is not None:
                dma.close()
                return keep_next(f"auto crossover measurement failed ({failure})")
        assert crossover is not None
        if crossover.min_bytes is None:
            dma.close()
            return keep_next(f"auto ({crossover.source}): {crossover.reason}", crossover)
        dma.min_bytes = crossover.min_bytes
        reason = f"auto ({crossover.source}): {crossover.reason}; {capability.reason}"
    else:
        dma.min_bytes = int(threshold.min_bytes or 0)
        reason = f"fixed threshold; {capability.reason}"

    # 7. capture sizes
    router = AllReduceRouter(fallback=fallback, oneshot=oneshot, dma=dma, next_name=next_name)
    prepared = 0
    error = None
    try:
        prepared = router.prepare_capture(list(capture_sizes))
    except Exception as exc:  # noqa: BLE001
        error = describe_error(exc)
    failure = agree(group, error)
    if failure is not None:
        dma.close()
        return keep_next(f"preparing capture sizes failed ({failure})", crossover)

    router.decision = RouterDecision(
        router.backend_name, dma.min_bytes, reason, threshold_text, max_bytes,
        dma.workspace_bytes, crossover, prepared,
    )
    return router


__all__ = [
    "AllReduceRouter", "DMA", "NEXT", "ONESHOT", "RouterDecision", "RouterHooks",
    "backend_name", "build_router",
]
