"""The DSpark engine shares the DFlash engine's pool: capacity is all-or-nothing, rewinds and
forks (reconnects) edit block tables only, copy on write keeps forks intact, proposals leave
the state unchanged, and random sequences of batched chunked ingests, rewinds, forks, releases
and proposals never leak a block. The oracle for every proposal is a fresh engine that ingests
the request's accepted rows in one go (the math itself is checked against vLLM's in-tree
DSpark in test_dspark_vllm_module.py). Both layouts, with and without the confidence head."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_support import Mirror, random_ops, random_ops_strategy, random_rows
from k3_accel.server.engines.base import EngineError, EngineFault
from k3_accel.server.engines.dflash import DSparkEngine
from k3_accel.testing.tiny import write_tiny_target
from k3_accel.testing.tiny_dspark import write_tiny_dspark

ROW = 2 * 2 * 2 * 32 * 4            # fp32 K+V of one context row in the tiny draft
VARIANTS = {"anchor_confidence": {}, "fill_in": dict(sample_from_anchor=False, confidence=False)}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def ckpt(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark_pool")
    target = write_tiny_target(root / "target")
    return write_tiny_dspark(root / "draft", target, **VARIANTS[request.param]), target


def _engine(ckpt, blocks: int, spare: int = 0) -> DSparkEngine:
    return DSparkEngine(str(ckpt[0]), str(ckpt[1]), budget_bytes=blocks * 16 * ROW + spare)


def _fresh(ckpt, m: Mirror, states, anchors, k: int):
    """What a new engine drafts over each state's accepted rows, ingested at once."""
    ref = Mirror(DSparkEngine(str(ckpt[0]), str(ckpt[1]), budget_bytes=1 << 22))
    fresh = [ref.new() for _ in states]
    ref.ingest([(f, 0, m.rows[s]) for f, s in zip(fresh, states)])
    return ref.propose(fresh, anchors, k, logits="none")


def _same(ckpt, m: Mirror, states, anchors, k: int) -> None:
    got = m.propose(states, anchors, k, logits="none")
    want = _fresh(ckpt, m, states, anchors, k)
    assert torch.equal(got.tokens, want.tokens)
    if want.confidence is None:
        assert got.confidence is None
    else:
        torch.testing.assert_close(got.confidence, want.confidence, atol=1e-5, rtol=0)


def _snapshot(engine, states) -> tuple:
    return ([(list(s.blocks), s.length) for s in states], engine.pool.free_blocks,
            [engine.pool.refcount(b) for b in range(engine.pool.num_blocks)])


def test_capacity_rewind_fork_and_copy_on_write(ckpt):
    engine = _engine(ckpt, blocks=6, spare=16 * ROW - 1)          # one byte short of a 7th block
    assert engine.pool.num_blocks == 6 and engine.caps.kind == "dspark"
    m = Mirror(engine)
    gen = torch.Generator().manual_seed(1)
    a, b = m.new(), m.new()
    m.ingest([(a, 0, random_rows(gen, 40)), (b, 0, random_rows(gen, 48))])
    before = m.propose([a, b], [1, 2], 7, logits="none")
    snap = _snapshot(engine, [a, b])
    for call in (lambda: m.ingest([(b, 48, random_rows(gen, 9))]),
                 lambda: m.ingest([(a, 40, random_rows(gen, 8)), (b, 48, random_rows(gen, 1))]),
                 lambda: engine.fork(a, 37)):
        with pytest.raises(EngineError) as err:
            call()
        assert err.value.fault is EngineFault.CAPACITY and _snapshot(engine, [a, b]) == snap
    assert torch.equal(m.propose([a, b], [1, 2], 7, logits="none").tokens, before.tokens)
    m.ingest([(b, 10, random_rows(gen, 3))])                       # rewind into b: two blocks back
    assert engine.pool.free_blocks == 2
    shared = m.fork(a, 32)                                         # whole blocks: shared
    assert engine.pool.refcount(a.blocks[0]) == 2
    partial = m.fork(a, 37)                                        # copies the partial block
    m.ingest([(a, 5, random_rows(gen, 20))])                       # writes a's shared blocks: copy on write
    assert a.blocks[0] not in (shared.blocks[0], partial.blocks[0])
    _same(ckpt, m, [a, b, shared, partial], [3, 4, 5, 6], 7)
    for s in (a, b, shared, partial):
        m.release(s)
    assert engine.pool.free_blocks == engine.pool.num_blocks


_OPS = random_ops_strategy()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(ops=_OPS, seed=st.integers(0, 2**16))
def test_random_sequences_match_a_fresh_engine_and_never_leak(ckpt, ops, seed):
    engine = _engine(ckpt, blocks=12)
    m = Mirror(engine)
    live = [m.new(), m.new()]

    def check(states, anchors, k):
        states = [s for s in states if engine.length(s) > 0]
        if states:
            _same(ckpt, m, states, anchors[:len(states)], k)
    random_ops(engine, m, live, ops, torch.Generator().manual_seed(seed), check)
    for s in live:
        m.release(s)
    assert engine.pool.free_blocks == engine.pool.num_blocks
