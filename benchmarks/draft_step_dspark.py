"""DSpark draft step time against the floor set by the bytes that must move.

Checkpoint: a Qwen3-8B-like DSpark draft (``draft_step.config``: hidden 4096, 5 layers,
32/8 heads, head_dim 128, intermediate 12288, vocab 151936, 5 aux layers, block 16) with a
Markov head of rank ``--markov-rank`` (default 256) and a confidence head reading
``[hidden | Markov embedding]``, ``sample_from_anchor`` (K query rows), random weights built
on the device, bf16.

* propose at B in {1, 8, 32, 64}, K in {7, 15}, context in {1024, 8192}: greedy (``propose_ms``)
  and sampled (every request at temperature 1 with its own seed, ``sampled_ms``), CUDA graphs
  when they apply (``eager_ms``: greedy without them). Time = host wall clock of one
  ``propose`` call (median), drafts and confidence on the host.
* floor = bytes a step must read once / copy bandwidth measured in this run: the backbone
  layers, final norm, lm_head, the block's embedding rows, each request's context K/V, the
  Markov head (``markov_w2`` once, the ``markov_w1`` rows of B x K tokens) and the confidence
  head. The Markov loop's K sequential steps (K bias GEMMs over ``markov_w2``, K samples, their
  launches) are not in the floor: they count against the engine (``markov_rereads_ms``: what reading
  ``markov_w2`` again at each later step costs at the copy bandwidth, for reference).

* diagnosis, not the ratio (CUDA): ``graph_device_ms``, the replay alone on the device (replays queued
  back to back), and ``replay_launch_ms``, the host's ``replay()`` call alone with the device idle.

``summary.ratio`` = the worst of greedy and sampled propose / floor over B in {1, 8, 32} at K=7,
context 1024; goal 2.0. ``--smoke`` runs tiny shapes on any device (the CPU included).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

SRC = str(Path(__file__).resolve().parents[1] / "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)

from report import emit  # noqa: E402  (benchmarks/report.py)
from draft_step import config, fill, propose_weight_bytes, random_weights, timed  # noqa: E402
from k3_accel.server.engines.base import ProposeBatch  # noqa: E402
from k3_accel.server.engines.dflash import DSparkEngine, triton_sampling  # noqa: E402
from k3_accel.server.engines.dflash.dspark_config import DSparkConfig  # noqa: E402
from k3_accel.server.engines.dflash.dspark_weights import DSparkHeads  # noqa: E402

import draft_step_parts as parts  # noqa: E402  (benchmarks/draft_step_parts.py)


def dspark_config(smoke: bool, rank: int) -> DSparkConfig:
    base = config(smoke)
    return DSparkConfig(**{f: getattr(base, f) for f in base.__dataclass_fields__}, markov_rank=rank,
                        confidence_head=True, confidence_with_markov=True, sample_from_anchor=True)


def random_heads(cfg: DSparkConfig, device: str, dtype: torch.dtype, seed: int = 1) -> DSparkHeads:
    gen = torch.Generator(device=device).manual_seed(seed)
    r, width = cfg.markov_rank, cfg.hidden_size + cfg.markov_rank
    return DSparkHeads(
        markov_w1=torch.randn(cfg.vocab_size, r, generator=gen, device=device, dtype=dtype),
        markov_w2=torch.randn(cfg.draft_vocab_size, r, generator=gen, device=device, dtype=dtype) * (4 / math.sqrt(r)),
        confidence_w=torch.randn(1, width, generator=gen, device=device) / math.sqrt(width),
        confidence_b=torch.zeros(1, device=device))


def head_bytes(heads: DSparkHeads, tokens: int) -> int:
    """The Markov and confidence heads' bytes one propose must read: ``markov_w2`` once, the
    ``markov_w1`` rows of ``tokens`` previous tokens, the confidence projection."""
    w1 = heads.markov_w1
    return (heads.markov_w2.numel() * heads.markov_w2.element_size() + tokens * w1.shape[1] * w1.element_size()
            + heads.confidence_w.numel() * 4 + 4)


def launch_seconds(graph, stream, iters: int) -> float:
    """Median host time of the ``replay()`` call alone, the device idle before each: what launching
    the graph costs the host (part of ``propose_ms`` minus ``graph_device_ms``)."""
    times = []
    for _ in range(iters):
        stream.synchronize()
        begin = time.perf_counter()
        graph.replay()
        times.append(time.perf_counter() - begin)
    stream.synchronize()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", "--quick", action="store_true", help="tiny shapes on any device (a smoke run)")
    ap.add_argument("--markov-rank", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--main", action="store_true", help="only the summary's points (K = 7, context 1,024, B = 1, 8, 32)")
    ap.add_argument("--markov-tile", help="the Markov kernel's tile, BLOCK:WARPS:STAGES:PER_SM (default: as shipped)")
    ap.add_argument("--attention", action="store_true", help="also time one layer's attention at each "
                    "context split count (CUDA; diagnosis: attention_ms in each point)")
    ap.add_argument("--out", help="write the JSON document here too")
    args = ap.parse_args()
    if args.markov_tile:
        triton_sampling.TILE = tuple(int(x) for x in args.markov_tile.split(":"))
    dev, cuda = args.device, args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = dspark_config(args.smoke, 16 if args.smoke else args.markov_rank)
    batches, ks = ((1, 8, 32), (7,)) if args.smoke else ((1, 8, 32, 64), (7, 15))
    contexts = (64,) if args.smoke else (1024, 8192)
    if args.main and not args.smoke:
        batches, ks, contexts = (1, 8, 32), (7,), (1024,)
    iters = 3 if args.smoke else args.iters

    weights, heads = random_weights(cfg, dev, dtype), random_heads(cfg, dev, dtype)
    bw = parts.bandwidths(dev, quick=args.smoke)
    row_bytes = 2 * cfg.num_layers * cfg.kv_size * torch.empty((), dtype=dtype).element_size()
    pool_rows = max(batches) * sum(contexts) + 64 * 1024
    engine = DSparkEngine.from_weights(weights, heads, budget_bytes=pool_rows * row_bytes,
                                       max_batch=max(batches), graph_k=ks)
    hidden = torch.randn(max(contexts), cfg.context_width, device=dev, dtype=torch.float32).to(dtype)
    ctx_states = {c: fill(engine, max(batches), c, hidden) for c in contexts}
    gen = torch.Generator().manual_seed(0)

    table = []
    for c in contexts:
        for k in ks:
            for b in batches:
                states = ctx_states[c][:b]
                anchors = torch.randint(0, cfg.vocab_size - 1, (b,), generator=gen)
                greedy = ProposeBatch(states, [[]] * b, anchors, k)
                sampled = ProposeBatch(states, [[]] * b, anchors, k, temperature=torch.ones(b),
                                       seeds=torch.arange(b, dtype=torch.int64) * 1_000_003)
                ms = 1e3 * timed(lambda: engine.propose(greedy).wait(), iters, 3, sync)
                sampled_ms = 1e3 * timed(lambda: engine.propose(sampled).wait(), iters, 3, sync)
                graphs, engine.graphs = engine.graphs, None
                eager_ms = 1e3 * timed(lambda: engine.propose(greedy).wait(), max(3, iters // 4), 1, sync)
                engine.graphs = graphs
                floor = (propose_weight_bytes(weights, b * k) + b * c * row_bytes + head_bytes(heads, b * k)) / bw["copy"]
                worst = max(ms, sampled_ms)
                w2 = heads.markov_w2.numel() * heads.markov_w2.element_size()
                table.append({"B": b, "K": k, "context": c, "propose_ms": ms, "sampled_ms": sampled_ms,
                              "eager_ms": eager_ms, "floor_ms": 1e3 * floor, "ratio": worst / (1e3 * floor),
                              # not in the floor: markov_w2 read again at each of the K - 1 later steps
                              "markov_rereads_ms": 1e3 * (k - 1) * w2 / bw["copy"]})
                # diagnosis, not the ratio: the replay alone on the device (propose_ms minus this is the
                # host's share) and the matrix FLOPs at the measured matmul rate (where compute, not bytes, binds)
                flops = parts.propose_flops(cfg, b, k - 1, c) + 2 * b * cfg.hidden_size * cfg.vocab_size  # K query rows
                table[-1]["flop_ms"] = 1e3 * flops / bw["matmul_flops"]
                graph = engine.graphs and engine.graphs.graphs.get(
                    (next(x for x in engine.graphs.buckets if x >= b), k, 0))
                if graph and cuda:
                    with torch.cuda.stream(engine.stream):
                        table[-1]["graph_device_ms"] = parts._events_ms(graph.graph.replay, iters)
                        table[-1]["replay_launch_ms"] = 1e3 * launch_seconds(graph.graph, engine.stream, iters)
                if args.attention and cuda and k == ks[0]:
                    table[-1]["attention_ms"] = parts.splits_sweep(engine, states, k, iters, bw["copy"])
                print(table[-1], flush=True)
                if args.out:                   # what a run cut short by its time limit still leaves
                    Path(args.out + ".partial").write_text(json.dumps(table, indent=1) + "\n")

    main_points = [r for r in table if r["K"] == 7 and r["context"] == contexts[0] and r["B"] in (1, 8, 32)]
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    machine = (torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu") + \
        f", torch {torch.__version__}"
    doc = {
        "benchmark": "draft_step_dspark",
        "config": {"hidden": cfg.hidden_size, "layers": cfg.num_layers, "heads": cfg.num_heads,
                   "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                   "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
                   "aux_layers": cfg.num_aux, "block_size": cfg.block_size, "markov_rank": cfg.markov_rank,
                   "confidence_head": "[hidden | markov]", "sample_from_anchor": True, "dtype": str(dtype),
                   "kernels": engine.ops.__name__.rsplit(".", 1)[-1], "markov_tile": triton_sampling.TILE,
                   "graph_buckets": engine.graphs.buckets if engine.graphs else None, "smoke": args.smoke},
        "bandwidth": bw,
        "table": table,
        "summary": {
            "metric": "DSpark propose time (worst of greedy and sampled) / floor (bytes that must move / "
                      "measured copy bandwidth), worst over B in {1, 8, 32} at K=7, context 1024",
            "ratio": max(r["ratio"] for r in main_points), "goal": 2.0,
            "machine": machine, "date": now},
    }
    emit(doc, args.out)


if __name__ == "__main__":
    main()
