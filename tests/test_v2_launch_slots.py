"""How long the V2 step thread waits for a launch slot (``LaunchSlots.acquire``).

The rule a user relies on: a step's context is never lost because vLLM's host ran ahead of the
GPU (on the H200 a 16k-token prefill step held a slot for 300 ms that way, and every request of a
B = 32 batch lost its drafts for good); only a draft thread that is slow once the GPU is there
costs the rows, and a hung one costs one bound, not one per step. Real threads and a stand-in for
the CUDA launch event (``query()``), the only piece this machine lacks.
"""
from __future__ import annotations

import threading

import pytest
import torch

from k3_accel.vllm.spec_decode.v2_launch import LaunchSlots


class Event:
    """A launch event: complete once the GPU reached the step."""

    def __init__(self, done: bool = False):
        self.done = threading.Event()
        if done:
            self.done.set()

    def query(self) -> bool:
        return self.done.is_set()


def slots(depth: int = 2) -> LaunchSlots:
    return LaunchSlots(depth, 8, 0, torch.bfloat16, 4, pin=False)


def in_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_a_gpu_behind_the_host_never_costs_the_rows():
    s = slots(1)
    i = s.acquire(0.01)
    gpu = Event()
    s.hold(i, gpu, 1 << 20)
    t, box = in_thread(lambda: s.acquire(0.01))          # waits far past its 10 ms: the GPU is not there
    t.join(0.3)
    assert t.is_alive() and not box                       # still waiting, no timeout
    s.release(i)                                          # the draft thread took the step (before the GPU
    gpu.done.set()                                        # "reached" it here: only the order matters)
    t.join(30)
    assert box == {"value": i} and not s.stuck


def test_a_slow_thread_gets_the_deadline_plus_its_bytes():
    s = slots(1)
    i = s.acquire(0.0)
    s.hold(i, Event(done=True), int(5 * LaunchSlots.SHIP_FLOOR_BYTES_PER_S))   # 5 s to move at the floor
    t, box = in_thread(lambda: s.acquire(0.0))            # a zero deadline: only the bytes' time is left
    threading.Timer(0.05, s.release, (i,)).start()
    t.join(30)
    assert box == {"value": i}


def test_a_hung_thread_costs_one_bound_then_none_until_a_slot_frees():
    s = slots(2)
    a, b = s.acquire(0.0), s.acquire(0.0)
    s.hold(a, Event(done=True), 0)
    s.hold(b, Event(done=True), 0)
    with pytest.raises(TimeoutError, match="still in use"):
        s.acquire(0.02)                                   # the deadline runs out once
    assert s.stuck
    t, box = in_thread(lambda: s.acquire(1e9))            # then no wait at all, whatever the bound
    t.join(30)
    assert not t.is_alive() and isinstance(box.get("error"), TimeoutError)
    s.release(a)                                          # the thread moved: waits are back
    assert not s.stuck and s.acquire(0.0) == a


def test_a_slot_never_reached_is_bounded_by_the_cap():
    s = slots(1)
    i = s.acquire(0.0)
    s.hold(i, Event(), 0)                                 # a GPU that never gets there
    with pytest.raises(TimeoutError):
        s.acquire(0.0, reach_cap=0.05)
    assert s.stuck
