"""When a round's proposes run: at once, or after a short wait for the targets expected back.

Several targets that step in a closed loop split into groups that take turns on the engine: while
one group's batch computes, the others' proposes arrive and wait, so every engine call serves only
a part of the targets (four targets of B = 8 made about 14 requests per call, not 32, on an H100).
So a round may hold its proposes briefly for the sessions **expected back**: those whose last
propose was answered and whose measured turnaround (reply sent -> next propose here) says the next
one is due within the wait, and those whose propose is here but not yet ready (its device rows are
still being read, for at most the limit: a target that died mid-step leaves a read that never ends). Then the groups run as one batch and stay together.

The wait is bounded: a round is held at most ``limit``, the configured window and at most ``share``
(default 1) of the engine's measured call time (waiting longer costs more than the second call it
saves). A held round's proposes are already checked and their rows stored (the loop prepares them as
they come), so only the engine call is left when the last target arrives. A session that misses its expected arrival is not waited for again
until it is back; a lone session never waits; a target whose steps are far apart (a vLLM target
whose forward takes longer than the limit) is never waited for. Host-side and from timestamps only;
the clock is injectable for tests.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

ALPHA = 0.25            # weight of the newest turnaround in its running mean
MIN_SLACK_S = 50e-6     # how late a session may be against its mean turnaround, at least
FORGET_S = 60.0         # a session silent this long is forgotten


@dataclass(slots=True)
class _Peer:
    answered_at: float | None = None
    arrived_at: float | None = None  # its latest propose
    turn: float | None = None        # running mean of reply sent -> next propose here
    back: bool = False               # a propose arrived since the last reply
    missed: bool = False             # not back when expected: not waited for until it is

    @property
    def heard_at(self) -> float:
        """Its latest propose or reply, whichever came last (a peer exists once either happened)."""
        return max(t for t in (self.answered_at, self.arrived_at) if t is not None)


class Gather:
    def __init__(self, window_s: float, share: float = 1.0, clock: Callable[[], float] = time.monotonic):
        if window_s < 0 or share < 0:
            raise ValueError("the batch wait and its share of the engine time must be >= 0")
        self.window_s, self.share, self.clock = window_s, share, clock
        self.engine_s: float | None = None     # running mean of an engine call, measured
        self.held_since: float | None = None   # when the proposes now held were first held
        self.held_s: float | None = None       # how long the proposes that run now were held (None: not)
        self._peers: dict[str, _Peer] = {}

    # ------------------------------------------------------------------ events
    def arrived(self, key: str) -> None:
        """A propose of session ``key`` arrived."""
        now, peer = self.clock(), self._peers.setdefault(key, _Peer())
        if not peer.back and peer.answered_at is not None:
            gap = now - peer.answered_at
            peer.turn = gap if peer.turn is None else peer.turn + ALPHA * (gap - peer.turn)
        peer.back, peer.missed, peer.arrived_at = True, False, now

    def answered(self, key: str) -> None:
        """A reply to a propose of session ``key`` was sent."""
        peer = self._peers.setdefault(key, _Peer())
        peer.answered_at, peer.back = self.clock(), False

    def engine(self, seconds: float) -> None:
        """One round's engine call took this long."""
        self.engine_s = seconds if self.engine_s is None else self.engine_s + ALPHA * (seconds - self.engine_s)

    def idle(self) -> None:
        """No round's proposes wait now (those held went away): the next hold starts afresh."""
        self.held_since = None

    def forget(self) -> None:
        """Drop sessions silent for FORGET_S (closed ones among them): neither answered nor arrived
        since (one whose first propose is here, not answered yet, is not silent)."""
        now = self.clock()
        for key in [k for k, p in self._peers.items() if now - p.heard_at > FORGET_S]:
            del self._peers[key]

    # ---------------------------------------------------------------- decision
    @property
    def limit(self) -> float:
        """The longest ready proposes may be held."""
        return self.window_s if self.engine_s is None else min(self.window_s, self.share * self.engine_s)

    def wait_s(self, ready: Iterable[str], pending: Iterable[str] = ()) -> float:
        """How much longer to hold the proposes of the ``ready`` sessions (0: run them now).
        ``pending``: sessions whose propose is here but not ready (its device rows on their way);
        one that has been so for longer than the limit (a target that died mid-step) is not waited for."""
        now = self.clock()
        until = self._until(set(ready), set(pending), now)
        if until is None:
            self.held_s = None if self.held_since is None else now - self.held_since
            self.held_since = None
            return 0.0
        if self.held_since is None:
            self.held_since = now
        return until - now

    def _until(self, ready: set[str], pending: set[str], now: float) -> float | None:
        limit = self.limit
        if limit <= 0:
            return None
        cap = (now if self.held_since is None else self.held_since) + limit
        if cap <= now:
            return None
        for key in pending:
            peer = self._peers.get(key)
            if peer is not None and peer.arrived_at is not None and now - peer.arrived_at <= limit:
                return cap
        until = None
        for key, peer in self._peers.items():
            if key in ready or peer.back or peer.missed or peer.answered_at is None or peer.turn is None:
                continue
            due = peer.answered_at + peer.turn
            if peer.turn > limit or due > cap:
                continue                          # not back before the wait would end anyway
            late = due + max(0.5 * peer.turn, MIN_SLACK_S)
            if late <= now:
                peer.missed = True
                continue
            until = late if until is None else max(until, late)
        return None if until is None else min(until, cap)
