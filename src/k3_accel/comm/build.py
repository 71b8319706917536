"""Start-up of the all-reduce router: whether the DMA ring runs at all, and from which size.

:func:`build_router` is collective over the TP group's gloo group. It is a
fixed sequence of stages that every rank runs in the same order; each stage's
local work runs inside :func:`~.consensus.run_agreed` (or agrees internally),
and every branch is taken on agreed values only, so no rank ever enters a
collective on its own local answer:

1. ``inputs`` — every rank's settings, sizing and one-shot report are gathered.
   Ranks that disagree keep the next backend. From here on, each check reads
   the agreed values: setting off, world size, ring size, threshold above the
   ring, a one-shot report that forbids the ring.
2. ``probe`` — capability, fail closed (:mod:`.eligibility`), and the topology
   signature the crossover cache is keyed on.
3. ``cache-key`` — with ``auto``: the ladder and the cache key; the first rank's
   cached decision is broadcast. A cached "never" ends here (no ring allocated).
4. ``ring`` — the ring is built on every rank or none (:class:`.ring.RingSource`).
5. ``measure-setup`` / ``measure`` — with ``auto`` and no cached decision: the
   crossover is measured, merged and cached (:mod:`.crossover`); no winning
   size → the ring is closed on every rank and its memory released.
6. ``capture-alloc`` / ``capture`` — sizes that will be graph-captured are
   prepared before capture.

Any failure keeps the next backend on every rank and carries its (agreed) reason
into the one line logged at start (:attr:`RouterDecision.summary`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .consensus import Outcome, StageHook, describe_error, describe_failures, gather, run_agreed
from .crossover import (
    DEFAULT_MARGIN,
    CrossoverCache,
    CrossoverDecision,
    cache_key,
    environment_fields,
    ladder_sizes,
    load_agreed,
    make_event_measure,
    run_auto,
)
from .dma import DmaBackend, Planner
from .eligibility import (
    GpuView,
    combine_reports,
    decide_capability,
    probe_all_peer,
    world_size_supported,
)
from .oneshot import OneShotBackend
from .ring import DEFAULT_EXCHANGE_TIMEOUT_S, RingSource
from .router import AllReduceFn, AllReduceRouter, RouterDecision, backend_name
from .threshold import DmaThreshold, format_bytes

# Where a test may inject a failure: on_stage(f"{stage}:start" / f"{stage}:end").
# The probe is injected through its GpuView, the measurement through measure_factory.
STAGES = ("inputs", "cache-key", "ring", "measure-setup", "capture-alloc", "capture")


@dataclass
class RouterHooks:
    """Injection points for hardware this process may lack (tests, benchmarks).

    ``runtime_cls`` builds the ring (default b12x ``DmaAllReduce``), ``planner``
    declares its plans, ``gpus`` is what the P2P probe asks the machine,
    ``measure_factory(dma, fallback, device, dtype, max_bytes)`` returns the
    crossover measurement, ``exchange_timeout_s`` bounds every exchange and
    close of the ring, ``on_stage`` is called at each stage's start and end
    (tests raise from it to inject failures).
    """

    runtime_cls: Optional[Callable[..., object]] = None
    planner: Optional[Planner] = None
    gpus: Optional[GpuView] = None
    measure_factory: Optional[Callable[..., Callable[[int], Tuple[float, float]]]] = None
    cache: Optional[CrossoverCache] = field(default_factory=CrossoverCache)
    margin: float = DEFAULT_MARGIN
    exchange_timeout_s: float = DEFAULT_EXCHANGE_TIMEOUT_S
    on_stage: Optional[StageHook] = None


def _default_measure_factory(dma: DmaBackend, fallback: AllReduceFn, device, dtype, max_bytes: int):
    return make_event_measure(fallback, dma.all_reduce, device=device, dtype=dtype, max_bytes=max_bytes)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class AutoPlan(NamedTuple):
    sizes: Tuple[int, ...]
    fields: dict
    key: str
    cache: Optional[CrossoverCache]  # None: no topology signature, so no cache


@dataclass
class _Start:
    """One call of :func:`build_router`: its (per-rank) inputs and the stages."""

    group: object
    device: torch.device
    threshold: DmaThreshold
    max_bytes: Optional[int]
    fallback: AllReduceFn
    oneshot: Optional[OneShotBackend]
    next_name: str
    capture_sizes: Tuple[Tuple[int, torch.dtype], ...]
    measure_dtype: torch.dtype
    hooks: RouterHooks
    cache_fields: dict
    threshold_source: str
    capturable: bool
    t0: float = field(default_factory=time.monotonic)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def stage(self, name: str, work: Callable) -> Outcome:
        return run_agreed(self.group, work, stage=name, hook=self.hooks.on_stage)

    def keep_next(
        self, reason: str, crossover: Optional[CrossoverDecision] = None, *, failed: bool = False
    ) -> AllReduceRouter:
        """The next backend only; ``failed`` when a fault, not a rule, decided it."""
        name = backend_name(self.oneshot is not None, False, self.next_name)
        decision = RouterDecision(
            name, None, reason, str(self.threshold), self.max_bytes, 0, crossover,
            threshold_source=self.threshold_source, seconds=time.monotonic() - self.t0, failed=failed,
        )
        return AllReduceRouter(
            fallback=self.fallback, oneshot=self.oneshot, next_name=self.next_name, decision=decision
        )

    # ---------------------------------------------------------------- stages
    def run(self) -> AllReduceRouter:
        # 1. inputs: one exchange; a local failure travels as its reason
        everyone = gather(self.group, _guarded(self.local_inputs))
        if any(err is not None for _, err in everyone):
            why = describe_failures([err for _, err in everyone])
            return self.keep_next(f"set-up inputs failed ({why})", failed=True)
        if len({value[0] for value, _ in everyone}) != 1:
            why = _first_difference(everyone)
            return self.keep_next(f"ranks disagree on settings or sizing: {why}", failed=True)
        report = combine_reports([value[1] for value, _ in everyone])
        refusal = self.refusal(report)
        if refusal is not None:
            return self.keep_next(refusal)

        # 2. capability (the probe agrees internally) and the topology for the cache
        probe = probe_all_peer(self.group, self.device, self.hooks.gpus)
        capability = decide_capability(report, probe)
        if not capability.capable:
            return self.keep_next(capability.reason)

        # 3. auto: a cached decision for this world size / topology / driver / versions
        plan: Optional[AutoPlan] = None
        cached: Optional[CrossoverDecision] = None
        if self.threshold.is_auto:
            keyed = self.stage("cache-key", lambda: self.auto_plan(probe.signature))
            if not keyed.ok:
                return self.keep_next(f"auto crossover set-up failed ({keyed.failure})", failed=True)
            plan = keyed.value
            cached = load_agreed(self.group, plan.key, cache=plan.cache)
            if cached is not None and cached.min_bytes is None:
                return self.keep_next(f"auto ({cached.source}): {cached.reason}", cached)

        # 4. the ring, on every rank or none
        ring = RingSource(
            self.group, device=self.device, max_bytes=int(self.max_bytes or 0), world_size=self.world,
            runtime_cls=self.hooks.runtime_cls, planner=self.hooks.planner,
            capturable=self.capturable, capture_sizes=self.capture_sizes,
            exchange_timeout_s=self.hooks.exchange_timeout_s, hook=self.hooks.on_stage,
        )
        built = ring.build()
        if not built.ok:
            return self.keep_next(f"DMA ring initialisation failed ({built.failure})", cached, failed=True)
        dma: DmaBackend = built.value  # type: ignore[assignment]

        # 5. threshold: fixed, cached, or measured now
        crossover = cached
        if plan is not None and crossover is None:
            measured = self.measure(dma, plan)
            if not measured.ok:
                ring.release(dma)
                return self.keep_next(f"auto crossover measurement failed ({measured.failure})", failed=True)
            crossover = measured.value
        if crossover is not None:
            if crossover.min_bytes is None:
                ring.release(dma)  # the ring never won here: give its memory back
                return self.keep_next(f"auto ({crossover.source}): {crossover.reason}", crossover)
            dma.min_bytes = crossover.min_bytes
            reason = f"auto ({crossover.source}): {crossover.reason}; {capability.reason}"
        else:
            dma.min_bytes = int(self.threshold.min_bytes or 0)
            reason = f"fixed threshold; {capability.reason}"
        if not self.capturable:
            reason += "; kept out of CUDA graphs so sleep mode can release it"

        # 6. capture sizes
        warmed = ring.warm(dma)
        if not warmed.ok:
            ring.release(dma)
            why = warmed.failure
            return self.keep_next(f"preparing capture sizes failed ({why})", crossover, failed=True)

        router = AllReduceRouter(
            fallback=self.fallback, oneshot=self.oneshot, dma=dma, next_name=self.next_name, ring=ring
        )
        router.decision = RouterDecision(
            router.backend_name, dma.min_bytes, reason, str(self.threshold), self.max_bytes,
            dma.workspace_bytes, crossover, int(warmed.value or 0),
            threshold_source=self.threshold_source, seconds=time.monotonic() - self.t0,
        )
        return router

    def local_inputs(self) -> tuple:
        """What must be identical on every rank, and this rank's one-shot report."""
        hook = self.hooks.on_stage or (lambda name: None)
        hook("inputs:start")
        same = (
            self.threshold, self.max_bytes, self.world, self.next_name, str(self.measure_dtype),
            bool(self.capturable), tuple((int(n), str(d)) for n, d in self.capture_sizes),
        )
        report = self.oneshot.all_peer_report() if self.oneshot is not None else None
        hook("inputs:end")
        return same, report

    def refusal(self, report: Optional[bool]) -> Optional[str]:
        """Why the ring cannot run, from agreed values only (None: go on)."""
        if self.threshold.is_off:
            return "DMA disabled by setting"
        if not world_size_supported(self.world):
            return f"world size {self.world} not supported by the DMA ring"
        if not self.max_bytes or self.max_bytes <= 0:
            return "ring size unknown (max batched tokens x hidden size)"
        if self.threshold.min_bytes is not None and self.threshold.min_bytes > self.max_bytes:
            return (
                f"threshold {format_bytes(self.threshold.min_bytes)} above the largest reduce "
                f"{format_bytes(self.max_bytes)}"
            )
        if report is False:
            return decide_capability(False, None).reason
        return None

    def auto_plan(self, signature: tuple) -> AutoPlan:
        """Ladder, cache key fields and key for ``auto``. Without a topology signature
        the cache is not used: a decision must not move between different GPUs."""
        assert self.max_bytes is not None
        sizes = ladder_sizes(self.max_bytes, self.world, _itemsize(self.measure_dtype))
        topology, driver = (signature[:2], signature[2]) if signature else ("unknown", "unknown")
        fields = environment_fields(
            self.world, topology, driver, dtype=str(self.measure_dtype), next=self.next_name,
            **self.cache_fields,
        )
        fields.update({"ladder": list(sizes), "margin": self.hooks.margin})
        return AutoPlan(sizes, fields, cache_key(fields), self.hooks.cache if signature else None)

    def measure(self, dma: DmaBackend, plan: AutoPlan) -> Outcome[CrossoverDecision]:
        factory = self.hooks.measure_factory or _default_measure_factory
        setup = self.stage(
            "measure-setup",
            lambda: factory(dma, self.fallback, self.device, self.measure_dtype, self.max_bytes),
        )
        if not setup.ok:
            return Outcome(None, setup.failure)
        decided = run_agreed(self.group, lambda: run_auto(
            self.group, setup.value, plan.sizes, margin=self.hooks.margin, cache=plan.cache,
            key=plan.key, fields=plan.fields,
        ))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the measurement's buffers back before vLLM profiles memory
        return decided


def _guarded(fn: Callable) -> tuple:
    """``(fn(), None)``, or ``(None, reason)`` if it raised."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001
        return None, describe_error(exc)


def _first_difference(everyone: Sequence) -> str:
    names = ("threshold", "max_bytes", "world size", "next backend", "dtype", "capturable", "capture sizes")
    first = everyone[0][0][0]
    for rank, ((same, _), _) in enumerate(everyone):
        for name, a, b in zip(names, first, same):
            if a != b:
                return f"{name} {a!r} on rank 0, {b!r} on rank {rank}"
    return "unknown field"


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
    hooks: Optional[RouterHooks] = None,
    cache_fields: Optional[dict] = None,
    threshold_source: str = "dma_min_bytes",
    capturable: bool = True,
) -> AllReduceRouter:
    """Collective over ``group`` (a gloo group of the TP ranks). See the module doc.

    All ranks return routers with the same backends and the same crossover.
    ``threshold_source`` names where the threshold was set (for the log line);
    ``capturable=False`` keeps the ring out of CUDA graphs (sleep mode frees it).
    """
    return _Start(
        group=group, device=device, threshold=threshold, max_bytes=max_bytes, fallback=fallback,
        oneshot=oneshot, next_name=next_name, capture_sizes=tuple(capture_sizes),
        measure_dtype=measure_dtype, hooks=hooks or RouterHooks(), cache_fields=dict(cache_fields or {}),
        threshold_source=threshold_source, capturable=capturable,
    ).run()


__all__ = ["RouterHooks", "STAGES", "build_router"]
