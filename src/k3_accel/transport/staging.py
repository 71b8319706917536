"""The pinned staging ring: N host slots that context rows are copied into.

A step copies its rows device->slot, and the frames it sends are zero-copy
views of the slot. A slot is *busy* while anything still references it:

* a **hold** per message whose reply has not arrived (and per capture job
  that has not been written yet), and
* a ZMQ **tracker** per zero-copy frame that libzmq has not released yet
  (only matters after a socket was torn down with messages still queued).

Slots are used round robin, so the slot a step needs is always the oldest
one; when it is busy the step waits for it (back-pressure), bounded by a
deadline, and never rewrites memory that may still be on the wire.

Without CUDA (CPU-only torch) the slots are ordinary memory; ``pinned``
says which.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from k3_accel.transport.failures import RingTimeout


def pinning_available() -> bool:
    """Whether page-locked host memory can be allocated here."""
    return torch.cuda.is_available()


@dataclass(eq=False)
class Slot:
    """One staging slot: row-aligned buffers of ``capacity`` rows."""
    index: int
    positions: torch.Tensor                 # [capacity] int64
    token_ids: torch.Tensor                 # [capacity] int64
    hidden: torch.Tensor | None             # [capacity, width] or None
    holds: int = 0
    uses: int = 0                           # how many steps have acquired it
    trackers: list[Any] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return self.positions.numel()

    def trackers_done(self) -> bool:
        self.trackers = [t for t in self.trackers if not t.done]
        return not self.trackers


class StagingRing:
    """``depth`` slots of ``capacity`` rows (+ ``width`` hidden columns of ``dtype``)."""

    def __init__(self, depth: int, capacity: int, width: int = 0,
                 dtype: torch.dtype = torch.bfloat16, pin: bool | None = None):
        if depth < 1 or capacity < 1 or width < 0:
            raise ValueError(f"staging ring needs depth >= 1, capacity >= 1, width >= 0 "
                             f"(got {depth}, {capacity}, {width})")
        self.pinned = pinning_available() if pin is None else pin
        self.capacity, self.width, self.dtype = capacity, width, dtype
        self._cond = threading.Condition()
        self._next = 0
        self.slots = [self._new_slot(i) for i in range(depth)]

    def _new_slot(self, index: int) -> Slot:
        def buf(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pinned)
        hidden = buf(self.capacity, self.width, dtype=self.dtype) if self.width else None
        return Slot(index, buf(self.capacity, dtype=torch.int64), buf(self.capacity, dtype=torch.int64), hidden)

    @property
    def depth(self) -> int:
        return len(self.slots)

    @property
    def nbytes(self) -> int:
        per_row = 16 + self.width * self.dtype.itemsize
        return per_row * self.capacity * self.depth

    # ------------------------------------------------------------ lifetime
    def busy(self, slot: Slot) -> bool:
        with self._cond:
            return slot.holds > 0 or not slot.trackers_done()

    def hold(self, slot: Slot, n: int = 1) -> None:
        with self._cond:
            slot.holds += n

    def release(self, slot: Slot, n: int = 1) -> None:
        with self._cond:
            if slot.holds < n:
                raise RuntimeError(f"slot {slot.index}: release of {n} with {slot.holds} hold(s)")
            slot.holds -= n
            self._cond.notify_all()

    def track(self, slot: Slot, trackers: list[Any]) -> None:
        """Remember ZMQ trackers of zero-copy frames that view ``slot``."""
        with self._cond:
            slot.trackers.extend(trackers)

    def wait_change(self, timeout: float) -> None:
        """Sleep until a hold is released or ``timeout`` seconds pass."""
        with self._cond:
            self._cond.wait(timeout)

    # ------------------------------------------------------------- acquire
    def peek(self) -> Slot:
        """The slot the next :meth:`acquire` returns."""
        return self.slots[self._next]

    def acquire(self, deadline: float, progress: Callable[[Slot, float], None]) -> tuple[Slot, bool]:
        """The next slot once it is free; ``(slot, waited)``.

        While it is busy, ``progress(slot, seconds_left)`` is called to make
        progress (read replies, wait for the capture thread). Raises
        :class:`RingTimeout` at ``deadline`` (a ``time.monotonic`` value).
        """
        slot, waited = self.slots[self._next], False
        while self.busy(slot):
            waited = True
            left = deadline - time.monotonic()
            if left <= 0:
                raise RingTimeout(f"staging slot {slot.index} still busy (holds={slot.holds}, "
                                  f"unsent frames={len(slot.trackers)}) at the deadline")
            progress(slot, left)
        self._next = (self._next + 1) % len(self.slots)
        slot.uses += 1
        return slot, waited
