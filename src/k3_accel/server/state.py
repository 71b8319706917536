"""Per-request draft state of every session: active requests, retained contexts, the pool.

Each client session is a namespace: its requests are keyed by the integer
handles it chose, and nothing it sends reaches another session's state.
Retained contexts (finished requests kept as reconnect sources) form one LRU
over all sessions. The pool, the active requests and the retained contexts
are shared fairly (:mod:`k3_accel.server.share`): a session may borrow what
the others leave unused and gives it back when one within its share needs
it: its retained contexts first (least recent first), then its newest active
requests, which are *evicted* (their next rows get ``CAPACITY``). Every rule
about *which* request may hold *how much* lives here; what a message must
look like is checked before (:mod:`k3_accel.server.rows`).
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from k3_accel.protocol import ErrorCode
from k3_accel.server.engines.base import DraftEngine
from k3_accel.server.share import Division, divide, gives_way, wanting_weight

MAX_EVICTED_MARKS = 4096     # per session: evicted handles remembered (their next rows get CAPACITY)
PROBE = 16                   # a context's head: the tokens a reconnect's candidates are indexed by


class RequestError(Exception):
    """A per-request failure: only this request is affected."""

    def __init__(self, code: ErrorCode | str, message: str):
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message


@dataclass(eq=False)
class RequestState:
    session: "Session"
    handle: int
    engine_state: Any
    tokens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    length: int = 0

    @property
    def history(self) -> np.ndarray:
        return self.tokens[:self.length]

    def write_tokens(self, start: int, tokens: np.ndarray) -> None:
        end = start + len(tokens)
        if end > len(self.tokens):
            grown = np.empty(max(end, 2 * len(self.tokens), 64), dtype=np.int64)
            grown[:start] = self.tokens[:start]
            self.tokens = grown
        self.tokens[start:end] = tokens
        self.length = end


@dataclass(eq=False)
class Session:
    key: str                                   # the secret the client declared in hello
    name: str                                  # "label#n": for logs, stats and metrics
    owner: str | None = None                   # CURVE public key (z85) bound at first hello
    slot: int = 0                              # the pool's owner id for its blocks
    weight: int = 1                            # its fair-share weight (--session-weight)
    active: dict[int, RequestState] = field(default_factory=dict)   # in activation order
    num_retained: int = 0
    evicted: dict[int, str] = field(default_factory=dict)          # handle -> why it was taken back
    gave_back: Counter = field(default_factory=Counter)            # "retained" | "active" -> times
    last_seen: float = field(default_factory=time.monotonic)

    def wants_room(self) -> bool:
        """Whether it counts when a table is divided: it holds a request or a context."""
        return bool(self.active) or self.num_retained > 0


class RequestStore:
    def __init__(self, engine: DraftEngine, *, max_requests: int, max_requests_total: int,
                 max_retained: int, weights: dict[str, int] | None = None):
        self.engine = engine
        self.max_requests = max_requests               # active per session
        self.max_requests_total = max_requests_total   # active over all sessions
        self.max_retained = max_retained
        self.weights = dict(weights or {})             # client label or CURVE public key -> weight
        self.sessions: dict[str, Session] = {}
        self.retained: OrderedDict[tuple[str, int], RequestState] = OrderedDict()  # LRU, oldest first
        # retained contexts by (session, head): a reconnect looks up its candidates instead of
        # scanning a table that may hold thousands (their histories do not change while retained)
        self._heads: dict[tuple[str, bytes], dict[tuple[str, int], None]] = {}
        self._head_of: dict[tuple[str, int], tuple[str, bytes]] = {}
        self.num_active = 0
        self.in_flight: list[list[RequestState]] = []  # states of proposes prepared, not launched yet
        self.on_gave_back: Callable[[Session, str], None] | None = None
        self._sessions_opened = 0
        self._free_slots: list[int] = []

    # ------------------------------------------------------------ sessions
    def open_session(self, key: str, label: str, owner: str | None) -> Session:
        """The session ``key`` (created on first use); NOT_OWNER if another client key holds it."""
        session = self.sessions.get(key)
        if session is None:
            self._sessions_opened += 1
            name = f"{label or 'client'}#{self._sessions_opened}"
            slot = self._free_slots.pop() if self._free_slots else self._sessions_opened
            weight = self.weights.get(owner or "", self.weights.get(label, 1))
            session = self.sessions[key] = Session(key, name, owner, slot, weight)
        elif session.owner is not None and session.owner != owner:
            raise RequestError(ErrorCode.NOT_OWNER, "this session belongs to another client key")
        session.last_seen = time.monotonic()
        return session

    def is_open(self, session: Session) -> bool:
        return self.sessions.get(session.key) is session

    def close_session(self, session: Session) -> int:
        """Free everything of ``session`` and forget it; returns the requests released."""
        released = self.clear(session)
        if self.sessions.pop(session.key, None) is session:
            self._free_slots.append(session.slot)
        return released

    def expired(self, lease_s: float, now: float | None = None) -> list[Session]:
        now = time.monotonic() if now is None else now
        return [s for s in self.sessions.values() if now - s.last_seen > lease_s]

    # ------------------------------------------------------------- lookups
    def lookup(self, session: Session, handle: int) -> RequestState | None:
        """The active or retained state of ``handle`` (None: unknown)."""
        return session.active.get(handle) or self.retained.get((session.key, handle))

    def new_state(self, session: Session, handle: int) -> RequestState:
        state = RequestState(session, handle, self.engine.new_state())
        self.engine.table(state.engine_state).owner = session.slot
        return state

    def check_evicted(self, session: Session, handle: int, start: int) -> None:
        """CAPACITY for rows that continue a request the server took back (rows from 0 start anew)."""
        if start > 0 and handle in session.evicted:
            raise RequestError(ErrorCode.CAPACITY, f"request {handle}: {session.evicted[handle]}")

    def check_room(self, session: Session, new_active: int) -> None:
        """TOO_MANY_REQUESTS unless ``new_active`` more requests fit the limits; a session within
        its share of the server's limit first takes requests back from sessions over theirs."""
        if len(session.active) + new_active > self.max_requests:
            raise RequestError(ErrorCode.TOO_MANY_REQUESTS,
                               f"{len(session.active)} requests active in this session, its limit is "
                               f"{self.max_requests}")
        total = self.max_requests_total
        if self.num_active + new_active <= total:
            return
        share = self.division(total, session)
        if share.over(len(session.active) + new_active, session.weight) <= 0:
            self._take_back(session, lambda s: share.over(len(s.active), s.weight),
                            lambda: self.num_active + new_active <= total, "the server's requests")
        if self.num_active + new_active > total:
            raise RequestError(ErrorCode.TOO_MANY_REQUESTS,
                               f"{self.num_active} requests active on the server, its limit is {total}; "
                               f"this session's fair share is {share.guaranteed(session.weight)}")

    def activate(self, state: RequestState) -> None:
        """Make a new or retained state active."""
        session = state.session
        if session.active.get(state.handle) is state:
            return
        self._pop_retained((session.key, state.handle))
        session.active[state.handle] = state
        self.num_active += 1
        if session.evicted:
            session.evicted.pop(state.handle, None)

    # --------------------------------------------------------- fair shares
    def division(self, size: int, asking: Session) -> Division:
        """A table of ``size`` entries divided among the sessions that want room and ``asking``."""
        return divide(size, self.sessions.values(), asking)

    def shares(self, session: Session, wanting: int | None = None) -> dict[str, int]:
        """What ``session`` is guaranteed now: pool blocks, active requests, retained contexts
        (``wanting``: :func:`~k3_accel.server.share.wanting_weight`, when already known)."""
        wanting = wanting_weight(self.sessions.values()) if wanting is None else wanting
        sizes = {"share_blocks": self.engine.pool.num_blocks, "share_requests": self.max_requests_total,
                 "share_retained": self.max_retained}
        return {key: divide(size, (), session, wanting).guaranteed(session.weight) for key, size in sizes.items()}

    def _protected(self, keep: Iterable[RequestState]) -> set[int]:
        return {id(s) for s in keep} | {id(s) for states in self.in_flight for s in states}

    def _take_back(self, asking: Session, over: Callable[[Session], int], enough: Callable[[], bool],
                   what: str) -> None:
        """Evict the newest active requests of the session furthest over its share (``over``)
        until ``enough()`` or no other session is over; never a state of the batch being built."""
        protected, spent = self._protected(()), set()
        while not enough():
            ranked = [(o, s) for s in self.sessions.values()
                      if s is not asking and s.active and id(s) not in spent and (o := over(s)) > 0]
            if not ranked:
                return
            victim = max(ranked, key=lambda item: item[0])[1]
            state = next((st for st in reversed(victim.active.values()) if id(st) not in protected), None)
            if state is None:
                spent.add(id(victim))
                continue
            self._evict(state, f"taken back: its session was over its fair share of {what}, which a "
                               f"session within its own needed (re-ingest it to draft again)")

    def _evict(self, state: RequestState, why: str) -> None:
        session = state.session
        del session.active[state.handle]
        self.num_active -= 1
        self.engine.release(state.engine_state)
        session.evicted[state.handle] = why
        if len(session.evicted) > MAX_EVICTED_MARKS:
            del session.evicted[next(iter(session.evicted))]
        self._gave_back(session, "active")

    def _gave_back(self, session: Session, kind: str) -> None:
        session.gave_back[kind] += 1
        if self.on_gave_back is not None:
            self.on_gave_back(session, kind)

    # ---------------------------------------------------------------- pool
    def make_room(self, session: Session, blocks: int, keep: Iterable[RequestState] = ()) -> None:
        """Make ``blocks`` pool blocks free for ``session`` (never evicting a state in ``keep``):
        retained contexts of sessions at least as far over their share as it (least recent first),
        then its own; then, while it stays within its share, the newest active requests of the
        sessions over theirs. CAPACITY if that is not enough (at once, dropping nothing, if the
        whole pool is not enough)."""
        pool = self.engine.pool
        if pool.free_blocks >= blocks:
            return
        if blocks > pool.num_blocks:        # never fits: refused before anything is dropped for it
            raise RequestError(ErrorCode.CAPACITY, f"draft pool too small: {blocks} block(s) needed, the pool "
                                                   f"has {pool.num_blocks} (raise --memory-budget-mb)")
        protected = self._protected(keep)
        share = self.division(pool.num_blocks, session)

        def over(s: Session, extra: int = 0) -> int:
            return share.over(pool.held(s.slot) + extra, s.weight)
        for others in (True, False):
            for key in [k for k, s in self.retained.items()
                        if id(s) not in protected and (s.session is not session) == others]:
                if others and not gives_way(over(session, blocks), over(self.retained[key].session)):
                    continue
                self._drop_retained(key, gave_back=others)
                if pool.free_blocks >= blocks:
                    return
        if over(session, blocks) <= 0:
            self._take_back(session, over, lambda: pool.free_blocks >= blocks, "the draft pool")
        if pool.free_blocks < blocks:
            raise RequestError(ErrorCode.CAPACITY,
                               f"draft pool full: {blocks} block(s) needed, {pool.free_blocks} free of "
                               f"{pool.num_blocks}; this session holds {pool.held(session.slot)}, its fair "
                               f"share is {share.guaranteed(session.weight)} (raise --memory-budget-mb or "
                               f"free requests)")

    def _pop_retained(self, key: tuple[str, int]) -> RequestState | None:
        state = self.retained.pop(key, None)
        if state is not None:
            state.session.num_retained -= 1
            head = self._head_of.pop(key)
            bucket = self._heads[head]
            del bucket[key]
            if not bucket:
                del self._heads[head]
        return state

    def _drop_retained(self, key: tuple[str, int], gave_back: bool = False) -> None:
        state = self._pop_retained(key)
        self.engine.release(state.engine_state)
        if gave_back:
            self._gave_back(state.session, "retained")

    def _retained_victim(self, asking: Session) -> tuple[str, int]:
        """The retained context that goes when the table is full: the least recent one of the
        sessions that give way to ``asking`` (itself, when it is the furthest over its share)."""
        share = self.division(self.max_retained, asking)
        mine = share.over(asking.num_retained, asking.weight)
        for key, state in self.retained.items():
            if gives_way(mine, share.over(state.session.num_retained, state.session.weight)):
                return key
        return next(iter(self.retained))

    # ----------------------------------------------------------- lifecycle
    def free(self, session: Session, handles: Iterable[int], retain: bool) -> None:
        for handle in handles:
            if session.evicted:
                session.evicted.pop(handle, None)
            state = session.active.pop(handle, None)
            if state is None:
                if not retain and (session.key, handle) in self.retained:
                    self._drop_retained((session.key, handle))
                continue
            self.num_active -= 1
            self.retire(state, retain)

    def retire(self, state: RequestState, retain: bool) -> None:
        """An inactive state: kept in the retained LRU, or released."""
        if not retain or self.max_retained <= 0 or state.length == 0:
            self.engine.release(state.engine_state)
            return
        session = state.session
        old = self._pop_retained((session.key, state.handle))
        if old is not None and old is not state:
            self.engine.release(old.engine_state)
        key = (session.key, state.handle)
        self.retained[key] = state
        head = self._head_of[key] = _head(session.key, state.history)
        self._heads.setdefault(head, {})[key] = None
        session.num_retained += 1
        while len(self.retained) > self.max_retained:
            key = self._retained_victim(session)
            self._drop_retained(key, gave_back=key[0] != session.key)

    def replace(self, old: RequestState | None, new: RequestState) -> None:
        """``new`` takes over ``old``'s handle (reconnect): ``old`` is released."""
        session = new.session
        if old is not None:
            if session.active.get(old.handle) is old:
                del session.active[old.handle]
                self.num_active -= 1
            elif self.retained.get((session.key, old.handle)) is old:
                self._pop_retained((session.key, old.handle))
            self.engine.release(old.engine_state)
        self.activate(new)

    def clear(self, session: Session) -> int:
        states = list(session.active.values())
        session.active.clear()
        self.num_active -= len(states)
        for state in states:
            self.engine.release(state.engine_state)
        for key in [k for k in self.retained if k[0] == session.key]:
            self._drop_retained(key)
        session.evicted.clear()
        return len(states)

    def sources(self, session: Session, tokens: np.ndarray) -> Iterable[RequestState]:
        """Contexts a reconnect of ``session`` to ``tokens`` may reuse: its active requests and
        those of its retained ones whose head is a prefix of ``tokens`` (or that ``tokens`` are a
        prefix of, when shorter than a head)."""
        yield from session.active.values()
        if not session.num_retained:
            return
        if len(tokens) < PROBE:
            yield from (s for (key, _), s in self.retained.items() if key == session.key)
            return
        for m in range(1, PROBE + 1):
            for key in self._heads.get(_head(session.key, tokens[:m]), ()):
                yield self.retained[key]

    # --------------------------------------------------------------- stats
    def summary(self) -> dict[str, Any]:
        pool = self.engine.pool
        per, wanting = {}, wanting_weight(self.sessions.values())
        for session in self.sessions.values():
            per[session.name] = {"active": len(session.active), "retained": session.num_retained,
                                  "blocks": pool.held(session.slot), **self.shares(session, wanting),
                                  "weight": session.weight, "gave_back": dict(session.gave_back),
                                  "idle_s": round(time.monotonic() - session.last_seen, 3)}
        return {"active": self.num_active, "retained": len(self.retained), "sessions": per,
                "pool_blocks": pool.num_blocks, "pool_free_blocks": pool.free_blocks,
                "pool_block_bytes": pool.block_rows * self.engine.bytes_per_row}


def _head(session_key: str, history: np.ndarray) -> tuple[str, bytes]:
    return session_key, np.ascontiguousarray(history[:PROBE], dtype=np.int64).tobytes()
