"""Target-side blocking time per deferred context chunk, against the bare device->pinned copy.

For each chunk size (rows x width, bf16 hidden rows on the target's device):

(a) naive: device -> pageable host copy, ``.numpy().tobytes()`` serialisation,
    copying send, wait for the reply (what a REQ/REP client does);
(b) ``DraftClient.step`` on a deferred ingest step: the target's thread only
    launches a gather into a private device buffer and the copy to a pinned
    slot on a side stream, and queues the send; the sender thread waits for
    the copy and sends. Measured in steady state with a gap between steps
    that stands in for the target's forward pass;
(c) the bare device -> pinned-host copy of the same hidden bytes.

Also records a timeline of a few chunks (target thread, copy, sender thread).
The server is the real draft server (``DraftService`` + ``ServerLoop``) in a
subprocess, with an engine that takes hidden rows of the chunk's width and
drafts by n-gram (it keeps no hidden state), so the server's own cost is the
real decode / validate / store path. Prints one JSON document; ``--out``
writes it too. Goal (P1): (b)/(c) <= 0.25 at the largest chunk on a GPU host.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

SRC = str(Path(__file__).resolve().parents[1] / "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)

from k3_accel import protocol as p  # noqa: E402
from report import emit  # noqa: E402  (benchmarks/report.py)
from k3_accel.transport.api import ClientSettings, StepInput  # noqa: E402
from k3_accel.transport.client import DraftClient  # noqa: E402
from k3_accel.transport import outbox as outbox_module  # noqa: E402

DEFAULT_SIZES = "1536x21504,512x21504,128x21504,1536x7168"


# ------------------------------------------------------------------ server
def serve(port: int, width: int) -> None:
    """Run the real server loop with a hidden-row-taking n-gram engine (``--serve`` mode)."""
    import dataclasses
    import threading
    import zmq
    from k3_accel.server.engines.ngram import NgramEngine
    from k3_accel.server.loop import ServerLoop
    from k3_accel.server.metrics import ServerMetrics
    from k3_accel.server.service import DraftService
    from k3_accel.server.state import RequestStore

    from k3_accel.server.device_plane import ServerDevicePlane

    engine = NgramEngine(max_spec_tokens=16, budget_bytes=1 << 32)
    engine.caps = dataclasses.replace(engine.caps, needs_hidden_states=True, context_width=width,
                                      hidden_dtypes=("bfloat16",))
    store = RequestStore(engine, max_requests=256, max_requests_total=256, max_retained=0)
    # on CUDA the server offers the device plane: device-path rows are read into a buffer on the GPU
    # (what a GPU draft engine would then use) and checked there; the n-gram engine ignores them
    plane = ServerDevicePlane("auto", "cuda" if torch.cuda.is_available() else None, True)
    service = DraftService(engine, store, ServerMetrics(), max_message_bytes=1 << 31, device_plane=plane)
    loop = ServerLoop(service, [f"tcp://127.0.0.1:{port}"], 1 << 31, ctx=zmq.Context())
    print("ready", flush=True)
    import gc
    gc.collect()
    gc.freeze()          # as k3-draft-server does once its engine is loaded
    loop.serve(threading.Event())


def start_server(width: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), str(width)], env=env,
                            stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("benchmark server did not start")
    return proc, f"tcp://127.0.0.1:{port}"


# ---------------------------------------------------------------- measures
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def chunk(rows: int, width: int, start: int, device: torch.device):
    positions = torch.arange(start, start + rows, device=device)
    tokens = torch.randint(0, 1000, (rows,), device=device)
    hidden = torch.randn(rows, width, device=device, dtype=torch.bfloat16)
    return positions, tokens, hidden


def busy_gap(seconds: float) -> None:
    """Stand-in for the target's forward pass: keep the thread busy (a target thread launching
    kernels or spinning on a sync does not sleep), so neither measure starts from an idle core."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def bare_copy(sources: list[torch.Tensor], iters: int, depth: int, gap_s: float) -> list[float]:
    """(c) the device -> pinned host copy alone (plain memory without CUDA).

    Same memory footprint as (b): the sources alternate like (b)'s chunks and
    the copies rotate over ``depth`` destinations like (b)'s slots (on a CPU
    host a single hot buffer pair would sit in the last-level cache).
    """
    pin = torch.cuda.is_available()
    dsts = [torch.empty(sources[0].shape, dtype=sources[0].dtype, pin_memory=pin) for _ in range(max(depth, 1))]
    out = []
    for i in range(iters):
        src, dst = sources[i % len(sources)], dsts[i % len(dsts)]
        sync(src.device)
        t0 = time.perf_counter()
        if src.device.type == "cuda":
            dst.copy_(src, non_blocking=True)
        else:                        # the memcpy (b) uses on a CPU host
            np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
        sync(src.device)
        out.append(time.perf_counter() - t0)
        busy_gap(gap_s)
    return out


def naive(address: str, rows: int, width: int, device: torch.device, iters: int) -> list[float]:
    """(a) pageable copy + tobytes + copying send + synchronous reply wait."""
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    sock.send_multipart(p.encode_request(1, p.Hello("naive-benchmark-session", "naive")))
    assert p.decode_reply(sock.recv_multipart()).ok
    out, start = [], 0
    for i in range(iters):
        positions, tokens, hidden = chunk(rows, width, start, device)
        sync(device)
        t0 = time.perf_counter()
        meta = np.array([[1, start, rows]], dtype=np.int64)
        frames = p.encode_request(i + 2, p.Ingest(1, rows, "bfloat16", width), meta.tobytes(),
                                  tokens.cpu().numpy().tobytes(), hidden.cpu().view(torch.int16).numpy().tobytes())
        sock.send_multipart(frames, copy=True)
        reply = p.decode_reply(sock.recv_multipart())
        out.append(time.perf_counter() - t0)
        assert reply.ok and not reply.failures, reply
        start += rows
    sock.close(linger=0)
    ctx.term()
    return out


def ring(address: str, rows: int, width: int, device: torch.device, iters: int, gap_s: float,
         depth: int, settle: bool, path: str = "host") -> tuple[list[float], dict]:
    """(b) DraftClient.step on deferred ingest steps, with ``gap_s`` of 'forward pass' between.

    ``settle``: also wait (untimed) until the server has answered before the
    next step, so the server's work does not compete for this host's CPU
    cores and memory bandwidth while the step is timed.
    """
    settings = ClientSettings(address=address, timeout_ms=60000, ring_depth=depth, max_rows=rows,
                              context_width=width, hidden_dtype=torch.bfloat16,
                              device_plane="auto" if path == "device" else "off")
    client = DraftClient(settings).start()
    assert client.state.value == "ready", client.state
    out, start = [], 0
    chunks = [chunk(rows, width, rows * i, device) for i in range(2)]
    for i in range(iters):
        positions, tokens, hidden = chunks[i % 2]
        positions = positions + start - rows * (i % 2)
        inp = StepInput(["ring"], [rows], positions, tokens, [False], [0], [start + rows], k=0, hidden=hidden)
        sync(device)
        t0 = time.perf_counter()
        result = client.step(inp)
        out.append(time.perf_counter() - t0)
        assert result.deferred or depth == 0
        start += rows
        if settle:
            client.flush()
        busy_gap(gap_s)
    client.flush()
    stats = client.stats()
    client.close()
    failures = {k: v for k, v in stats["counters"].items() if k.startswith("failures.")}
    assert not failures, failures
    return out, stats


class Breakdown:
    """Times pieces of ``DraftClient.step`` (median per call) by wrapping them for a ``with`` block."""
    PIECES = (("k3_accel.transport.client", "DraftClient", "step"),
              ("k3_accel.transport.client", "DraftClient", "_run_step"),
              ("k3_accel.transport.layout", None, "stage"),
              ("k3_accel.transport.outbox", "Outbox", "defer"),
              ("k3_accel.protocol", None, "encode_request"),
              ("k3_accel.transport.connection", "Connection", "_send_frames"))

    def __enter__(self) -> "Breakdown":
        import importlib
        self.times: dict[str, list[float]] = {}
        self.saved = []
        for module, cls, name in self.PIECES:
            owner = importlib.import_module(module)
            owner = getattr(owner, cls) if cls else owner
            original = getattr(owner, name)
            self.saved.append((owner, name, original))
            setattr(owner, name, self._timed(f"{cls + '.' if cls else ''}{name}", original))
        return self

    def _timed(self, label: str, fn):
        times = self.times.setdefault(label, [])

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times.append(time.perf_counter() - t0)
        return wrapper

    def __exit__(self, *exc) -> None:
        for owner, name, original in self.saved:
            setattr(owner, name, original)

    def medians(self, skip: int) -> dict:
        return {k: round(statistics.median(v[skip:] or v) * 1e6, 1) for k, v in self.times.items() if v}


class Timeline:
    """Records, for a few deferred chunks, when the target thread, the copy and the sender ran."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.t0 = time.perf_counter()

    def span(self, lane: str, label: str, start: float, end: float) -> None:
        self.events.append({"lane": lane, "label": label, "start_us": round((start - self.t0) * 1e6, 1),
                            "end_us": round((end - self.t0) * 1e6, 1)})

    def __enter__(self) -> "Timeline":
        timeline, original = self, outbox_module.SendJob
        self._saved = original

        class TimedJob(original):
            def __init__(self, build, ready=None, on_error=None):
                issued = time.perf_counter()
                label = f"chunk {sum(e['lane'] == 'target' for e in timeline.events)}"

                class Ready:
                    def synchronize(self_inner) -> None:
                        picked = time.perf_counter()
                        if ready is not None:       # CUDA: the copy runs on a side stream
                            ready.synchronize()
                        done = time.perf_counter()
                        if ready is not None:       # (without CUDA it ran inside the target's step)
                            timeline.span("copy", label, issued, done)
                        timeline.span("sender", f"{label}: wait for copy", picked, done)

                def timed_build() -> None:
                    begin = time.perf_counter()
                    build()
                    timeline.span("sender", f"{label}: encode + send", begin, time.perf_counter())
                super().__init__(timed_build, Ready(), on_error)
        outbox_module.SendJob = TimedJob
        return self

    def __exit__(self, *exc) -> None:
        outbox_module.SendJob = self._saved


def timeline_run(address: str, rows: int, width: int, device: torch.device, steps: int, gap_s: float,
                 depth: int, path: str = "host") -> list[dict]:
    settings = ClientSettings(address=address, timeout_ms=60000, ring_depth=depth, max_rows=rows,
                              context_width=width, hidden_dtype=torch.bfloat16,
                              device_plane="auto" if path == "device" else "off")
    client = DraftClient(settings).start()
    chunks = [chunk(rows, width, rows * i, device) for i in range(2)]
    for i in range(3):                                  # warm up outside the timeline
        inp = StepInput(["warm"], [rows], chunks[0][0] + rows * i, chunks[0][1], [False], [0], [rows * (i + 1)],
                        k=0, hidden=chunks[0][2])
        client.step(inp)
    client.flush()
    with Timeline() as tl:
        start = 0
        for i in range(steps):
            positions, tokens, hidden = chunks[i % 2]
            inp = StepInput(["tl"], [rows], positions + start - rows * (i % 2), tokens, [False], [0],
                            [start + rows], k=0, hidden=hidden)
            sync(device)
            t0 = time.perf_counter()
            client.step(inp)
            tl.span("target", f"chunk {i}", t0, time.perf_counter())
            start += rows
            busy_gap(gap_s)
        client.flush()
    client.close()
    return sorted(tl.events, key=lambda e: e["start_us"])


def summary_ms(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": statistics.median(xs) * 1e3, "p90_ms": xs[int(0.9 * (len(xs) - 1))] * 1e3,
            "min_ms": xs[0] * 1e3, "n": len(xs)}


def run_size(rows: int, width: int, device: torch.device, args) -> dict:
    proc, address = start_server(width)
    try:
        sources = [chunk(rows, width, 0, device)[2] for _ in range(2)]
        c = bare_copy(sources, args.iters + args.warmup, args.depth, args.gap_ms / 1e3)[args.warmup:]
        del sources
        n = args.iters + args.warmup
        b, stats = ring(address, rows, width, device, n, args.gap_ms / 1e3, args.depth, settle=False)
        with Breakdown() as pieces:
            b_settled, _ = ring(address, rows, width, device, n, args.gap_ms / 1e3, args.depth, settle=True)
        b, b_settled = b[args.warmup:], b_settled[args.warmup:]
        a = naive(address, rows, width, device, max(3, args.iters // 4) + 1)[1:]
        timeline = timeline_run(address, rows, width, device, 4, args.gap_ms / 1e3, args.depth)
        device_row = device_path(address, rows, width, device, args, c) if "device" in args.paths else None
    finally:
        proc.terminate()
        proc.wait(10)
    row = {"rows": rows, "width": width, "hidden_mib": rows * width * 2 / 2**20,
           "a_naive": summary_ms(a), "b_ring": summary_ms(b), "b_ring_server_idle": summary_ms(b_settled),
           "c_copy": summary_ms(c),
           "ratio_b_over_c": statistics.median(b) / statistics.median(c),
           "ratio_b_server_idle_over_c": statistics.median(b_settled) / statistics.median(c),
           "ratio_a_over_c": statistics.median(a) / statistics.median(c),
           "ring": stats["ring"], "ring_waits": stats["counters"].get("ring_waits", 0),
           "server_idle_breakdown_median_us": pieces.medians(args.warmup),
           "client_phases_ms": {k: round(v["mean_ms"], 4) for k, v in stats["phases"].items()},
           "timeline": timeline, "device_path": device_row}
    print(json.dumps({k: row[k] for k in ("rows", "width", "ratio_b_over_c", "ratio_b_server_idle_over_c",
                                           "ratio_a_over_c")} |
                     ({"device_ratio_b_over_c": device_row["ratio_b_over_c"]} if device_row else {})),
          file=sys.stderr, flush=True)
    return row


def device_path(address: str, rows: int, width: int, device: torch.device, args, c: list[float]) -> dict:
    """(b) on the device plane: the rows go GPU to GPU into a shared slot, only control on the
    socket; against the same bare device->pinned copy (c) as the host path."""
    n = args.iters + args.warmup
    b, stats = ring(address, rows, width, device, n, args.gap_ms / 1e3, args.depth, settle=False, path="device")
    b_settled, _ = ring(address, rows, width, device, n, args.gap_ms / 1e3, args.depth, settle=True, path="device")
    b, b_settled = b[args.warmup:], b_settled[args.warmup:]
    return {"path_used": stats["device_plane"]["path"], "path_reason": stats["device_plane"]["reason"],
            "b_ring": summary_ms(b), "b_ring_server_idle": summary_ms(b_settled),
            "ratio_b_over_c": statistics.median(b) / statistics.median(c),
            "ratio_b_server_idle_over_c": statistics.median(b_settled) / statistics.median(c),
            "ring_waits": stats["counters"].get("ring_waits", 0),
            "client_phases_ms": {k: round(v["mean_ms"], 4) for k, v in stats["phases"].items()},
            "timeline": timeline_run(address, rows, width, device, 4, args.gap_ms / 1e3, args.depth, "device")}


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()} CPU only, {os.cpu_count()} CPUs, torch {torch.__version__}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", nargs=2, type=int, metavar=("PORT", "WIDTH"), help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated ROWSxWIDTH chunks")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gap-ms", type=float, default=100.0, help="pause between steps (the target's forward)")
    ap.add_argument("--depth", type=int, default=2, help="ring depth (VLLM_K3_DRAFT_ASYNC_PREFILL_INGEST)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--paths", default="host,device" if torch.cuda.is_available() else "host",
                    help="host,device: also measure the device plane (CUDA, hidden rows GPU to GPU)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    if args.serve:
        serve(*args.serve)
        return
    device = torch.device(args.device)
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    table = [run_size(r, w, device, args) for r, w in sizes]
    head = table[0]
    on_device = [r for r in table if r["device_path"] and r["device_path"]["path_used"] == "device"]
    if on_device:                        # the ratio: the device path's worst over the sizes
        worst = max(on_device, key=lambda r: r["device_path"]["ratio_b_over_c"])
        summary = {"metric": "target blocking time per deferred bf16 chunk on the device plane "
                             "(DraftClient.step) / bare device->pinned copy of the same bytes, worst over "
                             + ", ".join(f"{r['rows']}x{r['width']}" for r in on_device),
                   "ratio": round(worst["device_path"]["ratio_b_over_c"], 4),
                   "worst": f"{worst['rows']}x{worst['width']}",
                   "host_path": {f"{r['rows']}x{r['width']}": round(r["ratio_b_over_c"], 4) for r in table}}
    else:
        summary = {"metric": f"target blocking time per deferred {head['rows']}x{head['width']} bf16 "
                             "chunk (DraftClient.step) / bare device->pinned copy of the same bytes",
                   "ratio": round(head["ratio_b_over_c"], 4)}
    doc = {"summary": {**summary, "goal": 0.25, "machine": machine(device),
                       "date": datetime.date.today().isoformat()},
           "timeline": head["timeline"],
           "device": str(device), "pinned": torch.cuda.is_available(),
           "params": {"iters": args.iters, "warmup": args.warmup, "gap_ms": args.gap_ms, "depth": args.depth},
           "table": table}
    emit(doc, args.out)


if __name__ == "__main__":
    main()
