"""The pinned staging ring: N host slots that context rows are copied into.

A step copies its rows device->slot (token ids and hidden rows; positions
are implied by each request's start), and the frames it sends are zero-copy
views of the slot. A slot is *busy* while it holds a **hold** per message
whose reply has not arrived (and per capture job not written yet): a reply
proves the server has every byte, so libzmq no longer reads the slot.

A message that will never be answered (its socket was torn down) releases
its hold but **retires** the slot: libzmq may still be reading the old
memory (pyzmq keeps it alive until then), so the slot gets fresh buffers
before its next use instead of tracking every frame (tracking costs ~40%
more per zero-copy send).

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
from typing import Callable

import torch

from k3_accel.transport.failures import RingTimeout


def pinning_available() -> bool:
    """Whether page-locked host memory can be allocated here."""
    return torch.cuda.is_available()


@dataclass(eq=False)
class Slot:
    """One staging slot: row-aligned buffers of ``capacity`` rows."""
    index: int
    token_ids: torch.Tensor                 # [capacity] int64
    hidden: torch.Tensor | None             # [capacity, width] or None
    holds: int = 0
    retired: bool = False                   # memory may still be read by libzmq: replace it
    generation: int = 0                     # how many times its memory was replaced
    device: dict = field(default_factory=dict)   # (device, name) -> the slot's private device buffer

    def device_buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """This slot's own device buffer of ``capacity`` rows shaped like ``like`` (made once).
        A deferred step gathers its rows into it on the compute stream: nothing else writes
        it until the slot is free again, and no allocation happens per step."""
        key = (like.device, name)
        buf = self.device.get(key)
        if buf is None or buf.dtype != like.dtype or buf.shape[1:] != like.shape[1:]:
            buf = self.device[key] = torch.empty((self.capacity, *like.shape[1:]), dtype=like.dtype,
                                                 device=like.device)
        return buf

    @property
    def capacity(self) -> int:
        return self.token_ids.numel()


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

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        def buf(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pinned)
        hidden = buf(self.capacity, self.width, dtype=self.dtype) if self.width else None
        return buf(self.capacity, dtype=torch.int64), hidden

    def _new_slot(self, index: int) -> Slot:
        return Slot(index, *self._buffers())

    @property
    def depth(self) -> int:
        return len(self.slots)

    @property
    def nbytes(self) -> int:
        per_row = 8 + self.width * self.dtype.itemsize
        return per_row * self.capacity * self.depth

    # ------------------------------------------------------------ lifetime
    def busy(self, slot: Slot) -> bool:
        with self._cond:
            return slot.holds > 0

    def next_busy(self) -> bool:
        """Whether the slot the next step would take still has holds (acquiring it would wait)."""
        return self.busy(self.slots[self._next])

    def hold(self, slot: Slot, n: int = 1) -> None:
        with self._cond:
            slot.holds += n

    def release(self, slot: Slot, n: int = 1) -> None:
        with self._cond:
            if slot.holds < n:
                raise RuntimeError(f"slot {slot.index}: release of {n} with {slot.holds} hold(s)")
            slot.holds -= n
            self._cond.notify_all()

    def retire(self, slot: Slot) -> None:
        """``slot``'s memory may still be on the wire: give it fresh buffers before its next use."""
        with self._cond:
            slot.retired = True

    def _renew(self, slot: Slot) -> None:
        slot.token_ids, slot.hidden = self._buffers()
        slot.retired = False
        slot.generation += 1

    def wait_change(self, timeout: float) -> None:
        """Sleep until a hold is released or ``timeout`` seconds pass."""
        with self._cond:
            self._cond.wait(timeout)

    # ------------------------------------------------------------- acquire
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
                raise RingTimeout(f"staging slot {slot.index} still busy ({slot.holds} hold(s)) "
                                  f"at the deadline")
            progress(slot, left)
        if slot.retired:
            self._renew(slot)
        self._next = (self._next + 1) % len(self.slots)
        return slot, waited
