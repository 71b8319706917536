"""GPU checks of the DMA router with the real b12x ring (run under torchrun, 2+ GPUs).

    torchrun --nproc-per-node 2 benchmarks/gpu/dma_checks.py --out DIR [--machine NAME]

1. P2P probe (the plugin's own, fail-closed) on this host.
2. Router with a fixed threshold over the real ring: correctness against NCCL
   at several sizes/shapes and bf16/fp16/fp32 (same-dtype NCCL result and an
   fp32 reference), identical results on every rank, small tensors → next.
3. CUDA-graph capture and replay: a prepared size captured through the router
   (ring), replayed on new data with no host-side ring calls; an unprepared
   size during capture falls through to NCCL.
4. First-use cost of an eager size the ring has not seen (plan materialisation).
5. Teardown: collective close on every rank; device memory returns.
6. Sleep mode: ``suspend()`` gives the ring's memory back, ``resume()`` takes it
   again and the rebuilt ring is correct.
7. A fault: the ring's construction fails on the last rank before its handle
   exchange; every rank keeps NCCL within the exchange timeout.
8. ``auto``: measured crossover on this host (first start, timed), then the
   cached decision.
9. Overhead of the router with DMA off over the bare next backend (small sizes).

Rank 0 writes ``dma-checks-<machine>.json`` into ``--out``; every check records
pass/fail with its numbers, and the process exits non-zero if any check failed.
``benchmarks/gpu/run_h200x2.sh`` runs this and ``allreduce.py`` in one go.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from allreduce import event_times, init_torchrun, routing_host_ns  # noqa: E402  (benchmarks/allreduce.py)

MiB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--machine", default="h200x2")
    args = parser.parse_args()

    from k3_accel.comm.build import RouterHooks, build_router
    from k3_accel.comm.crossover import CrossoverCache
    from k3_accel.comm.dma import b12x_runtime_class
    from k3_accel.comm.eligibility import probe_all_peer
    from k3_accel.comm.router import AllReduceRouter
    from k3_accel.comm.threshold import DmaThreshold

    rank, world, device, gloo = init_torchrun()
    dist.all_reduce(torch.ones(1, device=device))
    report: dict = {"world_size": world, "device": torch.cuda.get_device_name(device), "checks": {}}
    checks = report["checks"]

    def record(name, ok, **data):
        checks[name] = {"ok": bool(ok), **data}
        if rank == 0:
            print(f"[{'PASS' if ok else 'FAIL'}] {name}: {json.dumps(data, default=str)[:600]}", flush=True)

    def nccl_out(t):
        out = t.clone()
        dist.all_reduce(out)
        return out

    def nccl_in(t):
        dist.all_reduce(t)
        return t

    def same_on_all_ranks(t):
        ref = t.clone()
        dist.broadcast(ref, src=0)
        return bool(torch.equal(ref, t))

    # 1. probe ---------------------------------------------------------------
    t0 = time.perf_counter()
    probe = probe_all_peer(gloo, device)
    record("probe", probe.ok, reason=probe.reason, signature=probe.signature,
           seconds=time.perf_counter() - t0)

    # 2. fixed threshold over the real ring ------------------------------------
    hidden = 7168
    capture_tokens = 512                     # 512 x 7168 bf16 = 7 MiB, prepared before capture
    free0 = torch.cuda.mem_get_info(device)[0]
    t0 = time.perf_counter()
    router = build_router(
        group=gloo, device=device, threshold=DmaThreshold.at(1 * MiB), max_bytes=256 * MiB,
        fallback=nccl_out, hooks=RouterHooks(cache=None),
        capture_sizes=[(capture_tokens * hidden, torch.bfloat16)],
    )
    build_seconds = time.perf_counter() - t0
    free1 = torch.cuda.mem_get_info(device)[0]
    dec = router.decision
    record("build_fixed", router.dma is not None, summary=dec.summary, seconds=build_seconds,
           workspace_bytes=dec.workspace_bytes, device_bytes_taken=free0 - free1,
           prepared=dec.prepared_sizes)
    if router.dma is None:
        return finish(report, args.out, rank, args.machine)

    cases = []
    gen = torch.Generator(device=device)
    gen.manual_seed(1234 + rank)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for tokens in (80, 768, 1600, 4680):             # ~1.1 / 10.5 / 22 / 64 MiB in bf16
            numel = tokens * hidden
            if numel * torch.empty(0, dtype=dtype).element_size() > 256 * MiB:
                continue
            x = torch.randn(tokens, hidden, device=device, generator=gen, dtype=torch.float32)
            x = (x * (rank + 1)).to(dtype)
            keep = x.clone()
            route = router.choose(x)
            y = router.all_reduce(x)
            ref_same = nccl_out(x)
            ref32 = nccl_out(x.float())
            err = ((y.float() - ref32).norm() / ref32.norm()).item()
            diff = (y.float() - ref_same.float()).abs().max().item()
            cases.append({
                "dtype": str(dtype).removeprefix("torch."), "shape": [tokens, hidden],
                "bytes": x.numel() * x.element_size(), "route": route,
                "rel_err_vs_fp32": err, "max_abs_diff_vs_nccl_same_dtype": diff,
                "bit_exact_vs_nccl": bool(torch.equal(y, ref_same)),
                "identical_on_all_ranks": same_on_all_ranks(y), "finite": bool(torch.isfinite(y).all()),
                "input_untouched": bool(torch.equal(x, keep)),
            })
    # tolerance vs an fp32 reference: the inputs are exact in their dtype, so the only error
    # is one rounding per addition of the ring: (world - 1) units of the dtype's epsilon
    tol = {d: (world - 1) * torch.finfo(getattr(torch, d)).eps for d in ("bfloat16", "float16", "float32")}
    # two ranks add a + b on both paths, so the ring must match NCCL bit for bit there;
    # with more ranks the summation order may differ, so only the tolerance applies
    ok = all(
        c["route"] == "dma" and c["finite"] and c["identical_on_all_ranks"] and c["input_untouched"]
        and c["rel_err_vs_fp32"] < tol[c["dtype"]] and (world != 2 or c["bit_exact_vs_nccl"]) for c in cases
    )
    record("correctness", ok, cases=cases, tolerance=tol, bit_exact_required=world == 2)
    small = torch.randn(64, hidden, device=device).to(torch.bfloat16)     # 896 KiB
    odd = torch.randn(16 * 200_000 + 8, device=device).to(torch.bfloat16)   # 6.1 MiB, numel % 16 == 8
    record("small_and_unaligned_go_next", router.choose(small) == "next" and router.choose(odd) == "next",
           small=router.choose(small), odd=router.choose(odd))

    # 3. graph capture / replay -----------------------------------------------
    try:
        dma = router.dma
        static_in = torch.randn(capture_tokens, hidden, device=device).to(torch.bfloat16)
        unprepared_in = torch.randn(capture_tokens + 8, hidden, device=device).to(torch.bfloat16)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        routes = {}
        with torch.cuda.graph(graph, stream=stream):
            routes["prepared"] = router.choose(static_in)
            static_out = router.all_reduce(static_in)
            routes["unprepared"] = router.choose(unprepared_in)
            unprepared_out = router.all_reduce(unprepared_in)
        torch.cuda.synchronize()
        calls = {"n": 0}
        real = dma.all_reduce

        def counting(t):
            calls["n"] += 1
            return real(t)

        dma.all_reduce = counting
        replays = []
        for i in range(3):
            static_in.copy_(torch.randn(capture_tokens, hidden, device=device) * (rank + 1 + i))
            unprepared_in.copy_(torch.randn(capture_tokens + 8, hidden, device=device) * (rank + 1))
            graph.replay()
            torch.cuda.synchronize()
            ref = nccl_out(static_in.float())
            ref_u = nccl_out(unprepared_in.float())
            replays.append({
                "rel_err": ((static_out.float() - ref).norm() / ref.norm()).item(),
                "rel_err_unprepared": ((unprepared_out.float() - ref_u).norm() / ref_u.norm()).item(),
                "identical_on_all_ranks": same_on_all_ranks(static_out),
            })
        dma.all_reduce = real
        ok = (routes == {"prepared": "dma", "unprepared": "next"} and calls["n"] == 0
              and all(r["rel_err"] < 1e-2 and r["rel_err_unprepared"] < 1e-2 and r["identical_on_all_ranks"]
                      for r in replays))
        record("graph_capture_replay", ok, routes=routes, host_ring_calls_during_replay=calls["n"],
               replays=replays)
        del graph
    except Exception:  # noqa: BLE001
        record("graph_capture_replay", False, error=traceback.format_exc()[-1500:])

    # 4. first use of an unseen eager size --------------------------------------
    x = torch.randn(3000, hidden, device=device).to(torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    router.all_reduce(x)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    router.all_reduce(x)
    torch.cuda.synchronize()
    second = time.perf_counter() - t0
    record("new_eager_size_cost", True, first_call_ms=first * 1e3, second_call_ms=second * 1e3)

    # 5. teardown ---------------------------------------------------------------
    ring = router.dma
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info(device)[0]
    t0 = time.perf_counter()
    router.close()
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info(device)[0]
    released = free_after - free_before
    record("teardown", ring.closed and router.dma is None and released >= 0.9 * dec.workspace_bytes,
           released_bytes=released, workspace_bytes=dec.workspace_bytes,
           seconds=time.perf_counter() - t0, route_after_close=router.choose(x))

    # 6. sleep mode ----------------------------------------------------------------
    try:
        sleepy = build_router(
            group=gloo, device=device, threshold=DmaThreshold.at(1 * MiB), max_bytes=256 * MiB,
            fallback=nccl_out, hooks=RouterHooks(cache=None), capturable=False,
        )
        torch.cuda.synchronize()
        free = [torch.cuda.mem_get_info(device)[0]]
        t0 = time.perf_counter()
        what = [sleepy.suspend()]
        torch.cuda.synchronize()
        free.append(torch.cuda.mem_get_info(device)[0])
        what.append(sleepy.resume())
        torch.cuda.synchronize()
        free.append(torch.cuda.mem_get_info(device)[0])
        seconds = time.perf_counter() - t0
        y = torch.randn(1600, hidden, device=device).to(torch.bfloat16) * (rank + 1)
        ok_after = sleepy.choose(y) == "dma" and torch.equal(sleepy.all_reduce(y), nccl_out(y))
        ws = sleepy.decision.workspace_bytes
        released, retaken = free[1] - free[0], free[1] - free[2]
        record("sleep_mode", released >= 0.9 * ws and retaken >= 0.9 * ws and ok_after,
               workspace_bytes=ws, released_bytes=released, retaken_bytes=retaken, steps=what,
               seconds=seconds, correct_after_resume=ok_after)
        sleepy.close()
    except Exception:  # noqa: BLE001
        record("sleep_mode", False, error=traceback.format_exc()[-1500:])

    # 7. a fault: the ring's construction fails on the last rank before its exchange
    real_cls = b12x_runtime_class()

    def failing_cls(**kw):
        if rank == world - 1:
            raise RuntimeError("injected: allocation failed before the handle exchange")
        return real_cls(**kw)

    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info(device)[0]
    t0 = time.perf_counter()
    faulty = build_router(
        group=gloo, device=device, threshold=DmaThreshold.at(1 * MiB), max_bytes=256 * MiB, fallback=nccl_out,
        hooks=RouterHooks(cache=None, runtime_cls=failing_cls, exchange_timeout_s=20.0),
    )
    seconds = time.perf_counter() - t0
    torch.cuda.synchronize()
    held = free0 - torch.cuda.mem_get_info(device)[0]
    d = faulty.decision
    ok = faulty.dma is None and d.failed and "injected" in d.reason and seconds < 120
    record("fault_ring_init", ok, reason=d.reason, seconds=seconds, device_bytes_still_held=held,
           note="a bound, not a speed claim: the waiting ranks give up after exchange_timeout_s=20")

    # 8. auto ------------------------------------------------------------------
    cache_dir = Path(tempfile.mkdtemp(prefix="k3-auto-"))
    results = []
    for attempt in range(2):
        t0 = time.perf_counter()
        auto = build_router(
            group=gloo, device=device, threshold=DmaThreshold.auto(), max_bytes=256 * MiB,
            fallback=nccl_in, hooks=RouterHooks(cache=CrossoverCache(cache_dir)),
        )
        seconds = time.perf_counter() - t0
        d = auto.decision
        results.append({
            "backend": d.backend, "dma_min_bytes": d.dma_min_bytes, "reason": d.reason,
            "decision_seconds": d.seconds,
            "source": d.crossover.source if d.crossover else None, "seconds": seconds,
            "ring_kept": auto.dma is not None,
            "samples": [{"bytes": s.nbytes, "next_ms": s.next_s * 1e3, "dma_ms": s.dma_s * 1e3}
                        for s in (d.crossover.samples if d.crossover else ())],
        })
        auto.close()
    record("auto_crossover", results[0]["source"] == "measured" and results[1]["source"] == "cache"
           and results[0]["dma_min_bytes"] == results[1]["dma_min_bytes"], runs=results)

    # 9. overhead of the router with DMA off -----------------------------------
    # stock = the bare next backend; router = AllReduceRouter(dma=None) around it;
    # branch = the adapter's own DMA-off path (one `is None` test, then stock).
    off = AllReduceRouter(fallback=nccl_in, dma=None)
    holder = type("Holder", (), {"k3_router": None})()

    def branch(t):
        r = holder.k3_router
        if r is None:
            return nccl_in(t)
        return r.all_reduce(t)

    fns = {"stock": nccl_in, "router": off.all_reduce, "branch": branch}
    rows = []
    for nbytes in (64 << 10, 256 << 10, 1 * MiB):
        base = torch.randn(nbytes // 2, device=device).to(torch.bfloat16)
        xs = {k: base.clone() for k in fns}
        for k, fn in fns.items():
            for _ in range(10):
                fn(xs[k])
        torch.cuda.synchronize()
        ev = {k: [] for k in fns}
        names = list(fns)
        for i in range(300):
            if i % 50 == 0:
                xs = {k: base.clone() for k in fns}
            for k in (names if i % 2 == 0 else names[::-1]):
                ev[k] += event_times(fns[k], xs[k], 1)
        row = {"bytes": nbytes}
        for k in fns:
            row[f"{k}_us"] = statistics.median(ev[k]) * 1e6
        row["router_over_stock"] = row["router_us"] / row["stock_us"]
        row["branch_over_stock"] = row["branch_us"] / row["stock_us"]
        rows.append(row)
    host = routing_host_ns(AllReduceRouter, base)
    record("overhead_dma_off", True, rows=rows, host_ns_per_call=host,
           note="median of 300 interleaved event-timed single calls per cell; pure NCCL as stock")

    return finish(report, args.out, rank, args.machine)


def finish(report, out_dir, rank, machine) -> int:
    ok = all(c["ok"] for c in report["checks"].values())
    report["all_ok"] = ok
    report["date"] = time.strftime("%Y-%m-%d")
    report["versions"] = {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    try:
        from importlib.metadata import version
        report["versions"]["b12x"] = version("b12x")
    except Exception:  # noqa: BLE001
        pass
    if rank == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"dma-checks-{machine}.json").write_text(json.dumps(report, indent=1, default=str))
        print("ALL OK" if ok else "SOME CHECKS FAILED", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
