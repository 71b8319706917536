"""Collective start-up over real gloo groups (spawned processes).

The DMA ring itself needs GPUs; here the router, consensus, probe and crossover
code runs unchanged with :class:`LoopbackDmaRuntime` standing in for b12x and a
fake :class:`GpuView` standing in for the CUDA device queries.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers.comm import fake_gpus, loopback_hooks
from helpers.ranks import run_ranks

from k3_accel.comm.build import build_router
from k3_accel.comm.consensus import agree, create_on_all_ranks
from k3_accel.comm.crossover import MiB, CrossoverCache, load_agreed, run_auto
from k3_accel.comm.eligibility import probe_all_peer
from k3_accel.comm.threshold import DmaThreshold
from k3_accel.testing.loopback import LoopbackDmaRuntime


def _agree(rank, world):
    group = dist.new_group(backend="gloo")
    none = agree(group, None)
    one = agree(group, "boom" if rank == 1 else None)
    two = agree(group, f"bad{rank}" if rank in (1, 2) else None)
    same = agree(group, "timeout" if rank != 1 else "root cause")
    return none, one, two, same


def test_agree_reports_the_same_reason_everywhere(three):
    out = [r["agree"] for r in three]
    assert all(r[0] is None for r in out)
    assert {r[1] for r in out} == {"rank 1: boom"}
    assert {r[2] for r in out} == {"rank 1: bad1; rank 2: bad2"}
    assert {r[3] for r in out} == {"ranks 0,2: timeout; rank 1: root cause"}


def _create_with_failure(rank, world):
    group = dist.new_group(backend="gloo")
    runtime_cls = LoopbackDmaRuntime.failing_on({1})
    abandoned = []
    created = create_on_all_ranks(
        group,
        lambda: runtime_cls(exchange_group=group, device="cpu", max_bytes=MiB),
        abandon=abandoned.append,
    )
    # the group still works afterwards (nobody is stuck in a collective)
    t = torch.ones(2)
    dist.all_reduce(t, group=group)
    return created.ok, created.failure, len(abandoned), t.tolist(), created.value is None


def test_one_rank_failing_init_keeps_every_rank_off(three):
    out = [r["create"] for r in three]
    assert [o[0] for o in out] == [False, False, False]
    assert all("rank 1" in o[1] and "injected init_after_exchange" in o[1] for o in out)
    assert [o[2] for o in out] == [1, 0, 1]        # ranks that built one release it locally
    assert all(o[3] == [3.0, 3.0] for o in out)
    assert all(o[4] for o in out)        # a failed consensus hands no rank its value, not even one that built it


def _build(rank, world, mode, fail_ranks, probe_kind, report):
    held0 = LoopbackDmaRuntime.held_bytes        # earlier cases in this process may have leaked
    group = dist.new_group(backend="gloo")
    runtime_cls = LoopbackDmaRuntime.failing_on(fail_ranks) if fail_ranks else LoopbackDmaRuntime
    asked = []

    def can_access(a, b):
        asked.append((a, b))
        return probe_kind == "ok"

    gpus = fake_gpus(rank, world, can_access=can_access)
    if probe_kind == "real-fail":
        # each rank sees only its own GPU (e.g. CUDA_VISIBLE_DEVICES per process)
        gpus = fake_gpus(rank, world)
        gpus = type(gpus)(**{**gpus.__dict__, "visible_devices": lambda: [rank]})
    oneshot = None
    if report is not None:
        from k3_accel.comm.oneshot import OneShotBackend

        ws = type("W", (), {"supports_all_peer_auxiliary": report})()
        impl = type("F", (), {"disabled": False, "workspace": ws, "should_use": lambda self, t: False})()
        oneshot = OneShotBackend.from_vllm(impl)
    hooks = loopback_hooks(rank, world, runtime_cls=runtime_cls, gpus=gpus)
    fallback_calls = []

    def fallback(t):
        fallback_calls.append(t.numel())
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    threshold = {"off": DmaThreshold.off(), "fixed": DmaThreshold.at(64 * 1024)}[mode]
    router = build_router(
        group=group, device=torch.device("cpu"), threshold=threshold, max_bytes=4 * MiB,
        fallback=fallback, oneshot=oneshot, hooks=hooks,
        capture_sizes=[(128 * 1024, torch.float32), (1024, torch.float32)],
    )
    result = {
        "backend": router.backend_name,
        "reason": router.decision.reason,
        "failed": router.decision.failed,
        "min": router.dma_min_bytes,
        "probed": len(asked),
        "prepared": router.decision.prepared_sizes,
        "workspace": router.decision.workspace_bytes,
        "held": LoopbackDmaRuntime.held_bytes - held0,
    }
    if router.dma is not None:
        big = torch.full((256, 1024), float(rank + 1))       # 1 MiB fp32
        small = torch.full((8, 128), float(rank + 1))         # 4 KiB
        out_big = router.all_reduce(big)
        out_small = router.all_reduce(small)
        result["sums"] = (out_big[0, 0].item(), out_small[0, 0].item())
        result["ring_calls"] = router.dma.runtime.calls
        result["fallback_calls"] = list(fallback_calls)
        runtime = router.dma.runtime
        result["close"] = router.close()
        result["closed"] = runtime.closed
        result["held_after_close"] = LoopbackDmaRuntime.held_bytes - held0
    return result


def test_fixed_threshold_routes_through_ring_and_closes_collectively(two):
    out = [r["build"]["fixed"] for r in two]
    for r in out:
        assert r["backend"] == "B12X_DMA" and r["min"] == 64 * 1024
        assert r["prepared"] == 1                 # 512 KiB capture size yes, 4 KiB no
        assert r["sums"] == (3.0, 3.0)
        assert r["ring_calls"] == 2               # prepare warm-up + the big tensor
        assert r["fallback_calls"] == [8 * 128]
        assert r["closed"] is True and r["close"] is None
        # the start-up line reports the memory the ring really holds, and close gives it back
        assert r["workspace"] == r["held"] > 2 * MiB and r["held_after_close"] == 0


def test_off_never_builds_or_probes(two):
    out = [r["build"]["off"] for r in two]
    assert all(r["backend"] == "NCCL" and r["probed"] == 0 and r["min"] is None for r in out)


def test_init_failure_on_one_rank_keeps_nccl_on_all(two):
    out = [r["build"]["init-fails"] for r in two]
    assert all(r["backend"] == "NCCL" and r["min"] is None and r["failed"] for r in out)
    assert all("initialisation failed" in r["reason"] and "rank 1" in r["reason"] for r in out)


def test_fail_closed_without_a_report(two):
    out = [r["build"]["no-p2p"] for r in two]
    assert all(r["backend"] == "NCCL" and "no peer access from rank" in r["reason"] for r in out)
    assert not any(r["failed"] for r in out)          # a rule, not a fault


def test_explicit_false_report_vetoes_even_a_passing_probe(two):
    out = [r["build"]["false-report"] for r in two]
    assert all(r["backend"] == "FLASHINFER_PCIE_IPC" and r["probed"] == 0 for r in out)
    assert all("reports no all-peer" in r["reason"] for r in out)


def test_true_report_allows_even_a_failing_probe(two):
    out = [r["build"]["true-report"] for r in two]
    assert all(r["backend"] == "FLASHINFER_PCIE_IPC_B12X_DMA" for r in out)
    assert all("runtime reports all-peer connectivity" in r["reason"] for r in out)


def test_real_probe_fails_closed_when_peers_are_invisible(two):
    out = [r["build"]["invisible"] for r in two]
    assert all(r["backend"] == "NCCL" and "not visible" in r["reason"] for r in out)


# ------------------------------------------------------------------ probe
def _probe(rank, world):
    group = dist.new_group(backend="gloo")
    cases = {
        "one-node": fake_gpus(rank, world),
        "two-nodes": fake_gpus(rank, world, node=f"n{rank % 2}"),
        "no-p2p": fake_gpus(rank, world, can_access=lambda a, b: not (a == 2 and b == 0)),
        "shared-gpu": fake_gpus(rank, world, gpu_ids=["GPU-0", "GPU-1", "GPU-0"]),
        "unidentified": fake_gpus(rank, world, fail_identify=rank == 1),
    }
    out = {}
    for case, view in cases.items():
        res = probe_all_peer(group, torch.device("cpu"), view)
        out[case] = (res.ok, res.reason, res.signature)
    return out


def test_probe_rule_on_three_ranks(three):
    out = [r["probe"] for r in three]
    for case, ok in (("one-node", True), ("two-nodes", False), ("no-p2p", False),
                     ("shared-gpu", False), ("unidentified", False)):
        assert [o[case][0] for o in out] == [ok] * 3, case
        assert len({o[case][1:] for o in out}) == 1, case        # same reason and signature everywhere
    nodes, gpus, drivers = out[0]["one-node"][2]
    assert nodes == 1 and gpus == tuple(("Fake GPU", f"GPU-{i}") for i in range(3)) and drivers == ("drv-1",) * 3
    assert "2 nodes" in out[0]["two-nodes"][1]
    assert "no peer access from rank 2 to rank 0" in out[0]["no-p2p"][1]
    assert "two ranks share one GPU" in out[0]["shared-gpu"][1]
    assert "rank 1" in out[0]["unidentified"][1] and out[0]["unidentified"][2] == ()


def test_probe_refuses_a_cpu_device(two):
    assert [r["probe-cpu"] for r in two] == [False, False]


def _probe_cpu(rank, world):
    return probe_all_peer(dist.new_group(backend="gloo"), torch.device("cpu")).ok


# -------------------------------------------------------------- crossover
def _auto(rank, world, cache_dir):
    group = dist.new_group(backend="gloo")
    sizes = [4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB]
    # rank 0: DMA wins from 16 MiB; rank 1 is slower at 16 MiB, wins from 32 MiB.
    def measure(nbytes):
        nxt = nbytes / (10 * MiB) * 1e-3
        if nbytes >= 32 * MiB or (nbytes >= 16 * MiB and rank == 0):
            return nxt, nxt * 0.8
        return nxt, nxt * 1.5

    cache = CrossoverCache(cache_dir)
    before = load_agreed(group, "k1", cache=cache)
    first = run_auto(group, measure, sizes, cache=cache, key="k1", fields={"world_size": world})
    second = load_agreed(group, "k1", cache=cache)
    return (before, first.min_bytes, first.source, second.min_bytes, second.source,
            [s.dma_s for s in first.samples])


def test_auto_merges_ranks_and_caches(two, cache_root):
    out = [r["auto"] for r in two]
    assert all(o[0] is None for o in out)
    assert {o[1] for o in out} == {32 * MiB}            # slowest rank decides
    assert all(o[2] == "measured" and o[3] == 32 * MiB and o[4] == "cache" for o in out)
    assert out[0][5] == out[1][5]                        # identical merged tables
    assert len(list((cache_root / "auto").glob("dma-crossover-*.json"))) == 1


def _auto_router(rank, world, winning, cache_dir):
    group = dist.new_group(backend="gloo")

    def factory(dma, fallback, device, dtype, max_bytes):
        def measure(nbytes):
            return (1e-3, 0.5e-3) if winning and nbytes >= 2 * MiB else (1e-3, 2e-3)
        return measure

    hooks = loopback_hooks(rank, world, measure_factory=factory, cache=CrossoverCache(cache_dir))
    first, held0 = len(LoopbackDmaRuntime.instances), LoopbackDmaRuntime.held_bytes
    router = build_router(
        group=group, device=torch.device("cpu"), threshold=DmaThreshold.auto(), max_bytes=8 * MiB,
        fallback=lambda t: t, hooks=hooks,
    )
    closed = [inst.closed for inst in LoopbackDmaRuntime.instances[first:]]
    res = (router.backend_name, router.dma_min_bytes, router.decision.reason, closed,
           LoopbackDmaRuntime.held_bytes - held0 if not winning else None)
    router.close()
    # a second start on the same host: the cached decision is used
    again = build_router(
        group=group, device=torch.device("cpu"), threshold=DmaThreshold.auto(), max_bytes=8 * MiB,
        fallback=lambda t: t, hooks=hooks,
    )
    res += (again.dma_min_bytes, again.decision.crossover.source, len(LoopbackDmaRuntime.instances) - first)
    again.close()
    return res


def test_auto_without_a_winning_size_releases_the_ring(two):
    out = [r["auto-never"] for r in two]
    for backend, min_bytes, reason, closed, held, min2, source2, rings in out:
        assert backend == "NCCL" and min_bytes is None
        assert reason.startswith("auto (measured)") and "never wins" in reason
        assert closed == [True] and held == 0
        assert min2 is None and source2 == "cache" and rings == 1   # no second ring allocated


def test_auto_with_a_winning_size_keeps_the_ring(two):
    out = [r["auto-wins"] for r in two]
    for backend, min_bytes, reason, closed, held, min2, source2, rings in out:
        assert backend == "B12X_DMA" and min_bytes == 2 * MiB and closed == [False]
        assert "wins from 2 MiB" in reason
        assert min2 == 2 * MiB and source2 == "cache" and rings == 2


def _keyed(rank, world, cache_dir):
    """Which starts measure and which reuse the cache, as the driver and the GPUs change."""
    from k3_accel.comm.oneshot import OneShotBackend

    group = dist.new_group(backend="gloo")

    def factory(*args):
        return lambda nbytes: (1e-3, 0.5e-3)

    def start(gpus, report=None):
        oneshot = None
        if report is not None:
            ws = type("W", (), {"supports_all_peer_auxiliary": report})()
            oneshot = OneShotBackend.from_vllm(
                type("F", (), {"disabled": False, "workspace": ws, "should_use": lambda self, t: False})())
        hooks = loopback_hooks(rank, world, gpus=gpus, measure_factory=factory, cache=CrossoverCache(cache_dir))
        router = build_router(group=group, device=torch.device("cpu"), threshold=DmaThreshold.auto(),
                              max_bytes=2 * MiB, fallback=lambda t: t, hooks=hooks, oneshot=oneshot)
        source = router.decision.crossover.source
        router.close()
        return source

    base = fake_gpus(rank, world)
    unidentified = fake_gpus(rank, world, fail_identify=rank == 1)
    return [
        start(base), start(base),                                            # first start, then cached
        start(fake_gpus(rank, world, driver="drv-2")),                       # new driver: measure again
        start(fake_gpus(rank, world, driver="drv-2")),
        start(fake_gpus(rank, world, gpu_ids=["GPU-1", "GPU-0"])),           # other GPUs in rank order
        start(unidentified, report=True), start(unidentified, report=True),  # no topology: never cached
    ]


def test_auto_cache_is_keyed_on_driver_and_topology(two):
    out = [r["keyed"] for r in two]
    assert out[0] == out[1] == ["measured", "cache", "measured", "cache", "measured", "measured", "measured"]


def _thresholds_differ(rank, world):
    """Each rank was given its own byte threshold (say, its own environment): 6,000,000 and
    6,000,032 bytes. Both print as "5.7 MiB", yet a tensor between them would go to the ring
    on one rank and to NCCL on the other (mismatched collectives)."""
    group = dist.new_group(backend="gloo")
    router = build_router(
        group=group, device=torch.device("cpu"), threshold=DmaThreshold.at(6_000_000 + 32 * rank),
        max_bytes=8 * MiB, fallback=lambda t: t, hooks=loopback_hooks(rank, world),
    )
    res = (router.dma_min_bytes, router.decision.reason, router.decision.failed)
    router.close()
    return res


def test_ranks_with_different_byte_thresholds_keep_the_stock_path(two):
    out = [r["thresholds-differ"] for r in two]
    for min_bytes, reason, failed in out:
        assert min_bytes is None and failed
        assert "ranks disagree on settings or sizing: threshold" in reason


# ------------------------------------------------------------ the groups
# Spawning a group costs seconds on a 2-core CI box, so each group size is
# spawned once per module and runs every case in a row; the tests read their part.
BUILD_CASES = {
    "fixed": ("fixed", (), "ok", None),
    "off": ("off", (), "ok", None),
    "init-fails": ("fixed", (1,), "ok", None),
    "no-p2p": ("fixed", (), "fail", None),
    "false-report": ("fixed", (), "ok", False),
    "true-report": ("fixed", (), "fail", True),
    "invisible": ("fixed", (), "real-fail", None),
}


def _all_two(rank, world, root):
    return {
        "build": {name: _build(rank, world, *args) for name, args in BUILD_CASES.items()},
        "probe-cpu": _probe_cpu(rank, world),
        "auto": _auto(rank, world, f"{root}/auto"),
        "auto-never": _auto_router(rank, world, False, f"{root}/never"),
        "auto-wins": _auto_router(rank, world, True, f"{root}/wins"),
        "keyed": _keyed(rank, world, f"{root}/keyed"),
        "thresholds-differ": _thresholds_differ(rank, world),
    }


def _all_three(rank, world):
    return {"agree": _agree(rank, world), "create": _create_with_failure(rank, world), "probe": _probe(rank, world)}


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("crossover")


@pytest.fixture(scope="module")
def two(cache_root):
    return run_ranks(_all_two, 2, str(cache_root))


@pytest.fixture(scope="module")
def three():
    return run_ranks(_all_three, 3)
