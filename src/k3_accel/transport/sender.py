"""The sender thread: deferred ingests leave the target's thread entirely, and heartbeats.

The step thread only launches a deferred ingest's copies and queues a
:class:`SendJob`; this thread waits for the copy's event, encodes and sends.
Jobs leave in queue order; :meth:`Sender.wait_idle` lets the step thread put
a propose on the wire only after every ingest queued before it (so the
server never sees a propose before the ingests sent before it). While the
link is idle it sends a heartbeat every ``heartbeat_s`` (keeps the server's
lease on this client's session). A failure here fails the job's requests
closed and marks the link broken, exactly like a socket failure.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

from k3_accel import threads

log = logging.getLogger("k3_accel.transport")


@dataclass
class SendJob:
    """Frames to send once ``ready`` (a CUDA event, or None) has completed."""
    build: Callable[[], Any]               # -> None; encodes and posts (runs on the sender thread)
    ready: Any = None
    on_error: Callable[[Exception], None] | None = None


class Sender:
    def __init__(self, heartbeat_s: float, heartbeat: Callable[[], None]):
        self.heartbeat_s = heartbeat_s
        self._heartbeat = heartbeat
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._outstanding = 0
        self.broken: Exception | None = None       # set by a failed job; the step thread acts on it
        self._thread = threads.start(self._run, "k3-draft-sender")

    def submit(self, job: SendJob) -> None:
        with self._cond:
            self._outstanding += 1
        self._queue.put(job)

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until every submitted job has been sent (or failed); False at the timeout."""
        with self._cond:
            if self._outstanding == 0:
                return True
            return self._cond.wait_for(lambda: self._outstanding == 0, timeout_s)

    @property
    def idle(self) -> bool:
        return self._outstanding == 0

    def close(self, timeout_s: float = 5.0) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=self.heartbeat_s / 2)
            except queue.Empty:
                self._beat()
                continue
            if job is None:
                return
            try:
                if job.ready is not None:
                    job.ready.synchronize()
                job.build()
            except Exception as exc:  # noqa: BLE001 - fail closed, never kill the thread
                self.broken = exc
                log.warning("k3 draft sender failed: %s", exc)
                if job.on_error is not None:
                    job.on_error(exc)
            finally:
                with self._cond:
                    self._outstanding -= 1
                    self._cond.notify_all()

    def _beat(self) -> None:
        try:
            self._heartbeat()
        except Exception:  # noqa: BLE001 - a missed heartbeat only shortens the lease
            log.debug("k3 draft heartbeat failed", exc_info=True)
