"""The draft pipeline's deadline and watchdog (:class:`StepWatch`, mixed into
:class:`~.pipeline.DraftPipeline`; it runs on the ``k3-draft-watchdog`` thread).

The GPU never waits for the draft thread longer than ``deadline_s`` per step
(the propose timeout plus a margin): the watch thread notes when the GPU reached
a proposing step (its launch event completed) and, that long after, releases the
step's fence with "no drafts" in its reply (the step's work goes on: its rows
still reach the server, its late drafts are never written). While such a step
is unfinished the pipeline is :attr:`~StepWatch.behind` and the speculator asks
for no drafts (nothing for the GPU to wait on) until the thread has caught up.
Without it a server that paused (a first-use compile, a full staging ring) held
the GPU for as long as the transport's generous timeouts (30 s each), twice in a
row on the H200.

A watchdog bounds the rest: when a submitted step is still unfinished
``stall_s`` after its submission (longer than any wait the draft thread takes
on its own), it logs where the thread is and every thread's stack once,
releases the fence for good and closes the pipeline: remote drafting is off
for this engine, its output unchanged (the drafts then read are verified like any).
"""
from __future__ import annotations

import faulthandler
import logging
import sys
import time
from typing import Any

log = logging.getLogger("k3_accel.vllm")


class StepWatch:
    """What the pipeline shares with its watch: ``_pending`` (fence value -> [submitted, launch,
    GPU reached it]), ``_released``, ``_expired``, ``reply``, ``confidence``, ``fence``, ``_lock`` /
    ``_wake``, ``_closed``, ``_where``, ``_jobs``, ``on_failure``, ``deadline_s``, ``stall_s``."""
    _pending: dict[int, list]
    _released: set[int]
    _expired: set[int]
    deadline_s: float | None
    stall_s: float | None
    fence: Any

    @property
    def behind(self) -> bool:
        """A step the deadline released is still running: the GPU should not wait for drafts now."""
        return bool(self._expired)

    def expire(self, now: float) -> list[int]:
        """Release the GPU from every proposing step it reached ``deadline_s`` or more before ``now``
        (a ``time.monotonic`` value) whose drafts are not in: "no drafts" in its reply, its fence
        signalled. Returns their fence values. The GPU has "reached" a step when its launch event
        completed (a host-side query; at once for a launch without one), noted here."""
        if self.deadline_s is None:
            return []
        with self._lock:
            due = []
            for seq, entry in self._pending.items():
                if seq in self._released:                 # the GPU went on already
                    continue
                if entry[2] is None:
                    ready = getattr(entry[1], "ready", None)
                    if ready is None or ready.query():
                        entry[2] = now
                if entry[2] is not None and seq not in self._expired and now - entry[2] >= self.deadline_s:
                    due.append(seq)
            for seq in due:
                self.reply[seq % 2].fill_(-1)
                self.confidence[seq % 2].fill_(-1.0)
                self._expired.add(seq)
            if due:
                self.fence.signal(max(due))
        return due

    def overdue(self, now: float) -> int | None:
        """The fence value of the oldest submitted step still unfinished ``stall_s`` after its
        submission at ``now`` (a ``time.monotonic`` value), else None; finished steps never count."""
        with self._lock:
            seq = min(self._pending, default=None)          # fence values grow: the smallest is the oldest
            since = self._pending[seq][0] if seq is not None else None
        if since is None or self.stall_s is None or now - since < self.stall_s:
            return None
        return seq

    def _interval(self) -> float:
        if self.deadline_s is not None and self._pending:
            return min(max(self.deadline_s / 4, 0.002), 0.05)
        return min(0.5, self.stall_s / 4) if self.stall_s is not None else 0.5

    def _watch(self) -> None:
        """The deadline and the watchdog (see the module docstring)."""
        while not self._closed:
            with self._lock:
                self._wake.wait(self._interval())
            now = time.monotonic()
            for late in self.expire(now):
                self.on_failure("deadline", f"delivering step {late}'s drafts within {self.deadline_s * 1e3:.0f} "
                                "ms of the GPU reaching it")
            seq = self.overdue(now)
            if seq is None:
                continue
            self.stalled = True
            log.error("k3-accel: the draft thread has not finished step %d after %.1f s; the GPU is released "
                      "and remote drafting is off for this engine (output unchanged). Draft thread: %s; "
                      "jobs queued %d; fence word %s; every thread's stack follows on stderr.", seq, self.stall_s,
                      dict(self._where), self._jobs.qsize(), self.fence.value())
            try:
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            except Exception:  # noqa: BLE001 - diagnosis only
                pass
            self.on_failure("stalled", f"draft thread stuck in step {seq}")
            self._closed = True
            self.fence.close()
            return


__all__ = ["StepWatch"]
