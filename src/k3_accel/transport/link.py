"""The link to the draft server: connect, hello, backoff, restart and lease detection.

States: ``new`` -> ``connecting`` (socket open, hello sent) -> ``ready``;
a transport error drops the socket and goes to ``disconnected`` until the
next attempt (exponential backoff); a hello that does not fit the target
goes to ``incompatible`` for good (fail closed); ``closed`` at the end.
The link never raises out of :meth:`Link.service` except
:class:`TransportError` for the step to fail closed.
"""
from __future__ import annotations

import logging
import time
from enum import Enum
from typing import Callable

from k3_accel import protocol as p
from k3_accel.protocol import Caps, Reply
from k3_accel.transport import handshake
from k3_accel.transport.api import ClientSettings
from k3_accel.transport.connection import Connection, CurveKeys, Pending
from k3_accel.transport.failures import IncompatibleServer, TransportError, TransportTimeout
from k3_accel.transport.timing import Telemetry

log = logging.getLogger("k3_accel.transport")


# hello refusals that say nothing about whether the server fits this target
_HELLO_RETRIED = (p.ErrorCode.SHUTTING_DOWN.value, p.ErrorCode.INTERNAL.value)


class State(str, Enum):
    NEW = "new"
    CONNECTING = "connecting"
    READY = "ready"
    DISCONNECTED = "disconnected"
    INCOMPATIBLE = "incompatible"
    CLOSED = "closed"


class Link:
    def __init__(self, settings: ClientSettings, telemetry: Telemetry, *,
                 on_ready: Callable[[Caps], None], on_state_lost: Callable[[str], None],
                 on_lost: Callable[[], None] = lambda: None):
        self.settings = settings
        self.telemetry = telemetry
        self.on_ready, self.on_state_lost, self.on_lost = on_ready, on_state_lost, on_lost
        self.caps: Caps | None = None
        self.state = State.NEW
        self.problem: str | None = None       # why the link is incompatible
        curve = (CurveKeys.load(settings.curve_server_key, settings.curve_client_key)
                 if settings.curve_server_key else None)
        self.conn = Connection(settings.address, settings.timeout_s, curve=curve,
                               zero_copy_min_bytes=settings.zero_copy_min_bytes,
                               on_server_id=self._server_changed)
        self._hello: Pending | None = None
        self._started = False
        self._since = 0.0
        self._backoff = settings.backoff_initial_ms / 1000
        self._next_attempt = 0.0

    @property
    def ready(self) -> bool:
        return self.state is State.READY

    @property
    def down(self) -> bool:
        """No server is there: disconnected, incompatible, closed, or connecting with no peer to
        send the hello to yet. (Not while a hello is in flight, nor before :meth:`start`.)"""
        state = self.state
        if not self._started:
            return False                    # start() is still making its first attempt
        return state in (State.DISCONNECTED, State.INCOMPATIBLE, State.CLOSED) or (
            state is State.CONNECTING and self._hello is None)

    # ------------------------------------------------------------- lifecycle
    def start(self, wait_s: float) -> None:
        """Connect and say hello, waiting up to ``wait_s`` for the answer (the timeout at
        most); a slower hello is finished by :meth:`service`. Never raises on failure."""
        if self.state is not State.NEW:
            raise RuntimeError(f"start() called in state {self.state.value}")
        now = time.monotonic()
        wait_s = min(wait_s, self.settings.timeout_s)
        try:
            self._open(now)
            if not self.conn.writable(wait_s):
                if wait_s >= self.settings.timeout_s:
                    raise TransportTimeout(f"draft server at {self.settings.address} not reachable")
                return                               # service() sends the hello once it can
            self._send_hello()
            while not self._hello.done and time.monotonic() - now < wait_s:
                self.conn.poll(max(0.0, wait_s - (time.monotonic() - now)), until=self._hello)
            if self._hello.done:
                self._accept(self._hello.reply)
            elif wait_s >= self.settings.timeout_s:
                raise TransportTimeout(f"no hello from the draft server at {self.settings.address}")
        except TransportError as exc:
            log.error("k3 draft server not usable at start (%s); drafting stays off until it answers", exc)
            self.lose(exc)
        finally:
            self._started = True

    def goodbye(self, seconds: float = 2.0) -> None:
        """Tell the server to free this client's session; bounded, best effort."""
        try:
            bye = self.conn.send(p.Bye())
            bye.deadline = min(bye.deadline, time.monotonic() + seconds)
            self.conn.wait(bye)
        except TransportError:
            pass

    def close(self) -> None:
        if self.state is State.CLOSED:
            return
        self.conn.close()
        self.state = State.CLOSED

    def _open(self, now: float) -> None:
        self.conn.open()
        self.state, self._since, self._hello = State.CONNECTING, now, None

    # --------------------------------------------------------------- service
    def service(self) -> None:
        """Advance: reconnect attempts, hello, replies, overdue checks."""
        now = time.monotonic()
        if self.state is State.DISCONNECTED and now >= self._next_attempt:
            self._open(now)
        if self.state is State.CONNECTING and self._hello is None:
            if self.conn.writable(0):
                self._send_hello()
            elif now - self._since > self.settings.timeout_s:
                raise TransportTimeout(f"draft server at {self.settings.address} not reachable")
        if self.state in (State.CONNECTING, State.READY):
            self.conn.poll(0)
            self.conn.expire()
        if self.state is State.CONNECTING and self._hello is not None and self._hello.done:
            self._accept(self._hello.reply)

    def _send_hello(self) -> None:
        s = self.settings
        self._hello = self.conn.send(p.Hello(s.session, s.client_name))

    def _accept(self, reply: Reply) -> None:
        if not reply.ok and reply.error and reply.error[0] in _HELLO_RETRIED:
            # a server that stops (a restart) or fails inside (a fault of its own) says nothing
            # about whether it fits: try again later, with backoff
            self.lose(TransportError(f"hello refused: {reply.error[0]}: {reply.error[1]}"))
            return
        needs = handshake.TargetNeeds.from_settings(self.settings)
        try:
            caps = handshake.check(reply, needs)
        except IncompatibleServer as exc:
            if reply.ok:                  # the server opened a session for us: free it now
                self.goodbye()
            self._incompatible(exc)
            return
        self.caps, self.state = caps, State.READY
        self._backoff = self.settings.backoff_initial_ms / 1000
        for warning in handshake.warnings(caps, needs):
            log.warning("k3 draft server %s: %s", self.settings.address, warning)
        log.info("k3 draft server %s ready: engine=%s server_id=%s width=%d max_k=%d", self.settings.address,
                 caps.engine, reply.server_id, caps.context_width, caps.max_spec_tokens)
        self.on_ready(caps)

    def _incompatible(self, exc: Exception) -> None:
        self.problem = str(exc)
        log.error("k3 draft server at %s does not fit this target, drafting is OFF for this engine: %s",
                  self.settings.address, exc)
        self.telemetry.count("incompatible")
        self.conn.abandon(exc)
        self.state = State.INCOMPATIBLE
        self.on_state_lost(f"incompatible server: {exc}")

    def rehello(self, why: str) -> None:
        """The server forgot our session (its lease ran out): say hello again on this socket."""
        if self.state is not State.READY:
            return
        log.warning("k3 draft server %s lost this client's session (%s); starting a new one",
                    self.settings.address, why)
        self.on_state_lost(why)
        # no hello in flight until the new one is queued: the old one's answer is no answer to it
        self.state, self._since, self._hello = State.CONNECTING, time.monotonic(), None
        self._send_hello()

    def lose(self, exc: Exception) -> None:
        """Drop the socket after a transport error; reconnect later with backoff."""
        was_ready = self.state is State.READY
        self.conn.abandon(exc)
        self.on_lost()
        self._hello = None
        if self.state in (State.INCOMPATIBLE, State.CLOSED):
            return
        now = time.monotonic()
        if was_ready:
            log.warning("k3 draft transport error, reconnecting: %s", exc)
            self._backoff, self._next_attempt = self.settings.backoff_initial_ms / 1000, now
        else:
            self._next_attempt = now + self._backoff
            self._backoff = min(self._backoff * 2, self.settings.backoff_max_ms / 1000)
        self.telemetry.count("transport_errors")
        self.state = State.DISCONNECTED

    def _server_changed(self, old: str, new: str) -> None:
        log.warning("k3 draft server restarted (server_id %s -> %s): all remote state is gone", old, new)
        self.telemetry.count("server_restarts")
        self.on_state_lost(f"server restarted ({old} -> {new})")
