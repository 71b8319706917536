"""Prompt lookup on crafted histories, and the indexed engine against the reference."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from k3_accel.server.engines.ngram import NgramEngine, lookup


def test_longest_suffix_match_wins():
    # suffix "1 2 3" occurred once before (followed by 9); "3" alone first follows index 1 (then 7)
    history = [2, 3, 7, 1, 2, 3, 9, 8, 1, 2, 3]
    assert lookup(history, 3, 1, 3) == [9, 8, 1]
    assert lookup(history, 3, 1, 1) == [7, 1, 2]


def test_earliest_occurrence_wins_ties_like_vllm():
    assert lookup([4, 5, 6, 4, 5, 7, 4, 5], 4, 2, 2) == [6, 4, 5, 7]
    assert lookup([1, 2, 3], 4) == []              # no repeat: no draft
    assert lookup([1], 4) == []


def test_min_n_is_respected():
    assert lookup([1, 9, 1], 2, 2, 3) == []        # only a 1-gram would match
    assert lookup([1, 9, 1], 2, 1, 3) == [9, 1]


def _state(engine, tokens):
    state = engine.new_state()
    engine.append(state, None, torch.tensor(tokens, dtype=torch.int64), None)
    return state


def test_engine_pads_with_minus_one():
    engine = NgramEngine(max_spec_tokens=8)
    states = [_state(engine, [1, 2, 1]), _state(engine, [5, 6])]
    prop = engine.propose(states, [[1, 2, 1], [5, 6]], [2, 7], k=4)
    assert prop.tokens.dtype == torch.int64
    assert prop.tokens.tolist() == [[1, 2, -1, -1], [-1, -1, -1, -1]]


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40), anchor=st.integers(0, 4),
       cut=st.integers(0, 40), k=st.integers(1, 6), min_n=st.integers(1, 2), extra=st.integers(0, 2))
def test_indexed_engine_equals_reference_after_appends_truncate_and_fork(tokens, anchor, cut, k, min_n, extra):
    engine = NgramEngine(min_n=min_n, max_n=min_n + extra)
    state = engine.new_state()
    for lo in range(0, len(tokens), 7):            # rows arrive in chunks
        engine.append(state, None, torch.tensor(tokens[lo:lo + 7]), None)
    want = lookup([*tokens, anchor], k, min_n, min_n + extra)
    assert engine.propose([state], [tokens], [anchor], k).tokens[0, :len(want)].tolist() == want
    cut = min(cut, len(tokens))
    fork = engine.fork(state, cut)
    engine.truncate(state, cut)
    want = lookup([*tokens[:cut], anchor], k, min_n, min_n + extra)
    for s in (state, fork):
        got = engine.propose([s], [tokens[:cut]], [anchor], k).tokens[0].tolist()
        assert got[:len(want)] == want and all(t == -1 for t in got[len(want):])
