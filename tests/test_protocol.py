"""Encoding and decoding of every op, in process (no sockets)."""
from __future__ import annotations

import msgpack
import pytest
import torch

from k3_accel import protocol as p
from k3_accel.protocol import ErrorCode, ProtocolError

MESSAGES = [
    p.Hello("me"),
    p.Ingest([p.RowSpan("a", 2), p.RowSpan("b", 1)]),
    p.Propose(k=3, requests=[p.ProposeItem("a", 0, 5, 9)], logits="topk", topk=4),
    p.Free(["a", "b"], retain=False),
    p.Clear(),
    p.Reconnect("a", "b", 16),
    p.Stats(),
]


def _bytes(frames):
    return [bytes(f) for f in frames]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_request_round_trip(msg):
    tensors = {"positions": torch.arange(3), "hidden": torch.randn(3, 4).to(torch.bfloat16)}
    req = p.decode_request(_bytes(p.encode_request(11, msg, tensors)))
    assert req.seq == 11 and req.msg == msg and req.op == p._OP_NAMES[type(msg)]
    assert torch.equal(req.tensors["positions"], tensors["positions"])
    assert torch.equal(req.tensors["hidden"], tensors["hidden"]) and req.tensors["hidden"].dtype == torch.bfloat16


def test_reply_round_trip_with_error_and_tensors():
    reply = p.Reply(seq=3, ok=True, server_id="s1", body={"results": [{"id": "a", "ok": True}]},
                    tensors={"drafts": torch.tensor([[1, -1]])})
    back = p.decode_reply(_bytes(p.encode_reply(reply)))
    assert back.ok and back.server_id == "s1" and back.body == reply.body
    assert back.tensors["drafts"].tolist() == [[1, -1]]
    err = p.decode_reply(_bytes(p.encode_reply(p.error_reply(4, "s1", ErrorCode.CAPACITY, "full"))))
    with pytest.raises(ProtocolError) as info:
        err.raise_for_error()
    assert info.value.code is ErrorCode.CAPACITY and info.value.seq == 4


def test_frames_are_zero_copy_views():
    t = torch.zeros(4, dtype=torch.int64)
    frames = p.encode_request(1, p.Stats(), {"x": t})
    t[2] = 77   # a later write shows through: nothing was copied
    assert p.decode_request(_bytes(frames)).tensors["x"].tolist() == [0, 0, 77, 0]


def test_declared_size_limit():
    header = msgpack.packb({"v": 1, "op": "stats", "seq": 1, "body": {}, "tensors": [["x", "uint8", [100], 100]]})
    with pytest.raises(ProtocolError) as info:
        p.decode_request([header, b"x" * 100], max_bytes=99)
    assert info.value.code is ErrorCode.TOO_LARGE and info.value.seq == 1


def test_bool_is_not_an_int():
    header = msgpack.packb({"v": 1, "op": "propose", "seq": 1, "body": {"k": True, "requests": []}, "tensors": []})
    with pytest.raises(ProtocolError) as info:
        p.decode_request([header])
    assert info.value.code is ErrorCode.BAD_FIELD and "k" in info.value.message


def test_literal_field_lists_allowed_values():
    header = msgpack.packb({"v": 1, "op": "propose", "seq": 1,
                            "body": {"k": 1, "requests": [], "logits": "all"}, "tensors": []})
    with pytest.raises(ProtocolError, match="allowed"):
        p.decode_request([header])
