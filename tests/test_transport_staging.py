"""The staging ring (slot lifetime, back-pressure) and the slot layout, without sockets."""
from __future__ import annotations

import threading
import time

import numpy as np
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
    assert ring.nbytes == 2 * 8 * (8 + 4 * 2)


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


def plan(counts, ingest, propose):
    counts = np.asarray(counts, dtype=np.int64)
    anchors = np.full(len(counts), 10) + counts          # every request's rows start at 10
    return layout.plan_rows(counts, anchors, np.asarray(ingest, dtype=np.int64), np.asarray(propose, dtype=np.int64))


def test_plan_puts_ingest_rows_before_propose_rows():
    p = plan([2, 3, 0, 4, 1], ingest=[1, 3], propose=[0, 4])
    assert p.order.tolist() == [1, 3, 0, 4] and p.dst.tolist() == [0, 3, 7, 9]
    assert p.ingest_rows == 7 and p.total_rows == 10 and p.starts.tolist() == [10] * 5
    # input rows of slot rows 0..9: request 1 (2..4), 3 (5..8), 0 (0..1), 4 (9)
    assert p.row_index().tolist() == [2, 3, 4, 5, 6, 7, 8, 0, 1, 9]
    assert plan([2, 3, 4], ingest=[0, 1], propose=[2]).row_index() is None   # the input as it is


def test_stage_puts_rows_with_their_requests():
    counts = [2, 3, 4]
    tokens = torch.arange(100, 109)
    hidden = torch.arange(18, dtype=torch.float32).reshape(9, 2)
    ring = StagingRing(1, 16, 2, torch.float32)
    slot = ring.slots[0]
    p = plan(counts, ingest=[1], propose=[0, 2])
    assert layout.stage(slot, p.row_index(), p.total_rows, tokens, hidden, private=True) is None  # CPU: done
    for i, d in zip(p.order.tolist(), p.dst.tolist()):
        src, n = [0, 2, 5][i], counts[i]
        assert torch.equal(slot.token_ids[d:d + n], tokens[src:src + n])
        assert torch.equal(slot.hidden[d:d + n], hidden[src:src + n])


def test_split_cuts_rows_into_messages_and_keeps_every_request():
    starts, counts = np.array([0, 5, 7]), np.array([5, 0, 6])
    parts = layout.split(starts, counts, base=3, max_rows=4)
    assert [(pt.lo, pt.hi) for pt in parts] == [(3, 7), (7, 11), (11, 14)]
    assert [pt.index.tolist() for pt in parts] == [[0], [0, 1, 2], [2]]
    assert [pt.starts.tolist() for pt in parts] == [[0], [4, 5, 7], [10]]
    assert [pt.counts.tolist() for pt in parts] == [[4], [1, 0, 3], [3]]
    assert sum(int(pt.counts.sum()) for pt in parts) == 11
    whole = layout.split(starts, counts, base=0, max_rows=11)
    assert len(whole) == 1 and whole[0].counts.tolist() == [5, 0, 6]


def test_tail_gives_every_request_its_rows_from_the_last_message():
    starts, counts = np.array([0, 5, 7]), np.array([5, 0, 6])
    last = layout.tail(starts, counts, base=3, lo=11)
    assert last.index.tolist() == [0, 1, 2] and (last.lo, last.hi) == (11, 14)
    assert last.counts.tolist() == [0, 0, 3]
    assert (last.starts + last.counts).tolist() == (starts + counts).tolist()   # anchors follow the rows


def test_row_index_is_none_only_for_the_input_as_it_is():
    assert plan([1, 1, 1, 1], ingest=[0, 1], propose=[2, 3]).row_index() is None
    interleaved = plan([1, 1, 1, 1], ingest=[0, 2], propose=[1, 3])
    assert interleaved.row_index().tolist() == [0, 2, 1, 3]
    assert plan([2, 1], ingest=[1], propose=[0]).row_index().tolist() == [2, 0, 1]
