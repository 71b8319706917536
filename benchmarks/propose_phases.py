"""Where the host's share of a DSpark propose goes: each phase of a graph replay timed on the host.

``draft_step_dspark.py`` reports a propose's wall time and its graph's device time; their
difference is the host's share (0.2 ms of 2.0 at B = 32 on the H200). This times, per propose of
the same engine and shape (K = 7, context 1,024, greedy), with ``time.perf_counter`` wrappers
(no profiler): ``host_inputs`` (the int32 input buffer), the pinned buffers, the replay call, and
the whole propose to the event's wait; and the replay call alone three ways — the device idle,
right after a host-to-device copy, and behind a long kernel — to tell the launch's own cost from
waiting. Per propose also: the time before the replay call (``pre_replay``), the device's span from
an event just before it to one after the outputs' copy (``device_span``; against ``graph_device``, the
replays queued back to back) and what is left (``tail``: the wake-up after the device finishes).
The wrappers add their own few microseconds. ``--sweep-engine`` builds the engine as ``draft_step_dspark.py``'s full sweep does (graphs of
K = 7 and 15, batches to 64, contexts of 1,024 and 8,192 filled), whose host share ran higher.
Medians of ``--iters``. ``summary.ratio`` = host share / propose at the largest B. GPU only.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

SRC = str(Path(__file__).resolve().parents[1] / "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)

from draft_step import fill, random_weights  # noqa: E402
from draft_step_dspark import dspark_config, random_heads  # noqa: E402
import draft_step_parts as parts  # noqa: E402
from report import emit  # noqa: E402
from k3_accel.server.engines.base import ProposeBatch  # noqa: E402
from k3_accel.server.engines.dflash import DSparkEngine  # noqa: E402


def wrap(obj, name: str, log: list) -> None:
    """Time every call of ``obj.name`` into ``log`` (seconds)."""
    fn = getattr(obj, name)

    def timed(*a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        log.append(time.perf_counter() - t)
        return out
    setattr(obj, name, timed)


def med_us(xs: list) -> float:
    return 1e6 * statistics.median(xs) if xs else float("nan")


def build(batches: list[int], sweep: bool = False) -> tuple[DSparkEngine, list]:
    """The Qwen3-8B-like DSpark engine (bf16, graphs of K = 7) and requests of context 1,024, as many as
    the largest batch; ``sweep``: as ``draft_step_dspark.py``'s full sweep builds it (K 7 and 15,
    batches to 64, contexts of 1,024 and 8,192 filled)."""
    dev, dtype = "cuda", torch.bfloat16
    cfg = dspark_config(False, 256)
    weights, heads = random_weights(cfg, dev, dtype), random_heads(cfg, dev, dtype)
    row_bytes = 2 * cfg.num_layers * cfg.kv_size * torch.empty((), dtype=dtype).element_size()
    most, ks, contexts = max(batches), (7,), (1024,)
    if sweep:
        most, ks, contexts = max(most, 64), (7, 15), (1024, 8192)
    engine = DSparkEngine.from_weights(weights, heads, budget_bytes=(most * sum(contexts) + 64 * 1024) * row_bytes,
                                       max_batch=most, graph_k=ks)
    hidden = torch.randn(max(contexts), cfg.context_width, device=dev).to(dtype)
    return engine, [fill(engine, most, c, hidden) for c in contexts][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--sweep-engine", action="store_true",
                    help="the engine of draft_step_dspark.py's full sweep (K 7 and 15, B to 64, contexts 1,024 and 8,192)")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, k, context = "cuda", 7, 1024
    batches = [int(b) for b in args.batches.split(",")]
    engine, states = build(batches, args.sweep_engine)
    runner, stream = engine.graphs, engine.stream
    logs = {name: [] for name in ("host_inputs", "_host", "run")}
    wrap(engine, "host_inputs", logs["host_inputs"])
    wrap(runner, "_host", logs["_host"])
    wrap(runner, "run", logs["run"])
    busy = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    table = []
    for b in batches:
        batch = ProposeBatch(states[:b], [[]] * b, torch.arange(b) * 7 + 3, k)
        for _ in range(10):
            engine.propose(batch).wait()
        graph = runner.graphs[(next(x for x in runner.buckets if x >= b), k, 0)]
        replays: list = []
        marks: dict = {}
        replay = graph.graph.replay

        def marked_replay():             # when the replay is called, and an event just before it
            marks["entry"] = time.perf_counter()
            marks["e0"] = torch.cuda.Event(enable_timing=True)
            marks["e0"].record()
            t = time.perf_counter()
            replay()
            replays.append(time.perf_counter() - t)
        graph.graph.replay = marked_replay
        for log in logs.values():
            log.clear()
        total, calls, waits, pre, span = [], [], [], [], []
        for _ in range(args.iters):
            t = time.perf_counter()
            proposal = engine.propose(batch)
            u = time.perf_counter()
            e1 = torch.cuda.Event(enable_timing=True)
            e1.record(stream)
            proposal.wait()
            total.append(time.perf_counter() - t)
            calls.append(u - t)
            waits.append(total[-1] - calls[-1])
            pre.append(marks["entry"] - t)
            e1.synchronize()
            span.append(marks["e0"].elapsed_time(e1) / 1e3)
        graph.graph.replay = replay
        with torch.cuda.stream(stream):
            device_ms = parts._events_ms(graph.graph.replay, 50)
        alone = {"idle": [], "after_copy": [], "behind_kernel": []}
        host = torch.empty(graph.inputs.shape[0], dtype=torch.int32, pin_memory=True)
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(50):
                for how, log in alone.items():
                    stream.synchronize()
                    if how == "after_copy":
                        graph.inputs.copy_(host, non_blocking=True)
                    elif how == "behind_kernel":
                        busy.add_(1)
                    t = time.perf_counter()
                    graph.graph.replay()
                    log.append(time.perf_counter() - t)
        stream.synchronize()
        row = {"B": b, "propose_us": med_us(total), "graph_device_us": 1e3 * device_ms,
               "host_share_us": med_us(total) - 1e3 * device_ms,
               # before the replay call; the device from just before it to after the outputs' copy; the rest
               "pre_replay_us": med_us(pre), "device_span_us": med_us(span),
               "tail_us": med_us([a - b - c for a, b, c in zip(total, pre, span)]),
               "propose_call_us": med_us(calls), "wait_us": med_us(waits), "run_us": med_us(logs["run"]),
               "width": runner.width, "replay_in_propose_us": med_us(replays), "host_inputs_us": med_us(logs["host_inputs"]),
               "pinned_buffers_us": 2 * med_us(logs["_host"]),
               **{f"replay_{how}_us": med_us(log) for how, log in alone.items()}}
        table.append(row)
        print(row, flush=True)
    last = table[-1]
    emit({"benchmark": "propose_phases", "table": table, "summary": {
        "metric": f"host share / propose, DSpark K={k} context {context} greedy, B={last['B']}",
        "ratio": last["host_share_us"] / last["propose_us"], "goal": "diagnosis (issue 22: the host's share)",
        "machine": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat()}}, args.out)


if __name__ == "__main__":
    main()
