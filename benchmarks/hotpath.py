"""CPU cost of the propose hot path on each side, without sockets (process CPU time per step).

* client: ``DraftClient.step`` for B decode requests, with the connection
  short-circuited (every message is answered at once, in process, with a
  ready-made reply), so what is timed is the client's own Python: plan,
  staging, encoding, reply decoding, drafts.
* server: a decoded propose through ``DraftService.propose_batch`` (checks,
  admission, rows stored, ngram engine, reply) plus decode and encode.

Process CPU time, so what other processes on the machine do does not count.
Prints one JSON document (and a cProfile table per side with ``--profile``):
the numbers to set beside ``rpc.py``'s round trips when asking where the
time goes.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE)]

from k3_accel import protocol as p  # noqa: E402
from rpc import step_input  # noqa: E402


def client_cost(b: int, k: int, steps: int, profile: bool) -> tuple[float, str]:
    from k3_accel.transport.api import ClientSettings
    from k3_accel.transport.client import DraftClient
    from k3_accel.transport.connection import Pending
    from k3_accel.transport.link import State
    c = DraftClient(ClientSettings("tcp://127.0.0.1:1", num_speculative_tokens=k, max_rows=max(4096, 256 * b)))
    caps = p.Caps(engine="ngram", needs_hidden_states=False, context_width=0, hidden_dtypes=[],
                  supports_logits=False, supports_topk=False, max_spec_tokens=16, block_size=16, vocab_size=0)
    c.link.caps, c.link.state = caps, State.READY
    frames = p.encode_reply(p.Reply(0, True, "sid", result=[1e-5, 1e-5],
                                    tensors={"drafts": np.zeros((b, k), np.int32)}))
    conn = c.link.conn

    def post(out, on_reply=None, on_abandon=None, keepalive=None, timeout_s=None):
        now = time.monotonic()
        item = Pending(out.seq, out.op, now, now + 10, on_reply, on_abandon, keepalive)
        item.reply, item.received_at = p.decode_reply(frames), now
        if on_reply:
            on_reply(item)
        return item
    conn.post, conn.poll, conn.expire = post, (lambda *a, **k: 0), (lambda: None)
    prefill = step_input(b, k, 0, 256, torch.device("cpu"))
    prefill.sampled = [False] * b
    c.step(prefill)
    c.flush()
    inps = [step_input(b, k, 256 + i, 1, torch.device("cpu")) for i in range(steps + 100)]
    for inp in inps[:100]:
        c.step(inp)
    assert not c.is_disabled(inps[0].req_ids[0]), "the timed steps would not draft"
    return _timed(lambda: [c.step(inp) for inp in inps[100:]], steps, profile)


def server_cost(b: int, k: int, steps: int, profile: bool) -> tuple[float, str]:
    from k3_accel.server.engines.ngram import NgramEngine
    from k3_accel.server.metrics import ServerMetrics
    from k3_accel.server.service import DraftService
    from k3_accel.server.state import RequestStore
    engine = NgramEngine(budget_bytes=1 << 28)
    svc = DraftService(engine, RequestStore(engine, max_requests=1024, max_requests_total=4096, max_retained=64),
                       ServerMetrics())
    session, _ = svc.hello(p.decode_request(p.encode_request(1, p.Hello("s" * 32, "hotpath"))), None)
    meta = np.stack([np.arange(b), np.zeros(b, np.int64), np.full(b, 256)], 1)
    svc.handle(session, p.decode_request(p.encode_request(
        2, p.Ingest(b, b * 256), meta.tobytes(), np.tile(np.arange(256) % 17, b).tobytes())))
    frames = []
    for i in range(steps + 100):
        m = np.stack([np.arange(b), np.full(b, 256 + i), np.ones(b, np.int64), np.full(b, (257 + i) % 17)], 1)
        frames.append(p.encode_request(3 + i, p.Propose(k, b, b), m.tobytes(),
                                       np.full(b, (256 + i) % 17, np.int64).tobytes()))

    def one(f):
        return p.encode_reply(svc.propose_batch([(session, p.decode_request(f))])[0])
    for f in frames[:100]:
        one(f)
    return _timed(lambda: [one(f) for f in frames[100:]], steps, profile)


def _timed(fn, steps: int, profile: bool) -> tuple[float, str]:
    gc.collect()
    gc.freeze()                               # as the server and vLLM's engine core do after start-up
    prof = cProfile.Profile() if profile else None
    t0 = time.process_time()
    if prof:
        prof.enable()
    fn()
    if prof:
        prof.disable()
    seconds = (time.process_time() - t0) / steps
    text = ""
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        text = out.getvalue()
    return seconds, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--profile", help="write cProfile tables here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows, profiles = [], []
    for b in map(int, args.batches.split(",")):
        client, ctext = client_cost(b, args.k, args.steps, False)
        server, stext = server_cost(b, args.k, args.steps, False)
        rows.append({"B": b, "K": args.k, "client_us": round(client * 1e6, 1), "server_us": round(server * 1e6, 1)})
        if args.profile:
            profiles += [f"== client B={b}\n{client_cost(b, args.k, 500, True)[1]}",
                         f"== server B={b}\n{server_cost(b, args.k, 500, True)[1]}"]
    print(json.dumps({"python": sys.version.split()[0], "torch": torch.__version__, "table": rows}, indent=2))
    if args.profile:
        Path(args.profile).write_text("\n".join(profiles))


if __name__ == "__main__":
    main()
