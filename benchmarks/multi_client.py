"""One draft server, several targets: 4 clients x B=8 against 1 client x B=32 on the same engine.

Each client is its own process with its own session (like separate vLLM
instances), stepping decode proposes (one new row per request, K drafts) in
a closed loop for a fixed time. Reported per setup: the server's engine calls
per second and requests drafted per second (from its ``stats``), the
requests per engine call (cross-client batching merges proposes that wait
together), and each client's median round trip. The engine is the server's
ngram engine by default (CPU, any machine) or a GPU DFlash engine with the
draft_step.py shapes (``--engine dflash``). Prints one JSON document; the
summary ratio is (4 x 8 throughput) / (1 x 32 throughput) in drafted
requests per second (goal >= 0.9: batching keeps several small targets as
cheap as one large one). Each set-up runs against a fresh server per
``--batch-wait-ms`` value (default: the server's default, then 0 = rounds
never held for targets expected back), side by side; the summary is the
first value's.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE)]

from report import emit  # noqa: E402
from rpc import env, free_port  # noqa: E402


def start_server(engine: str, batch_wait_ms: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    wait = ["--batch-wait-ms", str(batch_wait_ms)]
    if engine == "ngram":
        from k3_accel.demo.server import DraftServer
        server = DraftServer(["--engine", "ngram", "--log-level", "WARNING", *wait], env=env()).start(timeout=30)
        return server.proc, server.address
    proc = subprocess.Popen([sys.executable, str(HERE / "draft_rpc.py"), "--serve", str(port), *wait], env=env(),
                            stdout=subprocess.PIPE, text=True)
    if not proc.stdout.readline().startswith("ready"):
        raise RuntimeError("server not ready")
    return proc, f"tcp://127.0.0.1:{port}"


def client(address: str, name: str, b: int, k: int, width: int, seconds: float, barrier, queue) -> None:
    import gc
    from k3_accel.transport.api import ClientSettings, StepInput
    from k3_accel.transport.client import DraftClient
    dev = torch.device("cuda" if width and torch.cuda.is_available() else "cpu")
    c = DraftClient(ClientSettings(address=address, timeout_ms=60000, max_rows=8192, context_width=width,
                                   num_speculative_tokens=k, client_name=name)).start()
    gc.collect()
    gc.freeze()
    ids, ctx = [f"{name}-{i}" for i in range(b)], 256
    hidden = (lambda n: torch.randn(n, width, device=dev, dtype=torch.bfloat16)) if width else (lambda n: None)
    c.step(StepInput(ids, [ctx] * b, torch.arange(ctx).repeat(b), (torch.arange(ctx) % 17).repeat(b), [False] * b,
                     [1] * b, [ctx] * b, k=k, hidden=hidden(b * ctx)))
    c.flush()
    times, pos = [], ctx
    barrier.wait(300)                      # every client connected and prefilled
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        inp = StepInput(ids, [1] * b, torch.full((b,), pos), torch.full((b,), pos % 17), [True] * b,
                        [(pos + 1) % 17] * b, [pos + 1] * b, k=k, hidden=hidden(b))
        t0 = time.perf_counter()
        c.step(inp)
        times.append(time.perf_counter() - t0)
        pos += 1
    stats = c.stats()
    failures = {n: v for n, v in stats["counters"].items() if n.startswith("failures.")}
    c.close()
    queue.put({"client": name, "steps": len(times), "round_trip_median_ms": statistics.median(times) * 1e3,
               "failures": failures, "path": stats["device_plane"]["path"]})


def run(address: str, engine: str, clients: int, b: int, k: int, seconds: float) -> dict:
    from k3_accel.demo.probe import probe
    hello = probe(address, 60000)
    width = hello["hello"]["context_width"]
    before = hello["stats"]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    barrier = ctx.Barrier(clients)
    procs = [ctx.Process(target=client, args=(address, f"t{i}", b, k, width, seconds, barrier, queue))
             for i in range(clients)]
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join(60)
    after = probe(address, 60000)["stats"]
    calls = after["engine_batches"] - before["engine_batches"]
    held = after["batches_held"] - before["batches_held"]
    drafted = after["proposals"] - before["proposals"]
    steps = sum(r["steps"] for r in results)
    return {"clients": clients, "B": b, "K": k, "engine": engine, "seconds": seconds,
            "engine_calls_per_s": calls / seconds, "drafted_requests_per_s": drafted / seconds,
            "requests_per_engine_call": drafted / max(calls, 1), "engine_calls_held": held,
            "client_steps": steps,
            "round_trip_median_ms": {r["client"]: round(r["round_trip_median_ms"], 3) for r in results},
            "hidden_rows_path": sorted({r["path"] for r in results}),      # host, or device (the device plane)
            "failures": {r["client"]: r["failures"] for r in results if r["failures"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["ngram", "dflash"], default="ngram")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--batch-wait-ms", default="1.0,0",
                    help="the server's --batch-wait-ms, one fresh server per value (the first: the summary's)")
    ap.add_argument("--out")
    args = ap.parse_args()
    table, ratios = [], {}
    for wait in [float(x) for x in args.batch_wait_ms.split(",")]:
        proc, address = start_server(args.engine, wait)   # one server, one engine, for both set-ups
        try:
            one = run(address, args.engine, 1, 32, args.k, args.seconds)
            four = run(address, args.engine, 4, 8, args.k, args.seconds)
        finally:
            proc.terminate()
            proc.wait(30)
        for row in (one, four):
            row["batch_wait_ms"] = wait
        table += [one, four]
        ratios[str(wait)] = round(four["drafted_requests_per_s"] / one["drafted_requests_per_s"], 4)
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    doc = {"summary": {"metric": f"drafted requests/s, 4 clients x B=8 / 1 client x B=32 ({args.engine} engine, "
                                 f"K={args.k}, one server, --batch-wait-ms {next(iter(ratios))})",
                       "ratio": next(iter(ratios.values())), "by_batch_wait_ms": ratios,
                       "goal": 0.9,
                       "machine": f"{platform.machine()}, {os.cpu_count()} CPUs{gpu}, torch {torch.__version__}",
                       "date": datetime.date.today().isoformat()},
           "table": table}
    emit(doc, args.out)


if __name__ == "__main__":
    main()
