"""How long the V2 step thread waits for a launch slot (``LaunchSlots.acquire``).

The rule a user relies on: a step's context is never lost because vLLM's host ran ahead of the
GPU (on the H200 a 16k-token prefill step held a slot for 300 ms that way, and every request of a
B = 32 batch lost its drafts for good); only a draft thread that is slow once the GPU is there
may cost the rows, and then only once it is more steps behind than the spill budget holds (a
server that answers late for a second must not disable every request in flight); a hung one costs
one bound and the budget, not one wait per step. Real threads and a stand-in for the CUDA launch
event (``query()``), the only piece this machine lacks.
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


def held(s: LaunchSlots, rows: int | None = 4) -> int:
    i = s.acquire(0.0, rows=rows)
    s.hold(i, Event(done=True), 0)                        # the GPU is there; the draft thread is not done
    return i


def test_a_thread_behind_gets_spill_slots_sized_to_the_step_not_a_wait_or_a_loss():
    s = LaunchSlots(2, 64, 6, torch.bfloat16, 4, pin=False)
    a, b = held(s), held(s)
    assert {a, b} == {0, 1} and s.spilled == 0            # the fixed slots first
    spill = [s.acquire(0.0, rows=n) for n in (3, 0, 5)]   # a zero deadline: any wait would raise
    assert len(set(spill) | {a, b}) == 5 and s.spills == 3
    for j, n in zip(spill, (3, 0, 5)):
        assert s.token_ids[j].shape == (n,) and s.hidden[j].shape == (n, 6) and s.meta[j].shape[1] == 4
    assert s.spilled == sum(s.slot_bytes(n) for n in (3, 0, 5))
    for j in spill:
        s.release(j)
    assert s.spilled == 0 and all(j not in s.token_ids for j in spill)
    assert s.token_ids[a].shape == (64,)                  # the fixed slots are untouched
    s.release(a)
    assert s.acquire(0.0, rows=2) == a                    # and used again in turn once free


def test_the_spill_budget_bounds_pinned_memory_then_the_deadline_rule_holds():
    s = LaunchSlots(1, 64, 6, torch.bfloat16, 4, pin=False, spill_bytes=0)
    s.release(held(s))
    s2 = LaunchSlots(1, 64, 6, torch.bfloat16, 4, pin=False)
    assert s2.spill_cap == s2.slot_bytes(64)              # default: one full slot per fixed slot
    i = held(s)
    with pytest.raises(TimeoutError, match="still in use"):
        s.acquire(0.01, rows=1)                           # no budget: the old bound, then no waits
    assert s.stuck and s.spills == 0
    s.release(i)
    cap = s2.spill_cap
    held(s2)
    first = s2.acquire(0.0, rows=40)                       # 40 of 64 rows' worth fits ...
    with pytest.raises(TimeoutError):
        s2.acquire(0.0, rows=40)                          # ... a second one does not
    assert s2.spilled <= cap
    s2.release(first)
    assert s2.acquire(0.0, rows=40) > 1                   # budget back once the thread moves
