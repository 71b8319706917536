"""Reconnect: give a request a context that its session's stored contexts already hold.

A target that hits its prefix cache (or resumes a preempted request) starts
a request's rows past position 0. The client sends the tokens of the cached
positions; the server picks, within the same session only, the stored
context (active or retained, the request's own retained one included) that
shares the longest prefix with them and forks it (full blocks shared). An
engine that needs no hidden rows rebuilds the rest from the tokens; one that
needs them can only reuse a context that covers every cached token.
"""
from __future__ import annotations

import numpy as np
import torch

from k3_accel.protocol import ErrorCode
from k3_accel.server.engines.base import IngestBatch
from k3_accel.server.rows import outside_vocab, token_tensor, vocab_text
from k3_accel.server.state import PROBE, RequestError, RequestState, RequestStore, Session


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def best_source(store: RequestStore, session: Session, tokens: np.ndarray) -> tuple[RequestState | None, int]:
    best, best_len = None, 0
    for state in store.sources(session, tokens):
        hist = state.history
        m = min(PROBE, len(hist), len(tokens))
        if m == 0 or not np.array_equal(hist[:m], tokens[:m]):
            continue
        length = common_prefix(hist, tokens)
        if length > best_len:
            best, best_len = state, length
    return best, best_len


def reconnect(store: RequestStore, session: Session, handle: int, tokens: np.ndarray) -> int:
    """Attach ``handle`` to ``tokens`` (length L); returns the rows restored from a stored
    context. Afterwards the request holds exactly L rows."""
    engine = store.engine
    if not 0 <= handle < 1 << 63:
        raise RequestError(ErrorCode.BAD_FIELD, f"handle {handle}: handles are 0 .. 2**63-1")
    bad = int(outside_vocab(tokens, engine.caps.vocab_size).sum())
    if bad:
        raise RequestError(ErrorCode.BAD_REQUEST, f"request {handle}: {bad} token id(s) outside "
                                                  f"{vocab_text(engine.caps.vocab_size)}")
    wanted = len(tokens)
    source, length = best_source(store, session, tokens)
    if engine.caps.needs_hidden_states and length < wanted:
        found = f"the best stored context covers {length}" if source else "no stored context matches"
        raise RequestError(ErrorCode.PREFIX_MISMATCH, f"request {handle}: {wanted} cached tokens, {found}; "
                                                      f"their hidden rows cannot be rebuilt")
    old = store.lookup(session, handle)
    if old is None or session.active.get(handle) is not old:
        store.check_room(session, 1)
    fill = wanted - length
    pool = engine.pool
    need = (pool.fork_needed(length) if source else 0) + pool.blocks_for(wanted) - pool.blocks_for(length)
    store.make_room(session, need, keep=[s for s in (source,) if s is not None])
    state = store.new_state(session, handle)
    if source is not None:
        state.engine_state = engine.fork(source.engine_state, length)
        state.write_tokens(0, source.history[:length])
    if fill:
        engine.ingest(IngestBatch([state.engine_state], [length], [fill],
                                  torch.arange(length, wanted, dtype=torch.int64),
                                  token_tensor(tokens[length:])))
        state.write_tokens(length, tokens[length:])
    store.replace(old, state)
    return length
