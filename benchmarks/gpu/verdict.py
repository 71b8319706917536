"""Issue 12's acceptance criteria, read from the GPU results: one PASS/FAIL line each.

    python benchmarks/gpu/verdict.py DIR [--machine h200x2]

Reads ``DIR/dma-checks-<machine>.json`` and ``DIR/allreduce-<machine>.json``
(written by ``dma_checks.py`` and ``allreduce.py``) and exits 1 if any criterion
failed or a result file is missing.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GOAL = 0.97  # router time within 3 % of the best single backend, at every size


def criteria(checks: dict, bench: dict) -> list:
    """``[(name, ok, detail)]`` for each criterion."""
    c = checks.get("checks", {})

    def ok(name):
        return bool(c.get(name, {}).get("ok"))

    cases = c.get("correctness", {}).get("cases", [])
    exact = [x for x in cases if x.get("bit_exact_vs_nccl")]
    rows = bench.get("rows", [])
    worst = min(rows, key=lambda r: r["best_over_router"]) if rows else None
    auto = c.get("auto_crossover", {}).get("runs", [{}])
    return [
        ("results complete", bool(c) and bool(rows), f"{len(c)} checks, {len(rows)} sizes"),
        ("correct and bit-exact vs NCCL", ok("correctness"),
         f"{len(exact)}/{len(cases)} cases bit-exact (required at 2 ranks)"),
        ("CUDA-graph capture and replay", ok("graph_capture_replay"),
         f"host ring calls during replay: {c.get('graph_capture_replay', {}).get('host_ring_calls_during_replay')}"),
        ("teardown returns the ring's memory", ok("teardown"),
         f"released {c.get('teardown', {}).get('released_bytes')} of {c.get('teardown', {}).get('workspace_bytes')} B"),
        ("sleep mode releases and restores", ok("sleep_mode"),
         f"released {c.get('sleep_mode', {}).get('released_bytes')} B, retaken {c.get('sleep_mode', {}).get('retaken_bytes')} B"),
        ("a set-up fault keeps NCCL on every rank", ok("fault_ring_init"),
         f"{c.get('fault_ring_init', {}).get('seconds', 0):.1f} s"),
        ("auto crossover measured, then cached", ok("auto_crossover"),
         f"first start {auto[0].get('seconds', 0):.1f} s, cached start "
         f"{auto[-1].get('seconds', 0):.2f} s" if auto and auto[0] else "no runs"),
        (f"router / best single backend >= {GOAL} at every size",
         bool(rows) and worst["best_over_router"] >= GOAL,
         f"min {worst['best_over_router']:.3f} at {worst['bytes']} B" if worst else "no rows"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--machine", default="h200x2")
    args = parser.parse_args()
    out = Path(args.dir)
    loaded = []
    for name in (f"dma-checks-{args.machine}.json", f"allreduce-{args.machine}.json"):
        path = out / name
        loaded.append(json.loads(path.read_text()) if path.exists() else {})
    results = criteria(*loaded)
    for name, ok, detail in results:
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
