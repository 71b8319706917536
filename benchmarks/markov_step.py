"""DSpark's Markov step on the device: the fused kernel against the two-kernel step it replaced.

One draft position of the sequential Markov head at the Qwen3-8B-like shape of
``draft_step_dspark.py`` (draft vocabulary 151,936, Markov rank 256, bf16): the bias
``e @ markov_w2.T`` for R requests, added to the position's base logits, and the pick (greedy
argmax, or the seeded Gumbel-max sample at temperature 1).

* ``two_kernel``: the bias GEMM (cuBLAS), the sum stored ``[R, V]``, then the Triton argmax or
  Gumbel-max pass over it (the engine's step before the fused kernel, as ``ops_torch.markov_pick``
  composes it, with the Triton pick);
* ``fused``: ``ops_triton.markov_pick`` (one pass over ``markov_w2``; nothing ``[R, V]`` stored),
  for each ``--tiles`` entry (columns per block, warps, stages, programs per SM; the first is the
  shipped one);
* ``floor``: ``markov_w2``'s bytes plus the base logits' bytes / copy bandwidth measured here;
* ``head``: ``ops_triton.markov_drafts``, the engine's whole Markov head (each step's token read
  from the step before, ``e = w1[prev]`` gathered in the kernel), per step, with odd steps walking
  the columns backwards (``head_ms`` for each tile; ``walk_back``, the shipped tile) and without
  (``walk_forward``, the shipped tile).

Each is K = 7 steps captured in one CUDA graph, replayed (device time by CUDA events, median of
``--repeats``), per step. ``summary.ratio`` = worst over R in {1, 8, 32, 64} and greedy/sampled of
shipped fused ÷ two-kernel; goal below 1 (the fused step is faster). GPU only.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

SRC = str(Path(__file__).resolve().parents[1] / "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)

from report import emit  # noqa: E402  (benchmarks/report.py)
from k3_accel.server.engines.dflash import ops_triton, triton_sampling  # noqa: E402


def graph_ms(fn, k: int, repeats: int) -> float:
    """Device ms per step of ``fn(i)`` for i < k, captured once as a graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(k):                                  # compile and warm up outside the capture
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(k):
            fn(i)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / k)
    return statistics.median(times)


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * 10 * src.numel() / (start.elapsed_time(end) / 1e3)      # read + write bytes / s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--rank", type=int, default=256)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--tiles", default="128:4:3:2,64:4:3:2,64:4:4:2,128:4:2:1,128:8:3:1,32:4:4:3,64:8:3:2")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, dtype, v, r, k = "cuda", torch.bfloat16, args.vocab, args.rank, args.k
    tiles = [tuple(int(x) for x in t.split(":")) for t in args.tiles.split(",")]
    bw = copy_bandwidth()
    gen = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(v, r, device=dev, dtype=dtype, generator=gen) * (4 / r ** 0.5)
    w1 = torch.randn(v, r, device=dev, dtype=dtype, generator=gen)
    table = []
    for b in (int(x) for x in args.batches.split(",")):
        base = torch.randn(b, k, v, device=dev, dtype=dtype, generator=gen) * 3
        e = torch.randn(b, r, device=dev, dtype=dtype, generator=gen)
        temps = torch.ones(b, device=dev)
        seeds = torch.randint(0, 2**62, (b,), device=dev, generator=gen)
        lens = torch.randint(0, 4096, (b,), device=dev, dtype=torch.int32, generator=gen)
        floor = (w.numel() * w.element_size() + b * v * base.element_size()) / bw * 1e3
        for sampled in (False, True):
            extra = (temps, seeds, lens) if sampled else ()

            def two_kernel(i):
                logits = base[:, i] + F.linear(e, w)
                if sampled:
                    return ops_triton.gumbel_argmax(logits, temps, seeds, lens, i)
                return ops_triton.argmax(logits)

            row = {"B": b, "sampled": sampled, "floor_ms": floor,
                   "two_kernel_ms": graph_ms(two_kernel, k, args.repeats), "fused_ms": {}}
            anchors = torch.randint(0, v, (b,), device=dev, generator=gen)

            def head(i):
                return i or ops_triton.markov_drafts(base, anchors, w1, w, 1.0, None, *extra)

            row["head_ms"] = {}
            for tile in tiles:
                triton_sampling.TILE = tile
                name = ":".join(map(str, tile))
                row["fused_ms"][name] = graph_ms(
                    lambda i: ops_triton.markov_pick(base[:, i], e, w, 1.0, *extra, *((i,) if sampled else ())),
                    k, args.repeats)
                row["head_ms"][name] = graph_ms(head, k, args.repeats)      # walking back, as shipped
            triton_sampling.TILE = tiles[0]
            row["walk_back_ms"] = row["head_ms"][":".join(map(str, tiles[0]))]
            triton_sampling.WALK_BACK = False
            row["walk_forward_ms"] = graph_ms(head, k, args.repeats)
            triton_sampling.WALK_BACK = True
            shipped = row["fused_ms"][":".join(map(str, tiles[0]))]
            row["fused_over_two_kernel"] = shipped / row["two_kernel_ms"]
            row["fused_over_floor"] = shipped / floor
            table.append(row)
            print(row, flush=True)
    ratio = max(row["fused_over_two_kernel"] for row in table)
    emit({"benchmark": "markov_step", "config": {"vocab": v, "rank": r, "k": k, "dtype": str(dtype), "tiles": tiles},
          "bandwidth": bw, "table": table,
          "summary": {"metric": "fused Markov step / two-kernel step (device ms per step, graph replay), "
                                "worst over B in {1, 8, 32, 64}, greedy and sampled",
                      "ratio": ratio, "goal": "< 1", "machine": f"{torch.cuda.get_device_name()}, torch {torch.__version__}",
                      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}},
         args.out)


if __name__ == "__main__":
    main()
