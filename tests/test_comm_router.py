"""Router decisions, the DMA backend's gate, eligibility and crossover rules (one process)."""
from __future__ import annotations

import json

import pytest
import torch

import k3_accel.comm.dma as dma_mod
from k3_accel.comm.crossover import (
    MiB,
    CrossoverCache,
    CrossoverDecision,
    Sample,
    cache_key,
    ladder_sizes,
    select_crossover,
)
from k3_accel.comm.dma import DmaBackend
from k3_accel.comm.eligibility import (
    ProbeResult,
    combine_reports,
    decide_capability,
    runtime_report,
    tensor_fits_ring,
    world_size_supported,
)
from k3_accel.comm.oneshot import OneShotBackend
from k3_accel.comm.router import AllReduceRouter, backend_name


class RecordingRuntime:
    """Single-process stand-in: records calls; the 'sum' is the input times world size."""

    def __init__(self, *, world_size=2, max_bytes=64 * MiB, device="cpu"):
        self.world_size = world_size
        self.max_bytes = max_bytes
        self.device = torch.device(device)
        self.shard_capacity = -(-(-(-max_bytes // world_size)) // 256) * 256
        self.calls = []
        self.closed = 0

    def all_reduce(self, inp, *, plan, out=None):
        assert plan == ("plan", inp.numel(), inp.dtype)
        assert inp.dim() == 1  # the backend reduces flat views
        self.calls.append((inp.numel(), inp.dtype))
        out.copy_(inp * self.world_size)
        return out

    def close(self):
        self.closed += 1


def planner(runtime, numel, dtype):
    return ("plan", numel, dtype)


def make_dma(min_bytes=1 * MiB, **kw):
    runtime = RecordingRuntime(**kw)
    return DmaBackend(runtime, world_size=runtime.world_size, min_bytes=min_bytes, planner=planner)


class FakeOneShot:
    """vLLM-wrapper-shaped one-shot: accepts bf16 tensors up to a size."""

    def __init__(self, limit_bytes=512 * 1024, report=None):
        self.disabled = False
        self.limit = limit_bytes
        self.calls = 0
        if report is not None:
            self.workspace = type("W", (), {"supports_all_peer_auxiliary": report})()

    def should_use(self, t):
        return t.dtype == torch.bfloat16 and t.numel() * t.element_size() <= self.limit

    def all_reduce(self, t):
        self.calls += 1
        return t * 2


def fallback_recorder():
    calls = []

    def fallback(t):
        calls.append(t.numel())
        return t * 2

    return fallback, calls


def bf16(nbytes, cols=1024):
    return torch.randn(nbytes // 2 // cols, cols).to(torch.bfloat16)


# ------------------------------------------------------------------ routing
def test_below_threshold_goes_next_at_and_above_goes_dma():
    dma = make_dma(min_bytes=2 * MiB)
    fallback, calls = fallback_recorder()
    router = AllReduceRouter(fallback=fallback, dma=dma)
    small, edge, big = bf16(1 * MiB), bf16(2 * MiB), bf16(8 * MiB)
    assert router.choose(small) == "next"
    assert router.choose(edge) == "dma"
    assert router.choose(big) == "dma"
    out = router.all_reduce(big)
    assert out is not big and out.shape == big.shape
    torch.testing.assert_close(out, big * 2)
    router.all_reduce(small)
    assert calls == [small.numel()]
    assert dma.runtime.calls == [(big.numel(), torch.bfloat16)]


def test_ring_requirements_each_send_to_next():
    dma = make_dma(min_bytes=0, max_bytes=4 * MiB)
    fallback, _ = fallback_recorder()
    router = AllReduceRouter(fallback=fallback, dma=dma)
    ok = bf16(1 * MiB)
    assert router.choose(ok) == "dma"
    assert router.choose(bf16(8 * MiB)) == "next"                      # > max_bytes
    assert router.choose(torch.ones(1024, 512, dtype=torch.int32)) == "next"  # dtype
    assert router.choose(bf16(1 * MiB).t()) == "next"                  # not contiguous
    assert router.choose(torch.ones(16 * 1000 + 8, dtype=torch.bfloat16)) == "next"  # numel % 16
    assert router.choose(torch.ones(16 * 1000, dtype=torch.bfloat16)) == "dma"
    assert router.choose(torch.ones(16 * 1000, dtype=torch.float32)) == "dma"
    assert router.choose(torch.ones(16 * 1000, dtype=torch.float16)) == "dma"
    assert router.choose(torch.ones(0, dtype=torch.bfloat16)) == "next"   # empty
    dma.close()
    assert router.choose(ok) == "next"                                   # closed


def test_multiple_follows_world_size():
    dma = make_dma(min_bytes=0, world_size=4)
    router = AllReduceRouter(fallback=lambda t: t, dma=dma)
    assert router.choose(torch.ones(32 * 100, dtype=torch.bfloat16)) == "dma"
    assert router.choose(torch.ones(16 * 101, dtype=torch.bfloat16)) == "next"  # 1616 % 32 != 0


def test_device_mismatch_goes_next():
    dma = make_dma(min_bytes=0, device="meta")
    router = AllReduceRouter(fallback=lambda t: t, dma=dma)
    assert router.choose(bf16(1 * MiB)) == "next"


def test_oneshot_first_then_dma_then_next():
    oneshot = OneShotBackend.from_vllm(FakeOneShot(limit_bytes=4 * MiB))
    dma = make_dma(min_bytes=1 * MiB)
    fallback, calls = fallback_recorder()
    router = AllReduceRouter(fallback=fallback, oneshot=oneshot, dma=dma)
    assert router.choose(bf16(2 * MiB)) == "oneshot"   # both accept: one-shot wins
    assert router.choose(bf16(8 * MiB)) == "dma"
    fp32 = torch.ones(1024, 128)                        # 512 KiB fp32: one-shot declines, below DMA min
    assert router.choose(fp32) == "next"
    router.all_reduce(bf16(2 * MiB))
    assert oneshot.impl.calls == 1 and dma.runtime.calls == [] and calls == []
    assert router.backend_name == "FLASHINFER_PCIE_IPC_B12X_DMA"


def test_a_closed_oneshot_workspace_is_never_used():
    oneshot = OneShotBackend.from_vllm(FakeOneShot(limit_bytes=4 * MiB))
    router = AllReduceRouter(fallback=fallback_recorder()[0], oneshot=oneshot, dma=make_dma(min_bytes=1 * MiB))
    assert router.choose(bf16(2 * MiB)) == "oneshot"
    oneshot.close()                                     # its workspace is gone (sleep mode, shutdown)
    assert not oneshot.should_use(bf16(2 * MiB))
    assert router.choose(bf16(2 * MiB)) == "dma"
    router.all_reduce(bf16(2 * MiB))
    assert oneshot.impl.calls == 0


def test_oneshot_run_override_and_disabled_wrapper():
    seen = []
    oneshot = OneShotBackend.from_vllm(FakeOneShot(), run=lambda t: seen.append(t) or t + 1)
    t = bf16(64 * 1024)
    out = oneshot.all_reduce(t)
    assert seen == [t] and oneshot.impl.calls == 0
    torch.testing.assert_close(out, t + 1)
    disabled = FakeOneShot()
    disabled.disabled = True
    assert OneShotBackend.from_vllm(disabled) is None
    assert OneShotBackend.from_vllm(None) is None


def test_backend_names():
    assert backend_name(True, True) == "FLASHINFER_PCIE_IPC_B12X_DMA"
    assert backend_name(False, True) == "B12X_DMA"
    assert backend_name(True, False) == "FLASHINFER_PCIE_IPC"
    assert backend_name(False, False) == "NCCL"
    assert backend_name(False, False, "VLLM_STOCK") == "VLLM_STOCK"


def test_capture_declines_unprepared_sizes(monkeypatch):
    dma = make_dma(min_bytes=1 * MiB)
    router = AllReduceRouter(fallback=lambda t: t, dma=dma)
    captured, other = bf16(4 * MiB), bf16(8 * MiB)
    small = bf16(512 * 1024)
    n = router.prepare_capture([(captured.numel(), torch.bfloat16), (small.numel(), torch.bfloat16)])
    assert n == 1  # the size below the crossover is not prepared
    assert dma.prepared_sizes() == {(captured.numel(), torch.bfloat16)}
    monkeypatch.setattr(dma_mod, "_capturing", lambda device: True)
    assert router.choose(captured) == "dma"
    assert router.choose(other) == "next"
    monkeypatch.setattr(dma_mod, "_capturing", lambda device: False)
    assert router.choose(other) == "dma"


def test_prepare_skips_sizes_the_ring_cannot_take():
    dma = make_dma(min_bytes=0, max_bytes=4 * MiB)
    bad = [(10, torch.bfloat16), (8 * MiB, torch.bfloat16), (16, torch.int32), (0, torch.float32)]
    assert dma.capture_plan(bad) == [] and dma.prepare(dma.capture_plan(bad)) == 0
    plan = dma.capture_plan([(1024, torch.float32), (1024, torch.float32), (4096, torch.bfloat16)])
    assert plan == [(1024, torch.float32), (4096, torch.bfloat16)]
    assert dma.prepare(plan) == 2
    assert dma.runtime.calls == [(1024, torch.float32), (4096, torch.bfloat16)]
    assert dma.capture_plan([(1024, torch.float32)]) == []            # already prepared


def test_a_ring_kept_out_of_graphs_declines_every_size_during_capture(monkeypatch):
    dma = make_dma(min_bytes=1 * MiB)
    dma.capturable = False
    router = AllReduceRouter(fallback=lambda t: t, dma=dma)
    big = bf16(4 * MiB)
    assert router.prepare_capture([(big.numel(), torch.bfloat16)]) == 0    # nothing prepared
    router.all_reduce(big)                                                 # eager: ring, plan ready
    monkeypatch.setattr(dma_mod, "_capturing", lambda device: True)
    assert router.choose(big) == "next" and not dma.captured
    dma.capturable = True
    assert router.choose(big) == "dma" and dma.captured                    # a graph now holds it


def test_plans_are_keyed_by_numel_and_dtype():
    dma = make_dma(min_bytes=0)
    made = []

    def counting(runtime, numel, dtype):
        made.append((numel, dtype))
        return ("plan", numel, dtype)

    dma._planner = counting
    a = torch.ones(64, 1024, dtype=torch.bfloat16)
    dma.all_reduce(a)
    dma.all_reduce(a.view(1024, 64))        # same numel and dtype: same plan
    dma.all_reduce(a.float())
    assert made == [(65536, torch.bfloat16), (65536, torch.float32)]


def test_close_is_idempotent_and_router_close_closes_ring():
    dma = make_dma()
    router = AllReduceRouter(fallback=lambda t: t, dma=dma)
    assert router.close() is None
    assert router.close() is None
    assert dma.runtime.closed == 1 and router.dma is None and dma.closed


def test_a_failing_close_is_abandoned_not_raised(caplog):
    dma = make_dma()

    def broken():
        raise RuntimeError("peer gone")

    dma.runtime.close = broken
    router = AllReduceRouter(fallback=lambda t: t, dma=dma)
    assert "peer gone" in router.close()
    assert dma.closed and router.dma is None
    assert any("leaked" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("max_bytes", [1000, 22 * MiB, 22 * MiB + 3])
def test_workspace_covers_what_a_ring_must_hold(world, max_bytes):
    """Each rank keeps 2(N-1) shards of ceil(max/N) bytes in flight; the report never
    claims less, grows with the ring, and follows the runtime's own shard size."""
    runtime = RecordingRuntime(world_size=world, max_bytes=max_bytes)
    del runtime.shard_capacity                                 # no report: the estimate
    dma = DmaBackend(runtime, world_size=world, planner=planner)
    need = 2 * (world - 1) * -(-max_bytes // world)
    assert need <= dma.workspace_bytes <= need + 64 * 1024 + 2 * (world - 1) * 256
    bigger = DmaBackend(RecordingRuntime(world_size=world, max_bytes=2 * max_bytes), world_size=world, planner=planner)
    assert bigger.workspace_bytes >= dma.workspace_bytes
    reported = RecordingRuntime(world_size=world, max_bytes=max_bytes)
    reported.shard_capacity = 1 << 20
    held = DmaBackend(reported, world_size=world, planner=planner).workspace_bytes
    assert 2 * (world - 1) * (1 << 20) <= held < 2 * (world - 1) * (1 << 20) + 64 * 1024


# -------------------------------------------------------------- eligibility
def test_runtime_report_is_fail_closed():
    assert runtime_report(None) is None
    assert runtime_report(object()) is None                       # no attribute: no report
    assert runtime_report(type("R", (), {"supports_all_peer_auxiliary": "yes"})()) is None
    assert runtime_report(type("R", (), {"supports_all_peer_auxiliary": 1})()) is None
    assert runtime_report(type("R", (), {"supports_all_peer_auxiliary": True})()) is True
    assert runtime_report(type("R", (), {"supports_all_peer_auxiliary": False})()) is False


def test_capability_rule():
    good, bad = ProbeResult(True, "ok"), ProbeResult(False, "no P2P")
    assert decide_capability(True, None).capable
    assert decide_capability(True, bad).capable
    assert not decide_capability(False, good).capable           # explicit False vetoes
    assert decide_capability(None, good).capable
    assert not decide_capability(None, bad).capable
    assert not decide_capability(None, None).capable            # nothing said: no DMA
    assert "no P2P" in decide_capability(None, bad).reason


def test_reports_combine_fail_closed():
    assert combine_reports([True, True, True]) is True
    assert combine_reports([True, None, True]) is None          # one rank without a report
    assert combine_reports([True, False, True]) is False        # any explicit False forbids
    assert combine_reports([None, False]) is False
    assert combine_reports([None, None]) is None
    assert combine_reports([]) is None


def test_oneshot_report_reads_the_workspace():
    assert OneShotBackend.from_vllm(FakeOneShot()).all_peer_report() is None
    assert OneShotBackend.from_vllm(FakeOneShot(report=True)).all_peer_report() is True
    assert OneShotBackend.from_vllm(FakeOneShot(report=False)).all_peer_report() is False


def test_world_sizes_and_tensor_rule():
    assert [n for n in range(1, 13) if world_size_supported(n)] == [2, 4, 6, 8, 10]
    assert tensor_fits_ring(torch.ones(48, dtype=torch.bfloat16), 6)
    assert not tensor_fits_ring(torch.ones(40, dtype=torch.bfloat16), 6)
    assert not tensor_fits_ring(torch.ones(48, dtype=torch.float64), 6)


# ---------------------------------------------------------------- crossover
def table(rows):
    return [Sample(int(n * MiB), a / 1e3, b / 1e3) for n, a, b in rows]


# measurements.md, 2x H200 NVLink: (MiB, NCCL ms, DMA ms)
NVLINK = table([(1, 0.066, 0.594), (6, 0.059, 0.883), (22, 0.117, 0.538), (64, 0.270, 0.541), (128, 0.495, 0.623)])
# b12x published, PCIe TP8 (6 MB / 24 MiB / 96 MiB)
PCIE = table([(1, 0.10, 0.34), (6, 0.294, 0.404), (24, 0.941, 0.884), (96, 3.653, 3.283)])


def test_nvlink_table_gives_no_crossover():
    min_bytes, reason = select_crossover(NVLINK)
    assert min_bytes is None and "never wins" in reason


def test_pcie_table_gives_first_winning_size():
    min_bytes, reason = select_crossover(PCIE)
    assert min_bytes == 24 * MiB and "24 MiB" in reason


def test_a_win_must_hold_at_every_larger_size():
    t = table([(4, 1.0, 0.5), (8, 1.0, 1.2), (16, 2.0, 1.0), (32, 4.0, 2.0)])
    assert select_crossover(t)[0] == 16 * MiB
    t = table([(4, 1.0, 0.5), (8, 1.0, 0.5), (16, 2.0, 2.5)])   # loses at the top: never
    assert select_crossover(t)[0] is None


def test_margin_is_required():
    t = table([(8, 1.0, 0.98), (16, 2.0, 1.97)])               # 2 % and 1.5 % wins
    assert select_crossover(t, margin=0.03)[0] is None
    assert select_crossover(t, margin=0.01)[0] == 8 * MiB
    assert select_crossover([])[0] is None


def test_order_of_samples_does_not_matter():
    assert select_crossover(list(reversed(PCIE)))[0] == 24 * MiB


def test_ladder_respects_capacity_and_alignment():
    sizes = ladder_sizes(100 * MiB, 2, 2)
    assert sizes == (1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB, 100 * MiB)
    odd = ladder_sizes(3 * MiB + 5, 6, 2)
    assert all(s % (6 * 8 * 2) == 0 and s <= 3 * MiB + 5 for s in odd) and len(odd) == 3
    assert ladder_sizes(1000, 2, 2) == (992,)


def test_cache_round_trip(tmp_path):
    cache = CrossoverCache(tmp_path)
    fields = {"world_size": 2, "topology": (1, ("H200", "H200")), "torch": "x"}
    key = cache_key(fields)
    assert cache.load(key) is None
    decision = CrossoverDecision(24 * MiB, "because", tuple(PCIE), "measured", key)
    path = cache.store(key, decision, fields)
    assert path is not None and json.loads(path.read_text())["fields"]["world_size"] == 2
    loaded = cache.load(key)
    assert loaded.min_bytes == 24 * MiB and loaded.samples == tuple(PCIE) and loaded.source == "cache"
    assert cache_key({**fields, "torch": "y"}) != key
    path.write_text("{not json")
    assert cache.load(key) is None


def test_cache_key_covers_world_size_topology_and_driver():
    from k3_accel.comm.crossover import environment_fields

    topology = (1, (("H200", "GPU-a"), ("H200", "GPU-b")))
    base = cache_key(environment_fields(2, topology, ("570.1", "570.1")))
    assert base == cache_key(environment_fields(2, topology, ("570.1", "570.1")))
    assert base != cache_key(environment_fields(4, topology, ("570.1", "570.1")))
    assert base != cache_key(environment_fields(2, (1, (("H200", "GPU-a"), ("H200", "GPU-c"))), ("570.1", "570.1")))
    assert base != cache_key(environment_fields(2, topology, ("575.2", "575.2")))


def test_a_cache_write_that_fails_leaves_no_temporary_file(tmp_path):
    """A crossover that cannot be cached is logged and dropped; every start that fails to write
    must not leave its half-written temporary file behind in the cache directory."""
    cache = CrossoverCache(tmp_path)
    key = cache_key({"world_size": 2})
    cache.path(key).mkdir()                                  # the entry's name is taken by a directory
    (cache.path(key) / "x").write_text("occupied")           # ... that is not empty: the rename fails
    decision = CrossoverDecision(24 * MiB, "because", tuple(PCIE), "measured", key)
    assert cache.store(key, decision, {"world_size": 2}) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [cache.path(key).name]
