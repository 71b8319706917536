"""Faults at every start-up stage and at teardown, on one rank of a real gloo group.

Every case checks the same three things: every rank ends in the same state (all
on the next backend, or all routed, with the same reason), nobody hangs (each
case is timed and must finish well inside a generous bound — a hang guard, not a
speed claim), and the group is still usable afterwards (nobody is left inside a
collective). The ring is :class:`LoopbackDmaRuntime`; its exchanges run on the
bounded group with a 3 s timeout, so a peer that never arrives costs 3 s.
"""
from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.distributed as dist

from helpers.comm import fake_gpus, loopback_hooks
from helpers.ranks import run_ranks

from k3_accel.comm.build import STAGES, build_router
from k3_accel.comm.crossover import MiB, CrossoverCache
from k3_accel.comm.threshold import DmaThreshold
from k3_accel.testing.loopback import LoopbackDmaRuntime

BOUND_S = 60.0          # a stage or a teardown must end within this (hang guard, not a speed claim)
RING_MIN = 1 * MiB      # the measured crossover in these tests
CAPTURE = ((256 * 1024, torch.float32),)     # 1 MiB: at the crossover, so the capture stages run

STAGE_POINTS = tuple(f"{stage}:{when}" for stage in STAGES for when in ("start", "end"))
OTHER_POINTS = (
    "runtime:init_before_exchange",   # the ring's allocation fails before its handle exchange
    "runtime:init_after_exchange",    # ... after it (a failed IPC open)
    "probe:identify",                 # the P2P probe's own failure before its exchange
    "probe:peer-check",               # ... after it
    "measure:mid-ladder",             # the crossover measurement fails half-way
    "inputs:disagree",                # this rank sized the ring differently
    "report:mixed",                   # this rank's one-shot gives no all-peer report, the others say yes
)
# (point, what every rank must end with, text the shared reason must contain)
EXPECTED = {
    **{p: ("NCCL", "rank {f}") for p in STAGE_POINTS},
    "runtime:init_before_exchange": ("NCCL", "rank {f}: RuntimeError: loopback: injected"),
    "runtime:init_after_exchange": ("NCCL", "rank {f}"),
    "probe:identify": ("NCCL", "rank {f}"),
    "probe:peer-check": ("NCCL", "rank {f}"),
    "measure:mid-ladder": ("NCCL", "rank {f}"),
    "inputs:disagree": ("NCCL", "ranks disagree on settings or sizing: max_bytes"),
    # no agreed report, so the probe decides (here: no P2P) — on every rank, not just the faulty one
    "report:mixed": ("FLASHINFER_PCIE_IPC", "P2P probe failed: rank 0: RuntimeError: no peer access from rank 0"),
}


def _start(rank, world, point, faulty, cache=None):
    """Build a router (auto threshold, winning measurement) with ``point`` injected on ``faulty``."""
    group = dist.new_group(backend="gloo")
    here = rank == faulty
    kind, _, what = point.partition(":")

    def on_stage(name):
        if here and name == point:
            raise RuntimeError(f"injected at {name}")

    def factory(dma, fallback, device, dtype, max_bytes):
        calls = []

        def measure(nbytes):
            calls.append(nbytes)
            if here and point == "measure:mid-ladder" and len(calls) == 2:
                raise RuntimeError("injected: measurement failed at the second size")
            return (1e-3, 0.5e-3) if nbytes >= RING_MIN else (1e-3, 2e-3)
        return measure

    runtime_cls = LoopbackDmaRuntime
    if kind == "runtime":
        runtime_cls = LoopbackDmaRuntime.with_faults(**{what: {faulty}})
    gpus = fake_gpus(rank, world)
    if here and point == "probe:identify":
        gpus = fake_gpus(rank, world, fail_identify=True)
    if here and point == "probe:peer-check":
        def broken(a, b):
            raise RuntimeError("injected: peer access query failed")
        gpus = fake_gpus(rank, world, can_access=broken)
    oneshot = None
    if kind == "report":
        gpus = fake_gpus(rank, world, can_access=lambda a, b: False)
        oneshot = _oneshot(None if here else True)
    hooks = loopback_hooks(rank, world, runtime_cls=runtime_cls, gpus=gpus, measure_factory=factory,
                           on_stage=on_stage, cache=cache)
    max_bytes = 4 * MiB + (64 * 1024 if here and point == "inputs:disagree" else 0)
    return group, build_router(
        group=group, device=torch.device("cpu"), threshold=DmaThreshold.auto(), max_bytes=max_bytes,
        fallback=lambda t: _gloo_sum(t, group), hooks=hooks, capture_sizes=CAPTURE, oneshot=oneshot,
    )


def _oneshot(report):
    """vLLM's one-shot wrapper as the router sees it: accepts nothing, reports ``report``."""
    from k3_accel.comm.oneshot import OneShotBackend

    workspace = type("Workspace", (), {} if report is None else {"supports_all_peer_auxiliary": report})()
    wrapper = type("Wrapper", (), {"disabled": False, "workspace": workspace,
                                   "should_use": lambda self, t: False})()
    return OneShotBackend.from_vllm(wrapper)


def _gloo_sum(t, group):
    out = t.clone()
    dist.all_reduce(out, group=group)
    return out


def _still_in_step(group, rank, world) -> bool:
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=group)
    return t.tolist() == [world * (world + 1) / 2] * 4


def _sweep(rank, world, points, faulty):
    out = {}
    for point in points:
        t0 = time.monotonic()
        group, router = _start(rank, world, point, faulty)
        seconds = time.monotonic() - t0
        d = router.decision
        routed_sum = None
        if router.dma is not None:
            routed_sum = router.all_reduce(torch.full((256, 1024), float(rank + 1)))[0, 0].item()
        router.close()
        out[point] = dict(backend=d.backend, reason=d.reason, failed=d.failed, seconds=seconds,
                          routed_sum=routed_sum, in_step=_still_in_step(group, rank, world))
    # the control: no fault anywhere routes large tensors through the ring on every rank
    group, router = _start(rank, world, "none:none", faulty)
    out["none"] = dict(backend=router.decision.backend, min=router.dma_min_bytes,
                       prepared=router.decision.prepared_sizes,
                       routed_sum=router.all_reduce(torch.full((256, 1024), float(rank + 1)))[0, 0].item())
    router.close()
    return out


def _check_sweep(out, points, faulty, world):
    total = world * (world + 1) / 2
    for r in out:
        assert r["none"] == dict(backend="B12X_DMA", min=RING_MIN, prepared=1, routed_sum=total)
    for point in points:
        cases = [r[point] for r in out]
        backend, needle = EXPECTED[point]
        assert len({(c["backend"], c["reason"], c["failed"]) for c in cases}) == 1, (point, cases)
        assert cases[0]["backend"] == backend, (point, cases[0])
        assert needle.format(f=faulty) in cases[0]["reason"], (point, cases[0]["reason"])
        assert all(c["in_step"] for c in cases), point
        assert all(c["seconds"] < BOUND_S for c in cases), (point, [c["seconds"] for c in cases])
        # a failing probe is the fail-closed rule, not a fault
        assert cases[0]["failed"] == (not point.startswith(("probe:", "report:"))), point


def test_comm_fault_every_setup_stage_on_one_of_two_ranks(two):
    _check_sweep([r["sweep"] for r in two], STAGE_POINTS + OTHER_POINTS, 1, 2)


FOUR_POINTS = ("inputs:start", "ring:start", "runtime:init_before_exchange", "runtime:init_after_exchange",
               "probe:identify", "probe:peer-check", "capture:start", "capture:end", "report:mixed")


def _four(rank, world):
    return {"sweep": _sweep(rank, world, FOUR_POINTS, 2), "tp-pairs": _tp_pairs(rank, world)}


def _tp_pairs(rank, world):
    """Two TP groups of two inside a world of four (as with PP or DP = 2): each builds its own
    ring, at the same time, over its own bounded exchange group; rank 3 fails its ring."""
    pairs = [[0, 1], [2, 3]]
    groups = [dist.new_group(ranks, backend="gloo") for ranks in pairs]   # every rank creates both, like vLLM
    mine = groups[rank // 2]
    faulty = LoopbackDmaRuntime.with_faults(init_before_exchange={1})     # group rank 1 of the second pair
    hooks = loopback_hooks(rank % 2, 2, runtime_cls=faulty if rank >= 2 else LoopbackDmaRuntime)
    router = build_router(group=mine, device=torch.device("cpu"), threshold=DmaThreshold.at(RING_MIN),
                          max_bytes=4 * MiB, fallback=lambda t: _gloo_sum(t, mine), hooks=hooks)
    total = router.all_reduce(torch.full((256, 1024), float(rank + 1)))[0, 0].item()
    result = (router.decision.backend, router.decision.failed, total)
    router.close()
    return result


def test_comm_fault_setup_before_and_after_the_exchanges_on_one_of_four_ranks():
    out = run_ranks(_four, 4, timeout=600)
    _check_sweep([r["sweep"] for r in out], FOUR_POINTS, 2, 4)
    pairs = [r["tp-pairs"] for r in out]
    assert pairs[0] == pairs[1] == ("B12X_DMA", False, 3.0)          # ranks 1 + 2, through the ring
    assert pairs[2] == pairs[3] == ("NCCL", True, 7.0)               # ranks 3 + 4, the fault kept NCCL


# ---------------------------------------------------------------- cache
def _cache_faults(rank, world, good_dir, bad_dir):
    """Rank 0's cache directory cannot be written: the decision still holds, nothing is cached."""
    out = {}
    for name, directory in (("unwritable", bad_dir), ("writable", good_dir)):
        cache = CrossoverCache(directory)
        group, router = _start(rank, world, "none:none", -1, cache=cache)
        out[name] = (router.decision.backend, router.dma_min_bytes, router.decision.crossover.source)
        router.close()
        group, again = _start(rank, world, "none:none", -1, cache=cache)
        out[name + "-again"] = again.decision.crossover.source
        again.close()
    return out


def test_comm_fault_unwritable_cache_keeps_the_decision(two):
    for r in [r["cache"] for r in two]:
        assert r["unwritable"] == ("B12X_DMA", RING_MIN, "measured") and r["unwritable-again"] == "measured"
        assert r["writable"] == ("B12X_DMA", RING_MIN, "measured") and r["writable-again"] == "cache"


# ------------------------------------------------------------- teardown
class _Leaks(logging.Handler):
    """The DMA module's warnings: an abandoned ring says how many device bytes it leaked."""
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _teardown(rank, world, faulty):
    out = {}
    leaks = _Leaks()
    logging.getLogger("k3_accel.comm.dma").addHandler(leaks)
    for case in ("close_before_barrier", "close_after_barrier", "absent"):
        leaks.messages.clear()
        runtime_cls = LoopbackDmaRuntime
        if case != "absent":
            runtime_cls = LoopbackDmaRuntime.with_faults(**{case: {faulty}})
        group = dist.new_group(backend="gloo")
        router = build_router(
            group=group, device=torch.device("cpu"), threshold=DmaThreshold.at(RING_MIN), max_bytes=4 * MiB,
            fallback=lambda t: _gloo_sum(t, group), hooks=loopback_hooks(rank, world, runtime_cls=runtime_cls),
        )
        routed = router.dma is not None
        t0 = time.monotonic()
        error = "skipped" if case == "absent" and rank == faulty else router.close()
        seconds = time.monotonic() - t0
        out[case] = dict(routed=routed, error=error, seconds=seconds, released=router.dma is None,
                         in_step=_still_in_step(group, rank, world),
                         leak_logged=any("bytes leaked" in m for m in leaks.messages))
    return out


def test_comm_fault_teardown_never_hangs_and_never_raises(two):
    out = [r["teardown"] for r in two]
    for case in ("close_before_barrier", "close_after_barrier", "absent"):
        cases = [r[case] for r in out]
        assert all(c["routed"] for c in cases), case
        assert all(c["in_step"] for c in cases), case
        assert cases[0]["released"] and (cases[1]["released"] or case == "absent"), case
        assert all(c["seconds"] < BOUND_S for c in cases), (case, [c["seconds"] for c in cases])
        assert cases[1]["error"] is not None                      # the faulty rank abandoned
        assert cases[0]["error"] is not None                      # its peer gave up waiting
        if case != "absent":
            assert "injected" in cases[1]["error"]
            assert cases[1]["leak_logged"]                      # abandoned locally, its leak said


# ----------------------------------------------------------- two ranks
def _two(rank, world, good_dir, bad_dir):
    return {"sweep": _sweep(rank, world, STAGE_POINTS + OTHER_POINTS, 1),
            "cache": _cache_faults(rank, world, good_dir, bad_dir),
            "teardown": _teardown(rank, world, 1)}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Every two-rank case in one spawned group (a spawn costs seconds on a 2-core box)."""
    root = tmp_path_factory.mktemp("faults")
    bad = root / "a-file"
    bad.write_text("not a directory")     # rank 0's cache directory cannot be created
    return run_ranks(_two, 2, str(root / "cache"), str(bad), timeout=600)
