"""Run a function on N spawned processes joined in a real gloo process group.

Other ``test_comm_*`` modules import :func:`run_ranks` (and the CPU stand-ins
:func:`fake_gpus` / :func:`loopback_hooks`) from here. The function must be
importable (module level); it gets ``(rank, world_size, *args)`` and its return
value (picklable) comes back in rank order. Any rank's exception fails the test
with that rank's traceback; a hang fails after ``timeout``. A rank that returns
:class:`ExitNow` reports its value and then dies without any teardown, like a
crashed worker.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import traceback

import pytest
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ExitNow:
    """Return ``ExitNow(value)`` from a rank: it reports ``value``, then exits at once."""

    def __init__(self, value=None):
        self.value = value


def _entry(fn, rank, world_size, port, results, args, env):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        value = fn(rank, world_size, *args)
        pickle.dumps(value.value if isinstance(value, ExitNow) else value)  # fail here, not in the feeder
        if isinstance(value, ExitNow):
            results.put((rank, True, value.value))
            results.close()
            results.join_thread()
            os._exit(0)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 180.0, env: dict | None = None) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, port, results, args, env or {}))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    got: dict = {}
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout)
            got[rank] = (ok, value)
    except queue_mod.Empty:
        pytest.fail(f"ranks {sorted(set(range(world_size)) - set(got))} did not finish in {timeout}s (hang?)")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    failures = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
    if failures:
        pytest.fail("\n".join(failures))
    return [got[r][1] for r in range(world_size)]


def fake_gpus(rank: int, world: int, *, node: str = "n0", driver: str = "drv-1", gpu_ids=None,
              can_access=None, fail_identify: bool = False):
    """A :class:`~k3_accel.comm.eligibility.GpuView` for CPU ranks: rank r owns GPU r of ``world``."""
    from k3_accel.comm.eligibility import GpuView

    ids = list(gpu_ids or [f"GPU-{i}" for i in range(world)])

    def own_index(device):
        if fail_identify:
            raise RuntimeError(f"injected: rank {rank} cannot identify its GPU")
        return rank

    return GpuView(
        node_id=lambda: node, device_id=lambda i: ids[i], device_name=lambda i: "Fake GPU",
        visible_devices=lambda: range(world), can_access=can_access or (lambda a, b: True),
        driver=lambda: driver, own_index=own_index,
    )


def loopback_hooks(rank: int, world: int, *, runtime_cls=None, cache=None, timeout_s: float = 3.0, **kw):
    """Router hooks for CPU ranks: the loopback ring, a passing fake probe, a short exchange timeout."""
    from k3_accel.comm.build import RouterHooks
    from k3_accel.testing.loopback import LoopbackDmaRuntime, loopback_planner

    kw.setdefault("gpus", fake_gpus(rank, world))
    return RouterHooks(
        runtime_cls=runtime_cls or LoopbackDmaRuntime, planner=loopback_planner, cache=cache,
        exchange_timeout_s=timeout_s, **kw,
    )


def _sum_ranks(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    return t.tolist()


def test_harness_runs_a_real_gloo_group():
    out = run_ranks(_sum_ranks, 3)
    assert out == [[6.0] * 4] * 3
