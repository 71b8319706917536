"""The staging ring (slot lifetime, back-pressure) and the slot layout, without sockets."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from k3_accel.transport import layout
from k3_accel.transport.failures import RingTimeout
from k3_accel.transport.staging import StagingRing


def never(slot, left):  # progress callback that cannot free anything
    time.sleep(min(left, 0.01))


def test_ring_falls_back_to_plain_memory_without_cuda():
    ring = StagingRing(2, 8, 4)
    assert ring.pinned == torch.cuda.is_available()
    assert ring.slots[0].hidden.shape == (8, 4) and ring.slots[0].hidden.is_pinned() == ring.pinned
    assert ring.nbytes == 2 * 8 * (16 + 4 * 2)


def test_bad_ring_shape_is_a_typed_error():
    with pytest.raises(ValueError):
        StagingRing(0, 8)


def test_slots_are_used_round_robin():
    ring = StagingRing(3, 4)
    got = [ring.acquire(time.monotonic() + 1, never)[0].index for _ in range(7)]
    assert got == [0, 1, 2, 0, 1, 2, 0]


def test_held_slot_is_not_handed_out_until_released():
    ring = StagingRing(2, 4)
    first, _ = ring.acquire(time.monotonic() + 1, never)
    ring.hold(first)
    ring.acquire(time.monotonic() + 1, never)           # slot 1, free
    released = threading.Timer(0.1, ring.release, args=(first,))
    released.start()
    waits = []

    def progress(slot, left):
        waits.append(slot.index)
        ring.wait_change(min(left, 0.05))
    again, waited = ring.acquire(time.monotonic() + 10, progress)
    assert again is first and waited and waits and set(waits) == {0}
    assert first.holds == 0


def test_back_pressure_is_bounded_by_the_deadline():
    ring = StagingRing(1, 4)
    slot, _ = ring.acquire(time.monotonic() + 1, never)
    ring.hold(slot)
    with pytest.raises(RingTimeout):
        ring.acquire(time.monotonic() + 0.05, never)
    assert slot.holds == 1                               # nothing was forced free


def test_retired_slot_gets_fresh_memory_and_old_bytes_stay_untouched():
    ring = StagingRing(1, 4, 2, torch.float32)
    slot, _ = ring.acquire(time.monotonic() + 1, never)
    slot.hidden.fill_(7.0)
    old = slot.hidden                     # what an abandoned zero-copy frame may still be reading
    ring.hold(slot)
    ring.release(slot)
    ring.retire(slot)
    again, _ = ring.acquire(time.monotonic() + 1, never)
    assert again is slot and slot.generation == 1 and not slot.retired
    assert slot.hidden.data_ptr() != old.data_ptr()
    slot.hidden.fill_(1.0)
    assert bool((old == 7.0).all())


def test_release_without_hold_is_an_error():
    ring = StagingRing(1, 4)
    with pytest.raises(RuntimeError):
        ring.release(ring.slots[0])


def test_plan_puts_ingest_rows_before_propose_rows_and_merges_runs():
    counts = [2, 3, 0, 4, 1]
    plan = layout.plan_rows(counts, ingest=[1, 3], propose=[0, 4])
    assert plan.dst == {1: 0, 3: 3, 0: 7, 4: 9}
    assert plan.ingest_rows == 7 and plan.propose_rows == 3
    assert layout.copy_runs(plan) == [(2, 0, 7), (0, 7, 2), (9, 9, 1)]   # 1 and 3 adjoin (2 is empty)
    contiguous = layout.plan_rows([2, 3, 4], ingest=[0, 1], propose=[2])
    assert layout.copy_runs(contiguous) == [(0, 0, 9)]


def test_stage_and_compact_keep_rows_with_their_requests():
    counts = [2, 3, 4]
    positions = torch.arange(9)
    tokens = torch.arange(100, 109)
    hidden = torch.arange(18, dtype=torch.float32).reshape(9, 2)
    ring = StagingRing(1, 16, 2, torch.float32)
    slot = ring.slots[0]
    plan = layout.plan_rows(counts, ingest=[1], propose=[0, 2], hidden=True)
    layout.stage(slot, plan, positions, tokens, hidden)
    layout.wait_for_copies(positions, tokens, hidden)
    for i, src in enumerate([0, 2, 5]):
        d, n = plan.dst[i], counts[i]
        assert torch.equal(slot.token_ids[d:d + n], tokens[src:src + n])
        assert torch.equal(slot.hidden[d:d + n], hidden[src:src + n])
    kept = layout.compact(slot, plan, drop={1})
    assert kept.ingest == [] and kept.propose == [0, 2] and kept.dst == {0: 0, 2: 2}
    assert slot.positions[:6].tolist() == [0, 1, 5, 6, 7, 8]
    assert torch.equal(slot.hidden[:6], hidden[[0, 1, 5, 6, 7, 8]])
