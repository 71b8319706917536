"""DFlashEngine pool accounting and random operation sequences.

* Capacity is exactly the budget; a request that does not fit gets
  ``EngineError(CAPACITY)`` and nothing changes (all-or-nothing per batch).
* Hypothesis drives random sequences of batched chunked ingests with rewinds,
  forks (reconnects onto a retained prefix), releases and proposals; every
  proposal equals the old eager engine (the oracle) under the fp32 precision
  rule, the block reference counts always match the tables, and once every
  state is released every block is back in the free list.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_support import Mirror, check_proposal, checkpoint, eager, random_ops, random_ops_strategy, random_rows
from k3_accel.server.engines.base import EngineError, EngineFault
from k3_accel.server.engines.dflash import DFlashEngine, load_dflash


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("dflash"))


@pytest.fixture(scope="module")
def oracle_weights(ckpt):
    return load_dflash(*ckpt)


def _engine(ckpt, blocks: int, spare: int = 0) -> DFlashEngine:
    row = 2 * 2 * 2 * 32 * 4                      # fp32 K+V of one row in the tiny draft
    return DFlashEngine(str(ckpt[0]), str(ckpt[1]), budget_bytes=blocks * 16 * row + spare)


def _snapshot(engine: DFlashEngine, states) -> tuple:
    return ([(list(s.blocks), s.length) for s in states], engine.pool.free_blocks,
            [engine.pool.refcount(b) for b in range(engine.pool.num_blocks)])


def test_capacity_is_exactly_the_budget(ckpt):
    row = 2 * 2 * 2 * 32 * 4
    engine = _engine(ckpt, blocks=6, spare=16 * row - 1)      # one byte short of a 7th block
    assert engine.pool.num_blocks == 6 and engine.cache.nbytes == 6 * 16 * row
    m = Mirror(engine)
    gen = torch.Generator().manual_seed(1)
    a, b = m.new(), m.new()
    m.ingest([(a, 0, random_rows(gen, 40)), (b, 0, random_rows(gen, 48))])   # 3 + 3 blocks
    assert engine.pool.free_blocks == 0 and engine.pool.used_blocks == 6
    before = m.propose([a, b], [1, 2], 7)
    snap = _snapshot(engine, [a, b])
    for call in (lambda: m.ingest([(b, 48, random_rows(gen, 9))]),           # needs a 7th block
                 lambda: m.ingest([(a, 40, random_rows(gen, 8)), (b, 48, random_rows(gen, 1))]),
                 lambda: engine.fork(a, 37)):                                # copies a partial block
        with pytest.raises(EngineError) as err:
            call()
        assert err.value.fault is EngineFault.CAPACITY
        assert _snapshot(engine, [a, b]) == snap
    after = m.propose([a, b], [1, 2], 7)
    assert torch.equal(before.logits, after.logits)
    m.ingest([(a, 40, random_rows(gen, 8))])        # fits: the last block had 8 free rows
    shared = m.fork(a, 32)                          # whole blocks only: no new block needed
    assert engine.pool.free_blocks == 0 and engine.pool.refcount(a.blocks[0]) == 2
    m.ingest([(b, 10, random_rows(gen, 1))])        # rewinding b frees two blocks
    assert engine.pool.free_blocks == 2
    for s in (a, b, shared):
        m.release(s)
    assert engine.pool.free_blocks == engine.pool.num_blocks and engine.stats()["pool_used_blocks"] == 0


_OPS = random_ops_strategy()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(ops=_OPS, seed=st.integers(0, 2**16))
def test_random_sequences_match_oracle_and_never_leak(ckpt, oracle_weights, ops, seed):
    engine = _engine(ckpt, blocks=12)
    m = Mirror(engine)
    live = [m.new(), m.new()]
    clear = total = 0

    def check(states, anchors, k):
        nonlocal clear, total
        clear += check_proposal(m.propose(states, anchors, k), [m.rows[s] for s in states], anchors, k,
                                lambda rows, a, k: eager(oracle_weights, rows, a, k), torch.float32)
        total += k * len(states)
    random_ops(engine, m, live, ops, torch.Generator().manual_seed(seed), check)
    assert clear >= 0.8 * total
    for s in live:
        m.release(s)
    assert engine.pool.free_blocks == engine.pool.num_blocks
    assert sorted(engine.pool._free) == list(range(engine.pool.num_blocks))
