"""Benchmark only: where a draft server's time goes between a propose's arrival and its reply.

``install()`` wraps a few methods of the server (the loop's receive and send, the device
plane's read, the service's batch, the engine's ingest and propose) to note the wall-clock
time of each step; ``summary()`` cuts the notes into one cycle per propose message (from
its frames' arrival to its reply's send) and gives, per path (host or device plane) and
batch size, the median time between consecutive marks. The product has no such hooks:
this file patches the classes of the server process it runs in (``draft_rpc.py
--trace-server``).

Marks, in order: ``recv`` (frames taken off the socket), ``read_issue`` / ``read_issued``
(the device plane queues a read of the target's slot: host time to queue it),
within it ``_copy_rows`` / ``_check_rows`` (and ``.done``: queueing the copy, the
non-finite check), ``read_seen`` (the loop finds the read complete), ``batch`` / ``prepared`` (the service prepares a
propose: admission, rows stored), ``launch`` (the round's proposes go to the engine), ``engine_ingest`` / ``engine_ingested`` (the engine queues the
rows' store), ``engine_launch`` / ``engine_launched`` (the engine queues the propose),
``finish`` / ``replies`` (the loop finds the device done; the replies are built), ``sent`` (the reply is on the socket).
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable

EVENTS: list[tuple[str, float, Any]] = []


def _mark(name: str, info: Any = None) -> None:
    EVENTS.append((name, time.perf_counter(), info))


def _around(cls: Any, attr: str, before: str | None, after: str | None,
            info: Callable[..., Any] | None = None) -> None:
    fn = getattr(cls, attr)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if before:
            _mark(before, info(*args, **kwargs) if info else None)
        out = fn(*args, **kwargs)
        if after:
            _mark(after)
        return out
    setattr(cls, attr, wrapped)


def install(engine_cls: type) -> None:
    from k3_accel.server import device_plane, loop, service
    _around(loop.ServerLoop, "_enqueue", "recv", None)
    _around(loop.ServerLoop, "_send", None, "sent")
    _around(device_plane.ServerDevicePlane, "_start", "read_issue", "read_issued")
    for fn in ("_copy_rows", "_check_rows"):         # module functions: wrapped where _read looks them up
        _around(device_plane, fn, fn, f"{fn}.done")
    ready = device_plane.Fetch.ready

    def fetch_ready(self) -> bool:
        ok = ready(self)
        if ok and not getattr(self, "_traced", False):
            self._traced = True
            _mark("read_seen")
        return ok
    device_plane.Fetch.ready = fetch_ready

    def prepare_info(_svc, _session, req):
        return {"B": int(req.msg.n), "path": "device" if req.fetch is not None else "host"}
    _around(service.DraftService, "prepare", "batch", "prepared", prepare_info)
    _around(service.DraftService, "launch", "launch", None)
    _around(service.Batch, "finish", "finish", "replies")
    _around(engine_cls, "ingest", "engine_ingest", "engine_ingested")
    _around(engine_cls, "propose", "engine_launch", "engine_launched")


def summary() -> dict:
    """Median milliseconds between consecutive marks of a propose cycle, per path and B."""
    cycles, cur = [], []
    for ev in EVENTS:
        if ev[0] == "recv" and not cur:
            cur = [ev]
        elif cur:
            cur.append(ev)
            if ev[0] == "sent":
                if any(e[0] == "batch" for e in cur):
                    cycles.append(cur)
                cur = []
    groups: dict[str, dict[str, list[float]]] = {}
    for cyc in cycles:
        info = next(e[2] for e in cyc if e[0] == "batch")
        key = f"{info['path']} B={info['B']}"
        steps = groups.setdefault(key, {})
        marks = [e for e in cyc if e[0] != "recv" or e is cyc[0]]   # frames of later messages: not this one's
        for (a, ta, _), (b, tb, _) in zip(marks, marks[1:]):
            steps.setdefault(f"{a}->{b}", []).append((tb - ta) * 1e3)
        steps.setdefault("total", []).append((cyc[-1][1] - cyc[0][1]) * 1e3)
    return {key: {"cycles": len(steps["total"]),
                  "median_ms": {k: round(statistics.median(v), 4) for k, v in steps.items()
                                if len(v) >= len(steps["total"]) // 2}}
            for key, steps in groups.items()}
