"""The draft service in process over an ngram engine: real encoded messages, no sockets."""
from __future__ import annotations

from collections import Counter

from k3_accel import protocol as p
from k3_accel.server.engines.ngram import NgramEngine
from k3_accel.server.metrics import ServerMetrics
from k3_accel.server.service import DraftService
from k3_accel.server.state import RequestStore, Session

from .wire import _rows, ints


class LocalService:
    def __init__(self, *, blocks: int = 1 << 14, block_size: int = 4, max_requests: int = 8,
                 max_requests_total: int = 64, max_retained: int = 4, max_spec_tokens: int = 8):
        self.engine = NgramEngine(max_spec_tokens=max_spec_tokens, block_size=block_size,
                                  budget_bytes=blocks * block_size * 32)
        assert self.engine.pool.num_blocks == blocks
        self.store = RequestStore(self.engine, max_requests=max_requests, max_requests_total=max_requests_total,
                                  max_retained=max_retained)
        self.service = DraftService(self.engine, self.store, ServerMetrics())
        self.seq = 0

    def request(self, msg, *frames) -> p.Request:
        self.seq += 1
        return p.decode_request([bytes(f) for f in p.encode_request(self.seq, msg, *frames)])

    def session(self, key: str, label: str = "t") -> Session:
        return self.store.open_session(key, label, None)

    def call(self, session: Session, msg, *frames) -> p.Reply:
        req = self.request(msg, *frames)
        if isinstance(msg, p.Propose):
            return self.service.propose_batch([(session, req)])[0]
        return self.service.handle(session, req)

    def ingest(self, session: Session, spans) -> p.Reply:
        return self.call(session, *_rows(p.Ingest, spans, None))

    def propose(self, session: Session, k: int, spans, **kw) -> p.Reply:
        return self.call(session, *_rows(p.Propose, spans, None, k=k, **kw))

    def reconnect(self, session: Session, handle: int, tokens) -> p.Reply:
        return self.call(session, p.Reconnect(handle, len(tokens)), ints(tokens))

    # ------------------------------------------------------------ inspection
    def snapshot(self) -> dict:
        """Everything the store holds, by (session key, handle, where)."""
        out = {}
        for key, session in self.store.sessions.items():
            for handle, state in session.active.items():
                out[(key, handle, "active")] = _state(self.engine, state)
        for (key, handle), state in self.store.retained.items():
            out[(key, handle, "retained")] = _state(self.engine, state)
        return out

    def check_pool(self) -> None:
        """Block tables agree with their states and the pool's reference counts add up."""
        pool = self.engine.pool
        refs: Counter[int] = Counter()
        states = [*(s for sess in self.store.sessions.values() for s in sess.active.values()),
                  *self.store.retained.values()]
        for state in states:
            table = self.engine.table(state.engine_state)
            assert table.length == state.length == state.engine_state.length
            assert state.engine_state.history.tolist() == state.history.tolist()   # the engine's own copy
            assert len(table.blocks) == pool.blocks_for(table.length)
            refs.update(table.blocks)
        assert pool.used_blocks == len(refs)
        assert all(pool.refcount(b) == n for b, n in refs.items())
        assert self.store.num_active == sum(len(s.active) for s in self.store.sessions.values())


def _state(engine, state) -> tuple:
    table = engine.table(state.engine_state)
    return tuple(state.history.tolist()), tuple(table.blocks), table.length


def codes(reply: p.Reply) -> dict[int, str]:
    """Request index -> failure code of a reply."""
    return {i: code for i, code, _ in reply.failures}
