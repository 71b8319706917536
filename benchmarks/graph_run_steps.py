"""Each host step of one DSpark graph propose (``GraphRunner.run``'s body, step by step), timed.

``propose_phases.py`` found most of a B = 32 propose's host time before the replay call outside
``host_inputs`` and the pinned buffers. This repeats ``run``'s steps for a greedy batch with a
timer between each (medians of ``--iters``; a fresh pinned input buffer each time, as ``run`` took one
before it kept the last one), and says whether the input buffer is pinned; then ``propose``'s own
steps around ``run`` the same way (``propose``; its ``anchors`` step as ``propose`` has it now, no copy
of a 1-D host tensor: the s28 results timed the copy it made before). GPU only.
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

from propose_phases import build  # noqa: E402
from report import emit  # noqa: E402
from k3_accel.server.engines.base import Proposal, ProposeBatch  # noqa: E402


def propose_steps(engine, batch, iters: int) -> dict:
    """``DFlashEngine.propose``'s own steps around ``run`` (its body repeated with a timer between
    each), then the proposal's wait and a device synchronize (as draft_step.py times a propose):
    median microseconds of each."""
    names = ["inference_mode", "ensure_positions", "anchors", "on_device", "run", "proposal", "exit",
             "wait", "synchronize"]
    laps = {n: [] for n in names}
    for _ in range(iters):
        t = [time.perf_counter()]
        mode = torch.inference_mode(); mode.__enter__(); t.append(time.perf_counter())
        engine._ensure_positions(max(s.length for s in batch.states) + batch.k + 1); t.append(time.perf_counter())
        anchors = batch.anchors
        if anchors.dim() != 1 or anchors.is_cuda:
            anchors = anchors.reshape(-1).cpu()
        t.append(time.perf_counter())
        ctx = engine._on_device(); ctx.__enter__(); t.append(time.perf_counter())
        tokens = engine.graphs.run(anchors, batch.states, batch.k, batch); t.append(time.perf_counter())
        out = Proposal(tokens[0], ready=tokens[1], confidence=tokens[2]); t.append(time.perf_counter())
        ctx.__exit__(None, None, None); mode.__exit__(None, None, None); t.append(time.perf_counter())
        out.wait(); t.append(time.perf_counter())
        torch.cuda.synchronize(); t.append(time.perf_counter())
        for n, a, z in zip(names, t, t[1:]):
            laps[n].append(z - a)
    return {n: round(1e6 * statistics.median(v), 1) for n, v in laps.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--out")
    args = ap.parse_args()
    k = 7
    batches = [int(b) for b in args.batches.split(",")]
    engine, states = build(batches)
    runner, stream = engine.graphs, engine.stream
    table = []
    for b in batches:
        batch = ProposeBatch(states[:b], [[]] * b, torch.arange(b) * 7 + 3, k)
        for _ in range(5):
            engine.propose(batch).wait()
        bucket = next(x for x in runner.buckets if x >= b)
        g = runner.graphs[(bucket, k, 0)]
        h, base = g.head, bucket * (2 + runner.width)
        anchors = batch.anchors.cpu()
        names = ["_host", "numpy", "host_inputs", "sampled", "copy_in", "replay", "_host out", "copy_out",
                 "event", "wait"]
        laps = {n: [] for n in names}
        pinned = None
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(args.iters):
                t = [time.perf_counter()]
                host = runner._host(g.inputs.shape[0]); t.append(time.perf_counter())
                buf = host.numpy(); t.append(time.perf_counter())
                engine.host_inputs(anchors, batch.states, bucket, runner.width, out=buf[h:h + base])
                t.append(time.perf_counter())
                buf[:h] = 0; t.append(time.perf_counter())
                g.inputs.copy_(host, non_blocking=True); t.append(time.perf_counter())
                g.graph.replay(); t.append(time.perf_counter())
                out = runner._host(g.out.shape[0]); t.append(time.perf_counter())
                out.copy_(g.out, non_blocking=True); t.append(time.perf_counter())
                done = torch.cuda.Event(); done.record(stream); t.append(time.perf_counter())
                done.synchronize(); t.append(time.perf_counter())
                for n, a, z in zip(names, t, t[1:]):
                    laps[n].append(z - a)
                pinned = host.is_pinned()
        row = {"B": b, "width": runner.width, "input_bytes": 4 * g.inputs.shape[0], "pinned": pinned,
               **{n: round(1e6 * statistics.median(v), 1) for n, v in laps.items()},
               "propose": propose_steps(engine, batch, args.iters)}
        table.append(row)
        print(row, flush=True)
    last = table[-1]
    before = sum(last[n] for n in ("_host", "numpy", "host_inputs", "sampled", "copy_in"))
    emit({"benchmark": "graph_run_steps", "table": table, "summary": {
        "metric": f"host time of run()'s steps before the replay / the replay's wait, B={last['B']}",
        "ratio": before / last["wait"], "goal": "diagnosis (issue 22: the host's share)",
        "machine": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat()}}, args.out)


if __name__ == "__main__":
    main()
