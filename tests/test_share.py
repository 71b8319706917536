"""Fair shares in process (``server/share.py``, ``server/state.py``): the same rule for active
requests and retained contexts as for the pool, weights, and distinct-block accounting."""
from __future__ import annotations

import pytest

from helpers.service import LocalService, codes
from k3_accel import protocol as p
from k3_accel.server.cli import build_parser
from k3_accel.server.share import MAX_WEIGHT, parse_weight


def test_a_session_within_its_request_share_takes_requests_back_newest_first():
    svc = LocalService(max_requests=8, max_requests_total=4)
    a, b = svc.session("a" * 16), svc.session("b" * 16)
    assert codes(svc.ingest(a, [(h, 0, [h, 1]) for h in range(4)])) == {}        # a borrows them all
    assert codes(svc.ingest(b, [(0, 0, [5]), (1, 0, [6])])) == {}                 # b's share: 2 of 4
    assert list(a.active) == [0, 1] and a.gave_back == {"active": 2}
    reply = svc.ingest(b, [(2, 0, [7])])                                          # beyond b's share
    assert codes(reply) == {0: "TOO_MANY_REQUESTS"} and "fair share is 2" in reply.failures[0][2]
    assert list(a.active) == [0, 1] and len(b.active) == 2
    reply = svc.propose(a, 2, [(3, 2, [], 1), (1, 2, [], 1)])                     # a's evicted request ...
    assert codes(reply) == {0: "CAPACITY"} and "taken back" in reply.failures[0][2]
    assert codes(svc.ingest(a, [(3, 0, [3, 1])])) == {0: "TOO_MANY_REQUESTS"}     # ... and a is over its share
    assert svc.call(b, p.Free([0, 1], False)).ok
    assert codes(svc.ingest(a, [(3, 0, [3, 1])])) == {}                           # re-ingested once there is room
    assert 3 not in a.evicted and 2 in a.evicted
    svc.check_pool()


def test_retained_contexts_are_shared_the_same_way():
    svc = LocalService(max_retained=2)
    a, b = svc.session("c" * 16), svc.session("d" * 16)
    assert codes(svc.ingest(a, [(h, 0, [h, 2]) for h in range(3)])) == {}
    assert codes(svc.ingest(b, [(0, 0, [4, 2])])) == {}
    assert svc.call(a, p.Free([0, 1], True)).ok                                   # a: 2 retained (all)
    assert svc.call(b, p.Free([0], True)).ok                                      # b within its share: a's oldest goes
    assert list(svc.store.retained) == [(a.key, 1), (b.key, 0)] and a.gave_back == {"retained": 1}
    assert svc.call(a, p.Free([2], True)).ok                                      # a over its share: its own goes
    assert list(svc.store.retained) == [(b.key, 0), (a.key, 2)] and b.gave_back == {}
    svc.check_pool()


def test_weights_divide_the_pool_in_proportion():
    svc = LocalService(blocks=16, block_size=4)
    svc.store.weights = {"heavy": 3}
    heavy, light = svc.session("e" * 16, "heavy"), svc.session("f" * 16, "light")
    assert (heavy.weight, light.weight) == (3, 1)
    assert svc.store.shares(light)["share_blocks"] == 16          # alone, a session may hold it all
    assert codes(svc.ingest(light, [(h, 0, [1] * 8) for h in range(8)])) == {}   # light borrows all 16
    assert svc.store.shares(heavy)["share_blocks"] == 12
    assert codes(svc.ingest(heavy, [(0, 0, [2] * 48)])) == {}     # 12 blocks: its share, taken back
    assert len(light.active) == 2 and svc.store.summary()["pool_free_blocks"] == 0
    assert codes(svc.ingest(heavy, [(1, 0, [2])])) == {0: "CAPACITY"}    # light is within its 4
    svc.check_pool()


def test_a_session_holds_the_distinct_blocks_of_its_forks_once():
    svc = LocalService(blocks=64, block_size=4)
    s = svc.session("g" * 16)
    assert codes(svc.ingest(s, [(0, 0, list(range(8)))])) == {}
    assert svc.call(s, p.Free([0], True)).ok
    for handle in (1, 2):                                         # both fork the retained context
        assert svc.reconnect(s, handle, list(range(8))).result == {"restored": 8}
    summary = svc.store.summary()
    assert summary["sessions"][s.name]["blocks"] == 2 == 64 - summary["pool_free_blocks"]
    svc.check_pool()


@pytest.mark.parametrize("text", ["wire", "=3", "wire=0", f"wire={MAX_WEIGHT + 1}", "wire=x", "a b=2"])
def test_a_bad_weight_is_refused_naming_the_flag(text, capsys):
    with pytest.raises(ValueError):
        parse_weight(text)
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--session-weight", text])
    assert info.value.code == 2 and "--session-weight" in capsys.readouterr().err


def test_weights_parse():
    key = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"                 # a Z85 public key with "=" in it
    key = key[:10] + "=" + key[11:]
    args = build_parser().parse_args(["--session-weight", "vllm-dp0=3", "--session-weight", f"{key}=2"])
    assert dict(args.session_weight) == {"vllm-dp0": 3, key: 2}


def test_a_batch_never_evicts_what_an_earlier_message_of_it_admitted():
    """Two sessions' proposes in one engine batch: the second takes its share back from the first,
    but not the requests the first message is about to be drafted for."""
    from helpers.wire import _rows
    svc = LocalService(blocks=16, block_size=4)
    a, b = svc.session("h" * 16), svc.session("i" * 16)
    assert codes(svc.ingest(a, [(h, 0, [h, 1, h, 1, h, 1, h, 1]) for h in range(8)])) == {}   # 2 blocks each
    first = svc.request(*_rows(p.Propose, [(7, 8, [], 7), (6, 8, [], 6)], None, k=2))
    second = svc.request(*_rows(p.Propose, [(0, 0, [3] * 16, 3)], None, k=2))
    reply_a, reply_b = svc.service.propose_batch([(a, first), (b, second)])
    assert codes(reply_a) == {} and codes(reply_b) == {}
    assert reply_a.tensors["drafts"].tolist() == [[1, 7], [1, 6]]
    assert sorted(a.active) == [0, 1, 2, 3, 6, 7] and sorted(a.evicted) == [4, 5]
    assert svc.store.in_flight == []
    svc.check_pool()
