"""``k3-accel probe ADDRESS``: say hello to a draft server and read its stats."""
from __future__ import annotations

from typing import Any

import uuid

import zmq

from k3_accel import protocol as p


class ProbeError(RuntimeError):
    """The server did not answer in time or answered with an error."""


def probe(address: str, timeout_ms: int = 5000) -> dict[str, Any]:
    """``{"address", "server_id", "hello": caps, "stats": counters}`` from one short connection."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        hello = _call(sock, 1, p.Hello(uuid.uuid4().hex, "k3-accel-probe"), timeout_ms)
        stats = _call(sock, 2, p.Stats(), timeout_ms)
        _call(sock, 3, p.Bye(), timeout_ms)
    finally:
        sock.close()
        ctx.term()
    return {"address": address, "server_id": hello.server_id, "hello": hello.result, "stats": stats.result}


def _call(sock: zmq.Socket, seq: int, msg: Any, timeout_ms: int) -> p.Reply:
    sock.send_multipart(p.encode_request(seq, msg))
    if not sock.poll(timeout_ms):
        raise ProbeError(f"no reply to {type(msg).__name__.lower()} within {timeout_ms} ms")
    reply = p.decode_reply(sock.recv_multipart())
    if not reply.ok:
        raise ProbeError(f"{type(msg).__name__.lower()} failed: {reply.error[0]}: {reply.error[1]}")
    return reply
