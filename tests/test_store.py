"""The request store and row admission (``server/state.py``, ``server/rows.py``) in process.

A model of the rules (namespaces, rewinds, context gaps, request limits,
retained LRU, reconnect) predicts every reply and the stored state after
every operation; a small pool adds CAPACITY, where the invariants are
checked instead (refused requests keep their state, the pool adds up).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from helpers.oracles import ngram_lookup
from helpers.service import LocalService, codes
from k3_accel import protocol as p
from k3_accel.protocol import ErrorCode, ProtocolError
from k3_accel.server import rows as r

KEYS = ["a" * 16, "b" * 16]
HANDLES = [0, 1, 2, 3]
K = 3
MAX_REQUESTS, MAX_TOTAL, MAX_RETAINED = 3, 5, 2

tokens = st.lists(st.integers(0, 3), max_size=9)
spans = st.lists(st.tuples(st.sampled_from(HANDLES), st.integers(0, 10), tokens, st.integers(0, 3)),
                 min_size=1, max_size=3, unique_by=lambda s: s[0])
ops = st.lists(st.one_of(
    st.tuples(st.just("ingest"), st.sampled_from(KEYS), spans),
    st.tuples(st.just("propose"), st.sampled_from(KEYS), spans),
    st.tuples(st.just("free"), st.sampled_from(KEYS), st.lists(st.sampled_from(HANDLES), max_size=3),
              st.booleans()),
    st.tuples(st.just("clear"), st.sampled_from(KEYS)),
    st.tuples(st.just("bye"), st.sampled_from(KEYS)),
    st.tuples(st.just("reconnect"), st.sampled_from(KEYS), st.sampled_from(HANDLES), tokens),
), max_size=30)


class Model:
    """The store's rules, written plainly: per-session active contexts and one retained LRU."""

    def __init__(self):
        self.active = {key: {} for key in KEYS}
        self.retained: OrderedDict[tuple[str, int], list[int]] = OrderedDict()

    def num_active(self) -> int:
        return sum(len(a) for a in self.active.values())

    def context(self, key, handle):
        return self.active[key].get(handle, self.retained.get((key, handle)))

    def rows(self, key, spans):
        failures, fresh, admitted = {}, 0, []
        for i, (handle, start, toks, _) in enumerate(spans):
            ctx = self.context(key, handle)
            if start > (len(ctx) if ctx is not None else 0):
                failures[i] = "CONTEXT_GAP"
                continue
            if handle not in self.active[key]:
                if (len(self.active[key]) + fresh + 1 > MAX_REQUESTS
                        or self.num_active() + fresh + 1 > MAX_TOTAL):
                    failures[i] = "TOO_MANY_REQUESTS"
                    continue
                fresh += 1
            admitted.append(i)
        drafts = {}
        for i in admitted:
            handle, start, toks, anchor = spans[i]
            ctx = self.context(key, handle) or []
            self.retained.pop((key, handle), None)
            self.active[key][handle] = ctx[:start] + toks
            found = ngram_lookup(self.active[key][handle] + [anchor], K)
            drafts[i] = found + [-1] * (K - len(found))
        return failures, drafts

    def free(self, key, handles, retain):
        for handle in handles:
            ctx = self.active[key].pop(handle, None)
            if ctx is None:
                if not retain:
                    self.retained.pop((key, handle), None)
                continue
            if retain and ctx:
                self.retained.pop((key, handle), None)
                self.retained[(key, handle)] = ctx
                while len(self.retained) > MAX_RETAINED:
                    del self.retained[self.retained_victim(key)]

    def retained_victim(self, key):
        """The fair-share rule for the retained table (equal weights): the table is divided among
        the sessions holding something and the one retiring; the least recent context of a
        session over its share, and at least as far over as the one retiring, goes."""
        holders = {k for k in KEYS if self.active[k] or any(r[0] == k for r in self.retained)} | {key}
        count = {k: sum(r[0] == k for r in self.retained) for k in KEYS}

        def over(k):                                   # scaled by the number of holders
            return count[k] * len(holders) - MAX_RETAINED
        return next(r for r in self.retained if over(r[0]) > 0 and over(r[0]) >= over(key))

    def clear(self, key):
        self.active[key] = {}
        for k in [k for k in self.retained if k[0] == key]:
            del self.retained[k]

    def reconnect(self, key, handle, toks):
        """(error code or None, rows restored)."""
        best = 0
        for hist in [*self.active[key].values(), *(c for (k, _), c in self.retained.items() if k == key)]:
            m = min(16, len(hist), len(toks))
            if m and hist[:m] == toks[:m]:
                best = max(best, next((j for j, (a, b) in enumerate(zip(hist, toks)) if a != b),
                                      min(len(hist), len(toks))))
        if handle not in self.active[key] and (len(self.active[key]) + 1 > MAX_REQUESTS
                                               or self.num_active() + 1 > MAX_TOTAL):
            return "TOO_MANY_REQUESTS", 0
        self.retained.pop((key, handle), None)
        self.active[key][handle] = list(toks)
        return None, best

    def snapshot(self):
        out = {(key, h, "active"): tuple(c) for key in KEYS for h, c in self.active[key].items()}
        out.update({(key, h, "retained"): tuple(c) for (key, h), c in self.retained.items()})
        return out


def _new_service(blocks: int) -> LocalService:
    return LocalService(blocks=blocks, max_requests=MAX_REQUESTS, max_requests_total=MAX_TOTAL,
                        max_retained=MAX_RETAINED, max_spec_tokens=K)


@settings(max_examples=250, deadline=None)
@given(sequence=ops)
def test_store_follows_the_rules(sequence):
    svc, model = _new_service(blocks=1 << 12), Model()
    sessions = {key: svc.session(key) for key in KEYS}
    for op in sequence:
        kind, key = op[0], op[1]
        session = sessions[key]
        if kind in ("ingest", "propose"):
            reply = svc.ingest(session, [s[:3] for s in op[2]]) if kind == "ingest" \
                else svc.propose(session, K, op[2])
            failures, drafts = model.rows(key, op[2])
            assert reply.ok and codes(reply) == failures, (reply, failures)
            if kind == "propose":
                got = reply.tensors["drafts"].tolist()
                assert all(got[i] == d for i, d in drafts.items())
                assert all(got[i] == [-1] * K for i in failures)
        elif kind == "free":
            assert svc.call(session, p.Free(op[2], op[3])).ok
            model.free(key, op[2], op[3])
        elif kind == "clear":
            assert svc.call(session, p.Clear()).ok
            model.clear(key)
        elif kind == "bye":
            assert svc.call(session, p.Bye()).ok
            model.clear(key)
            assert key not in svc.store.sessions
            sessions[key] = svc.session(key)            # the client comes back: an empty namespace
        else:
            reply = svc.reconnect(session, op[2], op[3])
            code, restored = model.reconnect(key, op[2], op[3])
            assert (reply.error[0] if not reply.ok else None) == code, reply
            assert code or reply.result == {"restored": restored}
        assert {k: v[0] for k, v in svc.snapshot().items()} == model.snapshot()
        svc.check_pool()


@settings(max_examples=250, deadline=None)
@given(sequence=ops, blocks=st.integers(2, 12))
def test_small_pool_refuses_without_changing_what_it_refuses(sequence, blocks):
    svc = _new_service(blocks)
    sessions = {key: svc.session(key) for key in KEYS}
    for op in sequence:
        kind, key = op[0], op[1]
        before = svc.snapshot()
        if kind not in ("ingest", "propose"):
            {"free": lambda: svc.call(sessions[key], p.Free(op[2], op[3])),
             "clear": lambda: svc.call(sessions[key], p.Clear()),
             "bye": lambda: svc.call(sessions[key], p.Bye()),
             "reconnect": lambda: svc.reconnect(sessions[key], op[2], op[3])}[kind]()
            if kind == "bye":
                sessions[key] = svc.session(key)
            svc.check_pool()
            continue
        spans = op[2]
        reply = svc.ingest(sessions[key], [s[:3] for s in spans]) if kind == "ingest" \
            else svc.propose(sessions[key], K, spans)
        assert reply.ok
        after, failed = svc.snapshot(), codes(reply)
        named = {h for h, *_ in spans}
        for i, (handle, start, toks, _) in enumerate(spans):
            old = [v for (k, h, _), v in before.items() if (k, h) == (key, handle)]
            new = [v for (k, h, _), v in after.items() if (k, h) == (key, handle)]
            if i in failed:           # a refused request keeps exactly what it had, where it had it
                assert [(k, h, w) for (k, h, w) in before if (k, h) == (key, handle)] == \
                       [(k, h, w) for (k, h, w) in after if (k, h) == (key, handle)] and old == new
            else:
                stored = list(old[0][0]) if old else []
                assert new[0][0] == tuple(stored[:start] + toks) and (key, handle, "active") in after
        mine = lambda ident: ident[0] == key and ident[1] in named   # noqa: E731
        over = _over_share(before, blocks, key)
        for ident, value in before.items():    # the others lose a retained context, or an active
            if not mine(ident):                # one only when they held more than their share
                assert after[ident] == value if ident in after else (ident[2] == "retained" or ident[0] in over)
        assert all(mine(ident) for ident in after.keys() - before.keys())
        if any("pool full" in m for _, _, m in reply.failures):   # its own retained contexts went first
            assert all(h in named for k, h in svc.store.retained if k == key)
        svc.check_pool()


def _over_share(snapshot: dict, blocks: int, asking: str) -> set[str]:
    """Sessions holding more distinct pool blocks than an equal share among the sessions holding
    anything and ``asking``."""
    held: dict[str, set] = {}
    for (key, _, _), (_, table, _) in snapshot.items():
        held.setdefault(key, set()).update(table)
    holders = len(held.keys() | {asking})
    return {key for key, ids in held.items() if len(ids) * holders > blocks}


def test_capacity_boundary_is_exact_and_retained_contexts_go_first():
    svc = LocalService(blocks=6, block_size=4, max_retained=4)     # 24 rows in all
    s = svc.session("c" * 16)
    assert codes(svc.ingest(s, [(0, 0, list(range(16))), (1, 0, list(range(8)))])) == {}
    assert svc.store.summary()["pool_free_blocks"] == 0
    assert codes(svc.ingest(s, [(2, 0, [1])])) == {0: "CAPACITY"}
    assert codes(svc.ingest(s, [(1, 8, [1])])) == {0: "CAPACITY"}     # growing past the pool, too
    assert codes(svc.ingest(s, [(1, 4, [5, 6, 7, 8])])) == {}         # a rewind that fits is fine
    assert svc.call(s, p.Free([0], True)).ok                          # 4 blocks retained
    assert svc.store.summary()["retained"] == 1
    assert codes(svc.ingest(s, [(2, 0, [1, 2, 3, 4, 5])])) == {}      # needs 2: the retained one goes
    assert svc.store.summary()["retained"] == 0
    assert not [ident for ident in svc.snapshot() if ident[1] == 0]     # gone for good
    svc.check_pool()


def test_same_handle_twice_in_one_message_is_refused_whole():
    svc = LocalService()
    s = svc.session("e" * 16)
    svc.ingest(s, [(0, 0, [1, 2, 3])])
    before = svc.snapshot()
    reply = svc.ingest(s, [(0, 3, [4]), (0, 4, [5])])
    assert not reply.ok and reply.error[0] == "BAD_REQUEST"
    assert svc.snapshot() == before


def test_one_message_never_evicts_a_context_it_names():
    """A request that resumes its own retained context, after another request of the same
    message that needs the pool: the context is protected, the other one is refused."""
    svc = LocalService(blocks=8, block_size=4)
    s = svc.session("d" * 16)
    assert codes(svc.ingest(s, [(0, 0, list(range(8)))])) == {}      # 2 blocks
    assert svc.call(s, p.Free([0], True)).ok                          # retained
    reply = svc.ingest(s, [(1, 0, list(range(28))), (0, 8, [9])])     # 7 blocks + 1, 6 free
    assert reply.ok and codes(reply) == {0: "CAPACITY"}
    assert svc.snapshot()[(s.key, 0, "active")][0] == (*range(8), 9)
    svc.check_pool()


def test_counts_beyond_the_rows_are_refused_before_anything_is_summed():
    big = 2 ** 63 - 1
    svc = LocalService()
    frames = (np.array([[5, 0, big], [6, 0, big], [7, 0, 2]], dtype=np.int64).data, b"")
    with pytest.raises(ProtocolError) as info:
        r.check_message(svc.request(p.Ingest(3, 0), *frames), svc.engine.caps)
    assert info.value.code is ErrorCode.FRAME_MISMATCH


def test_token_ids_outside_the_vocabulary_fail_only_their_request():
    svc = LocalService()
    s = svc.session("f" * 16)
    assert codes(svc.ingest(s, [(0, 0, [1, 2, 3]), (1, 0, [4, 5])])) == {}
    before = svc.snapshot()
    reply = svc.propose(s, 3, [(0, 3, [1, -7], 2), (1, 2, [4], 5), (2, 0, [1], -1)])
    assert codes(reply) == {0: "BAD_REQUEST", 2: "BAD_REQUEST"}
    assert "-1" in reply.failures[1][2] and "token id" in reply.failures[0][2]
    assert reply.tensors["drafts"].tolist() == [[-1] * 3, ngram_lookup([4, 5, 4, 5], 3) + [-1], [-1] * 3]
    assert svc.snapshot()[(s.key, 0, "active")] == before[(s.key, 0, "active")]
    assert (s.key, 2, "active") not in svc.snapshot()
    svc.engine.caps = dataclasses.replace(svc.engine.caps, vocab_size=6)   # an engine with a vocabulary
    assert codes(svc.propose(s, 3, [(0, 3, [6], 1), (1, 3, [5], 6), (2, 0, [5], 5)])) == \
        {0: "BAD_REQUEST", 1: "BAD_REQUEST"}


def test_reconnect_checks_its_handle_and_tokens():
    svc = LocalService()
    s = svc.session("g" * 16)
    before = svc.snapshot()
    for handle, tokens, code in ((-1, [1, 2], "BAD_FIELD"), (1 << 63, [1], "BAD_FIELD"), (0, [1, -2], "BAD_REQUEST")):
        reply = svc.reconnect(s, handle, tokens)
        assert not reply.ok and reply.error[0] == code, reply
    assert svc.snapshot() == before and svc.store.num_active == 0


def test_a_request_refused_for_the_pool_takes_no_request_slot():
    svc = LocalService(blocks=4, block_size=4, max_requests=2)
    s = svc.session("h" * 16)
    reply = svc.ingest(s, [(0, 0, [1] * 20), (1, 0, [1]), (2, 0, [2])])     # 5 blocks: more than the pool
    assert codes(reply) == {0: "CAPACITY"}
    assert sorted(s.active) == [1, 2]


SPECIALS = {  # per dtype: values that are NaN/Inf, and finite edge values (largest, tiny, -0)
    "bfloat16": ([float("nan"), float("inf"), -float("inf")], [3.3895e38, -3.3895e38, 1e-40, -0.0]),
    "float16": ([float("nan"), float("inf"), -float("inf")], [65504.0, -65504.0, 6e-8, -0.0]),
    "float32": ([float("nan"), float("inf"), -float("inf")], [3.4028e38, -3.4028e38, 1e-45, -0.0]),
}


@pytest.mark.parametrize("dtype", sorted(SPECIALS))
def test_a_device_plane_read_refuses_exactly_the_rows_its_dtype_calls_non_finite(dtype):
    """A read over the device plane copies each row's top bits to the host, and the host decides with
    the threshold of the ring's own dtype: NaN of either sign and both infinities flagged, the largest
    finite value (whose bits sit just under the threshold) and the tiny ones not."""
    import torch
    from k3_accel.server.device_plane import Fetch
    dt = p.DTYPES[dtype]
    bad_values, edge_values = SPECIALS[dtype]
    values = [1.0] + edge_values + bad_values + [-float("nan")]
    hidden = torch.full((len(values), 64), 0.5, dtype=torch.float32)
    hidden[:, 37] = torch.tensor(values)
    hidden = hidden.to(dt)
    fetch = Fetch(hidden, r.top_bits(hidden), done=None, ring=None)
    assert fetch.nonfinite.tolist() == (~torch.isfinite(hidden).all(dim=1)).tolist()
    assert int(fetch.nonfinite.sum()) == len(bad_values) + 1


@pytest.mark.parametrize("dtype", sorted(SPECIALS))
@pytest.mark.parametrize("width", [1, 7, 20480])
def test_bad_rows_counts_exactly_the_rows_torch_calls_non_finite(dtype, width):
    """The bit test agrees with ``torch.isfinite`` on every row (at width 20480 across several slabs
    of the check), for NaN of either sign bit and both infinities, and never flags a finite edge value."""
    import torch
    dt = p.DTYPES[dtype]
    bad_values, edge_values = SPECIALS[dtype]
    rng = np.random.default_rng(width)
    rows = max(3, (r._CHECK_CHUNK_BYTES // (width * dt.itemsize)) * 2 + 3)   # > two slabs
    rows = min(rows, 600)
    hidden = torch.from_numpy(rng.standard_normal((rows, width)).astype(np.float32)).to(dt)
    flat = hidden.view(-1)
    edges = torch.tensor(edge_values, dtype=torch.float32).to(dt)
    for i in rng.choice(rows, size=min(rows, 40), replace=False):
        flat[int(i) * width + int(rng.integers(width))] = edges[int(rng.integers(len(edges)))]
    nan_payload = torch.tensor([-float("nan")], dtype=torch.float32).to(dt)       # sign bit set
    for j, i in enumerate(rng.choice(rows, size=min(rows - 1, 25), replace=False)):
        value = nan_payload[0] if j % 4 == 3 else torch.tensor(bad_values[j % 3]).to(dt)
        flat[int(i) * width + int(rng.integers(width))] = value
    expected = (~torch.isfinite(hidden).all(dim=1)).numpy()
    assert 0 < expected.sum() < rows
    offsets = np.array([0, 1, rows // 2, rows], dtype=np.int64)
    got = r.bad_rows(hidden, offsets)
    want = [int(expected[a:b].sum()) for a, b in zip(offsets[:-1], offsets[1:])]
    assert got.tolist() == want
    device_plane = r.nonfinite_top_bits(r.top_bits(hidden).numpy(), dt)      # the device plane's test
    assert device_plane.tolist() == expected.tolist()
    finite = hidden.clone()
    finite[torch.from_numpy(expected)] = 0
    assert r.bad_rows(finite, offsets).tolist() == [0, 0, 0]
    assert not r.nonfinite_top_bits(r.top_bits(finite).numpy(), dt).any()


@settings(max_examples=150, deadline=None)
@given(histories=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=40), min_size=1, max_size=12),
       probes=st.lists(st.lists(st.integers(0, 1), max_size=40), min_size=1, max_size=6))
def test_reconnect_restores_the_longest_stored_prefix_among_many_retained(histories, probes):
    """Many retained contexts whose first tokens collide (a two-token alphabet), shorter and longer
    than the head a reconnect compares first: it restores what the best of them holds, as a scan of
    every stored context would (``Model.reconnect``)."""
    svc = LocalService(max_requests=4, max_requests_total=64, max_retained=64)
    s = svc.session("r" * 16)
    for handle, toks in enumerate(histories):
        assert svc.ingest(s, [(handle, 0, toks)]).ok
        assert svc.call(s, p.Free([handle], True)).ok
    for j, toks in enumerate(probes):
        best = 0
        for hist in histories:
            m = min(16, len(hist), len(toks))
            if m and hist[:m] == toks[:m]:
                best = max(best, next((i for i, (a, b) in enumerate(zip(hist, toks)) if a != b),
                                      min(len(hist), len(toks))))
        reply = svc.reconnect(s, 100 + j, toks)
        assert reply.ok and reply.result == {"restored": best}, (toks, reply)
        assert svc.call(s, p.Free([100 + j], False)).ok
    svc.check_pool()


def test_a_finished_context_outlives_many_others_under_the_server_defaults():
    """vLLM's prefix cache keeps a finished prompt's blocks until memory runs short; the server
    keeps a finished request's context the same way: 200 other requests finishing in between do
    not cost a later prefix-cache hit its drafts while the pool has room."""
    from k3_accel.server.cli import build_parser
    defaults = build_parser().parse_args(["--engine", "ngram"])
    svc = LocalService(max_requests=8, max_requests_total=64, max_retained=defaults.max_retained_requests)
    s = svc.session("d" * 16)
    prompt = list(range(40))
    assert svc.ingest(s, [(0, 0, prompt)]).ok and svc.call(s, p.Free([0], True)).ok
    for handle in range(1, 201):
        assert svc.ingest(s, [(handle, 0, [1000 + handle] * 20)]).ok
        assert svc.call(s, p.Free([handle], True)).ok
    reply = svc.reconnect(s, 999, prompt[:32])
    assert reply.ok and reply.result == {"restored": 32}


def test_a_reconnect_never_finds_a_context_the_server_let_go():
    """Retained contexts leave the table three ways: the table is full (least recent first), their
    handle comes back (active again) or the session frees them. A reconnect afterwards finds only
    what is still stored, with every context sharing the same first tokens."""
    svc = LocalService(max_requests=8, max_retained=2)
    s = svc.session("x" * 16)
    head = list(range(20))
    for handle, tail in enumerate(([1], [1, 2], [1, 2, 3])):           # the first leaves a full table
        assert svc.ingest(s, [(handle, 0, head + tail)]).ok and svc.call(s, p.Free([handle], True)).ok
    reply = svc.reconnect(s, 10, head + [1, 2, 3, 4])
    assert reply.ok and reply.result == {"restored": 23}
    assert svc.call(s, p.Free([10], False)).ok
    assert svc.ingest(s, [(2, 23, [9])]).ok                           # handle 2 is active again
    assert svc.call(s, p.Free([1], False)).ok                          # handle 1 freed for good
    reply = svc.reconnect(s, 11, head + [1, 2, 3, 4])
    assert reply.ok and reply.result == {"restored": 23}               # from handle 2, active: its 23
    assert svc.call(s, p.Free([2, 11], False)).ok
    reply = svc.reconnect(s, 12, head + [1, 2])
    assert reply.ok and reply.result == {"restored": 0}                # nothing of it is stored now
    svc.check_pool()
