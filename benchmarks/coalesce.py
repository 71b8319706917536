"""Coalesced ingest: what steps that draft nothing cost the draft server's device.

While a target's speculation is off (the adaptive controller, issue 24), each of its decode
steps still ships one context row per request, and the server ingests them so that a later
probe drafts from the whole context. On a GPU the draft server shares with its target (the P6
runs), every such ingest is a few kernels and a read of the fc and K/V projection weights, once
per target step. The DFlash engine coalesces small ingests of host rows (tables and copy at
once, one projection at the next propose, default ``--ingest-coalesce-rows 1024``).

Two engines over the same random weights (``draft_step.py``'s Qwen3-8B-shaped draft, bf16;
``--quick``: tiny shapes, any device), one coalescing and one projecting every ingest at once
(``coalesce_rows=0``), alternating, median over ``--repeats``:

* **off stretch**: B requests with 1,024 context rows, then ``--steps`` (32) ingests of one host
  row per request (bf16, pageable memory, as frames arrive), then one propose (K = 7); wall
  time of the whole stretch with the device synchronised at its end, less the same propose
  run again with nothing waiting, per target step: what the off steps cost the server.
* **four targets**: four ingests of 8 requests' decode rows, then one propose of all 32 (the
  server's batch of proposes from several sessions).

``summary.ratio`` = coalescing ÷ eager per-step cost of the off stretch at B = 32 (goal
<= 0.5: an off step's device work is mostly the per-ingest weight reads and launches).
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE)]

from draft_step import config, random_weights  # noqa: E402
from report import emit  # noqa: E402

from k3_accel.server.engines.base import IngestBatch, ProposeBatch  # noqa: E402
from k3_accel.server.engines.dflash import DFlashEngine  # noqa: E402

CONTEXT, K = 1024, 7


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ingest(engine: DFlashEngine, states: list, hidden: torch.Tensor) -> None:
    starts = [engine.length(s) for s in states]
    engine.ingest(IngestBatch(states, starts, [1] * len(states), torch.tensor(starts),
                              torch.zeros(len(states), dtype=torch.long), hidden))


def _propose(engine: DFlashEngine, states: list) -> None:
    engine.propose(ProposeBatch(states, [], torch.zeros(len(states), dtype=torch.long), K)).wait()


def _fresh(engine: DFlashEngine, b: int, context: torch.Tensor) -> list:
    states = [engine.new_state() for _ in range(b)]
    for s in states:
        engine.ingest(IngestBatch([s], [0], [CONTEXT], torch.arange(CONTEXT),
                                  torch.zeros(CONTEXT, dtype=torch.long), context))
    engine.flush()
    return states


def off_stretch(engine: DFlashEngine, b: int, steps: int, rows: list[torch.Tensor],
                context: torch.Tensor) -> tuple[float, float]:
    """Seconds of ``steps`` one-row ingests and a propose (device synchronised), and of the same
    propose again with nothing waiting."""
    states = _fresh(engine, b, context)
    _sync(engine.device)
    t0 = time.perf_counter()
    for i in range(steps):
        _ingest(engine, states, rows[i][:b])
    _propose(engine, states)
    _sync(engine.device)
    t1 = time.perf_counter()
    _propose(engine, states)
    _sync(engine.device)
    seconds = (t1 - t0, time.perf_counter() - t1)
    for s in states:
        engine.release(s)
    return seconds


def four_targets(engine: DFlashEngine, rows: list[torch.Tensor], context: torch.Tensor) -> float:
    """Seconds of four 8-request ingests and one 32-request propose (device synchronised)."""
    states = _fresh(engine, 32, context)
    _sync(engine.device)
    t0 = time.perf_counter()
    for t in range(4):
        _ingest(engine, states[8 * t:8 * t + 8], rows[t][:8])
    _propose(engine, states)
    _sync(engine.device)
    seconds = time.perf_counter() - t0
    for s in states:
        engine.release(s)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (any device)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = config(args.quick)
    weights = random_weights(cfg, args.device, dtype)
    budget = 2 << 30 if device.type == "cuda" else 256 << 20
    engines = {name: DFlashEngine.from_weights(weights, budget_bytes=budget, graph_k=(K,), coalesce_rows=rows)
               for name, rows in (("coalesced", 1024), ("eager", 0))}
    width = cfg.context_width
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(32, width, generator=gen).to(torch.bfloat16) for _ in range(args.steps)]
    context = torch.randn(CONTEXT, width, generator=gen).to(device=device, dtype=dtype)
    table = []
    for b in map(int, args.batches.split(",")):
        times: dict[str, list[float]] = {name: [] for name in engines}
        bare: list[float] = []
        for r in range(args.repeats + 1):              # the first round warms both engines up
            for name, engine in engines.items():
                stretch, propose = off_stretch(engine, b, args.steps, rows, context)
                if r:
                    times[name].append(stretch)
                    bare.append(propose)
        alone = statistics.median(bare)                # a propose with nothing waiting
        med = {name: statistics.median(v) for name, v in times.items()}
        per_step = {name: max(v - alone, 0.0) / args.steps for name, v in med.items()}
        table.append({"scenario": "off stretch", "B": b, "steps": args.steps,
                      **{f"{name}_ms_per_step": round(v * 1e3, 4) for name, v in per_step.items()},
                      "stretch_ms": {name: round(v * 1e3, 3) for name, v in med.items()},
                      "bare_propose_ms": round(alone * 1e3, 3),
                      "ratio": round(per_step["coalesced"] / per_step["eager"], 4) if per_step["eager"] else None})
    four: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.repeats + 1):
        for name, engine in engines.items():
            seconds = four_targets(engine, rows, context)
            if r:
                four[name].append(seconds)
    med = {name: statistics.median(v) for name, v in four.items()}
    table.append({"scenario": "four targets", "B": 32, **{f"{name}_ms": round(v * 1e3, 4) for name, v in med.items()},
                  "ratio": round(med["coalesced"] / med["eager"], 4)})
    largest = next(row for row in table if row["scenario"] == "off stretch" and row["B"] == max(
        int(b) for b in args.batches.split(",")))
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    emit({"summary": {"metric": f"per-step cost of an off stretch ({args.steps} one-row ingests per request, then "
                                f"one propose, K={K}, context {CONTEXT}) at B={largest['B']}: coalesced / eager"
                                f"{' (tiny shapes)' if args.quick else ''}",
                      "ratio": largest["ratio"], "goal": 0.5,
                      "machine": f"{platform.machine()}, {dev}, torch {torch.__version__}",
                      "date": datetime.date.today().isoformat()},
          "params": {"device": args.device, "quick": args.quick, "steps": args.steps, "repeats": args.repeats,
                     "context": CONTEXT, "k": K}, "table": table}, args.out)


if __name__ == "__main__":
    main()
