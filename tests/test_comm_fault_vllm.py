"""Faults through the engine-side hook: the real vLLM ``CudaCommunicator`` subclass over gloo.

The hook never raises on a fault: every rank ends with the same state, stock
behaviour after a set-up failure comes with exactly one log line (TP rank 0)
saying why, sleep mode releases and restores the ring (or keeps it, on every
rank, when a CUDA graph holds it), and ``destroy()`` returns in bounded time
even when the peer process is gone. One spawned group runs all the set-up and
sleep cases in a row (importing vLLM in a child costs seconds).
"""
from __future__ import annotations

import logging
import os
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from helpers.comm import loopback_hooks  # noqa: E402
from helpers.ranks import ExitNow, run_ranks  # noqa: E402

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_DISABLE_PYNCCL": "1"}
MiB = 1 << 20
BOUND_S = 60.0          # hang guard for one construction, sleep step or teardown (not a speed claim)


class _Lines(logging.Handler):
    """Records the adapter's log lines (INFO and up, vLLM's default level in a worker)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []
        logging.getLogger("vllm").setLevel(logging.INFO)   # what vLLM's logging config sets in workers

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _make(rank, world, lines, *, sizing=True, **hook_kw):
    """A TP communicator on a fresh gloo group; returns (comm or None, exception text, seconds)."""
    from k3_accel.comm.threshold import DmaThreshold
    from k3_accel.vllm.tp.communicator import K3CudaCommunicator, Overrides, Sizing

    K3CudaCommunicator.overrides = Overrides(
        hooks=loopback_hooks(rank, world, **hook_kw),
        sizing=Sizing(4 * MiB, ((64 * 2048, torch.float32),), torch.float32) if sizing else None,
        threshold=DmaThreshold.at(256 * 1024),
    )
    group = dist.new_group(backend="gloo")
    lines.clear()
    t0 = time.monotonic()
    try:
        comm = K3CudaCommunicator(cpu_group=group, device=torch.device("cpu"), device_group=group,
                                  unique_name="tp:0")
        return comm, None, time.monotonic() - t0
    except BaseException as exc:  # noqa: BLE001 - the test asserts there is none
        return None, f"{type(exc).__name__}: {exc}", time.monotonic() - t0


def _sum(comm, rank, world):
    big = torch.full((256, 1024), float(rank + 1))             # 1 MiB fp32: the ring's size class
    return comm.all_reduce(big)[0, 0].item() == world * (world + 1) / 2


def _setup_faults(rank, world):
    from k3_accel.testing.loopback import LoopbackDmaRuntime
    from k3_accel.vllm.tp import communicator as cm

    lines = _Lines()
    logging.getLogger("vllm.k3_accel.communicator").addHandler(lines)
    out = {}

    def record(name, comm, raised, seconds):
        out[name] = dict(raised=raised, seconds=seconds, lines=list(lines.lines))
        if comm is not None:
            d = comm.k3_decision
            out[name].update(backend=d.backend, reason=d.reason, failed=d.failed,
                             routed=comm.k3_router is not None, sum_ok=_sum(comm, rank, world))
            comm.destroy()

    # 1. sizing raises on one rank
    real_sizing = cm.sizing_from_vllm_config

    def sizing(vllm_config):
        if rank == 1:
            raise RuntimeError("injected: sizing failed")
        return real_sizing(vllm_config)

    cm.sizing_from_vllm_config = sizing
    record("sizing", *_make(rank, world, lines.lines, sizing=False))
    cm.sizing_from_vllm_config = real_sizing

    # 2. the ring's allocation fails on one rank before its handle exchange
    faulty = LoopbackDmaRuntime.with_faults(init_before_exchange={1})
    record("allocation", *_make(rank, world, lines.lines, runtime_cls=faulty))

    # 3. the router's start-up itself raises (on every rank: a bug, or a broken group)
    real_build = cm.build_router

    def broken(**kw):
        raise RuntimeError("injected: build_router raised")

    cm.build_router = broken
    record("build-raises", *_make(rank, world, lines.lines))
    cm.build_router = real_build

    # 4. no fault: the control
    record("none", *_make(rank, world, lines.lines))
    return out


def test_comm_fault_engine_hook_never_raises_and_logs_one_line(engine):
    out = [r["setup"] for r in engine]
    needles = {
        "sizing": "k3-accel set-up failed (rank 1: RuntimeError: injected: sizing failed)",
        "allocation": "rank 1: RuntimeError: loopback: injected init_before_exchange on rank 1",
        "build-raises": "k3-accel set-up failed (RuntimeError: injected: build_router raised)",
    }
    for name, needle in needles.items():
        cases = [r[name] for r in out]
        assert all(c["raised"] is None and c["seconds"] < BOUND_S for c in cases), (name, cases)
        assert len({(c["backend"], c["reason"], c["routed"]) for c in cases}) == 1, (name, cases)
        assert cases[0]["backend"] == "VLLM_STOCK" and not cases[0]["routed"] and cases[0]["failed"]
        assert needle in cases[0]["reason"], (name, cases[0]["reason"])
        assert all(c["sum_ok"] for c in cases), name
        rank0, rank1 = cases[0]["lines"], cases[1]["lines"]
        assert len(rank0) == 1 and rank0[0][0] == "WARNING" and needle in rank0[0][1], (name, rank0)
        assert rank1 == [], (name, rank1)
    for r in out:
        c = r["none"]
        assert c["raised"] is None and c["backend"] == "B12X_DMA" and c["routed"] and c["sum_ok"]
        assert not c["failed"]
    assert [level for level, _ in out[0]["none"]["lines"]] == ["INFO"] and out[1]["none"]["lines"] == []


# ------------------------------------------------------------ sleep mode
def _sleep(rank, world):
    from k3_accel.testing.loopback import LoopbackDmaRuntime

    lines = _Lines()
    logging.getLogger("vllm.k3_accel.communicator").addHandler(lines)
    out = {}

    def timed(step):
        t0 = time.monotonic()
        step()
        return time.monotonic() - t0

    # release on suspend, rebuild on resume
    comm, raised, _ = _make(rank, world, lines.lines)
    ring = comm.k3_router.dma.runtime
    min_bytes = [comm.k3_router.dma_min_bytes]
    workspace = comm.k3_decision.workspace_bytes
    base = LoopbackDmaRuntime.held_bytes - workspace   # earlier cases in this process may have leaked
    held = [LoopbackDmaRuntime.held_bytes - base]
    seconds = [timed(comm.suspend)]
    held.append(LoopbackDmaRuntime.held_bytes - base)
    suspended_router = comm.k3_router is not None and comm.k3_router.dma is None
    seconds.append(timed(comm.resume))
    held.append(LoopbackDmaRuntime.held_bytes - base)
    new_ring = comm.k3_router.dma.runtime
    min_bytes.append(comm.k3_router.dma_min_bytes)             # the threshold survives the rebuild:
    below, above = torch.empty(min_bytes[0] // 4 - 1), torch.empty(min_bytes[0] // 4)   # fp32, either side
    choices = [comm.k3_router.choose(below), comm.k3_router.choose(above)]
    calls = new_ring.calls
    ok = _sum(comm, rank, world)
    out["cycle"] = dict(raised=raised, workspace=workspace, held=held, seconds=seconds, old_closed=ring.closed,
                        new_ring=new_ring is not ring, suspended_router=suspended_router, sum_ok=ok,
                        ring_calls=new_ring.calls - calls, min_bytes=min_bytes, choices=choices)
    comm.destroy()
    out["cycle"]["held_after_destroy"] = LoopbackDmaRuntime.held_bytes - base

    # a CUDA graph on one rank captured the ring: every rank keeps it
    comm, raised, _ = _make(rank, world, lines.lines)
    if rank == 1:
        comm.k3_router.dma.captured = True
    before = LoopbackDmaRuntime.held_bytes
    lines.lines.clear()
    comm.suspend()
    kept = (LoopbackDmaRuntime.held_bytes == before > 0, comm.k3_router.dma is not None)
    comm.resume()
    out["captured"] = dict(kept=kept, sum_ok=_sum(comm, rank, world), lines=list(lines.lines))
    comm.destroy()

    # the rebuild fails on one rank: every rank goes stock
    comm, raised, _ = _make(rank, world, lines.lines)
    base = LoopbackDmaRuntime.held_bytes - comm.k3_decision.workspace_bytes
    comm.k3_router.ring.runtime_cls = LoopbackDmaRuntime.with_faults(init_before_exchange={1})
    comm.suspend()
    seconds = timed(comm.resume)
    out["resume-fails"] = dict(router=comm.k3_router is None, seconds=seconds, sum_ok=_sum(comm, rank, world),
                               held=LoopbackDmaRuntime.held_bytes - base)
    comm.destroy()
    return out


def test_comm_fault_sleep_mode_releases_and_restores_the_ring(engine):
    out = [r["sleep"] for r in engine]
    for r in out:
        c = r["cycle"]
        assert c["raised"] is None and c["workspace"] > 2 * MiB
        assert c["held"] == [c["workspace"], 0, c["workspace"]]          # released, then restored
        assert c["old_closed"] and c["new_ring"] and c["suspended_router"]
        assert c["sum_ok"] and c["ring_calls"] == 1                     # the new ring carries it
        assert c["min_bytes"] == [256 * 1024] * 2 and c["choices"] == ["next", "dma"]   # at the same threshold
        assert c["held_after_destroy"] == 0
        assert all(s < BOUND_S for s in c["seconds"])
        k = r["captured"]
        assert k["kept"] == (True, True) and k["sum_ok"]
        f = r["resume-fails"]
        assert f["router"] and f["sum_ok"] and f["held"] == 0 and f["seconds"] < BOUND_S
    lines = out[0]["captured"]["lines"]
    assert any("kept: CUDA graphs were captured through it" in text for _, text in lines), lines


def _engine(rank, world):
    return {"setup": _setup_faults(rank, world), "sleep": _sleep(rank, world)}


@pytest.fixture(scope="module")
def engine():
    """The set-up and sleep cases, in one spawned group (importing vLLM costs seconds per child)."""
    return run_ranks(_engine, 2, env=ENV, timeout=600)


# -------------------------------------------------------------- teardown
def _dead_peer(rank, world):
    lines = _Lines()
    logging.getLogger("vllm.k3_accel.communicator").addHandler(lines)
    comm, raised, _ = _make(rank, world, lines.lines)
    routed = comm.k3_router is not None
    if rank == 1:
        return ExitNow(dict(routed=routed))        # dies: no destroy, no goodbye
    time.sleep(2.0)                                # let the peer's process go away
    t0 = time.monotonic()
    try:
        comm.destroy()
        error = None
    except BaseException as exc:  # noqa: BLE001 - the test asserts there is none
        error = f"{type(exc).__name__}: {exc}"
    return dict(routed=routed, error=error, seconds=time.monotonic() - t0, router=comm.k3_router)


def test_comm_fault_destroy_with_a_dead_peer_is_bounded():
    out = run_ranks(_dead_peer, 2, env=ENV, timeout=600)
    assert out[1]["routed"] and out[0]["routed"]
    assert out[0]["error"] is None and out[0]["router"] is None
    assert out[0]["seconds"] < BOUND_S
