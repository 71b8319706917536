"""All-reduce benchmark: router vs NCCL vs DMA ring vs what stock vLLM would pick.

    torchrun --nproc-per-node 2 benchmarks/allreduce.py --out DIR [--machine NAME]

Needs GPUs, NCCL and b12x (``PYTHONPATH=$PWD/src``). bf16, sizes 64 KiB–256 MiB
(plus 22 and 24 MiB). Every cell is the median of event-timed single calls,
collected over interleaved rounds so drift hits every backend alike. Backends:

* ``nccl``   — ``torch.distributed.all_reduce`` in place (pure NCCL, no copy);
* ``dma``    — b12x ``DmaAllReduce`` through :class:`DmaBackend` (eager and
  CUDA-graph replay);
* ``router`` — :func:`build_router` with ``dma_min_bytes=auto`` (measured
  crossover), NCCL as the next backend;
* ``stock``  — what stock vLLM would use. vLLM is not installed on the GPU
  machine, so this is NCCL (stock's custom all-reduce / symmetric-memory
  paths could not be timed there); the column is kept so the JSON says so.

Writes ``allreduce-<machine>.json`` (top-level ``summary``: metric, ratio =
min over sizes of best-single-backend time ÷ router time, goal 0.97, machine,
date) and a PNG plot.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

MiB = 1 << 20
KiB = 1 << 10
SIZES = sorted({64 * KiB << k for k in range(13)} | {22 * MiB, 24 * MiB})  # 64 KiB .. 256 MiB


def init_torchrun():
    """NCCL world from torchrun's env, this rank's GPU, and a gloo group (for the ring's handshake)."""
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    return rank, world, torch.device("cuda", local), dist.new_group(backend="gloo")


def routing_host_ns(router_cls, x, calls: int = 20000) -> dict:
    """Host ns per call of a DMA-less router over a no-op fallback vs the bare no-op."""
    noop = lambda t: t  # noqa: E731
    off = router_cls(fallback=noop, dma=None)
    out = {}
    for label, fn in (("bare", noop), ("router", off.all_reduce)):
        samples = []
        for _ in range(7):
            t0 = time.perf_counter_ns()
            for _ in range(calls):
                fn(x)
            samples.append((time.perf_counter_ns() - t0) / calls)
        out[label] = statistics.median(samples)
    return out


def event_times(fn, x, iters):
    out = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x)
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def graph_times(fn, x, iters):
    """Capture ``fn(x)`` once, time replays (device time, no host work)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn(x)
    graph.replay()
    torch.cuda.synchronize()
    return event_times(lambda _: graph.replay(), None, iters)


def ce_peer_bandwidth(nbytes=256 * MiB, iters=10):
    """One copy-engine peer copy cuda:0 → cuda:1 (bytes/s), from rank 0's process."""
    if torch.cuda.device_count() < 2:
        return None
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        torch.cuda.synchronize("cuda:1")
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--machine", default="h200x2")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--iters", type=int, default=40)
    args = parser.parse_args()

    from k3_accel.comm.crossover import CrossoverCache
    from k3_accel.comm.build import RouterHooks, build_router
    from k3_accel.comm.dma import DmaBackend
    from k3_accel.comm.threshold import DmaThreshold

    rank, world, device, gloo = init_torchrun()
    max_bytes = max(SIZES)

    def nccl(t):
        dist.all_reduce(t)
        return t

    dist.all_reduce(torch.ones(1, device=device))

    ring = DmaBackend.create(exchange_group=gloo, device=device, max_bytes=max_bytes, world_size=world)
    t0 = time.perf_counter()
    router = build_router(
        group=gloo, device=device, threshold=DmaThreshold.auto(), max_bytes=max_bytes, fallback=nccl,
        hooks=RouterHooks(cache=CrossoverCache(Path(tempfile.mkdtemp()))),
    )
    auto_seconds = time.perf_counter() - t0
    decision = router.decision

    backends = {"nccl": nccl, "dma": ring.all_reduce, "router": router.all_reduce}
    raw = {name: {n: [] for n in SIZES} for name in backends}
    inputs = {}
    for n in SIZES:
        x = torch.randn(n // 2, device=device, dtype=torch.float32).to(torch.bfloat16)
        inputs[n] = x
        for fn in backends.values():  # warm-up (plans for the ring are prepared here)
            for _ in range(3):
                fn(x.clone())
    torch.cuda.synchronize()
    # NCCL and the router run the same collective, so they are timed call by call
    # interleaved (alternating order) in one block; the ring runs in its own block
    # (interleaving it with NCCL slows both: measured 0.05 -> 0.15 ms NCCL latency).
    # Blocks repeat for several rounds so drift hits every backend alike.
    pair = ["nccl", "router"]
    for n in SIZES:
        for _ in range(args.rounds):
            xs = {name: inputs[n].clone() for name in backends}
            for i in range(args.iters):
                for name in (pair if i % 2 == 0 else pair[::-1]):
                    raw[name][n] += event_times(backends[name], xs[name], 1)
            raw["dma"][n] += event_times(backends["dma"], xs["dma"], args.iters)
    # Host cost of routing alone (no collective): router vs its fallback, both no-ops.
    host_ns = routing_host_ns(type(router), inputs[SIZES[0]])
    graph = {"nccl": {}, "dma": {}}
    for n in SIZES:
        graph["nccl"][n] = statistics.median(graph_times(nccl, inputs[n].clone(), args.iters))
        graph["dma"][n] = statistics.median(graph_times(ring.all_reduce, inputs[n].clone(), args.iters))
    ce = ce_peer_bandwidth() if rank == 0 else None

    rows = []
    for n in SIZES:
        med = {name: statistics.median(raw[name][n]) for name in backends}
        q = {name: statistics.quantiles(raw[name][n], n=4) for name in backends}
        best_name = min(("nccl", "dma"), key=lambda k: med[k])
        bus = 2 * (world - 1) / world * n
        rows.append({
            "bytes": n,
            "nccl_ms": med["nccl"] * 1e3,
            "dma_ms": med["dma"] * 1e3,
            "router_ms": med["router"] * 1e3,
            "stock_ms": med["nccl"] * 1e3,
            "dma_graph_ms": graph["dma"][n] * 1e3,
            "nccl_graph_ms": graph["nccl"][n] * 1e3,
            "router_route": router.choose(inputs[n]),
            "iqr_ms": {name: [q[name][0] * 1e3, q[name][2] * 1e3] for name in backends},
            "best_single": best_name,
            "best_over_router": med[best_name] / med["router"],
            "nccl_busbw_GBps": bus / med["nccl"] / 1e9,
            "dma_busbw_GBps": bus / med["dma"] / 1e9,
            "dma_graph_busbw_GBps": bus / graph["dma"][n] / 1e9,
        })

    router.close()
    ring.close()
    if rank == 0:
        ratio = min(r["best_over_router"] for r in rows)
        ce_gbps = None if ce is None else ce / 1e9
        big = [r for r in rows if r["bytes"] >= 24 * MiB]
        result = {
            "summary": {
                "metric": "min over sizes of (best single backend time / router time), bf16 all-reduce",
                "ratio": ratio,
                "goal": 0.97,
                "machine": f"{world}x {torch.cuda.get_device_name(device)} ({args.machine})",
                "date": time.strftime("%Y-%m-%d"),
            },
            "world_size": world,
            "dtype": "bfloat16",
            "timing": f"median of {args.rounds * args.iters} event-timed eager single calls per cell over "
                      f"{args.rounds} rounds; nccl and router interleaved call by call (alternating order), "
                      f"the ring in its own block each round; graph columns: median of {args.iters} "
                      "CUDA-graph replays",
            "router_host_overhead_ns": {
                "bare_call": host_ns["bare"], "router_call": host_ns["router"],
                "added_per_call": host_ns["router"] - host_ns["bare"],
                "note": "router with DMA off around a no-op fallback vs the no-op itself (no collective)",
            },
            "stock_note": "vLLM is not installed on the GPU machine: 'stock' = NCCL here",
            "router_decision": {
                "backend": decision.backend,
                "dma_min_bytes": decision.dma_min_bytes,
                "reason": decision.reason,
                "auto_startup_seconds": auto_seconds,
                "crossover_samples": [
                    {"bytes": s.nbytes, "next_ms": s.next_s * 1e3, "dma_ms": s.dma_s * 1e3}
                    for s in (decision.crossover.samples if decision.crossover else ())
                ],
            },
            "ce_peer_bandwidth_GBps": ce_gbps,
            "dma_busbw_over_ce_bw_at_ge_24MiB": [
                {"bytes": r["bytes"], "eager": r["dma_busbw_GBps"] / ce_gbps,
                 "graph": r["dma_graph_busbw_GBps"] / ce_gbps}
                for r in big
            ] if ce_gbps else None,
            "versions": {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))},
            "rows": rows,
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"allreduce-{args.machine}.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"{'bytes':>10} {'nccl':>8} {'dma':>8} {'router':>8} {'dma-g':>8} {'best/rtr':>8} route")
        for r in rows:
            print(f"{r['bytes']:>10} {r['nccl_ms']:8.3f} {r['dma_ms']:8.3f} {r['router_ms']:8.3f} "
                  f"{r['dma_graph_ms']:8.3f} {r['best_over_router']:8.3f} {r['router_route']}")
        print(json.dumps(result["summary"]))
        print("router:", decision.summary)
        print("CE peer GB/s:", ce_gbps)
        print("router host overhead ns:", result["router_host_overhead_ns"])
        print(f"plot: python benchmarks/plot.py (reads {path})")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
