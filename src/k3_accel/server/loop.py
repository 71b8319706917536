"""The ROUTER socket loop: receive, decode, schedule, reply.

One ROUTER socket, bound to every endpoint given (``tcp://`` and, for
clients on the same host, ``ipc://``).

Each connection (ROUTER identity) has a FIFO of decoded messages; a
connection's messages are handled strictly in arrival order and its replies
leave in that order. Each round takes the head message of every connection:
the proposes among them run as **one engine batch** (several clients'
proposes that wait at the same time), the rest one by one; a round's proposes
may be held a little while for targets expected back (:mod:`.gather`). While the
device computes a batch's drafts, the loop keeps receiving and decoding
(it never blocks on the GPU); between rounds everything that arrived is
read first, so a burst from several targets is batched.

Housekeeping between rounds: sessions whose client sent nothing for the
lease are reclaimed; gauges are refreshed. At shutdown every queued message
is answered ``SHUTTING_DOWN``.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import zmq

from k3_accel import protocol as p
from k3_accel.protocol import ErrorCode, ProtocolError, Reply
from k3_accel.server.gather import Gather
from k3_accel.server.security import CurveGuard
from k3_accel.server.service import DraftService
from k3_accel.server.state import Session

log = logging.getLogger("k3_accel.server")
POLL_MS = 100
# after a round, poll without sleeping this long (a sleeping thread wakes slowly); not on a host of
# 1-3 CPUs, where a spinning server takes the core its clients need
SPIN_S = 0.002 if (os.cpu_count() or 1) >= 4 else 0.0
HOUSEKEEPING_S = 0.5
DRAIN_QUIET_MS = 300      # shutdown: answer what arrives until the socket is quiet this long ...
DRAIN_MAX_S = 3.0         # ... but no longer than this
BATCH_WAIT_S = 0.001      # the longest a round's proposes are held for targets expected back (--batch-wait-ms)


@dataclass(eq=False)
class _Conn:
    ident: bytes
    session: Session | None = None
    owner: str | None = None                      # CURVE client key (z85), when CURVE is on
    queue: deque = field(default_factory=deque)   # p.Request or a ready Reply (decode errors)
    job: Any = None                               # its head propose, prepared (rows stored), not launched
    last_seen: float = field(default_factory=time.monotonic)   # its latest message's arrival


class ServerLoop:
    def __init__(self, service: DraftService, endpoints: Sequence[str], max_message_bytes: int,
                 ctx: zmq.Context | None = None, curve: CurveGuard | None = None, lease_s: float = 0.0,
                 gather: Gather | None = None):
        self.service = service
        self.gather = gather if gather is not None else Gather(BATCH_WAIT_S)
        self.max_message_bytes = max_message_bytes
        self.lease_s = lease_s
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + (1 << 20))
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.curve = curve is not None
        if curve is not None:
            curve.apply(self.sock)
        self.endpoints = []                  # as bound (a tcp port 0 resolved)
        try:
            for endpoint in endpoints:
                self.sock.bind(endpoint)
                self.endpoints.append(self.sock.getsockopt_string(zmq.LAST_ENDPOINT))
        except zmq.ZMQError:
            self.sock.close(linger=0)        # else the context's term() waits for it forever
            raise
        self.ready = threading.Event()
        self._conns: dict[bytes, _Conn] = {}
        self._next_housekeeping = 0.0
        self._spin_until = 0.0

    # ----------------------------------------------------------------- loop
    def serve(self, stop: threading.Event) -> None:
        self.ready.set()
        try:
            while True:
                busy = any(c.queue for c in self._conns.values())
                if busy or time.monotonic() < self._spin_until:
                    arrived = self.sock.poll(0, zmq.POLLIN)
                else:
                    arrived = self.sock.poll(POLL_MS, zmq.POLLIN)
                if arrived:
                    self._receive_all()
                    self._spin_until = max(self._spin_until, time.monotonic() + SPIN_S)
                if stop.is_set():
                    break                     # what waits now is answered SHUTTING_DOWN
                if any(c.queue for c in self._conns.values()):
                    if self._round():
                        self._spin_until = time.monotonic() + SPIN_S
                    elif time.monotonic() < self._spin_until:
                        time.sleep(0)         # every head waits for rows from a target's GPU: usually a
                    else:                     # copy of microseconds away, not the millisecond a poll sleeps
                        self.sock.poll(1, zmq.POLLIN)
                self._housekeeping()
        finally:
            self.ready.clear()
            self._drain()
            self.sock.close()
            for endpoint in self.endpoints:   # leave no socket file behind
                if endpoint.startswith("ipc://"):
                    Path(endpoint[len("ipc://"):]).unlink(missing_ok=True)

    def _receive_all(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue                      # nothing to answer: no identity or no body
            self._enqueue(frames)

    def _enqueue(self, frames: list) -> None:
        ident = frames[0].bytes
        conn = self._conns.get(ident)
        if conn is None:
            conn = self._conns[ident] = _Conn(ident, owner=frames[1].get("User-Id") if self.curve else None)
        else:
            conn.last_seen = time.monotonic()
            if conn.session is not None:
                conn.session.last_seen = conn.last_seen   # the lease counts arrivals, not handling
        try:
            req = p.decode_request(frames[1:], self.max_message_bytes)
            conn.queue.append(req)
            if conn.session is not None and isinstance(req.msg, p.Propose):
                self.gather.arrived(conn.session.key)
        except ProtocolError as exc:
            legacy = p.legacy_error(frames[1:], self.service.server_id)
            if legacy is not None:            # a version-1 client: answer in its framing
                self.service.metrics.error(exc.code.value)
                self.sock.send_multipart([ident, *legacy])
                return
            log.debug("rejected message: %s", exc)
            conn.queue.append(self.service.reject(exc))
        except Exception as exc:  # noqa: BLE001 - a decoder bug must not stop the server
            log.exception("unexpected failure decoding a message")
            conn.queue.append(self.service.reject(ProtocolError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")))

    def _round(self) -> bool:
        """Handle the head message of every connection; proposes as one batch. False when
        nothing could be handled (every head waits for its device rows)."""
        heads = [c for c in self._conns.values() if c.queue]
        proposes, pending, handled = [], [], 0
        for conn in heads:
            fetched = self._head_fetched(conn)
            if conn.job is not None and conn.job.session is not conn.session:
                self._drop_job(conn)              # its session ended while the propose was held
            if not fetched:
                if isinstance(conn.queue[0].msg, p.Propose):
                    pending.append(conn.session.key)
                continue                      # its rows are still on their way from the target's GPU
            item = conn.queue[0]
            handled += 1
            if isinstance(item, Reply):
                self._send(conn, item)
            elif conn.session is None or isinstance(item.msg, p.Hello):
                self._send(conn, self._unbound(conn, item))
            elif isinstance(item.msg, p.Attach):
                self._send(conn, self.service.attach(conn.session, conn.ident, item))
            elif isinstance(item.msg, p.Propose):
                if conn.job is None:              # its rows are stored now, also while the round is held
                    conn.job = self.service.prepare(conn.session, item)
                proposes.append(conn)
                handled -= 1
                continue
            else:
                self.service.metrics.session_message(conn.session.name)
                self._send(conn, self.service.handle(conn.session, item))
            conn.queue.popleft()
        for conn in [c for c in proposes if not self.service.store.is_open(c.session)]:
            self._drop_job(conn)              # a later head ended its session (a bye on another connection):
            proposes.remove(conn)             # nothing runs on its released states; NO_SESSION next round
        if proposes:
            hold = self.gather.wait_s([c.session.key for c in proposes], pending)
            if hold > 0:                      # targets expected back within the wait: hold the round
                self._spin_until = max(self._spin_until, time.monotonic() + hold)
                return handled > 0
            if self.gather.held_s is not None:
                self.service.metrics.batch_held(self.gather.held_s)
            self._run_proposes(proposes)
            handled += len(proposes)
        else:
            self.gather.idle()                # nothing held now: a later hold starts afresh
        return handled > 0

    def _drop_job(self, conn: _Conn) -> None:
        """Its prepared propose will not run: what it admitted is no longer protected."""
        self.service.release([conn.job])
        conn.job = None

    def _run_proposes(self, proposes: list[_Conn]) -> None:
        """The proposes of one round as one engine batch; receive what arrives meanwhile."""
        for conn in proposes:
            self.service.metrics.session_message(conn.session.name)
        started = time.perf_counter()
        batch = self.service.launch([c.job for c in proposes])
        for conn in proposes:
            conn.job = None
        while not batch.done():          # the device works: read and decode what arrives, and
            if self.sock.poll(0, zmq.POLLIN):  # start its device rows' reads (the next round batches it)
                self._receive_all()
                for conn in self._conns.values():
                    if conn.queue and conn not in proposes:
                        self._head_fetched(conn)
            else:
                time.sleep(0)
        replies = batch.finish()
        self.gather.engine(time.perf_counter() - started)
        for conn, reply in zip(proposes, replies):
            conn.queue.popleft()
            self._send(conn, reply)
            self.gather.answered(conn.session.key)

    def _head_fetched(self, conn: _Conn) -> bool:
        """Whether the head message's device-plane rows are here; starts their read if not yet."""
        if conn.session is not None and not self.service.store.is_open(conn.session):
            conn.session = None               # its session ended (bye, perhaps on another connection)
        return self._fetched(conn, conn.queue[0])

    def _fetched(self, conn: _Conn, item) -> bool:
        """Whether a head message's device-plane rows are here (a refused read becomes its reply)."""
        if isinstance(item, Reply) or conn.session is None:
            return True
        try:
            return self.service.plane.fetch(conn.session.key, conn.ident, item)
        except ProtocolError as exc:
            exc.seq = item.seq
            conn.queue[0] = self.service.reject(exc)
            return True

    def _unbound(self, conn: _Conn, req: p.Request) -> Reply:
        """A hello (binds the connection to a session) or a message before any hello."""
        if isinstance(req.msg, p.Hello):
            session, reply = self.service.hello(req, conn.owner)
            if session is not None:
                conn.session = session
            return reply
        return self.service.reject(ProtocolError(ErrorCode.NO_SESSION, "send hello first", req.seq))

    def _send(self, conn: _Conn, reply: Reply) -> None:
        self.sock.send_multipart([conn.ident, *p.encode_reply(reply)], copy=False)

    # --------------------------------------------------------- housekeeping
    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now < self._next_housekeeping:
            return
        self._next_housekeeping = now + HOUSEKEEPING_S
        store = self.service.store
        if self.lease_s > 0:
            for session in store.expired(self.lease_s, now):
                self.service.reclaim(session, f"no message for {self.lease_s:g}s")
                for conn in [c for c in self._conns.values() if c.session is session]:
                    conn.session = None
        # unbound, its session ended (bye), or silent for the lease (a client's socket rebuilt: its
        # session lives on through the new one)
        for ident in [i for i, c in self._conns.items() if not c.queue and (
                c.session is None or not store.is_open(c.session) or 0 < self.lease_s < now - c.last_seen)]:
            del self._conns[ident]
        self.service.plane.collect()
        self.gather.forget()
        self.service.metrics.refresh(store.summary)
        self.service.metrics.flush()

    def _drain(self) -> None:
        """Answer SHUTTING_DOWN to everything that arrived but was not handled: what is queued,
        and what keeps arriving until the socket has been quiet for DRAIN_QUIET_MS (ZMQ's I/O
        thread may still be handing over messages that reached the host before the stop)."""
        give_up = time.monotonic() + DRAIN_MAX_S
        while True:
            self._receive_all()
            for conn in self._conns.values():
                if conn.job is not None:
                    self._drop_job(conn)
                while conn.queue:
                    item = conn.queue.popleft()
                    self.service.metrics.error(ErrorCode.SHUTTING_DOWN.value)
                    self._send(conn, p.error_reply(item.seq, self.service.server_id, ErrorCode.SHUTTING_DOWN,
                                                   "server is stopping"))
            if time.monotonic() > give_up or not self.sock.poll(DRAIN_QUIET_MS, zmq.POLLIN):
                return
