"""Benchmark-only: where each engine step's host time goes inside a running vLLM (P6's step trace).

Installed on the worker through ``collective_rpc`` (the engine core with one GPU hosts it), it times
the runner's ``execute_model`` and ``sample_tokens`` and the drafter's ``propose`` (wall clock on
the host, no device sync: a call that waits for the GPU shows as long), and every garbage collection
over a millisecond. :func:`summarise` turns one timed run's records into the step periods (from one
``execute_model`` start to the next), their median and worst, and the slowest steps with what
overlapped them: the eleventh session's P6 runs had single steps of 0.65-1.15 s that nothing else
explained. Each ``execute_model`` also records its batch from the scheduler output (requests, scheduled
tokens, draft slots), so a run that takes more steps than another for the same work says which steps
ran fewer requests. The runner and drafter are patched on the instance only; :func:`uninstall_on_worker`
restores them. Not part of the product.
"""
from __future__ import annotations

import gc
import statistics
import threading
import time
from collections import deque

CALLS = ("execute_model", "sample_tokens")
GC_MIN_S = 1e-3
_records: deque = deque(maxlen=50_000)          # (name, start, seconds, batch or None), perf_counter clock
_state: dict = {"installed": [], "gc_start": {}}
_CLASS = object()                               # the attribute came from the class


def batch_of(args: tuple, kwargs: dict) -> list | None:
    """``[requests, scheduled tokens, draft slots]`` of an ``execute_model`` call (its scheduler output)."""
    out = args[0] if args else kwargs.get("scheduler_output")
    counts = getattr(out, "num_scheduled_tokens", None)
    if not isinstance(counts, dict):
        return None
    spec = getattr(out, "scheduled_spec_decode_tokens", None) or {}
    return [len(counts), int(getattr(out, "total_num_scheduled_tokens", sum(counts.values()))),
            sum(len(v) for v in spec.values())]


def _timed(name: str, fn):
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        batch = batch_of(args, kwargs) if name == "execute_model" else None
        try:
            return fn(*args, **kwargs)
        finally:
            _records.append((name, t0, time.perf_counter() - t0, batch))
    return call


def _on_gc(phase: str, info: dict) -> None:
    ident = threading.get_ident()
    if phase == "start":
        _state["gc_start"][ident] = time.perf_counter()
        return
    t0 = _state["gc_start"].pop(ident, None)
    if t0 is not None and time.perf_counter() - t0 >= GC_MIN_S:
        _records.append((f"gc{info.get('generation')}", t0, time.perf_counter() - t0, None))


def install_on_worker(worker) -> int:
    """Time the runner's calls and the drafter's ``propose`` on this worker; returns how many were wrapped."""
    if _state["installed"]:
        return len(_state["installed"])
    runner = worker.model_runner
    targets = [(runner, name) for name in CALLS if hasattr(runner, name)]
    drafter = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)
    if drafter is not None and hasattr(drafter, "propose"):
        targets.append((drafter, "propose"))
    for obj, name in targets:
        own = vars(obj).get(name, _CLASS) if hasattr(obj, "__dict__") else _CLASS
        setattr(obj, name, _timed(name, getattr(obj, name)))
        _state["installed"].append((obj, name, own))
    gc.callbacks.append(_on_gc)
    return len(targets)


def uninstall_on_worker(worker) -> int:
    for obj, name, own in _state["installed"]:
        if own is _CLASS:
            delattr(obj, name)                      # the class's method again
        else:
            setattr(obj, name, own)                 # what the instance had
    n = len(_state["installed"])
    _state["installed"] = []
    if _on_gc in gc.callbacks:
        gc.callbacks.remove(_on_gc)
    return n


def clear_on_worker(worker) -> int:
    _records.clear()
    return 0


def take_on_worker(worker) -> list:
    out = list(_records)
    _records.clear()
    return out


def summarise(records: list, top: int = 3) -> dict:
    """Step periods (``execute_model`` start to the next one's) of one run, its ``top`` slowest steps
    with each call and collection that overlapped them (ms), and every step's batch (``batches``:
    ``[requests, scheduled tokens, draft slots]`` in step order, when the calls had one)."""
    records = [(*r, None)[:4] for r in records]
    steps = sorted((t0, batch) for name, t0, _, batch in records if name == "execute_model")
    starts = [t0 for t0, _ in steps]
    batches = {t0: batch for t0, batch in steps}
    if len(starts) < 2:
        return {"steps": len(starts)}
    periods = [(b - a, a, b) for a, b in zip(starts, starts[1:])]
    ms = [p * 1e3 for p, _, _ in periods]
    worst = sorted(periods, reverse=True)[:top]

    def inside(a: float, b: float) -> list:
        return [[name, round((t0 - a) * 1e3, 3), round(s * 1e3, 3)] for name, t0, s, _ in records
                if t0 < b and t0 + s > a]
    per_call = {}
    for name in sorted({r[0] for r in records}):
        d = [s * 1e3 for n, _, s, _ in records if n == name]
        per_call[name] = {"count": len(d), "median_ms": round(statistics.median(d), 3), "max_ms": round(max(d), 3)}
    return {"steps": len(starts), "period_median_ms": round(statistics.median(ms), 3),
            "period_max_ms": round(max(ms), 3), "periods_over_4x_median": sum(m > 4 * statistics.median(ms) for m in ms),
            "calls": per_call,
            "slowest": [{"period_ms": round(p * 1e3, 3), "at_ms": round((a - starts[0]) * 1e3, 3),
                         "batch": batches[a], "overlapping": inside(a, b)} for p, a, b in worst],
            **({"batches": [batches[t] for t in starts]} if any(batches.values()) else {})}
