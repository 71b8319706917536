"""Per-request draft state of every session: active requests, retained contexts, the pool.

Each client session is a namespace: its requests are keyed by the integer
handles it chose, and nothing it sends reaches another session's state.
Retained contexts (finished requests kept as reconnect sources) form one LRU
over all sessions; they are evicted when the LRU is full or when the
engine's block pool needs room. Every rule about *which* request may hold
*how much* lives here; what a message must look like is checked before
(:mod:`k3_accel.server.rows`).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from k3_accel.protocol import ErrorCode
from k3_accel.server.engines.base import DraftEngine


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
    active: dict[int, RequestState] = field(default_factory=dict)
    last_seen: float = field(default_factory=time.monotonic)


class RequestStore:
    def __init__(self, engine: DraftEngine, *, max_requests: int, max_requests_total: int,
                 max_retained: int):
        self.engine = engine
        self.max_requests = max_requests               # active per session
        self.max_requests_total = max_requests_total   # active over all sessions
        self.max_retained = max_retained
        self.sessions: dict[str, Session] = {}
        self.retained: OrderedDict[tuple[str, int], RequestState] = OrderedDict()  # LRU, oldest first
        self.num_active = 0
        self._sessions_opened = 0

    # ------------------------------------------------------------ sessions
    def open_session(self, key: str, label: str, owner: str | None) -> Session:
        """The session ``key`` (created on first use); NOT_OWNER if another client key holds it."""
        session = self.sessions.get(key)
        if session is None:
            self._sessions_opened += 1
            name = f"{label or 'client'}#{self._sessions_opened}"
            session = self.sessions[key] = Session(key, name, owner)
        elif session.owner is not None and session.owner != owner:
            raise RequestError(ErrorCode.NOT_OWNER, "this session belongs to another client key")
        session.last_seen = time.monotonic()
        return session

    def is_open(self, session: Session) -> bool:
        return self.sessions.get(session.key) is session

    def close_session(self, session: Session) -> int:
        """Free everything of ``session`` and forget it; returns the requests released."""
        released = self.clear(session)
        self.sessions.pop(session.key, None)
        return released

    def expired(self, lease_s: float, now: float | None = None) -> list[Session]:
        now = time.monotonic() if now is None else now
        return [s for s in self.sessions.values() if now - s.last_seen > lease_s]

    # ------------------------------------------------------------- lookups
    def lookup(self, session: Session, handle: int) -> RequestState | None:
        """The active or retained state of ``handle`` (None: unknown)."""
        return session.active.get(handle) or self.retained.get((session.key, handle))

    def new_state(self, session: Session, handle: int) -> RequestState:
        return RequestState(session, handle, self.engine.new_state())

    def check_room(self, session: Session, new_active: int) -> None:
        """TOO_MANY_REQUESTS unless ``new_active`` more requests fit the limits."""
        if len(session.active) + new_active > self.max_requests:
            raise RequestError(ErrorCode.TOO_MANY_REQUESTS,
                               f"{len(session.active)} requests active in this session, its limit is "
                               f"{self.max_requests}")
        if self.num_active + new_active > self.max_requests_total:
            raise RequestError(ErrorCode.TOO_MANY_REQUESTS,
                               f"{self.num_active} requests active on the server, its limit is "
                               f"{self.max_requests_total}")

    def activate(self, state: RequestState) -> None:
        """Make a new or retained state active."""
        session = state.session
        if session.active.get(state.handle) is state:
            return
        self.retained.pop((session.key, state.handle), None)
        session.active[state.handle] = state
        self.num_active += 1

    # ---------------------------------------------------------------- pool
    def make_room(self, blocks: int, keep: Iterable[RequestState] = ()) -> None:
        """Evict least-recent retained contexts (not those in ``keep``) until the pool has
        ``blocks`` free blocks; CAPACITY if it cannot."""
        pool = self.engine.pool
        if pool.free_blocks >= blocks:
            return
        protected = {id(s) for s in keep}
        for key in [k for k, s in self.retained.items() if id(s) not in protected]:
            self._drop_retained(key)
            if pool.free_blocks >= blocks:
                return
        raise RequestError(ErrorCode.CAPACITY,
                           f"draft pool full: {blocks} block(s) needed, {pool.free_blocks} free of "
                           f"{pool.num_blocks} (raise --memory-budget-mb or free requests)")

    def _drop_retained(self, key: tuple[str, int]) -> None:
        self.engine.release(self.retained.pop(key).engine_state)

    # ----------------------------------------------------------- lifecycle
    def free(self, session: Session, handles: Iterable[int], retain: bool) -> None:
        for handle in handles:
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
        key = (state.session.key, state.handle)
        old = self.retained.pop(key, None)
        if old is not None and old is not state:
            self.engine.release(old.engine_state)
        self.retained[key] = state
        while len(self.retained) > self.max_retained:
            self._drop_retained(next(iter(self.retained)))

    def replace(self, old: RequestState | None, new: RequestState) -> None:
        """``new`` takes over ``old``'s handle (reconnect): ``old`` is released."""
        session = new.session
        if old is not None:
            if session.active.get(old.handle) is old:
                del session.active[old.handle]
                self.num_active -= 1
            elif self.retained.get((session.key, old.handle)) is old:
                del self.retained[(session.key, old.handle)]
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
        return len(states)

    def sources(self, session: Session) -> Iterable[RequestState]:
        """Contexts a reconnect of ``session`` may reuse: its active and retained requests."""
        yield from session.active.values()
        yield from (s for (key, _), s in self.retained.items() if key == session.key)

    # --------------------------------------------------------------- stats
    def held_blocks(self, session: Session) -> int:
        table = self.engine.table
        own = [*session.active.values(), *(s for (k, _), s in self.retained.items() if k == session.key)]
        return sum(len(table(s.engine_state).blocks) for s in own)

    def summary(self) -> dict[str, Any]:
        pool = self.engine.pool
        per = {}
        for session in self.sessions.values():
            retained = sum(1 for k in self.retained if k[0] == session.key)
            per[session.name] = {"active": len(session.active), "retained": retained,
                                  "blocks": self.held_blocks(session),
                                  "idle_s": round(time.monotonic() - session.last_seen, 3)}
        return {"active": self.num_active, "retained": len(self.retained), "sessions": per,
                "pool_blocks": pool.num_blocks, "pool_free_blocks": pool.free_blocks,
                "pool_block_bytes": pool.block_rows * self.engine.bytes_per_row}
