"""The propose round trip a target sees from a GPU DFlash draft server (engine + transport).

The server (a subprocess: ``k3_accel.server`` loop and service over a
``DFlashEngine`` with the Qwen3-8B-DFlash-shaped random weights of
``draft_step.py``) holds B requests of CONTEXT rows each; the client
(``DraftClient``, hidden rows on the GPU like a real target's) times decode
steps: one new row per request (aux hidden rows, 5 x 4096 bf16) and K
drafts back, over the host path (pinned memory and the socket) and, on CUDA,
the device plane (GPU to GPU through CUDA IPC, control on the socket), for
each batch size. Reported beside the engine's own propose time from the same
server and a raw pyzmq ping-pong of the same frames (without the hidden frame
on the device path); ``--out`` writes ``summary.ratio`` = round trip / (engine
+ ping-pong), worst over B (device path when it ran). ``--merge FILE`` writes
the results into a ``draft-step-*.json`` under ``client_round_trip``.

``--busy-thread D`` measures each point again with a second Python thread in the client's
process, busy a fraction D of the time with pure Python and small torch ops, as vLLM's step
thread is beside the draft thread (the GIL is shared): ``busy`` in each result; the summary
counts only the runs without it. ``--switch-interval S`` adds a third run of each point beside the
busy thread with ``sys.setswitchinterval(S)`` in the client's process (``switch_interval_s``).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE)]

from k3_accel import protocol as p  # noqa: E402
from k3_accel.transport.api import ClientSettings, StepInput  # noqa: E402
from k3_accel.transport.client import DraftClient  # noqa: E402
from rpc import env, free_port, ping_pong  # noqa: E402  (benchmarks/rpc.py)
import draft_step  # noqa: E402  (benchmarks/draft_step.py)


def serve(port: int, quick: bool, profile: str | None = None, trace: str | None = None,
          batch_wait_ms: float | None = None, cprofile: str | None = None) -> None:
    import signal
    import zmq
    from k3_accel.server.engines.dflash import DFlashEngine
    from k3_accel.server.gather import Gather
    from k3_accel.server.loop import BATCH_WAIT_S, ServerLoop
    from k3_accel.server.metrics import ServerMetrics
    from k3_accel.server.service import DraftService
    from k3_accel.server.state import RequestStore
    cfg = draft_step.config(quick)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if trace:
        import server_trace
        server_trace.install(DFlashEngine)
    engine = DFlashEngine.from_weights(draft_step.random_weights(cfg, device, dtype), max_spec_tokens=15,
                                       graph_k=(7,), **({"budget_bytes": 8 << 30} if device == "cuda" else {}))
    store = RequestStore(engine, max_requests=1024, max_requests_total=1024, max_retained=0)
    service = DraftService(engine, store, ServerMetrics())
    wait_s = BATCH_WAIT_S if batch_wait_ms is None else batch_wait_ms / 1000   # as k3-draft-server's flag
    loop = ServerLoop(service, [f"tcp://127.0.0.1:{port}"], 1 << 31, ctx=zmq.Context(), gather=Gather(wait_s))
    print("ready", cfg.context_width, flush=True)
    import gc
    gc.collect()
    gc.freeze()          # as k3-draft-server does once its engine is loaded
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if cprofile:                       # the host's share by Python function (the loop's idle polls included)
        import cProfile
        import io
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        loop.serve(stop)
        prof.disable()
        text = io.StringIO()
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=text).sort_stats(key).print_stats(45)
        Path(cprofile).write_text(text.getvalue())
    elif profile is None:
        loop.serve(stop)
    if trace:                          # (under cProfile its steps are the profiler's too)
        import server_trace
        Path(trace).write_text(json.dumps(server_trace.summary(), indent=1) + "\n")
    if cprofile or profile is None:
        return
    from torch.profiler import ProfilerActivity, profile as torch_profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        loop.serve(stop)
    by = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    with open(profile, "w") as f:
        f.write(prof.key_averages().table(sort_by=by, row_limit=40, max_name_column_width=60) + "\n")
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                          max_name_column_width=60) + "\n")


def start_server(quick: bool, profile: str | None = None, trace: str | None = None,
                 cprofile: str | None = None) -> tuple[subprocess.Popen, int, int]:
    port = free_port()
    extra = (["--quick"] if quick else []) + (["--profile-server", profile] if profile else []) \
        + (["--trace-server", trace] if trace else []) + (["--cprofile-server", cprofile] if cprofile else [])
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)] + extra,
                            env=env(), stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    if not line or line[0] != "ready":
        raise RuntimeError("draft server did not start")
    return proc, port, int(line[1])


class BusyThread(threading.Thread):
    """A second Python thread in the client's process, like vLLM's step thread beside the draft
    thread: stretches of pure Python (~0.1 ms each, like a scheduler pass) between small torch ops,
    for ``duty`` of every millisecond, asleep the rest."""

    def __init__(self, duty: float, device: torch.device):
        super().__init__(daemon=True)
        self.duty, self.device, self.halt = duty, device, threading.Event()

    def run(self) -> None:
        x = torch.zeros(64, device=self.device)
        while not self.halt.is_set():
            until = time.perf_counter() + self.duty * 1e-3
            while time.perf_counter() < until:
                x.add_(1.0)                                  # the op releases and retakes the GIL
                sum(i * i for i in range(2000))              # Python holding it
            time.sleep((1.0 - self.duty) * 1e-3)


def measure(port: int, width: int, path: str, b: int, k: int, context: int, iters: int,
            busy: float = 0.0, switch: float | None = None) -> dict:
    """Decode steps of B requests over one path (``host``: hidden rows through pinned memory and
    the socket; ``device``: GPU to GPU through the device plane, control on the socket)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    client = DraftClient(ClientSettings(address=f"tcp://127.0.0.1:{port}", timeout_ms=120000,
                                        propose_timeout_ms=120000, max_rows=8192, context_width=width, hidden_dtype=dtype,
                                        num_speculative_tokens=k,
                                        device_plane="auto" if path == "device" else "off")).start()
    assert client.state.value == "ready", client.state
    used = client.stats()["device_plane"]
    gc.collect()
    gc.freeze()      # as vLLM's engine core does after start-up (vllm.utils.gc_utils.freeze_gc_heap)
    ids = [f"{path}{b}-r{i}" for i in range(b)]
    per = max(1, 8192 // context)
    for lo in range(0, b, per):                                  # prefill: CONTEXT rows each
        sub = ids[lo:lo + per]
        n = len(sub) * context
        client.step(StepInput(sub, [context] * len(sub), torch.arange(context, device=dev).repeat(len(sub)),
                              torch.randint(0, 1000, (n,), device=dev), [False] * len(sub), [1] * len(sub),
                              [context] * len(sub), k=k, hidden=torch.randn(n, width, device=dev, dtype=dtype)))
    client.flush()
    times, server, engine = [], [], []
    phases = client.telemetry._total
    rival = BusyThread(busy, dev) if busy > 0 else None
    default_switch = sys.getswitchinterval()
    if switch is not None:
        sys.setswitchinterval(switch)
    if rival is not None:
        rival.start()
    try:
        for i in range(iters + 10):
            if i == 10:
                phases.clear()                 # the client's phases: decode steps only
            pos = context + i
            inp = StepInput(ids, [1] * b, torch.full((b,), pos, device=dev), torch.randint(0, 1000, (b,), device=dev),
                            [True] * b, torch.randint(0, 1000, (b,), device=dev), torch.full((b,), pos + 1, device=dev),
                            k=k, hidden=torch.randn(b, width, device=dev, dtype=dtype))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            served = {n: phases[n].total if n in phases else 0.0 for n in ("server.store", "server.engine")}
            t0 = time.perf_counter()
            out = client.step(inp)
            times.append(time.perf_counter() - t0)
            now = {n: phases[n].total if n in phases else 0.0 for n in ("server.store", "server.engine")}
            server.append(sum(now.values()) - sum(served.values()))
            engine.append(now["server.engine"] - served["server.engine"])
            assert out.drafts.shape == (b, k) and not client.is_disabled(ids[0])
    finally:                               # also when a step fails: no rival left running, the interval back
        if rival is not None:
            rival.halt.set()
            rival.join()
        sys.setswitchinterval(default_switch)
    stats = client.stats()
    client.close()
    times, server, engine = times[10:], server[10:], engine[10:]
    on_device = stats["device_plane"]["path"] == "device"
    meta = np.zeros((b, 4 + on_device), np.int64)
    msg = p.Propose(k, b, b, "bfloat16", width, slot=0 if on_device else -1)
    frames = [meta.data, np.zeros(b, np.int64).data] + ([] if on_device else [np.zeros(b * width * 2, np.uint8).data])
    req = p.encode_request(1, msg, *frames)
    rep = p.encode_reply(p.Reply(1, True, "x" * 18, result=[1e-4, 1e-4], tensors={"drafts": np.zeros((b, k), np.int32)}))
    pp = ping_pong([len(bytes(f)) for f in req], [len(bytes(f)) for f in rep], iters + 10, "tcp")[10:]
    rt, eng, raw = statistics.median(times), statistics.median(engine), statistics.median(pp)
    return {"path": path, "path_used": stats["device_plane"]["path"], "path_reason": used["reason"],
            "busy": busy, "switch_interval_s": default_switch if switch is None else switch,
            "B": b, "K": k, "context": context, "hidden_width": width,
            "round_trip_ms": rt * 1e3,
            "round_trip_p90_ms": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3,
            "server_store_plus_engine_ms": statistics.median(server) * 1e3,
            "engine_ms": eng * 1e3,
            "raw_ping_pong_same_frames_ms": raw * 1e3,
            "ratio_round_trip_over_engine_plus_ping_pong": rt / (eng + raw) if eng + raw > 0 else None,
            "client_phases_ms": {n: round(v["mean_ms"], 4) for n, v in stats["phases"].items()}}


def run(batches: list[int], k: int, context: int, iters: int, quick: bool, paths: list[str],
        profile: str | None = None, trace: str | None = None, cprofile: str | None = None,
        busy: float = 0.0, switch: float | None = None) -> list[dict]:
    """Every (path, B) against one server process (its engine built once); with ``busy``, each point
    again beside a busy Python thread (and with ``switch``, once more at that switch interval)."""
    runs = [(0.0, None)] + ([(busy, None)] if busy > 0 else []) + ([(busy, switch)] if busy > 0 and switch else [])
    proc, port, width = start_server(quick, profile, trace, cprofile)
    try:
        return [measure(port, width, path, b, k, context, iters, d, sw) for path in paths for b in batches
                for d, sw in runs]
    finally:
        proc.terminate()
        proc.wait(30)


def summary(results: list[dict]) -> dict:
    """The issue's ratio: round trip / (engine propose + raw ping-pong of the same frames), worst over B,
    on the device path when it ran (else the host path)."""
    results = [r for r in results if not r["busy"]]
    device = [r for r in results if r["path_used"] == "device"]
    chosen = device or [r for r in results if r["path"] == "host"]
    worst = max(chosen, key=lambda r: r["ratio_round_trip_over_engine_plus_ping_pong"] or 0.0)
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return {"metric": f"propose round trip / (engine propose + raw ping-pong of the same frames), worst over "
                      f"B = {sorted({r['B'] for r in chosen})}, {chosen[0]['path_used']} path, K = {worst['K']}, "
                      f"context {worst['context']}",
            "ratio": round(worst["ratio_round_trip_over_engine_plus_ping_pong"], 3), "goal": 1.3,
            "machine": f"{dev}, {os.cpu_count()} CPUs, torch {torch.__version__}",
            "date": datetime.date.today().isoformat(), "worst_B": worst["B"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--batch-wait-ms", type=float, default=None, help=argparse.SUPPRESS)   # --serve: the server's
    ap.add_argument("--quick", action="store_true", help="tiny shapes (any machine)")
    ap.add_argument("--batch", type=int, default=None, help="one batch size (default: --batches)")
    ap.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--paths", default="host,device" if torch.cuda.is_available() else "host",
                    help="host, device or both (comma-separated): how hidden rows travel")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--profile-server", help="write the server's torch profile (device and host time by op) to this file")
    ap.add_argument("--trace-server", help="write a timeline of the server's handling of each propose "
                                           "(median ms between steps, per path and B; server_trace.py) to this file")
    ap.add_argument("--cprofile-server", help="write the server's cProfile tables (host time by Python function) "
                                              "to this file")
    ap.add_argument("--busy-thread", type=float, default=0.0, metavar="D",
                    help="also measure each point beside a Python thread busy a fraction D (0-1) of the time")
    ap.add_argument("--switch-interval", type=float, default=None, metavar="S",
                    help="with --busy-thread: once more with sys.setswitchinterval(S) in the client")
    ap.add_argument("--merge", help="a draft-step JSON to write the results into (client_round_trip)")
    ap.add_argument("--out", help="write the JSON document (summary + results) here, e.g. draft-rpc-h200.json")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.quick, args.profile_server, args.trace_server, args.batch_wait_ms, args.cprofile_server)
        return
    batches = [args.batch] if args.batch else [int(x) for x in args.batches.split(",")]
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if any(x not in ("host", "device") for x in paths):
        ap.error(f"--paths {args.paths!r}: host and/or device")
    if not 0.0 <= args.busy_thread < 1.0:
        ap.error(f"--busy-thread {args.busy_thread}: a fraction in [0, 1)")
    results = run(batches, args.k, args.context, args.iters, args.quick, paths, args.profile_server,
                  args.trace_server, args.cprofile_server, args.busy_thread, args.switch_interval)
    doc = {"summary": summary(results), "results": results}
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.merge:
        merged = json.loads(Path(args.merge).read_text())
        merged["client_round_trip"] = results
        Path(args.merge).write_text(json.dumps(merged, indent=2) + "\n")


if __name__ == "__main__":
    main()
