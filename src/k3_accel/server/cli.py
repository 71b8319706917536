"""``k3-draft-server``: serve draft tokens to a vLLM target over ZMQ."""
from __future__ import annotations

import argparse
import gc
import logging
import math
import re
import signal
import socket
import sys
import threading
from pathlib import Path

import torch
import zmq

from k3_accel.config import MAX_IPC_PATH     # one limit for --ipc-path and a client's address
from k3_accel.protocol import DEFAULT_MAX_MESSAGE_BYTES
from k3_accel.server.device_plane import ServerDevicePlane
from k3_accel.server.gather import Gather
from k3_accel.server.engines.base import DraftEngine
from k3_accel.server.http import HealthServer
from k3_accel.server.loop import ServerLoop
from k3_accel.server.metrics import ServerMetrics
from k3_accel.server.security import CurveGuard, SecurityError, check_bind, load_keys
from k3_accel.server.service import DraftService
from k3_accel.server.share import parse_weight
from k3_accel.server.state import RequestStore

log = logging.getLogger("k3_accel.server")
MIB = 1 << 20


def _device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected cpu, cuda or cuda:N")
    return text


def int_in(low: int, high: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            span = f"{low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{value} is outside {span}")
        return value
    return parse


def _float_in(low: float, high: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not low < value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside ({low}, {high}]")
        return value
    return parse


def _float_min(low: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):          # nan passes "< low" unseen
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value
    return parse


def _weight(text: str) -> tuple[str, int]:
    try:
        return parse_weight(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="k3-draft-server", description=__doc__,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--engine", choices=["ngram", "dflash", "dspark"], default="ngram",
                    help="drafting engine: ngram (prompt lookup, no weights), dflash (block drafting) or "
                         "dspark (block drafting + Markov head, with confidence when the checkpoint has it)")
    ap.add_argument("--draft-model", metavar="DIR",
                    help="DFlash or DSpark draft checkpoint (config.json + safetensors)")
    ap.add_argument("--target-model", metavar="DIR",
                    help="target checkpoint; only embed_tokens and lm_head are read (dflash, dspark)")
    ap.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--threads", type=int_in(0), default=0,
                    help="torch intra-op threads of the server (0: torch's default, one per core); give a "
                         "server that shares its CPUs with a vLLM target 1, or their two OpenMP teams spin "
                         "against each other (a 2 ms ingest took 30 ms on a 2-core box)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="draft compute dtype (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind; non-loopback needs CURVE keys")
    ap.add_argument("--port", type=int_in(0, 65535), default=5557, help="ZMQ port (0 = any free port)")
    ap.add_argument("--ipc-path", metavar="PATH", default=None,
                    help="also listen on the unix socket ipc://PATH (clients on this host; CURVE applies too)")
    ap.add_argument("--http-port", type=int_in(0, 65535), default=8095,
                    help="port of /healthz, /readyz and /metrics (0 = any free port)")
    ap.add_argument("--max-requests", type=int_in(1), default=1024,
                    help="active requests per client session (a quota: one target cannot starve the others; "
                         "at most --max-requests-total)")
    ap.add_argument("--max-requests-total", type=int_in(1), default=4096,
                    help="active requests over all client sessions")
    ap.add_argument("--lease-s", type=_float_min(0.0), default=20.0,
                    help="free a client session after this many seconds without a message (0 = never); "
                         "clients send a heartbeat every 2 s while idle")
    ap.add_argument("--max-retained-requests", type=int_in(0), default=1024,
                    help="finished requests whose contexts are kept for prefix-cache hits and resumed "
                         "requests to reconnect to (LRU); the pool also gives them back, least recent "
                         "first, whenever it needs the room, so this bounds only the table")
    ap.add_argument("--session-weight", type=_weight, action="append", default=[], metavar="NAME=W",
                    help="fair-share weight (1..1000, default 1) of the sessions whose CURVE client public key "
                         "or hello label (vLLM: vllm-dpN) is NAME; repeatable. The pool, --max-requests-total "
                         "and --max-retained-requests are divided among the sessions holding contexts in "
                         "proportion to their weights")
    ap.add_argument("--num-speculative-tokens", type=int_in(1, 64), default=16,
                    help="largest K a client may ask for")
    ap.add_argument("--block-size", type=int_in(1), default=16, help="reconnect granularity in tokens")
    ap.add_argument("--memory-budget-mb", type=int_in(1), default=None,
                    help="size of the context pool (draft K/V; ngram: token index) in MiB (default: "
                         "--gpu-memory-fraction on CUDA, 256 on CPU for dflash, 1024 for ngram)")
    ap.add_argument("--gpu-memory-fraction", type=_float_in(0.0, 1.0), default=0.8,
                    help="on CUDA without --memory-budget-mb: this fraction of the free GPU memory "
                         "(after loading weights) becomes the context pool")
    ap.add_argument("--max-message-mb", type=int_in(1), default=DEFAULT_MAX_MESSAGE_BYTES // MIB,
                    help="largest message accepted (also ZMQ MAXMSGSIZE)")
    ap.add_argument("--ngram-min", type=int_in(1), default=1, help="shortest n-gram to match (ngram)")
    ap.add_argument("--ngram-max", type=int_in(1), default=3, help="longest n-gram to match (ngram)")
    ap.add_argument("--curve-secret-key", metavar="FILE", help="server certificate with its secret key (zmq.auth format)")
    ap.add_argument("--curve-authorized-keys", metavar="DIR", help="directory of authorized client public keys")
    ap.add_argument("--allow-insecure-remote", action="store_true",
                    help="allow a non-loopback bind without CURVE (anyone who reaches the port can use it)")
    ap.add_argument("--device-plane", choices=["auto", "off", "always"], default="auto",
                    help="hidden rows GPU to GPU from targets on this host (CUDA IPC): auto = offered when the "
                         "engine runs on CUDA; always = offered even when it does not (tests of the refusal)")
    ap.add_argument("--ingest-coalesce-rows", type=int_in(0), default=1024, metavar="ROWS",
                    help="dflash/dspark: small ingests of host rows (steps that draft nothing) wait for one "
                         "projection at the next propose, up to ROWS rows (0: every ingest projects at once)")
    ap.add_argument("--batch-wait-ms", type=_float_min(0.0), default=1.0,
                    help="hold a round's proposes up to this long (and at most one engine call) for "
                         "targets expected back within it, so several targets stepping in a loop share one "
                         "engine call instead of taking turns (0: never hold)")
    ap.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], default="INFO",
                    help="log verbosity (stderr)")
    return ap


def validate(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """Cross-flag checks; each failure exits 2 with a message naming the flag."""
    if args.engine in ("dflash", "dspark"):
        for flag in ("draft_model", "target_model"):
            value = getattr(args, flag)
            if not value or not Path(value).is_dir():
                ap.error(f"--engine {args.engine} needs --{flag.replace('_', '-')} DIR (got {value!r})")
    if bool(args.curve_secret_key) != bool(args.curve_authorized_keys):
        ap.error("--curve-secret-key and --curve-authorized-keys go together")
    if args.curve_secret_key:
        try:
            load_keys(args.curve_secret_key, args.curve_authorized_keys)
        except SecurityError as exc:
            ap.error(str(exc))
    if args.ipc_path is not None:
        ipc = Path(args.ipc_path)
        if not ipc.parent.is_dir() or ipc.is_dir():
            ap.error(f"--ipc-path {args.ipc_path}: expected a file path in an existing directory")
        if len(str(ipc).encode()) > MAX_IPC_PATH:
            ap.error(f"--ipc-path {args.ipc_path}: longer than {MAX_IPC_PATH} bytes (the unix socket limit)")
    if args.ngram_min > args.ngram_max:
        ap.error("--ngram-min must be <= --ngram-max")
    if args.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            ap.error(f"--device {args.device}: CUDA is not available on this machine")
    try:
        check_bind(args.host, bool(args.curve_secret_key), args.allow_insecure_remote)
    except SecurityError as exc:
        ap.error(str(exc))


class StartupError(RuntimeError):
    """The server could not start (engine load, bind); the message says why."""


def build_engine(args: argparse.Namespace) -> DraftEngine:
    try:
        return _load_engine(args)
    except Exception as exc:
        raise StartupError(f"cannot load the {args.engine} engine: {exc}") from exc


def _load_engine(args: argparse.Namespace) -> DraftEngine:
    budget = None if args.memory_budget_mb is None else args.memory_budget_mb * MIB
    if args.engine == "ngram":
        from k3_accel.server.engines.ngram import DEFAULT_BUDGET_BYTES, NgramEngine
        return NgramEngine(max_spec_tokens=args.num_speculative_tokens, min_n=args.ngram_min,
                           max_n=args.ngram_max, block_size=args.block_size,
                           budget_bytes=budget or DEFAULT_BUDGET_BYTES)
    from k3_accel.server.engines.dflash import DFlashEngine, DSparkEngine
    pool = {"budget_bytes": budget} if budget is not None else (
        {"memory_fraction": args.gpu_memory_fraction} if args.device.startswith("cuda") else {})
    engine = DSparkEngine if args.engine == "dspark" else DFlashEngine
    return engine(args.draft_model, args.target_model, device=args.device, dtype=args.dtype,
                        max_spec_tokens=args.num_speculative_tokens, block_size=args.block_size,
                        graph_k=(args.num_speculative_tokens,), coalesce_rows=args.ingest_coalesce_rows, **pool)


def serve(args: argparse.Namespace, stop: threading.Event) -> None:
    """Load the engine, bind sockets, serve until ``stop`` is set."""
    metrics = ServerMetrics()
    loop = None
    try:
        http = HealthServer(args.host, args.http_port, metrics.registry,
                            ready=lambda: loop is not None and loop.ready.is_set(), on_scrape=metrics.flush).start()
    except OSError as exc:
        raise StartupError(f"cannot serve http on {_bracket(args.host)}:{args.http_port} (--http-port): {exc}") from None
    ctx = zmq.Context()
    curve = CurveGuard(ctx, args.curve_secret_key, args.curve_authorized_keys) if args.curve_secret_key else None
    log.info("http on %s:%d (/healthz /readyz /metrics)", args.host, http.port)
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        engine = build_engine(args)
        store = RequestStore(engine, max_requests=min(args.max_requests, args.max_requests_total),
                             max_requests_total=args.max_requests_total,
                             max_retained=args.max_retained_requests, weights=dict(args.session_weight))
        service = DraftService(engine, store, metrics, max_message_bytes=args.max_message_mb * MIB,
                               lease_s=args.lease_s,
                               device_plane=ServerDevicePlane.for_engine(engine, args.device_plane))
        endpoints = [f"tcp://{_bracket(args.host)}:{args.port}"]
        if args.ipc_path is not None:
            endpoints.append(f"ipc://{args.ipc_path}")
        if args.ipc_path is not None and _listened_on(args.ipc_path):
            raise StartupError(f"cannot bind ipc://{args.ipc_path}: another process listens on it "
                               f"(a file left by a stopped server is no obstacle)")
        try:
            loop = ServerLoop(service, endpoints, args.max_message_mb * MIB, ctx=ctx, curve=curve,
                              lease_s=args.lease_s, gather=Gather(args.batch_wait_ms / 1000))
        except zmq.ZMQError as exc:
            raise StartupError(f"cannot bind {' and '.join(endpoints)}: {exc}") from None
        gc.collect()
        gc.freeze()     # the startup heap (torch, weights, modules) is never scanned again: a full
        #                 collection over it costs tens of ms, paid by whichever propose triggers it
        log.info("k3-draft-server ready: engine=%s endpoints=%s server_id=%s pool=%d blocks x %d rows "
                 "threads=%d", engine.caps.kind, " ".join(loop.endpoints), service.server_id,
                 engine.pool.num_blocks, engine.pool.block_rows, torch.get_num_threads())
        loop.serve(stop)
    finally:
        http.close()
        if curve is not None:
            curve.close()
        ctx.term()
    log.info("k3-draft-server stopped")


def _listened_on(path: str) -> bool:
    """Whether a live process accepts connections on the unix socket ``path``: libzmq would bind
    over it without an error, taking the path from that process."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    validate(args, ap)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve(args, stop)
    except StartupError as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
