"""Prompt lookup on crafted histories, and the indexed engine against the reference."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from helpers.oracles import ngram_lookup as lookup
from k3_accel.server.engines.base import IngestBatch, ProposeBatch
from k3_accel.server.engines.ngram import NgramEngine


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


def ingest(engine, state, start, tokens):
    engine.ingest(IngestBatch([state], [start], [len(tokens)], torch.arange(start, start + len(tokens)),
                              torch.tensor(tokens, dtype=torch.int64)))


def propose(engine, states, anchors, k):
    return engine.propose(ProposeBatch(states, [], torch.tensor(anchors), k)).tokens


def test_engine_pads_with_minus_one():
    engine = NgramEngine(max_spec_tokens=8)
    a, b = engine.new_state(), engine.new_state()
    ingest(engine, a, 0, [1, 2, 1])
    ingest(engine, b, 0, [5, 6])
    tokens = propose(engine, [a, b], [2, 7], 4)
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == [[1, 2, -1, -1], [-1, -1, -1, -1]]


def test_pool_accounting_follows_rows_and_returns_every_block():
    engine = NgramEngine(block_size=4, budget_bytes=10 * 4 * 32)   # 10 blocks of 4 rows (32 B/row)
    assert engine.pool.num_blocks == 10
    a = engine.new_state()
    ingest(engine, a, 0, list(range(9)))                          # 3 blocks
    fork = engine.fork(a, 6)                                      # 1 shared + 1 copied partial
    assert engine.pool.free_blocks == 10 - 3 - 1
    ingest(engine, a, 2, [7, 7])                                  # rewind into the shared first block
    assert propose(engine, [a], [7], 2).tolist() == [lookup([0, 1, 7, 7, 7], 2) + [-1]]   # 0 1 7 7 | 7
    assert propose(engine, [fork], [3], 2).tolist() == [[4, 5]]   # the fork still holds 0..5 | 3
    engine.release(a)
    engine.release(fork)
    assert engine.pool.free_blocks == 10


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40), anchor=st.integers(0, 4),
       cut=st.integers(0, 40), k=st.integers(1, 6), min_n=st.integers(1, 2), extra=st.integers(0, 2),
       chunk=st.sampled_from([1, 2, 7, 40]))
def test_indexed_engine_equals_reference_after_appends_rewind_and_fork(tokens, anchor, cut, k, min_n, extra, chunk):
    engine = NgramEngine(min_n=min_n, max_n=min_n + extra, block_size=4, budget_bytes=1 << 20)
    state = engine.new_state()
    for lo in range(0, len(tokens), chunk):        # rows arrive in chunks (1: decode steps)
        ingest(engine, state, lo, tokens[lo:lo + chunk])
    want = lookup([*tokens, anchor], k, min_n, min_n + extra)
    assert propose(engine, [state], [anchor], k)[0, :len(want)].tolist() == want
    cut = min(cut, len(tokens))
    fork = engine.fork(state, cut)
    ingest(engine, state, cut, [])                 # a rewind with no new rows
    assert engine.length(state) == engine.length(fork) == cut
    want = lookup([*tokens[:cut], anchor], k, min_n, min_n + extra)
    for s in (state, fork):
        got = propose(engine, [s], [anchor], k)[0].tolist()
        assert got[:len(want)] == want and all(t == -1 for t in got[len(want):])
    engine.release(state)
    engine.release(fork)
    assert engine.pool.free_blocks == engine.pool.num_blocks


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.sampled_from([0, 1, 2, (1 << 21) - 1, 1 << 21, 10 ** 9]), min_size=1, max_size=30),
       anchor=st.sampled_from([0, 1, 1 << 21, 10 ** 9]), k=st.integers(1, 5), split=st.integers(0, 30))
def test_large_token_ids_match_exactly(tokens, anchor, k, split):
    """Ids past the packed-key range (2**21) switch a request to exact tuple keys."""
    engine = NgramEngine(block_size=4, budget_bytes=1 << 20)
    state = engine.new_state()
    split = min(split, len(tokens))
    ingest(engine, state, 0, tokens[:split])
    ingest(engine, state, split, tokens[split:])
    want = lookup([*tokens, anchor], k)
    assert propose(engine, [state], [anchor], k)[0].tolist() == want + [-1] * (k - len(want))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 5), min_size=65, max_size=300), anchor=st.integers(0, 5),
       chunk=st.sampled_from([65, 100, 300]), cut=st.integers(65, 300), k=st.integers(1, 6),
       large=st.booleans())
def test_long_histories_and_chunks_use_the_indexing_path_and_match_the_reference(tokens, anchor, chunk, cut, k,
                                                                                  large):
    """Chunks past 64 rows and rewinds of histories past 64 are indexed with numpy (``_index``),
    not a row at a time: the same drafts as the reference, packed keys or (an id >= 2**21) tuples."""
    if large:
        tokens = [t if t else 1 << 21 for t in tokens]
    engine = NgramEngine(block_size=16, budget_bytes=1 << 20)
    state = engine.new_state()
    for lo in range(0, len(tokens), chunk):
        ingest(engine, state, lo, tokens[lo:lo + chunk])
    want = lookup([*tokens, anchor], k)
    assert propose(engine, [state], [anchor], k)[0].tolist() == want + [-1] * (k - len(want))
    cut = min(cut, len(tokens))
    tail = tokens[::-1][:70]
    ingest(engine, state, cut, tail)               # a rewind past 64 rows, then 70 new rows at once
    hist = [*tokens[:cut], *tail]
    want = lookup([*hist, anchor], k)
    assert propose(engine, [state], [anchor], k)[0].tolist() == want + [-1] * (k - len(want))
    fork = engine.fork(state, len(hist) - 1)      # a fork rebuilds its index from its tokens
    want = lookup([*hist[:-1], anchor], k)
    assert propose(engine, [fork], [anchor], k)[0].tolist() == want + [-1] * (k - len(want))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(plan=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9), st.integers(0, 3)), min_size=1, max_size=60),
       vocab=st.sampled_from([4, 7]), large=st.booleans(), k=st.integers(1, 6), min_n=st.integers(1, 2),
       extra=st.integers(0, 2), seed=st.integers(0, 2 ** 16))
def test_batches_of_many_requests_draft_what_each_would_alone(plan, vocab, large, k, min_n, extra, seed):
    """The engine ingests and proposes several requests per call, as the server batches them:
    appends of different sizes (0: a request in the batch without rows), rewinds and large ids mixed
    in one batch. Every request's drafts are what the reference gives for its own history alone."""
    import random
    rng = random.Random(seed)
    engine = NgramEngine(min_n=min_n, max_n=min_n + extra, block_size=4, budget_bytes=1 << 22)
    states = [engine.new_state() for _ in range(4)]
    hist: list[list[int]] = [[] for _ in states]
    steps: dict[int, list[tuple[int, int, list[int]]]] = {}
    for step, (req, count, back) in enumerate(plan):
        step //= 3                                   # about three requests per batch
        start = max(0, len(hist[req]) - back) if back < 3 else len(hist[req])
        ids = [rng.randrange(vocab) for _ in range(count)]
        if large and ids and rng.random() < 0.1:
            ids[0] = (1 << 21) + rng.randrange(2)
        batch = steps.setdefault(step, [])
        if any(r == req for r, _, _ in batch):
            continue                                 # a request appears once per batch
        batch.append((req, start, ids))
        hist[req] = hist[req][:start] + ids
    for step in sorted(steps):
        items = steps[step]
        engine.ingest(IngestBatch([states[r] for r, _, _ in items], [s for _, s, _ in items],
                                  [len(ids) for _, _, ids in items],
                                  torch.tensor([s + j for _, s, ids in items for j in range(len(ids))],
                                               dtype=torch.int64),
                                  torch.tensor([t for _, _, ids in items for t in ids], dtype=torch.int64)))
    anchors = [rng.randrange(vocab) for _ in states]
    got = propose(engine, states, anchors, k).tolist()
    for h, anchor, row in zip(hist, anchors, got):
        want = lookup([*h, anchor], k, min_n, min_n + extra)
        assert row == want + [-1] * (k - len(want))
    for s in states:
        engine.release(s)
    assert engine.pool.free_blocks == engine.pool.num_blocks


@settings(max_examples=60, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 2), min_size=65, max_size=200), anchor=st.integers(0, 2),
       max_n=st.integers(4, 6), decode=st.integers(0, 12), k=st.integers(1, 5))
def test_grams_longer_than_three_match_like_vllm_after_a_long_prefill(tokens, anchor, max_n, decode, k):
    """``--ngram-max`` above 3 (vLLM's ``prompt_lookup_max`` is often 4 or 5): a prefill chunk past
    64 rows, then decode steps of one row; the longest gram still wins, as in the reference (three
    ids are all a packed int64 key holds)."""
    engine = NgramEngine(max_n=max_n, block_size=16, budget_bytes=1 << 20)
    state = engine.new_state()
    split = len(tokens) - min(decode, len(tokens) - 65)
    ingest(engine, state, 0, tokens[:split])
    for pos in range(split, len(tokens)):
        ingest(engine, state, pos, [tokens[pos]])
    want = lookup([*tokens, anchor], k, 1, max_n)
    assert propose(engine, [state], [anchor], k)[0].tolist() == want + [-1] * (k - len(want))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(tokens=st.lists(st.sampled_from([0, 1, 2, 1 << 21, (1 << 21) + 1, (1 << 22) + 1]), min_size=1, max_size=30),
       anchor=st.sampled_from([0, 1, (1 << 21) + 1]), k=st.integers(1, 4))
def test_decode_rows_with_large_ids_match_exactly(tokens, anchor, k):
    """Decode steps of one row each: an id past the packed-key range (it would alias a packed gram,
    e.g. 2**21 + 1 and the pair (1, 1)) switches the request to exact keys, as a chunk does."""
    engine = NgramEngine(block_size=4, budget_bytes=1 << 20)
    state = engine.new_state()
    for pos, token in enumerate(tokens):
        ingest(engine, state, pos, [token])
    want = lookup([*tokens, anchor], k)
    assert propose(engine, [state], [anchor], k)[0].tolist() == want + [-1] * (k - len(want))


@pytest.mark.vllm033
@settings(max_examples=300, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40), k=st.integers(1, 7), min_n=st.integers(1, 3),
       extra=st.integers(0, 3), cut=st.integers(0, 40), chunk=st.sampled_from([1, 3, 70]))
def test_drafts_equal_vllm_ngram_proposer(tokens, k, min_n, extra, cut, chunk):
    """The peer oracle: vLLM 0.33's own ``NgramProposer`` search (its numba kernel) over the history
    and the anchor gives the same drafts, after rows in chunks, a rewind and a fork."""
    import numpy as np
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as vllm_ngram
    engine = NgramEngine(min_n=min_n, max_n=min_n + extra, block_size=4, budget_bytes=1 << 20)
    state, (*history, anchor) = engine.new_state(), tokens
    for lo in range(0, len(history), chunk):
        ingest(engine, state, lo, history[lo:lo + chunk])
    cut = min(cut, len(history))
    fork = engine.fork(state, cut)
    ingest(engine, state, cut, history[cut:][::-1])                  # a rewind, other rows after it
    for s, h in ((state, history[:cut] + history[cut:][::-1]), (fork, history[:cut])):
        want = vllm_ngram(np.array([*h, anchor], dtype=np.int64), min_n, min_n + extra, 1 << 20, k).tolist()
        assert propose(engine, [s], [anchor], k)[0].tolist() == want + [-1] * (k - len(want))
