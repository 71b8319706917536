"""Property-based fuzzing of headers and frames against a live server: every message gets a
typed reply (no crash, no hang), and another session's state is never touched."""
from __future__ import annotations

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from helpers.oracles import ngram_lookup
from helpers.server import ServerProcess
from helpers.wire import Wire
from k3_accel import protocol as p

KEEP = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]
CODES = {c.value for c in p.ErrorCode}
INTS = st.one_of(st.integers(-3, 20), st.sampled_from([2 ** 31, 2 ** 62, 2 ** 63 - 1, -2 ** 63, 2 ** 64 - 1]))
scalars = st.one_of(st.none(), st.booleans(), INTS, st.text(max_size=8), st.binary(max_size=8),
                    st.floats(allow_nan=True))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                      max_leaves=10)

# any header: a version, a seq, an op tag (known or not) and fields of any type
headers = st.tuples(st.one_of(st.just(p.PROTOCOL_VERSION), values), st.one_of(INTS, values),
                    st.one_of(st.tuples(st.sampled_from(sorted(p.OPS)), st.lists(values, max_size=7))
                              .map(lambda t: [t[0], *t[1]]), values))
junk = st.lists(st.binary(max_size=48), max_size=3)


@st.composite
def row_messages(draw):
    """Near-valid ingest/propose messages: well-typed headers, hostile numbers, frames that
    match or nearly match them."""
    op = draw(st.sampled_from([p.Ingest, p.Propose]))
    n, cols = draw(st.integers(0, 4)), p.META_COLUMNS[op]
    int64 = INTS.filter(lambda v: -2 ** 63 <= v < 2 ** 63)
    column = {0: st.one_of(st.integers(0, 3), int64), 1: st.one_of(st.just(0), int64)}   # handles, starts
    meta = np.array([[draw(column.get(c, int64)) for c in range(cols)] for _ in range(n)],
                    dtype=np.int64).reshape(n, cols)
    rows = draw(st.one_of(st.integers(0, 12), INTS))
    size = rows if 0 <= rows <= 12 else draw(st.integers(0, 12))
    tokens = np.array(draw(st.lists(st.integers(-2, 6), min_size=size, max_size=size)), dtype=np.int64)
    if n and draw(st.booleans()):             # counts that add up to rows, as int64 arithmetic has it
        with np.errstate(over="ignore"):
            meta[-1, 2] = np.int64(rows if -2 ** 63 <= rows < 2 ** 63 else 0) - meta[:-1, 2].sum()
    hidden = draw(st.sampled_from(["", "", "float32", "bfloat16", "int8"]))
    width = draw(st.integers(0, 3))
    k = draw(st.one_of(st.integers(0, 5), INTS))
    msg = p.Ingest(n, rows, hidden, width) if op is p.Ingest else \
        p.Propose(k, n, rows, hidden, width, draw(st.sampled_from(["none", "full", "topk", "x"])),
                  draw(st.integers(-1, 3)))
    frames = [meta.tobytes(), tokens.tobytes()] + ([b"\0" * (len(tokens) * width * 4)] if hidden else [])
    if draw(st.booleans()):                                          # damage one frame's size
        i = draw(st.integers(0, len(frames) - 1))
        frames[i] = frames[i][:-1] if frames[i] and draw(st.booleans()) else frames[i] + b"\0"
    return [msgspec.msgpack.encode([p.PROTOCOL_VERSION, draw(INTS.filter(lambda v: v >= 0)), msg]), *frames]


def _encode(head) -> bytes:
    return msgspec.msgpack.encode(list(head))


messages = st.one_of(
    headers.map(lambda h: [_encode(h)]),
    st.tuples(headers, junk).map(lambda x: [_encode(x[0]), *x[1]]),
    row_messages(),
    st.fixed_dictionaries({"v": st.one_of(st.just(1), values), "op": values, "seq": INTS}).map(
        lambda d: [msgpack.packb(d)]),
    st.lists(st.binary(max_size=64), min_size=1, max_size=3),
)


@pytest.fixture(scope="module")
def live():
    server = ServerProcess("--engine", "ngram", "--block-size", "4", "--lease-s", "0")
    bystander = Wire(server.address, timeout_ms=10000)
    bystander.ingest([(0, 0, KEEP)]).raise_for_error()
    fuzzer = Wire(server.address, timeout_ms=10000)
    yield server, bystander, fuzzer
    bystander.close()
    fuzzer.close()
    assert server.stop() == 0


def _drafts(w: Wire) -> list:
    return w.propose(3, [(0, len(KEEP), [], 1)]).raise_for_error().tensors["drafts"].tolist()


def _check_reply(frames: list) -> None:
    try:
        reply = p.decode_reply(frames)
    except p.ProtocolError as exc:               # a v1-looking header is answered in v1 framing
        assert exc.code is p.ErrorCode.BAD_VERSION
        body = msgpack.unpackb(frames[0])["body"]
        assert body["server_id"] and body["error"]["code"] == "BAD_VERSION"
        return
    assert reply.server_id
    if not reply.ok:
        assert reply.error[0] in CODES
    assert all(code in CODES for _, code, _ in reply.failures)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=messages)
def test_fuzzed_messages_get_a_reply_and_spare_other_sessions(live, frames):
    server, bystander, fuzzer = live
    fuzzer.call(p.Hello(fuzzer.session, "fuzz")).raise_for_error()   # (re)bound: an example may say bye
    before = _drafts(bystander)
    fuzzer.send_frames(frames)
    assert fuzzer.sock.poll(fuzzer.timeout_ms), "no reply: the server hangs or dropped the message"
    _check_reply(fuzzer.sock.recv_multipart())
    assert server.proc.poll() is None
    assert _drafts(bystander) == before == [ngram_lookup(KEEP + [1], 3)]
