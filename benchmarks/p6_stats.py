"""What P6 (``e2e_p6.py``) reads from a running engine: vLLM's speculative-decoding counters, the
plugin's own stats (on the worker, through ``collective_rpc``), what went wrong in the plugin
between two reads, the adaptive controller's choices between two reads, and the oracle server's
own counts."""
from __future__ import annotations

import json
from pathlib import Path

BATCHES = (1, 8, 32)


def spec_counters(llm) -> dict:
    out: dict = {}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] = int(m.value)
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = [int(v) for v in m.values]
    return out


def oracle_counts(doc: dict, path: Path, work: Path) -> None:
    """The oracle's own counts per (variant, length, B): drafts it made right = what a greedy target
    accepts when its output equals the record (``identical_to_record``)."""
    for line in path.read_text().splitlines() if path.exists() else []:
        c = json.loads(line)
        for b in BATCHES:
            entry = doc["variants"].get(c.get("tag") or "", {}).get(str(c["length"]), {}).get(b)
            if entry is not None and c["record"] == str(work / f"record-{b}.json") and c["found"]:
                entry["oracle"] = {k: c[k] for k in ("requests", "found", "scheduled_accepts")}
                entry["oracle_acceptance_length"] = 1 + c["scheduled_accepts"] / c["found"]


def drafter_stats(llm) -> dict | None:
    """The plugin's own view (chosen K, steps off, probes, cost fit) where the engine exposes it."""
    try:
        return llm.collective_rpc(stats_on_worker)[0]
    except Exception as exc:  # noqa: BLE001 - informative only
        return {"error": str(exc)[:300]}


def trouble(stats: dict | None, before: dict | None = None) -> dict:
    """What went wrong in the plugin since ``before`` (this function's earlier result's base): failure
    and disabled-request counters that grew, or why its stats could not be read. Empty: nothing."""
    if not isinstance(stats, dict) or "error" in stats:
        return {"stats": (stats or {}).get("error", "unavailable") if isinstance(stats, dict) else "unavailable"}
    counts = {**(stats.get("counters") or {}), **{f"adapter.{k}": v for k, v in
                                                (stats.get("adapter") or {}).items() if isinstance(v, int)}}
    bad = {k: v for k, v in counts.items() if "failures" in k or k.endswith("disabled_requests")}
    if before is None:
        return {"_base": bad}
    base = before.get("_base", {})
    grew = {k: v - base.get(k, 0) for k, v in bad.items() if v > base.get(k, 0)}
    return {**grew, **({"stats": before["stats"]} if "stats" in before else {})}


def measures_drafting(problems: dict) -> bool:
    """Whether a run with these :func:`trouble` counts measures remote drafting. A step the GPU
    deadline released drafts the filler (the last sampled token), which this target (``--head
    shift``: it outputs the next id) rejects: such a run measures the system with its hiccups, a
    little below what drafting gives, and stands. Any other failure (a lost context, a disabled
    request, unreadable stats) voids it."""
    released = problems.get("adapter.failures.deadline", 0)
    rest = {k: v for k, v in problems.items() if k not in ("adapter.failures", "adapter.failures.deadline")}
    return not rest and problems.get("adapter.failures", 0) == released


def controller_delta(before: dict | None, after: dict | None) -> dict | None:
    """The adaptive controller's choices between two stats reads (K chosen per request-step, steps
    off, probes), or None without a controller."""
    c0, c1 = ((s or {}).get("controller") if isinstance(s, dict) else None for s in (before, after))
    if not isinstance(c1, dict):
        return None
    c0 = c0 if isinstance(c0, dict) else {}
    a0, a1 = ((s or {}).get("adapter") or {} for s in (before if isinstance(before, dict) else {}, after))
    k0, k1 = c0.get("k_chosen", {}), c1.get("k_chosen", {})
    return {"k_chosen": {k: v - k0.get(k, 0) for k, v in k1.items() if v - k0.get(k, 0)},
            # off steps the step thread held (v2_held) and the regions it handed over
            **{n: a1.get(n, 0) - a0.get(n, 0) for n in ("held_at_launch", "held_regions")},
            **{n: c1.get(n, 0) - c0.get(n, 0) for n in ("steps", "off_steps", "probe_steps", "held_steps", "stalled_steps",
                                                         "probes_judged", "probe_restarts")},
            **{n: c1.get(n) for n in ("acceptance_per_position", "step_ms", "round_trip_ms", "last_probe",
                                       "recent_fields", "recent")}}


def phase_delta(before: dict | None, after: dict | None) -> dict | None:
    """The draft thread's and the server's phases between two stats reads: per phase the count and
    mean milliseconds of the steps in between (where one run's time went), or None."""
    p0, p1 = ((s or {}).get("phases") if isinstance(s, dict) else None for s in (before, after))
    if not isinstance(p1, dict):
        return None
    p0 = p0 if isinstance(p0, dict) else {}
    out = {}
    for name, b in p1.items():
        a = p0.get(name) or {"count": 0, "mean_ms": 0.0}
        n = b.get("count", 0) - a.get("count", 0)
        if n > 0:
            total = b["mean_ms"] * b["count"] - a["mean_ms"] * a["count"]
            out[name] = {"count": n, "mean_ms": round(total / n, 3)}
    return out


def stats_on_worker(worker):
    runner = worker.model_runner
    spec = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)
    stats = getattr(spec, "stats", None)
    return stats() if callable(stats) else None
