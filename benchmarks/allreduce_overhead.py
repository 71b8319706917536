"""Cost of installing k3-accel where the DMA ring is off: K3CudaCommunicator vs stock.

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=src python benchmarks/allreduce_overhead.py --out benchmarks/results

Runs the real vLLM ``CudaCommunicator`` and ``K3CudaCommunicator`` (ring off, as
``auto`` leaves it on NVLink) side by side on one 2-process gloo group on CPU,
small tensors, single calls interleaved call by call (alternating order);
reports the median per-call time of each and their ratio. On CPU the
collective is gloo, so this measures the adapter's host-side cost (one
``is None`` branch) against a ~50–100 µs collective; the GPU counterpart is
``benchmarks/gpu/dma_checks.py`` (section "overhead_dma_off").
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_DISABLE_PYNCCL", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

SIZES = (4 << 10, 64 << 10, 256 << 10)
CALLS = 3000


def worker(rank, world, port, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

    from k3_accel.comm.threshold import DmaThreshold
    from k3_accel.vllm.tp.communicator import K3CudaCommunicator, Overrides

    K3CudaCommunicator.overrides = Overrides(threshold=DmaThreshold.off())
    group = dist.new_group(backend="gloo")
    kw = dict(cpu_group=group, device=torch.device("cpu"), device_group=group, unique_name="tp:0")
    stock = CudaCommunicator(**kw)
    k3 = K3CudaCommunicator(**kw)
    assert k3.k3_router is None
    fns = {"stock": stock.all_reduce, "k3": k3.all_reduce}
    rows = []
    for nbytes in SIZES:
        x = torch.randn(nbytes // 4)
        for fn in fns.values():
            for _ in range(50):
                fn(x)
        samples = {k: [] for k in fns}
        names = list(fns)
        for i in range(CALLS):
            for k in (names if i % 2 == 0 else names[::-1]):
                t0 = time.perf_counter_ns()
                fns[k](x)
                samples[k].append(time.perf_counter_ns() - t0)
        med = {k: statistics.median(v) / 1e3 for k, v in samples.items()}
        rows.append({"bytes": nbytes, "stock_us": med["stock"], "k3_us": med["k3"],
                     "ratio": med["k3"] / med["stock"]})
    k3.destroy()
    stock.destroy()
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=600)
    for p in procs:
        p.join()
    import vllm

    result = {
        "summary": {
            "metric": "K3CudaCommunicator.all_reduce (DMA off) / stock CudaCommunicator.all_reduce, "
                      "median per call, max over sizes (lower is better)",
            "ratio": max(r["ratio"] for r in rows),
            "goal": 1.02,  # lower is better: at most 2 % over stock
            "machine": f"CPU, {os.cpu_count()} cores, gloo, 2 processes",
            "date": time.strftime("%Y-%m-%d"),
        },
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "calls_per_cell": CALLS,
        "rows": rows,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "allreduce-overhead-cpu.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
