"""Replies: typed results, per-request failures and tensors, encoded by the server and
decoded by the client (see :mod:`k3_accel.protocol` for the wire)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import msgpack
import msgspec
import numpy as np

from k3_accel.protocol.base import (DTYPES, PROTOCOL_VERSION, ErrorCode, ProtocolError, _encoder,
                                    _peek_version, _version_message, dtype_name, frame_bytes,
                                    frame_tensor, tensor_frame)
from k3_accel.protocol.messages import Caps


class ReplyHeader(msgspec.Struct, array_like=True):
    v: int
    seq: int
    ok: bool
    server_id: str
    error: Optional[tuple[str, str]] = None          # (code, message)
    failures: list[tuple[int, str, str]] = []        # (request index, code, message)
    result: Any = None
    tensors: list[tuple[str, str, list[int]]] = []   # (name, dtype, shape) of each frame


_reply_decoder = msgspec.msgpack.Decoder(ReplyHeader)


# ------------------------------------------------------------------ replies
class Reply(msgspec.Struct):
    seq: int
    ok: bool
    server_id: str
    error: Optional[tuple[str, str]] = None
    failures: list = []
    result: Any = None
    tensors: dict = {}

    def raise_for_error(self) -> "Reply":
        if not self.ok:
            code, message = self.error or ("INTERNAL", "")
            raise ProtocolError(code, message, self.seq)
        return self


def error_reply(seq: int, server_id: str, code: ErrorCode | str, message: str) -> Reply:
    return Reply(seq, False, server_id, (ErrorCode(code).value, message))


_NP_NAMES = {np.dtype(np.int64): "int64", np.dtype(np.int32): "int32", np.dtype(np.float32): "float32",
             np.dtype(np.uint8): "uint8"}


def encode_reply(reply: Reply) -> list:
    """Frames of a reply; its tensors may be torch tensors or numpy arrays."""
    specs, frames = [], []
    for name, t in reply.tensors.items():
        if isinstance(t, np.ndarray):
            t = np.ascontiguousarray(t)
            specs.append((name, _NP_NAMES[t.dtype], list(t.shape)))
            frames.append(t.data)
            continue
        t = t if t.is_contiguous() else t.contiguous()
        specs.append((name, dtype_name(t.dtype), list(t.shape)))
        frames.append(tensor_frame(t))
    head = ReplyHeader(PROTOCOL_VERSION, reply.seq, reply.ok, reply.server_id, reply.error,
                       reply.failures, reply.result, specs)
    return [_encoder.encode(head), *frames]


def decode_reply(frames: Sequence[Any]) -> Reply:
    if not frames:
        raise ProtocolError(ErrorCode.BAD_FRAME, "empty reply")
    try:
        head = _reply_decoder.decode(frame_bytes(frames[0]))
    except msgspec.DecodeError:
        version, seq = _peek_version(bytes(frame_bytes(frames[0])))
        if version is not None and version != PROTOCOL_VERSION:
            raise ProtocolError(ErrorCode.BAD_VERSION, f"the server speaks protocol {version!r}, "
                                                       f"this client {PROTOCOL_VERSION}", seq) from None
        raise ProtocolError(ErrorCode.BAD_FRAME, "not a reply", seq) from None
    if head.v != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION, f"the server speaks protocol {head.v!r}, "
                                                   f"this client {PROTOCOL_VERSION}", head.seq)
    if len(frames) - 1 != len(head.tensors):
        raise ProtocolError(ErrorCode.FRAME_MISMATCH, "reply frames do not match its header", head.seq)
    tensors = {}
    for (name, dtype, shape), frame in zip(head.tensors, frames[1:]):
        if dtype not in DTYPES:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"reply tensor {name}: dtype {dtype!r}", head.seq)
        try:
            tensors[name] = frame_tensor(frame, DTYPES[dtype], shape, name)
        except ProtocolError as exc:      # the seq is known: the pending gets the typed error now
            exc.seq = head.seq
            raise
    return Reply(head.seq, head.ok, head.server_id, head.error, head.failures, head.result, tensors)


def legacy_error(frames: Sequence[Any], server_id: str) -> list | None:
    """A version-1 peer's message answered with BAD_VERSION in version-1 framing (None: not v1)."""
    version, seq = _peek_version(bytes(frame_bytes(frames[0]))) if frames else (None, -1)
    if version != 1:
        return None
    body = {"ok": False, "server_id": server_id,
            "error": {"code": ErrorCode.BAD_VERSION.value, "message": _version_message(1)}}
    return [msgpack.packb({"v": 1, "op": "reply", "seq": seq, "body": body, "tensors": []},
                          use_bin_type=True)]


def caps_from_result(result: Any) -> Caps:
    """The server's :class:`Caps` from a hello result; ProtocolError(BAD_FIELD) if unusable."""
    try:
        return msgspec.convert(result, Caps)
    except msgspec.ValidationError as exc:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"hello result: {exc}") from None

__all__ = ['ReplyHeader', 'Reply', 'error_reply', 'encode_reply', 'decode_reply', 'legacy_error',
           'caps_from_result']
