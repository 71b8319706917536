"""Where a DSpark propose's time goes, per kernel (torch.profiler, CUDA activities).

The draft step of ``draft_step_dspark.py`` (Qwen3-8B-like draft, Markov rank 256, confidence
head) at context 1,024, eager (no CUDA graph) or, with ``--graphs``, the graph replays as the
engine serves them (CUPTI attributes the kernels inside a replay), for each
``--cases B:K``; prints the top kernels by device time and writes the tables to ``--out``.
``--smoke`` runs tiny shapes on any device. What it is for: the Markov loop's cost grows with B
(about 180 us per extra position at B = 32 on the H200 against 29 us at B = 1), and the per-kernel
breakdown says which op.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

SRC = str(Path(__file__).resolve().parents[1] / "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)

from draft_step import fill, random_weights  # noqa: E402
from draft_step_dspark import dspark_config, random_heads  # noqa: E402
from k3_accel.server.engines.base import ProposeBatch  # noqa: E402
from k3_accel.server.engines.dflash import DSparkEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--cases", default="1:7,32:7,32:15")
    ap.add_argument("--graphs", action="store_true",
                    help="profile the CUDA-graph replays (the engine as it serves) instead of the eager step")
    ap.add_argument("--sampled", action="store_true", help="every request at temperature 1 with its own seed")
    ap.add_argument("--host", action="store_true",
                    help="the host's share instead: cProfile of 200 proposes (graphs as served), by own time")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, cuda = args.device, args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = dspark_config(args.smoke, 16 if args.smoke else 256)
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    context = 64 if args.smoke else 1024
    weights, heads = random_weights(cfg, dev, dtype), random_heads(cfg, dev, dtype)
    row_bytes = 2 * cfg.num_layers * cfg.kv_size * torch.empty((), dtype=dtype).element_size()
    b_max = max(b for b, _ in cases)
    engine = DSparkEngine.from_weights(weights, heads, budget_bytes=(b_max * context + 4096) * row_bytes,
                                       max_batch=b_max, graph_k=tuple(sorted({k for _, k in cases})))
    if not (args.graphs or args.host):     # the host's share is of the graphs as served
        engine.graphs = None
    hidden = torch.randn(context, cfg.context_width, device=dev, dtype=torch.float32).to(dtype)
    states = fill(engine, b_max, context, hidden)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    report = []
    for b, k in cases:
        sampling = dict(temperature=torch.ones(b), seeds=torch.arange(b) * 7919 + 1) if args.sampled else {}
        batch = ProposeBatch(states[:b], [[]] * b, torch.arange(b) * 7 + 3, k, **sampling)
        for _ in range(3):
            engine.propose(batch).wait()
        if args.host:
            import cProfile
            import io
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                engine.propose(batch).wait()
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            report.append(f"== B={b} K={k} host (200 proposes, cProfile)\n{text.getvalue()}")
            print(report[-1], flush=True)
            continue
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(5):
                engine.propose(batch).wait()
        key = "cuda_time_total" if cuda else "cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70)
        how = ("graph replays" if engine.graphs is not None else "eager") + (", sampled" if args.sampled else "")
        report.append(f"== B={b} K={k} context={context} (5 proposes, {how})\n{table}")
        print(report[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(report))


if __name__ == "__main__":
    main()
