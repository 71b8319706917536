"""Per-phase timings, counters, the periodic timing log and the stats snapshot."""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

log = logging.getLogger("k3_accel.transport")

PHASES = ("stage", "d2h", "enqueue", "wait", "ring_wait", "round_trip", "reply_age", "step")


@dataclass
class PhaseStat:
    """Running sum / count / max of one phase, in seconds."""
    total: float = 0.0
    count: int = 0
    peak: float = 0.0

    def add(self, seconds: float) -> None:
        self.total += seconds
        self.count += 1
        if seconds > self.peak:
            self.peak = seconds

    def as_ms(self) -> dict[str, float]:
        mean = self.total / self.count if self.count else 0.0
        return {"mean_ms": mean * 1e3, "max_ms": self.peak * 1e3, "count": self.count}


class Telemetry:
    """Phase timers and counters of one client.

    :meth:`add` and :meth:`count` are for the step thread only (no lock: they
    are on the hot path); other threads use :meth:`count_async`.

    Phases: ``stage`` (issuing the device->slot copies), ``d2h`` (waiting for
    them), ``enqueue`` (preludes, encode, hand frames to ZMQ), ``wait``
    (blocked on a propose / synchronous reply), ``ring_wait`` (blocked on a
    busy slot), ``round_trip`` (send -> reply of the messages a step waited
    for), ``reply_age`` (send -> reply read, every message; for deferred ones
    this includes the time until the next step reads it) and ``step`` (the
    whole step). ``server.*`` phases are whatever timing the server reports in
    a reply's ``timing`` map. The adapter may add its own (e.g. ``gather``)
    with :meth:`phase`.
    """

    def __init__(self, log_interval: int = 0):
        self.log_interval = log_interval
        self._lock = threading.Lock()
        self._window: dict[str, PhaseStat] = {}
        self._total: dict[str, PhaseStat] = {}
        self.counters: Counter[str] = Counter()
        self._async: Counter[str] = Counter()
        self.steps = 0

    def add(self, phase: str, seconds: float) -> None:
        stat = self._total.get(phase)
        if stat is None:
            stat = self._total[phase] = PhaseStat()
        stat.add(seconds)
        if self.log_interval:
            stat = self._window.get(phase)
            if stat is None:
                stat = self._window[phase] = PhaseStat()
            stat.add(seconds)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def count_async(self, name: str, n: int = 1) -> None:
        """:meth:`count` from a thread other than the step thread."""
        with self._lock:
            self._async[name] += n

    def add_server_timing(self, timing: Any) -> None:
        """Record a reply's ``timing`` map (seconds per server phase), if any."""
        if not isinstance(timing, Mapping):
            return
        for name, value in timing.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.add(f"server.{name}", float(value))

    def end_step(self) -> None:
        """Count a step; every ``log_interval`` steps log the window's means and reset it."""
        self.steps += 1
        due = self.log_interval > 0 and self.steps % self.log_interval == 0
        window = self._window if due else None
        if due:
            self._window = {}
        if window:
            parts = " ".join(f"{k}={v.total / v.count * 1e3:.3f}ms" for k, v in sorted(window.items()) if v.count)
            log.info("k3 draft transport timing over %d steps: %s", self.log_interval, parts)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            counters = self.counters + self._async
        return {"steps": self.steps, "counters": dict(counters),
                "phases": {k: v.as_ms() for k, v in sorted(self._total.items())}}
