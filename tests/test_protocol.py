"""Protocol v2 encoding and decoding of every op, in process (no sockets)."""
from __future__ import annotations

import msgpack
import msgspec
import numpy as np
import pytest
import torch

from helpers.wire import ints, meta
from k3_accel import protocol as p
from k3_accel.protocol import ErrorCode, ProtocolError


def _bytes(frames):
    return [bytes(f) for f in frames]


def _raise(frames, **kw) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        p.decode_request(frames, **kw)
    return info.value


def _header(*head) -> bytes:
    return msgspec.msgpack.encode(list(head))


HIDDEN = torch.randn(5, 3).to(torch.bfloat16)
MESSAGES = {
    "hello": (p.Hello("s" * 16, "me"), ()),
    "ingest": (p.Ingest(2, 5), (meta([7, 8], [0, 3], [2, 3]), ints([1, 2, 3, 4, 5]))),
    "ingest+hidden": (p.Ingest(2, 5, "bfloat16", 3),
                      (meta([7, 8], [0, 3], [2, 3]), ints([1, 2, 3, 4, 5]), p.tensor_frame(HIDDEN))),
    "propose": (p.Propose(4, 1, 2, logits="topk", topk=3), (meta([7], [5], [2], [9]), ints([1, 2]))),
    "free": (p.Free([1, 2], retain=False), ()),
    "clear": (p.Clear(), ()),
    "reconnect": (p.Reconnect(3, 4), (ints([4, 5, 6, 7]),)),
    "ping": (p.Ping(), ()),
    "bye": (p.Bye(), ()),
    "stats": (p.Stats(), ()),
    "attach": (p.Attach("host", "GPU-x", "bfloat16", 3, 5,
                        [p.IpcTensor([5, 3], [3, 1], 0, "bfloat16", b"h", 30, 0, b"/rc", 0, b"e", True)], [b"r"]),
               ()),
    "propose+slot": (p.Propose(4, 1, 2, "bfloat16", 3, slot=1), (meta([7], [5], [2], [9], [0]), ints([1, 2]))),
}


def test_every_op_is_covered():
    assert {m.__struct_config__.tag for m, _ in MESSAGES.values()} == set(p.OPS)


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_request_round_trip(name):
    msg, frames = MESSAGES[name]
    req = p.decode_request(_bytes(p.encode_request(11, msg, *frames)))
    assert req.seq == 11 and req.msg == msg and req.op == msg.__struct_config__.tag
    if isinstance(msg, p.ROW_OPS):
        cols = p.META_COLUMNS[type(msg)] + (msg.slot >= 0)     # + the slot rows on the device plane
        assert req.meta.shape == (msg.n, cols) and req.meta.dtype == np.int64
        assert req.meta.tobytes() == bytes(frames[0]) and req.tokens.tobytes() == bytes(frames[1])
        if msg.hidden and msg.slot < 0:
            assert req.hidden.dtype == torch.bfloat16 and torch.equal(req.hidden, HIDDEN)
        else:
            assert req.hidden is None
    elif isinstance(msg, p.Reconnect):
        assert req.tokens.tolist() == [4, 5, 6, 7]
    else:
        assert req.meta is None and req.tokens is None


def test_frames_are_zero_copy_views():
    tokens = np.zeros(4, dtype=np.int64)
    frames = p.encode_request(1, p.Ingest(1, 4), meta([0], [0], [4]), tokens.data)
    req = p.decode_request(frames)
    tokens[2] = 77          # a later write shows through: nothing was copied
    assert req.tokens.tolist() == [0, 0, 77, 0]


def test_reply_round_trip_with_failures_error_and_tensors():
    reply = p.Reply(seq=3, ok=True, server_id="s1", failures=[(1, "CONTEXT_GAP", "gap")], result=[0.1, 0.2],
                    tensors={"drafts": torch.tensor([[1, -1], [-1, -1]], dtype=torch.int32)})
    back = p.decode_reply(_bytes(p.encode_reply(reply)))
    assert back.ok and back.server_id == "s1" and back.result == [0.1, 0.2]
    assert [tuple(f) for f in back.failures] == [(1, "CONTEXT_GAP", "gap")]
    assert back.tensors["drafts"].dtype == torch.int32 and back.tensors["drafts"].tolist() == [[1, -1], [-1, -1]]
    err = p.decode_reply(_bytes(p.encode_reply(p.error_reply(4, "s1", ErrorCode.CAPACITY, "full"))))
    assert tuple(err.error) == ("CAPACITY", "full")
    with pytest.raises(ProtocolError) as info:
        err.raise_for_error()
    assert info.value.code is ErrorCode.CAPACITY and info.value.seq == 4


def test_reply_frames_must_match_header():
    frames = _bytes(p.encode_reply(p.Reply(1, True, "s", tensors={"drafts": torch.zeros(2, 2, dtype=torch.int32)})))
    with pytest.raises(ProtocolError) as info:
        p.decode_reply(frames[:1])
    assert info.value.code is ErrorCode.FRAME_MISMATCH
    with pytest.raises(ProtocolError) as info:              # the seq is known: its pending is answered now
        p.decode_reply([frames[0], frames[1][:-1]])
    assert info.value.code is ErrorCode.FRAME_MISMATCH and info.value.seq == 1
    with pytest.raises(ProtocolError) as info:              # a frame the header does not name
        p.decode_reply([*frames, frames[1]])
    assert info.value.code is ErrorCode.FRAME_MISMATCH and info.value.seq == 1


def test_a_reply_tensor_of_a_dtype_that_does_not_travel_is_a_typed_error():
    head = p.ReplyHeader(p.PROTOCOL_VERSION, 5, True, "s", tensors=[("drafts", "complex64", [1])])
    with pytest.raises(ProtocolError) as info:
        p.decode_reply([msgspec.msgpack.encode(head), bytes(8)])
    assert info.value.code is ErrorCode.BAD_FIELD and "complex64" in info.value.message and info.value.seq == 5


def test_a_reply_tensor_whose_shape_has_negative_sizes_is_a_typed_error():
    """[-2, -4] has the byte count of [2, 4]: the frame must still not decode (torch would raise a
    RuntimeError out of the client's reply reading instead of answering the pending, typed)."""
    for shape, size in (([-2, -4], 64), ([-1, 8], 64), ([-1, 0], 0)):
        head = p.ReplyHeader(p.PROTOCOL_VERSION, 6, True, "s", tensors=[("drafts", "int64", shape)])
        with pytest.raises(ProtocolError) as info:
            p.decode_reply([msgspec.msgpack.encode(head), bytes(size)])
        assert info.value.code is ErrorCode.FRAME_MISMATCH and info.value.seq == 6


def test_declared_hidden_size_limit():
    msg = p.Ingest(1, 100, "float32", 1000)        # 400 kB of hidden rows declared
    e = _raise([_header(2, 9, msgspec.to_builtins(msg)), b"", b"", b""], max_bytes=1000)
    assert e.code is ErrorCode.TOO_LARGE and e.seq == 9


def test_total_message_size_limit():
    """Frames that add up to more than the advertised limit are refused, whatever they are."""
    tokens = np.arange(200, dtype=np.int64)         # 1,600 bytes
    frames = _bytes(p.encode_request(5, p.Ingest(1, 200), meta([0], [0], [200]), tokens.data))
    assert p.decode_request(frames, max_bytes=4096).tokens.tolist() == tokens.tolist()
    e = _raise(frames, max_bytes=1024)
    assert e.code is ErrorCode.TOO_LARGE and e.seq == 5 and "1024" in e.message


def test_a_message_of_exactly_the_advertised_limit_is_accepted():
    """``max_message_bytes`` is the most a message may hold: a client that fills a message up to it
    is served; one byte more is TOO_LARGE."""
    tokens = np.arange(100, dtype=np.int64)
    frames = _bytes(p.encode_request(6, p.Ingest(1, 100), meta([0], [0], [100]), tokens.data))
    total = sum(len(f) for f in frames)
    assert p.decode_request(frames, max_bytes=total).tokens.tolist() == tokens.tolist()
    e = _raise(frames, max_bytes=total - 1)
    assert e.code is ErrorCode.TOO_LARGE and e.seq == 6


def test_an_attach_whose_slots_hold_another_dtype_than_it_declares_is_refused():
    """The server reads a slot as the attach's dtype: a ring of another dtype would be read as garbage."""
    good = MESSAGES["attach"][0]
    assert p.decode_request(_bytes(p.encode_request(1, good))).msg == good
    other = msgspec.structs.replace(good, slots=[msgspec.structs.replace(t, dtype="float16") for t in good.slots])
    e = _raise(_bytes(p.encode_request(3, other)))
    assert e.code is ErrorCode.BAD_FIELD and e.seq == 3


def test_bool_is_not_an_int_and_the_field_is_named():
    e = _raise([_header(2, 1, ["propose", True, 0, 0])])
    assert e.code is ErrorCode.BAD_FIELD and e.seq == 1 and "propose.k" in e.message


@pytest.mark.parametrize("msg, code", [
    (["free", [1], True, 9], ErrorCode.BAD_FIELD),       # an extra field
    (["free"], ErrorCode.BAD_FIELD),                     # a missing field
    (["hello", 5], ErrorCode.BAD_FIELD),                 # a mistyped field
    ("ping", ErrorCode.BAD_FIELD),                       # not a tagged array
    (["explode"], ErrorCode.UNKNOWN_OP),
    ([7], ErrorCode.BAD_FIELD),                          # an op that is not a name
])
def test_bad_messages_get_typed_codes_and_keep_the_seq(msg, code):
    e = _raise([_header(2, 42, msg)])
    assert e.code is code and e.seq == 42, e


@pytest.mark.parametrize("frames, code", [
    ([], ErrorCode.BAD_FRAME),
    ([b"\xc1\xc1 not msgpack"], ErrorCode.BAD_FRAME),
    ([msgpack.packb({"a": 1})], ErrorCode.BAD_FRAME),
    ([_header(2, -1, ["ping"])], ErrorCode.BAD_FIELD),
    ([_header(2, 1, ["stats"]), b"x"], ErrorCode.FRAME_MISMATCH),
    ([_header(2, 1, ["ingest", 1, 2])], ErrorCode.FRAME_MISMATCH),
    ([_header(2, 1, ["ingest", 1, 2]), bytes(meta([0], [0], [2])), b"\0" * 15], ErrorCode.FRAME_MISMATCH),
    ([_header(2, 1, ["ingest", 2, 2]), bytes(meta([0], [0], [2])), b"\0" * 16], ErrorCode.FRAME_MISMATCH),
    ([_header(2, 1, ["propose", 2, 1, 2]), bytes(meta([0], [0], [2])), b"\0" * 16], ErrorCode.FRAME_MISMATCH),
    ([_header(2, 1, ["ingest", 1, 1, "bfloat16", 2]), bytes(meta([0], [0], [1])), b"\0" * 8],
     ErrorCode.FRAME_MISMATCH),
    ([_header(2, 1, ["ingest", 1, 1, "float64", 2]), bytes(meta([0], [0], [1])), b"\0" * 8, b"\0" * 16],
     ErrorCode.BAD_FIELD),
    ([_header(2, 1, ["ingest", -1, 0]), b"", b""], ErrorCode.BAD_FIELD),
    ([_header(2, 1, ["ingest", 1, -1]), bytes(meta([0], [0], [0])), b""], ErrorCode.BAD_FIELD),
    ([_header(2, 1, ["ingest", 1, 0, "", -1]), bytes(meta([0], [0], [0])), b""], ErrorCode.BAD_FIELD),
    ([_header(2, 1, ["ingest", 1, 1, "bfloat16", -1]), bytes(meta([0], [0], [1])), bytes(ints([1])), b""],
     ErrorCode.BAD_FIELD),
    ([_header(2, 1, ["reconnect", 0, 3])], ErrorCode.FRAME_MISMATCH),
    ([_header(2, 1, ["reconnect", 0, 3]), b"\0" * 16], ErrorCode.FRAME_MISMATCH),
])
def test_frame_errors(frames, code):
    assert _raise(frames).code is code


def test_hidden_dtype_error_lists_the_allowed_ones():
    e = _raise([_header(2, 1, ["ingest", 1, 1, "float64", 2]), bytes(meta([0], [0], [1])), b"\0" * 8, b""])
    assert all(d in e.message for d in p.HIDDEN_DTYPES)


@pytest.mark.parametrize("head", [[3, 7, ["ping"]], [99, 7, ["no such op", 1]], {"v": 3, "seq": 7}])
def test_other_versions_get_bad_version_naming_ours(head):
    e = _raise([msgpack.packb(head)])
    assert e.code is ErrorCode.BAD_VERSION and e.seq == 7
    assert f"speaks {', '.join(map(str, p.SUPPORTED_VERSIONS))}" in e.message


def test_v1_peer_is_answered_in_v1_framing():
    v1 = [msgpack.packb({"v": 1, "op": "hello", "seq": 5, "body": {}, "tensors": []})]
    out = p.legacy_error(v1, "srv")
    head = msgpack.unpackb(out[0])
    assert head["v"] == 1 and head["op"] == "reply" and head["seq"] == 5 and head["tensors"] == []
    body = head["body"]
    assert body["ok"] is False and body["server_id"] == "srv" and body["error"]["code"] == "BAD_VERSION"
    assert "speaks 2" in body["error"]["message"]
    assert p.legacy_error(_bytes(p.encode_request(1, p.Ping())), "srv") is None
    assert p.legacy_error([b"junk"], "srv") is None


def test_a_client_reading_a_v1_reply_gets_bad_version():
    out = p.legacy_error([msgpack.packb({"v": 1, "op": "hello", "seq": 5})], "srv")
    with pytest.raises(ProtocolError) as info:
        p.decode_reply(out)
    assert info.value.code is ErrorCode.BAD_VERSION


def test_a_client_reading_a_reply_of_another_version_gets_bad_version():
    """A newer server's reply whose header still parses as ours is another protocol all the same:
    BAD_VERSION naming both versions, with its seq (so its pending fails at once), as the server
    does for a request."""
    for version in (p.PROTOCOL_VERSION + 1, 0):
        raw = msgspec.msgpack.encode([version, 7, True, "srv", None, [], {"engine": "ngram"}, []])
        with pytest.raises(ProtocolError) as info:
            p.decode_reply([raw])
        assert info.value.code is ErrorCode.BAD_VERSION and info.value.seq == 7
        assert str(version) in info.value.message and str(p.PROTOCOL_VERSION) in info.value.message


def test_caps_accept_new_fields_and_default_missing_optional_ones():
    caps = p.Caps(engine="ngram", needs_hidden_states=False, context_width=0, hidden_dtypes=[],
                  supports_logits=False, supports_topk=False, max_spec_tokens=8, block_size=16, vocab_size=0)
    result = msgspec.to_builtins(caps)
    assert p.caps_from_result({**result, "a_future_field": 1}) == caps
    minimal = {k: result[k] for k in ("engine", "needs_hidden_states", "context_width", "hidden_dtypes",
                                      "supports_logits", "supports_topk", "max_spec_tokens", "block_size",
                                      "vocab_size")}
    assert p.caps_from_result(minimal).max_message_bytes == p.DEFAULT_MAX_MESSAGE_BYTES
    with pytest.raises(ProtocolError) as info:
        p.caps_from_result({k: v for k, v in result.items() if k != "engine"})
    assert info.value.code is ErrorCode.BAD_FIELD


def test_only_known_dtypes_travel():
    with pytest.raises(ProtocolError):
        p.dtype_name(torch.complex64)
    assert {p.dtype_name(d) for d in p.DTYPES.values()} == set(p.DTYPES)
