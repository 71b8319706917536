"""The ROUTER socket loop: receive, decode, handle in arrival order, reply."""
from __future__ import annotations

import logging
import threading

import zmq

from k3_accel import protocol as p
from k3_accel.protocol import ErrorCode, ProtocolError
from k3_accel.server.security import CurveGuard
from k3_accel.server.service import DraftService

log = logging.getLogger("k3_accel.server")
POLL_MS = 100


class ServerLoop:
    """One thread, one ROUTER socket: every client's messages run strictly in order."""

    def __init__(self, service: DraftService, endpoint: str, max_message_bytes: int,
                 ctx: zmq.Context | None = None, curve: CurveGuard | None = None):
        self.service = service
        self.max_message_bytes = max_message_bytes
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + (1 << 20))
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if curve is not None:
            curve.apply(self.sock)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ready = threading.Event()

    def serve(self, stop: threading.Event) -> None:
        self.ready.set()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(POLL_MS):
                self._one(self.sock.recv_multipart(copy=False))
        self.ready.clear()
        self._drain()
        self.sock.close()

    def _one(self, frames: list) -> None:
        if len(frames) < 2:
            return  # nothing to answer: no identity or no body
        ident, body = frames[0].bytes, frames[1:]
        try:
            reply = self.service.handle(p.decode_request(body, self.max_message_bytes))
        except ProtocolError as exc:
            log.debug("rejected message: %s", exc)
            reply = self.service.reject(exc)
        except Exception as exc:  # a decoder bug must not stop the server
            log.exception("unexpected failure decoding a message")
            reply = self.service.reject(ProtocolError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
        self.sock.send_multipart([ident, *p.encode_reply(reply)], copy=False)

    def _drain(self) -> None:
        """Fail every message that arrived but was not handled before shutdown."""
        while self.sock.poll(0):
            frames = self.sock.recv_multipart(copy=False)
            if len(frames) < 2:
                continue
            seq = _peek_seq(frames[1:], self.max_message_bytes)
            reply = p.error_reply(seq, self.service.server_id, ErrorCode.SHUTTING_DOWN, "server is stopping")
            self.sock.send_multipart([frames[0].bytes, *p.encode_reply(reply)], copy=False)


def _peek_seq(frames: list, max_bytes: int) -> int:
    try:
        return p.decode_request(frames, max_bytes).seq
    except ProtocolError as exc:
        return exc.seq
