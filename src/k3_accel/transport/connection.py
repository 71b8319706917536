"""One DEALER socket to the draft server: sequence numbers, pending replies, deadlines.

Two threads use the socket: the step thread (sends, reads replies) and the
sender thread (deferred ingests, heartbeats). Every socket operation holds
``lock`` (a mutex is the full memory barrier ZMQ asks for when a socket
moves between threads); only the step thread reads replies. Messages are
never awaited one by one: a reply is matched to its :class:`Pending` by
``seq`` whenever replies are read, and the pending's callback runs then. The
server handles one client's messages in arrival order, so waiting for a
message also reads (and settles) the replies of everything sent before it.

Large tensor frames are sent zero-copy (``copy=False``); pyzmq keeps the
viewed memory alive until libzmq has sent it. Small frames are copied
(cheaper than zero-copy bookkeeping). Zero-copy ``zmq.Frame`` objects are
cached by (address, length): a staging slot's usual chunk is wrapped once,
and re-sending it only bumps a reference count inside libzmq instead of
registering the buffer with pyzmq's garbage-collector thread on every
message (whose GIL traffic costs milliseconds on a busy host). A cached
frame keeps its memory alive until evicted, so an address is never reused
while a frame for it exists.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import zmq
import zmq.auth

from k3_accel import protocol as p
from k3_accel.protocol import ProtocolError, Reply
from k3_accel.transport.failures import TransportError, TransportTimeout

log = logging.getLogger("k3_accel.transport")

ReplyCallback = Callable[["Pending"], None]
FRAME_CACHE = 32          # zero-copy frames kept for re-sending
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_LAST = int(zmq.NOBLOCK)


def _address(view: memoryview) -> int:
    """Start address of the memory under ``view``."""
    return np.frombuffer(view, dtype=np.uint8, count=1).__array_interface__["data"][0]


@dataclass(eq=False)
class Pending:
    """A sent message waiting for its reply."""
    seq: int
    op: str
    sent_at: float
    deadline: float
    on_reply: ReplyCallback | None = None
    on_abandon: Callable[["Pending", Exception], None] | None = None
    keepalive: Any = None                  # tensors the frames view (copied frames need none)
    reply: Reply | None = None
    received_at: float = 0.0

    @property
    def done(self) -> bool:
        return self.reply is not None

    @property
    def round_trip(self) -> float:
        return self.received_at - self.sent_at


@dataclass(frozen=True)
class Outgoing:
    """An encoded request not sent yet."""
    seq: int
    op: str
    frames: list
    expects_reply: bool = True


@dataclass(frozen=True)
class CurveKeys:
    """CURVE client keys: the server's public key and this client's key pair."""
    server_public: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def load(cls, server_key_file: str, client_cert_file: str) -> "CurveKeys":
        server_public, _ = zmq.auth.load_certificate(server_key_file)
        client_public, client_secret = zmq.auth.load_certificate(client_cert_file)
        if client_secret is None:
            raise ValueError(f"{client_cert_file} holds no secret key")
        return cls(server_public, client_public, client_secret)


class Connection:
    """A DEALER socket plus the table of pending replies by ``seq``."""

    def __init__(self, address: str, timeout_s: float, *, curve: CurveKeys | None = None,
                 zero_copy_min_bytes: int = 64 * 1024,
                 max_message_bytes: int = p.DEFAULT_MAX_MESSAGE_BYTES,
                 on_server_id: Callable[[str, str], None] | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self.curve = curve
        self.zero_copy_min_bytes = zero_copy_min_bytes
        self.max_message_bytes = max_message_bytes
        self.on_server_id = on_server_id or (lambda old, new: None)
        self.server_id: str | None = None
        self.lock = threading.RLock()
        self.last_send = 0.0
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        # Strong references, so that a connection dropped without close() still closes its
        # socket before the context terminates (else zmq's term() can block forever at exit/GC).
        self._open_socks: list[zmq.Socket] = []
        self._teardown = weakref.finalize(self, _teardown, self._ctx, self._open_socks)
        self._frames: OrderedDict[tuple[int, int], zmq.Frame] = OrderedDict()
        self._seq = 0
        self._pending: dict[int, Pending] = {}

    # ------------------------------------------------------------ socket
    @property
    def in_flight(self) -> int:
        return len(self._pending)

    @property
    def is_open(self) -> bool:
        return self._sock is not None

    def open(self) -> None:
        """A fresh socket (new identity); ZMQ reconnects TCP by itself with backoff."""
        with self.lock:
            self._open()

    def _open(self) -> None:
        if self._sock is not None:
            raise RuntimeError("connection already open")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)          # no queueing towards a peer that is not there
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes + (1 << 20))
        if self.curve is not None:
            sock.curve_serverkey = self.curve.server_public
            sock.curve_publickey = self.curve.client_public
            sock.curve_secretkey = self.curve.client_secret
        try:
            sock.connect(self.address)
        except zmq.ZMQError as exc:         # an address ZMQ refuses (an ipc path too long, a host of "*")
            sock.close(linger=0)            # an unclosed socket would block the context's term() forever
            raise TransportError(f"cannot connect to {self.address}: {exc}") from None
        self._sock = sock
        self._open_socks.append(sock)

    def writable(self, timeout_s: float = 0.0) -> bool:
        """Whether a message can be queued now (a peer is connected), waiting up to ``timeout_s``."""
        with self.lock:
            if self._sock is None:
                return False
            return bool(self._sock.poll(int(max(timeout_s, 0) * 1000), zmq.POLLOUT))

    def abandon(self, reason: Exception) -> list[Pending]:
        """Close the socket (dropping queued frames) and give up every pending reply."""
        with self.lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._open_socks.remove(self._sock)
                self._sock = None
            pending, self._pending = list(self._pending.values()), {}
        for item in pending:
            if item.on_abandon is not None:
                item.on_abandon(item, reason)
        return pending

    def close(self) -> None:
        self.abandon(TransportError("connection closed"))
        self._teardown()

    # -------------------------------------------------------------- send
    def send(self, msg: p.Message, *frames: Any, on_reply: ReplyCallback | None = None,
             on_abandon: Callable[[Pending, Exception], None] | None = None,
             keepalive: Any = None, timeout_s: float | None = None) -> Pending:
        """Encode and queue one message (never blocks); large frames go zero-copy."""
        with self.lock:
            return self.post(self.encode(msg, *frames), on_reply=on_reply, on_abandon=on_abandon,
                             keepalive=keepalive, timeout_s=timeout_s)

    def encode(self, msg: p.Message, *frames: Any, expects_reply: bool = True) -> Outgoing:
        """Frames for ``msg`` with the next seq, ready for :meth:`post` (the frames' bytes
        are read only when posted, so they may still be filling)."""
        with self.lock:
            self._seq += 1
            seq = self._seq
        return Outgoing(seq, msg.__struct_config__.tag, p.encode_request(seq, msg, *frames), expects_reply)

    def post(self, out: Outgoing, *, on_reply: ReplyCallback | None = None,
             on_abandon: Callable[[Pending, Exception], None] | None = None,
             keepalive: Any = None, timeout_s: float | None = None) -> Pending | None:
        """Queue encoded frames (never blocks); :class:`TransportError` if no peer takes them.
        A message that expects no reply (a heartbeat) gets no :class:`Pending`."""
        with self.lock:
            if self._sock is None:
                raise TransportError("not connected")
            self._send_frames(out.frames)
            now = self.last_send = time.monotonic()
            if not out.expects_reply:
                return None
            item = Pending(out.seq, out.op, now, now + (self.timeout_s if timeout_s is None else timeout_s),
                           on_reply, on_abandon, keepalive)
            self._pending[item.seq] = item
            return item

    def _send_frames(self, frames: list) -> None:
        """Queue a multipart message without blocking (IMMEDIATE: no peer -> EAGAIN at once).

        ZMQ multipart sends are atomic: if the first frame is accepted, all are.
        """
        last, sock, big = len(frames) - 1, self._sock, self.zero_copy_min_bytes
        try:
            for i, frame in enumerate(frames):
                flags = _MORE if i < last else _LAST
                if isinstance(frame, memoryview) and frame.nbytes >= big:
                    sock.send(self._zero_copy(frame), flags, copy=False)
                else:
                    sock.send(frame, flags, copy=True)
        except zmq.Again:
            raise TransportError(f"draft server at {self.address} is not connected "
                                 "(or its queue is full)") from None
        except zmq.ZMQError as exc:
            raise TransportError(f"send to {self.address} failed: {exc}") from exc

    def _zero_copy(self, view: memoryview) -> zmq.Frame:
        """A (cached) zero-copy frame over ``view``'s memory."""
        key = (_address(view), view.nbytes)
        frame = self._frames.get(key)
        if frame is None:
            frame = self._frames[key] = zmq.Frame(view, copy=False)
            while len(self._frames) > FRAME_CACHE:
                self._frames.popitem(last=False)
        else:
            self._frames.move_to_end(key)
        return frame

    # ----------------------------------------------------------- replies
    def poll(self, timeout_s: float = 0.0, until: Pending | None = None) -> int:
        """Read the replies available, waiting up to ``timeout_s`` for the first; returns how many.

        Stops early once ``until`` (if given) has its reply.
        """
        handled = 0
        wait_ms = int(max(timeout_s, 0) * 1000)
        with self.lock:
            if self._sock is None:
                return 0
            try:
                while self._sock.poll(wait_ms, zmq.POLLIN):
                    self._dispatch(self._sock.recv_multipart(zmq.NOBLOCK, copy=False))
                    handled += 1
                    wait_ms = 0
                    if until is not None and until.reply is not None:
                        break
            except zmq.ZMQError as exc:
                raise TransportError(f"receive from {self.address} failed: {exc}") from exc
        return handled

    def wait(self, item: Pending, spin_s: float = 0.0, give_up_at: float | None = None) -> Reply:
        """Read replies until ``item``'s arrives; :class:`TransportTimeout` at its deadline.

        For the first ``spin_s`` seconds it polls without sleeping: a thread that sleeps in
        the kernel (and a virtual CPU that idles) wakes up slowly, which a propose round trip
        of a few hundred microseconds feels in full. ``give_up_at`` (a ``time.monotonic``
        value before the deadline): :class:`ReplyLate` then, and the message stays pending
        (its reply is still read, and dropped, when it comes)."""
        spin_until = time.monotonic() + spin_s
        while item.reply is None and time.monotonic() < spin_until:
            self.poll(0, until=item)
        while item.reply is None:
            now = time.monotonic()
            if give_up_at is not None and now >= give_up_at and now < item.deadline:
                raise ReplyLate(f"no reply to {item.op} seq={item.seq} yet; going on without it")
            left = min(item.deadline, give_up_at if give_up_at is not None else item.deadline) - now
            if left <= 0 or self._sock is None:
                raise TransportTimeout(f"no reply to {item.op} seq={item.seq} from {self.address} "
                                       f"within {self.timeout_s:.3f}s")
            self.poll(min(left, 0.05), until=item)
        return item.reply

    def expire(self) -> None:
        """Raise :class:`TransportTimeout` if the oldest pending reply is overdue."""
        if self._pending:
            oldest = next(iter(self._pending.values()))
            if time.monotonic() > oldest.deadline:
                raise TransportTimeout(f"no reply to {oldest.op} seq={oldest.seq} within "
                                       f"{self.timeout_s:.3f}s")

    def _dispatch(self, frames: list) -> None:
        reply = self._decode(frames)
        if reply.server_id:
            self._note_server(reply.server_id)
        item = self._pending.get(reply.seq)
        if item is None:                 # a heartbeat's reply
            return
        first = next(iter(self._pending))
        if first != reply.seq:           # the server answers a connection in order: an older one is lost
            lost = self._pending[first]
            raise TransportError(f"no reply to {lost.op} seq={lost.seq} from {self.address}: a later message "
                                 f"(seq={reply.seq}) was answered first, so the server never got it (a restart?)")
        del self._pending[reply.seq]
        item.reply, item.received_at = reply, time.monotonic()
        if item.on_reply is not None:
            item.on_reply(item)

    def _decode(self, frames: list) -> Reply:
        try:
            return p.decode_reply(frames)
        except ProtocolError as exc:  # answer the pending with the typed error, if we know it
            log.warning("undecodable reply from %s: %s", self.address, exc)
            return Reply(exc.seq, False, "", (exc.code.value, exc.message))

    def _note_server(self, server_id: str) -> None:
        old, self.server_id = self.server_id, server_id
        if old is not None and old != server_id:
            self.on_server_id(old, server_id)


class ReplyLate(Exception):
    """A reply the caller stopped waiting for (not a transport failure: it may still come)."""


def _teardown(ctx: zmq.Context, socks: list) -> None:
    """Close what is still open (dropping queued frames), then end the context."""
    for sock in socks:
        sock.close(linger=0)
    socks.clear()
    ctx.term()
