"""Where a fresh DFlash engine stalls the first time it meets a shape: first call against the next.

P6 on the H200 logged, on every run, a draft server storing its first rows of some sizes in
140-220 ms ("a first-use compile"?) where the same store takes a few ms later on; when such a
store lands in a timed run the GPU deadline releases steps without drafts. This probe builds the
engine of ``draft_step.py`` (a Qwen3-8B-shaped DFlash draft, random weights, graphs for K = 7),
exactly as the server does at start (its ingest warm-up included), then for each ingest shape
(rows per request x requests, from position 0 or mid-block) and each propose shape (B, K, rows
stored in the replay) times the first call and a second call of the same shape on fresh
requests, device synchronised. ``summary.ratio`` = the worst first / second over the shapes
(goal 2: no shape pays a compile or capture on first use once the engine is up).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
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
from k3_accel.server.rows import top_bits  # noqa: E402

INGEST = [(1, 1), (1, 32), (3, 8), (16, 32), (17, 32), (100, 1), (128, 32), (500, 1), (512, 8), (1000, 4),
          (2048, 2), (4096, 1), (4097, 1), (300, 32), (8192, 1), (16384, 1)]
PROPOSE = [(1, 7), (2, 7), (5, 7), (8, 7), (13, 7), (32, 7), (1, 3), (32, 4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run on any device)")
    ap.add_argument("--out")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = config(args.quick)
    weights = random_weights(cfg, dev, dtype)
    row_bytes = 2 * cfg.num_layers * cfg.kv_size * torch.empty((), dtype=dtype).element_size()
    t0 = time.perf_counter()
    engine = DFlashEngine.from_weights(weights, budget_bytes=300_000 * row_bytes, max_batch=32, graph_k=(7,))
    sync()
    start_s = time.perf_counter() - t0
    width = cfg.context_width
    table = []

    def timed(fn) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return 1e3 * (time.perf_counter() - t)

    def ingest(rows: int, reqs: int, offset: int) -> list:
        states = [engine.new_state() for _ in range(reqs)]
        if offset:
            for s in states:
                engine.ingest(IngestBatch([s], [0], [offset], torch.arange(offset), torch.zeros(offset, dtype=torch.long),
                                          torch.zeros(offset, width, device=dev, dtype=dtype)))
            engine.flush()
        n = rows * reqs
        hidden = torch.randn(n, width, device=dev, dtype=dtype)
        pos = torch.arange(offset, offset + rows).repeat(reqs)
        ms = timed(lambda: (engine.ingest(IngestBatch(states, [offset] * reqs, [rows] * reqs, pos,
                                                      torch.zeros(n, dtype=torch.long), hidden)), engine.flush()))
        for s in states:
            engine.release(s)
        return ms

    for rows, reqs in INGEST:
        for offset in (0, 5):
            first, second = ingest(rows, reqs, offset), ingest(rows, reqs, offset)
            table.append({"op": "ingest", "rows": rows, "requests": reqs, "offset": offset,
                          "first_ms": first, "second_ms": second})
            print(json.dumps(table[-1]), flush=True)
    for n in (1, 32, 300, 4096, 16384):
        h = torch.randn(n, width, device=dev, dtype=dtype)
        first, second = timed(lambda: top_bits(h).cpu()), timed(lambda: top_bits(h).cpu())
        table.append({"op": "nonfinite", "rows": n, "first_ms": first, "second_ms": second})
        print(json.dumps(table[-1]), flush=True)
    for b, k in PROPOSE:
        def once() -> float:
            states = [engine.new_state() for _ in range(b)]
            for s in states:
                engine.ingest(IngestBatch([s], [0], [600], torch.arange(600), torch.zeros(600, dtype=torch.long),
                                          torch.zeros(600, width, device=dev, dtype=dtype)))
            engine.flush()
            ms = timed(lambda: engine.propose(ProposeBatch(states, [[]] * b, torch.zeros(b, dtype=torch.long), k)).wait())
            for s in states:
                engine.release(s)
            return ms
        first, second = once(), once()
        table.append({"op": "propose", "B": b, "K": k, "first_ms": first, "second_ms": second})
        print(json.dumps(table[-1]), flush=True)
    worst = max(table, key=lambda r: r["first_ms"] / max(r["second_ms"], 1e-3))
    gpu = f", {torch.cuda.get_device_name()}" if cuda else ""
    emit({"summary": {"metric": "first call / second call of the same shape on a fresh engine, worst over the "
                                f"shapes (worst: {json.dumps({k: v for k, v in worst.items() if not k.endswith('_ms')})})",
                      "ratio": round(worst["first_ms"] / max(worst["second_ms"], 1e-3), 3), "goal": 2.0,
                      "machine": f"{platform.machine()}{gpu}, torch {torch.__version__}",
                      "date": datetime.date.today().isoformat()},
          "engine_start_s": start_s, "table": table}, args.out)


if __name__ == "__main__":
    main()
