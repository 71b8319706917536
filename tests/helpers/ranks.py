"""Run a function on N spawned processes joined in a real gloo process group.

The function must be importable (module level); it gets ``(rank, world_size, *args)``
and its return value (picklable) comes back in rank order. Any rank's exception fails the test
with that rank's traceback; a hang fails after ``timeout``. A rank that returns
:class:`ExitNow` reports its value and then dies without any teardown, like a
crashed worker.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import traceback

import pytest
import torch.multiprocessing as mp

from .ports import free_port


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
    port = free_port()
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
