"""DFlash draft step time, old engine vs new, against the floor set by the bytes that must move.

Checkpoint: shaped like a Qwen3-8B DFlash draft (hidden 4096, 5 layers, 32/8 heads,
head_dim 128, intermediate 12288, vocab 151936, 5 aux layers, block 16), random
weights built on the device (no downloads, nothing written to disk), bf16.

* propose at B in {1, 8, 32, 64}, K in {7, 15}, context in {1024, 8192}: the new
  engine (graphs when they apply; ``eager_ms`` without them) and the old eager
  per-request engine (``testing/dflash_eager``) at B in {1, 8, 32, 64}, K=7, ctx 1024.
  Time = host wall clock of one ``propose`` call (median), drafts on the host.
* floor = bytes a step must read once / copy bandwidth measured in this run
  (device-to-device copy, bytes read + written): propose reads the draft layers,
  the final norm and lm_head (not fc/hidden_norm, which only ingest needs), the
  embedding rows of its blocks, and each request's context K/V.
* ingest of one 8192-row chunk from host memory (pageable and pinned); its floor is
  the larger of the host-to-device copy (pinned bandwidth measured here) and the
  device bytes (fc + K/V projection weights, the rows, the K/V written).
* attention alone (the choice of kernel), and a profile of one eager step.

``summary.ratio`` = the worst new-engine propose/floor over B in {1, 8, 32} at
K=7, context 1024; goal 2.0. ``--quick`` runs tiny shapes on any device.
"""
from __future__ import annotations

import argparse
import datetime
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
from k3_accel.server.engines.base import IngestBatch, ProposeBatch  # noqa: E402
from k3_accel.server.engines.dflash import DFlashEngine  # noqa: E402
from k3_accel.server.engines.dflash.config import DFlashConfig  # noqa: E402
from k3_accel.server.engines.dflash.weights import DFlashWeights, LayerWeights  # noqa: E402
from k3_accel.testing.dflash_eager import EagerDFlashEngine  # noqa: E402

import draft_step_parts as parts  # noqa: E402  (benchmarks/draft_step_parts.py)


def config(quick: bool) -> DFlashConfig:
    big = dict(hidden_size=4096, num_layers=5, num_heads=32, num_kv_heads=8, head_dim=128,
               intermediate_size=12288, vocab_size=151936, target_layer_ids=(1, 9, 17, 25, 33))
    small = dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                 intermediate_size=512, vocab_size=4096, target_layer_ids=(1, 3))
    shape = small if quick else big
    return DFlashConfig(
        **shape, rms_norm_eps=1e-6, rope_theta=1e6, rotary_dim=shape["head_dim"], is_neox_style=True,
        max_position_embeddings=40960, attention_bias=False, draft_vocab_size=shape["vocab_size"],
        target_hidden_size=shape["hidden_size"], logit_scale=1.0,
        mask_token_id=shape["vocab_size"] - 1, block_size=16, causal=False, v_scale=None)


def random_weights(cfg: DFlashConfig, device: str, dtype: torch.dtype, seed: int = 0) -> DFlashWeights:
    gen = torch.Generator(device=device).manual_seed(seed)

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen, device=device, dtype=dtype) / math.sqrt(in_f)

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=gen, device=device, dtype=dtype)

    h, f = cfg.hidden_size, cfg.intermediate_size
    layers = [LayerWeights(
        input_layernorm=norm(h), post_attention_layernorm=norm(h), q_proj=lin(cfg.q_size, h),
        k_proj=lin(cfg.kv_size, h), v_proj=lin(cfg.kv_size, h), o_proj=lin(h, cfg.q_size),
        q_norm=norm(cfg.head_dim), k_norm=norm(cfg.head_dim), gate_proj=lin(f, h),
        up_proj=lin(f, h), down_proj=lin(h, f)) for _ in range(cfg.num_layers)]
    return DFlashWeights(
        config=cfg, fc=lin(h, cfg.context_width), hidden_norm=norm(h), norm=norm(h), layers=layers,
        embed_tokens=torch.randn(cfg.vocab_size, h, generator=gen, device=device, dtype=dtype),
        lm_head=lin(cfg.vocab_size, h) * 4)


def propose_weight_bytes(w: DFlashWeights, rows: int) -> int:
    """Weights one propose must read: the layers, final norm, lm_head, ``rows`` embedding rows."""
    layer = sum(t.numel() * t.element_size() for lw in w.layers for t in vars(lw).values()
                if isinstance(t, torch.Tensor))
    row = w.embed_tokens.shape[1] * w.embed_tokens.element_size()
    return layer + w.norm.numel() * w.norm.element_size() + \
        w.lm_head.numel() * w.lm_head.element_size() + rows * row


def timed(fn, iters: int, warmup: int, sync) -> float:
    """Median wall seconds of ``fn``, whose return means the drafts are on the host (a
    proposal's ``wait()``); ``sync`` after each call, outside the timer (nothing of the call is
    left on the device then; a device-wide synchronize alone took 22-24 us on an H100 host)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        sync()
    return statistics.median(times)


def fill(engine: DFlashEngine, count: int, rows: int, hidden: torch.Tensor) -> list:
    """``count`` requests of ``rows`` context rows each (device rows, one ingest per request)."""
    states = []
    for _ in range(count):
        s = engine.new_state()
        engine.ingest(IngestBatch([s], [0], [rows], torch.arange(rows), torch.zeros(rows, dtype=torch.long),
                                  hidden[:rows]))
        states.append(s)
    return states


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", help="write the JSON document here too")
    ap.add_argument("--profile-out", help="write the profiler's kernel table here")
    args = ap.parse_args()
    dev, cuda = args.device, args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = config(args.quick)
    batches, ks = ((1, 8, 32), (7,)) if args.quick else ((1, 8, 32, 64), (7, 15))
    contexts = (64,) if args.quick else (1024, 8192)
    old_batches = (1, 8) if args.quick else (1, 8, 32, 64)
    ingest_rows = 256 if args.quick else 8192

    weights = random_weights(cfg, dev, dtype)
    bw = parts.bandwidths(dev, quick=args.quick)
    row_bytes = 2 * cfg.num_layers * cfg.kv_size * torch.empty((), dtype=dtype).element_size()
    pool_rows = max(batches) * sum(contexts) + 64 * 1024 + 4 * ingest_rows
    engine = DFlashEngine.from_weights(weights, budget_bytes=pool_rows * row_bytes,
                                       max_batch=max(batches), graph_k=ks)
    hidden = torch.randn(max(contexts + (ingest_rows,)), cfg.context_width, device=dev,
                         dtype=torch.float32).to(dtype)
    ctx_states = {c: fill(engine, max(batches), c, hidden) for c in contexts}
    gen = torch.Generator().manual_seed(0)

    table = []
    for c in contexts:
        for k in ks:
            for b in batches:
                states = ctx_states[c][:b]
                batch = ProposeBatch(states, [[]] * b, torch.randint(0, cfg.vocab_size - 1, (b,),
                                                                     generator=gen), k)
                ms = 1e3 * timed(lambda: engine.propose(batch).wait(), args.iters, 3, sync)
                graphs, engine.graphs = engine.graphs, None
                eager_ms = 1e3 * timed(lambda: engine.propose(batch).wait(), max(3, args.iters // 4), 1, sync)
                engine.graphs = graphs
                floor = (propose_weight_bytes(weights, b * (k + 1)) + b * c * row_bytes) / bw["copy"]
                table.append({"engine": "new", "B": b, "K": k, "context": c, "propose_ms": ms,
                              "eager_ms": eager_ms, "floor_ms": 1e3 * floor, "ratio": ms / (1e3 * floor),
                              "flop_ms": 1e3 * parts.propose_flops(cfg, b, k, c) / bw["matmul_flops"]})
                graph = engine.graphs and engine.graphs.graphs.get(
                    (next(x for x in engine.graphs.buckets if x >= b), k, 0))
                if graph:                  # the replay alone: propose_ms minus this is host time
                    with torch.cuda.stream(engine.stream):
                        table[-1]["graph_device_ms"] = parts._events_ms(graph.graph.replay, args.iters)
                print(table[-1], flush=True)

    old = EagerDFlashEngine(weights)
    c, k = contexts[0], 7
    old_states = []
    for _ in range(max(old_batches)):
        s = old.new_state()
        old.append(s, hidden[:c])
        old_states.append(s)
    for b in old_batches:
        anchors = torch.randint(0, cfg.vocab_size - 1, (b,), generator=gen).tolist()
        ms = 1e3 * timed(lambda: old.propose(old_states[:b], anchors, k), 3, 1, sync)
        floor = (propose_weight_bytes(weights, b * (k + 1)) + b * c * row_bytes) / bw["copy"]
        table.append({"engine": "old", "B": b, "K": k, "context": c, "propose_ms": ms,
                      "floor_ms": 1e3 * floor, "ratio": ms / (1e3 * floor)})
        print(table[-1], flush=True)
    del old_states, old

    ingest = parts.ingest_points(engine, weights, cfg, ingest_rows, bw, sync)
    attention = parts.attention_choice(engine, ctx_states, contexts, sync, args.iters, bw["copy"])
    profile = None
    if cuda:
        try:
            profile = [parts.profile_step(engine, ctx_states[contexts[0]][:b], cfg, args.profile_out)
                       for b in (32, 1)]
        except Exception as exc:          # the profile is informative; never lose the run for it
            profile = {"error": repr(exc)}

    main_points = [r for r in table if r["engine"] == "new" and r["K"] == 7
                   and r["context"] == contexts[0] and r["B"] in (1, 8, 32)]
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    machine = (torch.cuda.get_device_name(dev) if cuda else platform.processor() or "cpu") + \
        f", torch {torch.__version__}"
    doc = {
        "benchmark": "draft_step",
        "config": {"hidden": cfg.hidden_size, "layers": cfg.num_layers, "heads": cfg.num_heads,
                   "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                   "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
                   "aux_layers": cfg.num_aux, "block_size": 16, "dtype": str(dtype),
                   "kernels": engine.ops.__name__.rsplit(".", 1)[-1],
                   "graph_buckets": engine.graphs.buckets if engine.graphs else None},
        "bandwidth": bw,
        "table": table,
        "ingest": ingest,
        "attention": attention,
        "profile": profile,
        # The lead adds the client round trip (engine + transport) at B = 32 here.
        "client_round_trip": None,
        "summary": {
            "metric": "new-engine propose time / floor (bytes that must move / measured copy "
                      "bandwidth), worst over B in {1, 8, 32} at K=7, context 1024",
            "ratio": max(r["ratio"] for r in main_points), "goal": 2.0,
            "machine": machine, "date": now},
    }
    emit(doc, args.out)


if __name__ == "__main__":
    main()
