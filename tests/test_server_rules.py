"""The draft server's state rules under pressure, each written from the rule (issue 25), in process
over the n-gram engine with real encoded messages and a pool of a few 4-row blocks.

* A full pool evicts the least recent retained context first, of the sessions that give way.
* A session over its share is never given room by one less far over (``share.gives_way``).
* A reconnect never evicts the context it is about to copy from, and refuses token ids no engine holds.
* A rewind into a block a fork shares copies it, and checks room for the copy before anything
  changes (the pool alone, and through the server).
* What one message of an engine batch admits, a later message of the batch does not take back.
"""
from __future__ import annotations

import pytest

from helpers.service import LocalService, codes
from k3_accel import protocol as p
from k3_accel.server.engines.pool import BlockPool, BlockTable, PoolExhausted

A, B, C = "a" * 16, "b" * 16, "c" * 16


def held(svc: LocalService, session) -> int:
    return svc.engine.pool.held(session.slot)


def test_a_full_pool_evicts_the_least_recent_retained_context_first():
    svc = LocalService(blocks=6, block_size=4, max_retained=4)
    s = svc.session(A)
    assert codes(svc.ingest(s, [(h, 0, [h] * 8) for h in range(3)])) == {}       # 2 blocks each: full
    assert svc.call(s, p.Free([1], True)).ok                                      # 1 retained first,
    assert svc.call(s, p.Free([0], True)).ok                                      # then 0
    assert codes(svc.ingest(s, [(5, 0, [5])])) == {}                              # 1 block needed
    assert [h for _, h in svc.store.retained] == [0]                              # 1 went, 0 stays
    assert codes(svc.ingest(s, [(6, 0, [6] * 5)])) == {}                          # 2 more: 0 goes too
    assert not svc.store.retained
    svc.check_pool()


def test_retained_contexts_of_a_session_over_its_share_go_before_the_askers_own():
    svc = LocalService(blocks=8, block_size=4, max_retained=4)
    a, b = svc.session(A), svc.session(B)
    assert codes(svc.ingest(b, [(0, 0, [9] * 4)])) == {}                          # b: 1 block
    assert svc.call(b, p.Free([0], True)).ok                                      # the oldest retained
    assert codes(svc.ingest(a, [(h, 0, [h] * 8) for h in range(3)])) == {}        # a: 6 blocks, over 4
    assert svc.call(a, p.Free([0], True)).ok
    assert svc.engine.pool.free_blocks == 1
    assert codes(svc.ingest(b, [(1, 0, [1] * 8)])) == {}                          # b needs 2, within 4
    assert [(k, h) for k, h in svc.store.retained] == [(B, 0)]                    # a's went, b's stayed
    assert a.gave_back == {"retained": 1} and not b.gave_back
    svc.check_pool()


def _one_over_the_other(svc: LocalService):
    """a holds 7 of 12 blocks (3 of them retained), b the other 5: both want, shares of 6."""
    a, b = svc.session(A), svc.session(B)
    assert codes(svc.ingest(a, [(0, 0, [1] * 16), (1, 0, [2] * 12)])) == {}
    assert svc.call(a, p.Free([1], True)).ok
    assert codes(svc.ingest(b, [(0, 0, [3] * 20)])) == {} and svc.engine.pool.free_blocks == 0
    return a, b


def test_a_session_is_never_given_room_by_one_less_far_over_its_share():
    svc = LocalService(blocks=12, block_size=4, max_retained=4)
    a, b = _one_over_the_other(svc)
    before = svc.snapshot()
    reply = svc.ingest(b, [(0, 20, [4] * 12)])     # b would hold 8, further over its share than a (7)
    assert codes(reply) == {0: "CAPACITY"} and svc.snapshot() == before and not a.gave_back
    svc.check_pool()
    svc = LocalService(blocks=12, block_size=4, max_retained=4)
    a, b = _one_over_the_other(svc)
    assert codes(svc.ingest(b, [(0, 20, [4] * 8)])) == {}     # b at 7, as far over as a: a gives way
    assert a.gave_back == {"retained": 1} and not svc.store.retained
    svc.check_pool()


def test_a_reconnect_never_evicts_the_context_it_copies_from():
    svc = LocalService(blocks=4, block_size=4, max_retained=4)
    s = svc.session(A)
    source = [1, 2, 3, 4, 5, 6]
    assert codes(svc.ingest(s, [(0, 0, source), (1, 0, [7] * 8)])) == {}          # 2 + 2 blocks: full
    assert svc.call(s, p.Free([0, 1], True)).ok                                   # 0 is the oldest
    reply = svc.reconnect(s, 2, source)            # a fork of 0 (1 shared block, the partial copied)
    assert reply.ok and reply.result == {"restored": 6}
    assert [h for _, h in svc.store.retained] == [0]                              # 1 went, not 0
    assert svc.snapshot()[(A, 2, "active")][0] == tuple(source)
    svc.check_pool()
    svc = LocalService(blocks=3, block_size=4, max_retained=4)
    s = svc.session(A)
    assert codes(svc.ingest(s, [(0, 0, source), (1, 0, [7] * 4)])) == {}          # 2 + 1 blocks: full
    assert svc.call(s, p.Free([0], True)).ok
    before = svc.snapshot()
    reply = svc.reconnect(s, 2, source[:5])        # the only context it could evict is its source
    assert not reply.ok and reply.error[0] == "CAPACITY" and svc.snapshot() == before
    svc.check_pool()


def test_a_reconnect_with_token_ids_no_engine_holds_is_refused_and_changes_nothing():
    svc = LocalService(blocks=8, block_size=4, max_retained=4)
    s = svc.session(A)
    assert codes(svc.ingest(s, [(0, 0, [1, 2, 3, 4, 5])])) == {} and svc.call(s, p.Free([0], True)).ok
    before = svc.snapshot()
    reply = svc.reconnect(s, 1, [1, 2, -3])
    assert not reply.ok and reply.error[0] == "BAD_REQUEST" and svc.snapshot() == before
    svc.check_pool()


def test_a_reconnect_never_reuses_another_sessions_context():
    svc = LocalService(blocks=16, block_size=4, max_retained=4)
    a, b = svc.session(A), svc.session(B)
    hist = [1, 2, 3, 4, 5, 6, 7, 8]
    assert codes(svc.ingest(b, [(0, 0, hist), (1, 0, hist[:6])])) == {}
    assert svc.call(b, p.Free([0], True)).ok                                      # b: one retained, one active
    assert codes(svc.ingest(a, [(5, 0, [9, 9, 9])])) == {} and svc.call(a, p.Free([5], True)).ok  # a's own
    reply = svc.reconnect(a, 0, hist)              # the same tokens in another session: rebuilt, not forked
    assert reply.ok and reply.result == {"restored": 0}
    snap = svc.snapshot()
    mine = set(snap[(A, 0, "active")][1])
    assert mine and not mine & (set(snap[(B, 0, "retained")][1]) | set(snap[(B, 1, "active")][1]))
    svc.check_pool()


def _shared_partial(pool: BlockPool) -> tuple[BlockTable, BlockTable]:
    """A table of 8 rows (2 full blocks) and a fork of it; the pool full."""
    a = BlockTable(owner=1)
    pool.extend(a, 0, 8)
    fork = pool.fork(a, 8)
    pool.allocate(pool.free_blocks)
    return a, fork


@pytest.mark.parametrize("count", [1, 3, 6])
def test_a_rewind_into_a_shared_block_checks_room_for_its_copy_before_changing_anything(count):
    pool = BlockPool(6, 4)
    a, fork = _shared_partial(pool)
    assert pool.blocks_needed(a, 6, count) == (1 if count <= 2 else 2)
    refs = [pool.refcount(b) for b in range(6)]
    with pytest.raises(PoolExhausted):
        pool.extend(a, 6, count)
    assert (a.blocks, a.length, fork.blocks, fork.length) == ([0, 1], 8, [0, 1], 8)
    assert [pool.refcount(b) for b in range(6)] == refs and pool.free_blocks == 0
    pool.release_blocks([5] if count <= 2 else [4, 5])
    pool.extend(a, 6, count)                       # with room: block 1 copied, the fork keeps its own
    assert a.blocks[0] == 0 and a.blocks[1] not in (0, 1) and fork.blocks == [0, 1]
    assert pool.refcount(1) == 1 and a.length == 6 + count


def test_a_rewind_into_a_fork_shared_block_through_the_server():
    svc = LocalService(blocks=5, block_size=4, max_retained=0)
    s = svc.session(A)
    hist = [1, 2, 3, 4, 5, 6, 7, 8]
    assert codes(svc.ingest(s, [(0, 0, hist)])) == {}
    assert svc.reconnect(s, 1, hist).result == {"restored": 8}                     # shares both blocks
    assert codes(svc.ingest(s, [(2, 0, [9] * 12)])) == {}                          # the pool is full
    before = svc.snapshot()
    reply = svc.propose(s, 3, [(0, 6, [7], 1)])    # rewinds into the shared block: needs its copy
    assert codes(reply) == {0: "CAPACITY"} and reply.tensors["drafts"].tolist() == [[-1] * 3]
    assert svc.snapshot() == before
    svc.check_pool()
    assert svc.call(s, p.Free([2], False)).ok
    reply = svc.propose(s, 3, [(0, 6, [7], 1), (1, 8, [], 1)])
    assert codes(reply) == {} and reply.tensors["drafts"].tolist() == [[2, 3, 4], [2, 3, 4]]
    snap = svc.snapshot()
    assert snap[(A, 0, "active")][0] == (1, 2, 3, 4, 5, 6, 7) and snap[(A, 1, "active")][0] == tuple(hist)
    svc.check_pool()


def test_what_one_message_of_a_batch_admits_a_later_one_does_not_take_back():
    svc = LocalService(blocks=8, block_size=4, max_retained=0)
    a, b = svc.session(A), svc.session(B)
    assert codes(svc.ingest(a, [(h, 0, [h] * 8) for h in range(3)])) == {}        # a: 6 blocks (share 4)
    batch = [(a, svc.request(*_propose([(3, 0, [3] * 8, 1)]))),                   # a's 4th request: full
             (b, svc.request(*_propose([(0, 0, [5] * 8, 1)])))]                   # b needs 2, within share
    first, second = svc.service.propose_batch(batch)
    assert codes(first) == {}
    assert codes(second) == {}                     # room from a's older requests, not the new one
    assert 3 in a.active and 2 not in a.active and a.gave_back == {"active": 1}
    svc.check_pool()


def _propose(spans):
    from helpers.wire import _rows
    return _rows(p.Propose, spans, None, k=3)


def test_a_slow_message_is_logged_with_its_op_and_the_reply_still_goes(monkeypatch, caplog):
    """The H200's P6 runs had a draft server answering ingests 0.6-2.5 s late with nothing in its log:
    a message handled slower than ``SLOW_MESSAGE_S`` now says which op, which seq and how long."""
    import logging
    import time
    from k3_accel.server import service as service_module
    svc = LocalService()
    session = svc.session("s")
    ingest = svc.engine.ingest

    def slow(batch):                                   # a planted pause (a compile, a GC)
        time.sleep(2 * service_module.SLOW_MESSAGE_S)
        return ingest(batch)
    monkeypatch.setattr(svc.engine, "ingest", slow)
    with caplog.at_level(logging.WARNING, logger="k3_accel.server"):
        reply = svc.ingest(session, [(1, 0, [5, 6, 7])])
    assert reply.ok
    (rec,) = [r for r in caplog.records if "took" in r.getMessage()]
    assert "ingest (seq 1) took" in rec.getMessage()


def test_a_slow_propose_says_where_its_time_went(monkeypatch, caplog):
    """A propose slower than ``SLOW_MESSAGE_S`` (half the 0.1 s a V2 target's GPU waits for drafts)
    is logged with its phases: rows stored, engine, and what the engine did last."""
    import logging
    import time
    from k3_accel.server import service as service_module
    svc = LocalService()
    session = svc.session("s")
    propose = svc.engine.propose

    def slow(batch):                                   # a planted pause inside the engine
        time.sleep(2 * service_module.SLOW_MESSAGE_S)
        return propose(batch)
    monkeypatch.setattr(svc.engine, "propose", slow)
    monkeypatch.setattr(svc.engine, "stats", lambda: {"graphs_captured": 3}, raising=False)
    with caplog.at_level(logging.WARNING, logger="k3_accel.server"):
        reply = svc.call(session, *_propose([(1, 0, [5, 6, 7], 7)]))
    assert reply.ok
    (rec,) = [r for r in caplog.records if "took" in r.getMessage()]
    msg = rec.getMessage()
    assert "propose (seq 1) took" in msg and "rows stored in" in msg and "graphs_captured" in msg
    engine_ms = float(msg.split("engine ")[1].split(" ms")[0])
    assert engine_ms >= 2 * service_module.SLOW_MESSAGE_S * 1e3 * 0.99   # the pause is in the engine's phase


def test_an_engine_failure_fails_only_its_groups_messages_and_the_server_goes_on(monkeypatch):
    """Proposes of one round run as one engine call per (k, logits, topk); an engine bug in one
    call is an INTERNAL error for that call's messages only: another session's message of the same
    round, in another call, gets its drafts, and the failed session's stored context is intact."""
    from helpers.oracles import ngram_lookup
    from helpers.wire import _rows
    svc = LocalService()
    a, b = svc.session(A), svc.session(B)
    hist_a, hist_b = [1, 2, 3, 1, 2], [4, 5, 6, 4, 5]
    assert codes(svc.ingest(a, [(0, 0, hist_a)])) == {} and codes(svc.ingest(b, [(0, 0, hist_b)])) == {}
    propose = svc.engine.propose

    def broken_at_k2(batch):                           # a planted engine bug, for k = 2 only
        if batch.k == 2:
            raise RuntimeError("planted engine bug")
        return propose(batch)
    monkeypatch.setattr(svc.engine, "propose", broken_at_k2)
    batch = [(b, svc.request(*_rows(p.Propose, [(0, 5, [], 6)], None, k=3))),      # launched first
             (a, svc.request(*_rows(p.Propose, [(0, 5, [], 3)], None, k=2)))]      # its group fails
    theirs, mine = svc.service.propose_batch(batch)
    assert not mine.ok and mine.error[0] == "INTERNAL" and "planted engine bug" in mine.error[1]
    assert theirs.ok and codes(theirs) == {}
    assert theirs.tensors["drafts"].tolist() == [ngram_lookup(hist_b + [6], 3)]
    monkeypatch.setattr(svc.engine, "propose", propose)
    again = svc.propose(a, 2, [(0, 5, [], 3)])                 # the failed session drafts from what it stored
    assert codes(again) == {} and again.tensors["drafts"].tolist() == [ngram_lookup(hist_a + [3], 2)]
    svc.check_pool()


def test_an_engine_that_reads_histories_gets_each_requests_own_tokens():
    """``ProposeBatch.histories[i]`` is request i's stored context (positions 0..length-1), in the
    batch's order, after this message's rows (an engine may draft from the history: the oracle
    engine does); a request whose rows failed admission is not in the batch."""
    svc = LocalService(blocks=64, block_size=4)
    seen = []
    propose = svc.engine.propose

    def recording(batch):
        seen.append(([list(map(int, batch.histories[i])) for i in range(len(batch.histories))],
                     [list(map(int, h)) for h in batch.histories[0:len(batch.states)]]))
        return propose(batch)
    svc.engine.propose = recording
    s = svc.session(A)
    assert codes(svc.ingest(s, [(0, 0, [1, 2, 3]), (1, 0, [7, 8]), (2, 0, [5])])) == {}
    reply = svc.propose(s, 2, [(2, 1, [6], 1), (0, 3, [4], 2), (1, 9, [9], 3)])   # handle 1: a gap, refused
    assert codes(reply) == {2: "CONTEXT_GAP"}
    by_index, by_slice = seen[-1]
    assert by_index == by_slice == [[5, 6], [1, 2, 3, 4]]
