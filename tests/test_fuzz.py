"""Property-based fuzzing of headers and frames against a live server."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from k3_accel import protocol as p
from k3_accel.protocol import Ingest, ProposeItem, RowSpan
from conftest import ServerProcess, Wire
from rows import rows

KEEP = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.text(max_size=8),
                    st.binary(max_size=8), st.floats(allow_nan=True))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                      max_leaves=12)
tensor_specs = st.lists(st.tuples(st.text(max_size=4), st.sampled_from(["int64", "bfloat16", "uint8", "bad"]),
                                  st.lists(st.integers(-1, 5), max_size=3), st.integers(-1, 64)), max_size=3)
headers = st.fixed_dictionaries({
    "v": st.one_of(st.just(p.PROTOCOL_VERSION), values),
    "op": st.one_of(st.sampled_from(list(p.OPS)), values),
    "seq": st.one_of(st.integers(0, 2**31), values),
    "body": st.one_of(st.dictionaries(st.sampled_from(["k", "requests", "ids", "id", "count", "source", "length"]),
                                      values, max_size=4), values),
    "tensors": st.one_of(tensor_specs.map(lambda xs: [list(x[:2]) + [x[2], x[3]] for x in xs]), values),
}, optional={"extra": values})
messages = st.one_of(
    headers.map(lambda h: [msgpack.packb(h)]),
    st.tuples(headers, st.lists(st.binary(max_size=40), max_size=3)).map(lambda x: [msgpack.packb(x[0]), *x[1]]),
    st.lists(st.binary(max_size=64), min_size=1, max_size=3),
)


@pytest.fixture(scope="module")
def live():
    server = ServerProcess("--engine", "ngram")
    wire = Wire(server.address, timeout_ms=5000)
    wire.call(Ingest([RowSpan("keep", len(KEEP))]), rows((0, KEEP))).raise_for_error()
    yield wire
    wire.close()
    assert server.stop() == 0


def _drafts(wire):
    reply = wire.call(p.Propose(k=3, requests=[ProposeItem("keep", 0, anchor_token=1, anchor_position=len(KEEP))]))
    return reply.tensors["drafts"].tolist()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=messages)
def test_fuzzed_messages_get_a_reply_and_spare_other_state(live, frames):
    # (re)store "keep" from position 0: an earlier example may have cleared or freed it
    live.call(Ingest([RowSpan("keep", len(KEEP))]), rows((0, KEEP))).raise_for_error()
    before = _drafts(live)
    live.send_frames(frames)
    reply = live.recv()              # a reply always comes (no hang) ...
    assert reply.server_id           # ... from a live server
    if not reply.ok:
        assert reply.error["code"] in {c.value for c in p.ErrorCode}
    # an unrelated request's state is intact (unless the fuzz itself hit "keep")
    if b"keep" not in b"".join(frames) and b"clear" not in b"".join(frames):
        assert _drafts(live) == before == [[5, 9, 2]]
