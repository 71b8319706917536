"""The request table's bookkeeping under arbitrary operation sequences."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from k3_accel.server.engines.ngram import NgramEngine
from k3_accel.server.state import RequestError, RequestTable

IDS = ["a", "b", "c", "d"]
ops = st.lists(st.one_of(
    st.tuples(st.just("store"), st.sampled_from(IDS), st.integers(0, 12), st.integers(0, 9)),
    st.tuples(st.just("free"), st.sampled_from(IDS), st.booleans()),
    st.tuples(st.just("reconnect"), st.sampled_from(IDS), st.sampled_from(IDS), st.integers(1, 3)),
    st.tuples(st.just("clear"),),
), max_size=40)


def _apply(table: RequestTable, op) -> None:
    kind = op[0]
    if kind == "store":
        _, rid, start, n = op
        table.store(rid, torch.arange(start, start + n), torch.arange(n) % 3, None)
    elif kind == "free":
        table.free([op[1]], retain=op[2])
    elif kind == "reconnect":
        _, src, dst, blocks = op
        source = table.active.get(src) or table.retained.get(src)
        tokens = source.tokens[:2 * blocks] if source else [0] * (2 * blocks)
        table.reconnect(src, dst, torch.tensor(tokens, dtype=torch.int64), block=2)
    else:
        table.clear()


@settings(max_examples=300, deadline=None)
@given(sequence=ops, budget_rows=st.integers(5, 60))
def test_budget_accounting_matches_stored_rows(sequence, budget_rows):
    engine = NgramEngine(max_n=2)
    table = RequestTable(engine, max_requests=3, max_retained=2, budget_bytes=budget_rows * engine.bytes_per_row)
    for op in sequence:
        before = {k: list(v.tokens) for k, v in {**table.retained, **table.active}.items()}
        try:
            _apply(table, op)
        except RequestError:
            after = {k: list(v.tokens) for k, v in {**table.retained, **table.active}.items()}
            # a refused operation may evict retained requests, but never changes a kept one
            assert all(after[k] == before[k] for k in after)
        rows = sum(s.length for s in table.active.values()) + sum(s.length for s in table.retained.values())
        assert table.used_bytes == rows * engine.bytes_per_row <= table.budget_bytes
        assert len(table.active) <= 3 and len(table.retained) <= 2
        assert not set(table.active) & set(table.retained)
        for state in table.active.values():          # the ngram index agrees with the stored tokens
            assert state.engine_state.tokens == state.tokens
