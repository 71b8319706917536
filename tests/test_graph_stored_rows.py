"""A decode step is one graph replay: the context rows a propose brings (each request's accepted
rows, ingested just before) are projected and stored by the propose's replay, not eagerly before
it. On the CPU, with the replay simulated over the captured buffers (``graph_support``): over
prefill, decode steps of several rows per request (from two targets: two ingests before one
propose), a rewind and a fork, an engine whose replays store the rows holds the same K/V in every
block as one that stores them eagerly, drafts the same wherever the draft is clear, and its
padding rows land in the trash block, which no request's table names. More waiting rows than the
largest graph holds are stored eagerly before a replay without rows."""
from __future__ import annotations

import pytest
import torch

from dflash_support import Mirror, checkpoint, random_rows
from graph_support import SimulatedGraphs
from k3_accel.server.engines.dflash import DFlashEngine
from k3_accel.testing.precision import clear_positions, logit_tolerance

K = 7


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("stored_rows"))


def _engine(ckpt):
    return DFlashEngine(str(ckpt[0]), str(ckpt[1]), block_size=4, budget_bytes=4 << 20, max_batch=8)


def _same_kv(a: DFlashEngine, b: DFlashEngine) -> None:
    """Every block the pool hands out (the trash block excluded) holds the same K/V."""
    torch.testing.assert_close(a.cache.kv[:, :, :-1], b.cache.kv[:, :, :-1], rtol=1e-4, atol=1e-4)


def _decode_steps(graphed: DFlashEngine, eager: DFlashEngine) -> list[int]:
    """Prefill, eight decode steps (one with a rewind), a fork; after every propose the two engines
    hold the same K/V and draft the same where clear. Returns the rows each replay stored, from
    the engine's own flushes: a propose that flushed stored nothing in its replay."""
    mg, me = Mirror(graphed), Mirror(eager)
    flushes, flush = [], graphed.flush
    graphed.flush = lambda: (flushes.append(graphed.pending_rows), flush())[1]
    gen = torch.Generator().manual_seed(3)
    sizes = (3, 17, 40, 1, 29, 9)
    sg, se = [mg.new() for _ in sizes], [me.new() for _ in sizes]
    prefill = [random_rows(gen, n) for n in sizes]
    mg.ingest(list(zip(sg, [0] * len(sizes), prefill)))
    me.ingest(list(zip(se, [0] * len(sizes), prefill)))
    clear = total = 0
    stored = []

    def propose(step: int) -> None:
        nonlocal clear, total
        anchors = [(7 * step + 13 * i) % 200 for i in range(len(sg))]
        waiting, flushed = graphed.pending_rows, len(flushes)
        got = mg.propose(sg, anchors, K, logits="none")
        assert graphed.pending_rows == 0                      # every waiting row is stored
        stored.append(0 if len(flushes) > flushed else waiting)
        want = me.propose(se, anchors, K)                     # logits asked: eager, flushed first
        ok = clear_positions(want.logits.double(), logit_tolerance(torch.float32, want.logits.double()))
        assert torch.equal(got.tokens.cpu()[ok], want.tokens[ok]), step
        clear, total = clear + int(ok.sum()), total + ok.numel()
        _same_kv(graphed, eager)

    propose(0)                                                # 99 rows: more than bucket 8 holds
    assert stored == [0]
    for step in range(1, 9):
        accepted = [int(x) for x in torch.randint(1, K + 2, (len(sizes),), generator=gen)]
        rows = [random_rows(gen, n) for n in accepted]
        if step == 5:                                         # a rewind: request 2 drops 3 rows
            items = [(2, graphed.length(sg[2]) - 3, rows[2])]
        else:                                                 # two targets: two ingests, one propose
            items = [(i, graphed.length(sg[i]), rows[i]) for i in range(len(sizes))]
        for part in (items[::2], items[1::2]):
            if part:
                mg.ingest([(sg[i], start, r) for i, start, r in part])
                me.ingest([(se[i], start, r) for i, start, r in part])
        propose(step)
    assert sum(1 for n in stored if n) >= 6                   # not vacuous
    assert clear >= total // 2

    fork_g, fork_e = mg.fork(sg[1], 10), me.fork(se[1], 10)   # a fork after replays: shared blocks
    extra = random_rows(gen, 3)
    mg.ingest([(fork_g, 10, extra)])
    me.ingest([(fork_e, 10, extra)])
    propose(9)
    for g, e in zip(sg + [fork_g], se + [fork_e]):
        mg.release(g)
        me.release(e)
    assert graphed.pool.free_blocks == graphed.pool.num_blocks
    _same_kv(graphed, eager)
    return stored


def test_replays_store_the_waiting_rows_as_an_eager_flush_does(ckpt):
    graphed, eager = _engine(ckpt), _engine(ckpt)
    runner = graphed.graphs = SimulatedGraphs(graphed, max_batch=8)
    stored = _decode_steps(graphed, eager)
    caps = runner.row_caps(8, K)
    assert [n for n in runner.replayed if n] == [next(c for c in caps if c >= n) for n in stored if n]


@pytest.mark.gpu
def test_replays_store_the_waiting_rows_on_the_gpu(ckpt):
    """The same on CUDA graphs (fp32: the same kernels as the eager engine's)."""
    kw = dict(device="cuda", dtype="float32", block_size=4, budget_bytes=4 << 20, max_batch=8)
    graphed = DFlashEngine(str(ckpt[0]), str(ckpt[1]), **kw)
    eager = DFlashEngine(str(ckpt[0]), str(ckpt[1]), cuda_graphs=False, **kw)
    assert graphed.graphs is not None and eager.graphs is None
    _decode_steps(graphed, eager)


def test_padding_rows_are_stored_in_the_trash_block_only(ckpt):
    """A replay that stores 3 rows in a graph of capacity 4: its padding row (whatever the replay's
    row buffer held: an earlier step's row) goes to the trash block and touches no block the pool
    owns, neither another request's (block 0 is the first the pool hands out) nor a free one."""
    engine = _engine(ckpt)
    runner = engine.graphs = SimulatedGraphs(engine, max_batch=8)
    m = Mirror(engine)
    gen = torch.Generator().manual_seed(4)
    other = m.new()
    m.ingest([(other, 0, random_rows(gen, 4))])               # owns block 0
    state = m.new()
    m.ingest([(state, 0, random_rows(gen, 5))])
    m.propose([state], [1], K, logits="none")                 # 9 rows waiting: stored eagerly
    m.ingest([(state, 5, random_rows(gen, 7))])
    m.propose([state], [2], K, logits="none")                 # 7 rows: the buffer's rows 0..6 hold them
    before = engine.cache.kv.clone()
    m.ingest([(state, 12, random_rows(gen, 3))])
    m.propose([state], [3], K, logits="none")
    assert runner.replayed == [0, 8, 4]
    changed = (engine.cache.kv != before).flatten(3).any(-1).any(1).any(0)   # [blocks + trash]
    assert {int(b) for b in changed[:-1].nonzero()} == {state.blocks[3]}     # rows 12..14 only
    assert bool(changed[-1])                                  # the padding row went to the trash


@pytest.mark.parametrize("max_batch", [8, 12])
def test_every_batch_size_up_to_the_maximum_replays_a_graph(ckpt, max_batch):
    """A batch of any size from 1 to ``max_batch`` drafts through a graph (a bucket holds it), with
    and without rows waiting, and drafts what the eager step drafts where the draft is clear."""
    engine = DFlashEngine(str(ckpt[0]), str(ckpt[1]), block_size=4, budget_bytes=4 << 20, max_batch=max_batch)
    eager = _engine(ckpt)
    runner = engine.graphs = SimulatedGraphs(engine, max_batch=max_batch)
    mg, me = Mirror(engine), Mirror(eager)
    gen = torch.Generator().manual_seed(5)
    sg, se = [mg.new() for _ in range(max_batch)], [me.new() for _ in range(max_batch)]
    rows = [random_rows(gen, 6) for _ in range(max_batch)]
    mg.ingest(list(zip(sg, [0] * max_batch, rows)))
    me.ingest(list(zip(se, [0] * max_batch, rows)))
    for r in range(1, max_batch + 1):
        if r % 2:                                             # a decode step's row for each request
            more = [random_rows(gen, 1) for _ in range(r)]
            mg.ingest([(s, mg.engine.length(s), x) for s, x in zip(sg[:r], more)])
            me.ingest([(s, me.engine.length(s), x) for s, x in zip(se[:r], more)])
        before = len(runner.replayed)
        got = mg.propose(sg[:r], list(range(r)), K, logits="none")
        assert len(runner.replayed) == before + 1, r
        want = me.propose(se[:r], list(range(r)), K)
        ok = clear_positions(want.logits.double(), logit_tolerance(torch.float32, want.logits.double()))
        assert torch.equal(got.tokens[ok], want.tokens[ok]), r


def test_graphs_of_a_smaller_k_store_rows_after_a_larger_k_is_captured(ckpt):
    """Graphs captured for K = 3 (rows up to 4 per request) still store what they are given after
    graphs for K = 7 (up to 8 per request) are captured on first use: every graph reads the one row
    buffer the replays are filled through."""
    graphed, eager = _engine(ckpt), _engine(ckpt)
    runner = graphed.graphs = SimulatedGraphs(graphed, max_batch=8)
    runner.capture(3)
    mg, me = Mirror(graphed), Mirror(eager)
    gen = torch.Generator().manual_seed(6)
    sg, se = [mg.new() for _ in range(4)], [me.new() for _ in range(4)]
    for step, k in enumerate((3, 7, 3, 7, 3)):
        rows = [random_rows(gen, 2 if step else 6) for _ in range(4)]
        mg.ingest([(s, graphed.length(s), x) for s, x in zip(sg, rows)])
        me.ingest([(s, eager.length(s), x) for s, x in zip(se, rows)])
        before = len(runner.replayed)
        mg.propose(sg, [1, 2, 3, 4], k, logits="none")
        assert runner.replayed[before:] == [8 if step else 0], step      # 24 rows first: stored eagerly
        me.propose(se, [1, 2, 3, 4], k)
        _same_kv(graphed, eager)
