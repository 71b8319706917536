"""The target <-> draft-server wire protocol: typed messages and their encoding.

A message is a multipart ZMQ message. Frame 0 is a msgpack map::

    {"v": PROTOCOL_VERSION, "op": str, "seq": int, "body": {...},
     "tensors": [[name, dtype, shape, nbytes], ...]}

and frames 1..n are the raw bytes of the tensors, in the order listed.
A reply has the same shape with ``op == "reply"`` and, in ``body``,
``ok``, ``server_id``, ``error`` (``{"code", "message"}`` or None) and the
op's result. The sequence number of a request is echoed by its reply.

Context rows (ingest and propose) travel as three row-aligned tensors
``positions [N] int64``, ``token_ids [N] int64`` and optionally
``hidden [N, W]``; ``requests[i].count`` rows belong to request i, in order.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import typing
import warnings
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Literal, Mapping, Sequence, Union

import msgpack
import torch

PROTOCOL_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 2 << 30  # 2 GiB


class ErrorCode(str, Enum):
    BAD_FRAME = "BAD_FRAME"                  # frame 0 is not a msgpack map
    BAD_VERSION = "BAD_VERSION"
    UNKNOWN_OP = "UNKNOWN_OP"
    BAD_FIELD = "BAD_FIELD"                  # missing / extra / mistyped field
    FRAME_MISMATCH = "FRAME_MISMATCH"        # frame count or byte length vs header
    TOO_LARGE = "TOO_LARGE"
    NON_FINITE = "NON_FINITE"                # NaN / Inf in hidden rows
    BAD_REQUEST = "BAD_REQUEST"              # well-formed but inconsistent
    CONTEXT_GAP = "CONTEXT_GAP"              # positions skip past the stored context
    UNKNOWN_REQUEST = "UNKNOWN_REQUEST"
    PREFIX_MISMATCH = "PREFIX_MISMATCH"
    CAPACITY = "CAPACITY"                    # memory budget exhausted
    TOO_MANY_REQUESTS = "TOO_MANY_REQUESTS"
    K_TOO_LARGE = "K_TOO_LARGE"
    UNSUPPORTED = "UNSUPPORTED"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    INTERNAL = "INTERNAL"


class ProtocolError(Exception):
    """A message could not be accepted; carries a typed code."""

    def __init__(self, code: ErrorCode | str, message: str, seq: int = -1):
        super().__init__(f"{ErrorCode(code).value}: {message}")
        self.code = ErrorCode(code)
        self.message = message
        self.seq = seq


# --------------------------------------------------------------------- dtypes
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"dtype {dtype} cannot travel") from None


# ------------------------------------------------------------------- messages
@dataclass(frozen=True)
class ServerCaps:
    engine: str
    needs_hidden_states: bool
    context_width: int
    hidden_dtypes: list[str]
    supports_logits: bool
    supports_topk: bool
    max_requests: int
    max_spec_tokens: int
    block_size: int
    vocab_size: int
    protocol: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Hello:
    client: str = ""


@dataclass(frozen=True)
class RowSpan:
    """``count`` consecutive context rows of one request."""
    id: str
    count: int


@dataclass(frozen=True)
class Ingest:
    requests: list[RowSpan]


@dataclass(frozen=True)
class ProposeItem:
    id: str
    count: int               # new context rows for this request (may be 0)
    anchor_token: int        # token at anchor_position (just sampled / next prompt token)
    anchor_position: int     # must equal the request's context length after the new rows


@dataclass(frozen=True)
class Propose:
    k: int
    requests: list[ProposeItem]
    logits: Literal["none", "full", "topk"] = "none"
    topk: int = 0


@dataclass(frozen=True)
class Free:
    ids: list[str]
    retain: bool = True      # keep the context for a later reconnect


@dataclass(frozen=True)
class Clear:
    pass


@dataclass(frozen=True)
class Reconnect:
    """Attach ``id`` to the first ``length`` rows of ``source`` (tensor ``token_ids``)."""
    source: str
    id: str
    length: int


@dataclass(frozen=True)
class Stats:
    pass


Message = Union[Hello, Ingest, Propose, Free, Clear, Reconnect, Stats]
OPS: dict[str, type] = {"hello": Hello, "ingest": Ingest, "propose": Propose, "free": Free,
                        "clear": Clear, "reconnect": Reconnect, "stats": Stats}
_OP_NAMES = {cls: name for name, cls in OPS.items()}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def as_list(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.nbytes]


@dataclass
class Request:
    seq: int
    msg: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def op(self) -> str:
        return _OP_NAMES[type(self.msg)]


@dataclass
class Reply:
    seq: int
    ok: bool
    server_id: str
    body: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    error: dict[str, str] | None = None

    def raise_for_error(self) -> "Reply":
        if not self.ok:
            err = self.error or {}
            raise ProtocolError(err.get("code", "INTERNAL"), err.get("message", ""), self.seq)
        return self


@dataclass(frozen=True)
class RequestResult:
    """Per-request outcome inside an ok reply."""
    id: str
    ok: bool = True
    code: str | None = None
    message: str | None = None


# ------------------------------------------------------------ field checking
_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def _check_type(hint: type, value: Any, path: str) -> Any:
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{path}: expected {hint.__name__}, "
                                                 f"got {type(value).__name__}")
    return value


def _check_list(check_item: Callable[[Any, str], Any], value: Any, path: str) -> list:
    if not isinstance(value, list):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{path}: expected a list")
    return [check_item(v, f"{path}[{i}]") for i, v in enumerate(value)]


def _check_literal(allowed: tuple, value: Any, path: str) -> Any:
    if value not in allowed:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{path}={value!r}: allowed {list(allowed)}")
    return value


@functools.lru_cache(maxsize=None)
def _checker(hint: Any) -> Callable[[Any, str], Any]:
    """``check(value, path) -> value`` for a field's type hint, built once per hint."""
    if dataclasses.is_dataclass(hint):
        return functools.partial(_build, hint)
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        return functools.partial(_check_list, _checker(item))
    if origin is Literal:
        return functools.partial(_check_literal, typing.get_args(hint))
    return functools.partial(_check_type, hint)


@functools.lru_cache(maxsize=None)
def _schema(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """(name, type hint, required) per field of a message dataclass, computed once."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name],
                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(cls))


@functools.lru_cache(maxsize=None)
def _fields(cls: type) -> tuple[tuple[tuple[str, Any, Callable], ...], frozenset[str]]:
    """``((name, exact_type, check), ...)`` and the required names of ``cls``; ``exact_type``
    is the hint when a value of exactly that type needs no further checking, else None."""
    fields = tuple((name, hint if hint in _SCALARS else None, _checker(hint))
                   for name, hint, _ in _schema(cls))
    return fields, frozenset(name for name, _, required in _schema(cls) if required)


def _build(cls: type, data: Any, path: str) -> Any:
    """Build dataclass ``cls`` from a mapping, rejecting missing/extra/mistyped fields."""
    if not isinstance(data, (dict, Mapping)):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{path}: expected a map")
    fields, required = _fields(cls)
    if len(data) > len(fields) or not data.keys() >= required:
        _reject_fields(cls, data, path)
    values = {}
    for name, exact, check in fields:
        if name in data:
            value = data[name]
            values[name] = value if type(value) is exact else check(value, f"{path}.{name}")
    if len(values) != len(data):
        extra = sorted(map(str, set(data) - set(values)))
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{path}: unexpected field(s) {extra}")
    return cls(**values)


def _reject_fields(cls: type, data: Mapping, path: str) -> None:
    """Raise for the unexpected (first) or missing fields of ``data``."""
    schema = _schema(cls)
    extra = sorted(map(str, set(data) - {name for name, _, _ in schema}))
    if extra:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{path}: unexpected field(s) {extra}")
    missing = next(k for k, _, req in schema if req and k not in data)
    raise ProtocolError(ErrorCode.BAD_FIELD, f"{path}: missing field '{missing}'")


@functools.lru_cache(maxsize=None)
def _field_names(cls: type) -> tuple[str, ...] | None:
    """The field names of a dataclass type, or None for any other type."""
    return tuple(name for name, _, _ in _schema(cls)) if dataclasses.is_dataclass(cls) else None


def to_body(obj: Any) -> Any:
    """A message as plain msgpack-able data (a cheap, shallow ``dataclasses.asdict``)."""
    cls = type(obj)
    if cls in _SCALARS:
        return obj
    if cls is list:
        return [to_body(v) for v in obj]
    names = _field_names(cls)
    if names is not None:
        body = {}
        for name in names:
            value = getattr(obj, name)
            body[name] = value if type(value) in _SCALARS else to_body(value)
        return body
    return [to_body(v) for v in obj] if isinstance(obj, list) else obj


def caps_from_body(body: Mapping[str, Any]) -> ServerCaps:
    return _build(ServerCaps, body, "caps")


# ------------------------------------------------------------------- tensors
def tensor_frame(t: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU tensor's bytes (pinned memory included)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("only contiguous CPU tensors can be framed")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


def _specs_and_frames(tensors: Mapping[str, torch.Tensor]) -> tuple[list, list]:
    specs, frames = [], []
    for name, t in tensors.items():
        t = t if t.is_contiguous() else t.contiguous()
        specs.append(TensorSpec(name, dtype_name(t.dtype), tuple(t.shape),
                                t.numel() * t.element_size()).as_list())
        frames.append(tensor_frame(t))
    return specs, frames


def _parse_specs(raw: Any, max_bytes: int) -> list[TensorSpec]:
    if not isinstance(raw, list):
        raise ProtocolError(ErrorCode.BAD_FIELD, "tensors: expected a list")
    specs, total, names = [], 0, set()
    for i, item in enumerate(raw):
        if not (isinstance(item, list) and len(item) == 4):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"tensors[{i}]: expected [name, dtype, shape, nbytes]")
        name, dtype, shape, nbytes = item
        if not isinstance(name, str) or name in names:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"tensors[{i}]: bad or duplicate name {name!r}")
        if dtype not in DTYPES:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"tensors[{i}] ({name}): dtype {dtype!r} not in {list(DTYPES)}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"tensors[{i}] ({name}): bad shape {shape!r}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"tensors[{i}] ({name}): bad nbytes {nbytes!r}")
        expected = math.prod(shape) * DTYPES[dtype].itemsize
        if nbytes != expected:
            raise ProtocolError(ErrorCode.FRAME_MISMATCH,
                                f"tensor {name}: nbytes {nbytes} != shape {shape} x {dtype} = {expected}")
        total += nbytes
        if total > max_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"tensors declare more than {max_bytes} bytes")
        names.add(name)
        specs.append(TensorSpec(name, dtype, tuple(shape), nbytes))
    return specs


def _frame_buffer(frame: Any) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def _decode_tensors(specs: Sequence[TensorSpec], frames: Sequence[Any]) -> dict[str, torch.Tensor]:
    if len(frames) != len(specs):
        raise ProtocolError(ErrorCode.FRAME_MISMATCH,
                            f"header lists {len(specs)} tensor(s) but {len(frames)} frame(s) follow")
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers: we never write to them
        for spec, frame in zip(specs, frames):
            buf = _frame_buffer(frame)
            if buf.nbytes != spec.nbytes:
                raise ProtocolError(ErrorCode.FRAME_MISMATCH, f"tensor {spec.name}: frame has "
                                                              f"{buf.nbytes} bytes, header says {spec.nbytes}")
            if spec.nbytes == 0:
                out[spec.name] = torch.empty(spec.shape, dtype=DTYPES[spec.dtype])
                continue
            flat = torch.frombuffer(buf, dtype=torch.uint8)
            out[spec.name] = flat.view(DTYPES[spec.dtype]).reshape(spec.shape)
    return out


# ------------------------------------------------------------------ encoding
def _header(op: str, seq: int, body: Mapping[str, Any], specs: list) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": op, "seq": seq, "body": body,
                          "tensors": specs}, use_bin_type=True)


def encode_request(seq: int, msg: Message, tensors: Mapping[str, torch.Tensor] | None = None) -> list:
    """Frames for a request; tensor frames are zero-copy views (keep tensors alive until sent)."""
    specs, frames = _specs_and_frames(tensors or {})
    return [_header(_OP_NAMES[type(msg)], seq, to_body(msg), specs), *frames]


def encode_reply(reply: Reply) -> list:
    specs, frames = _specs_and_frames(reply.tensors)
    body = {"ok": reply.ok, "server_id": reply.server_id, "error": reply.error, **reply.body}
    return [_header("reply", reply.seq, body, specs), *frames]


def error_reply(seq: int, server_id: str, code: ErrorCode | str, message: str) -> Reply:
    return Reply(seq=seq, ok=False, server_id=server_id,
                 error={"code": ErrorCode(code).value, "message": message})


def _unpack_header(frames: Sequence[Any], max_bytes: int) -> tuple[dict, list[TensorSpec], int]:
    if not frames:
        raise ProtocolError(ErrorCode.BAD_FRAME, "empty message")
    raw = bytes(_frame_buffer(frames[0]))
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame 0 is not msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame 0 is not a msgpack map")
    seq = header.get("seq", -1)
    seq = seq if isinstance(seq, int) and not isinstance(seq, bool) else -1
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION,
                            f"protocol version {header.get('v')!r}, this side speaks {PROTOCOL_VERSION}", seq)
    expected = {"v", "op", "seq", "body", "tensors"}
    if set(header) != expected:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"header fields {sorted(map(str, header))}, "
                                                 f"expected {sorted(expected)}", seq)
    try:
        specs = _parse_specs(header["tensors"], max_bytes)
    except ProtocolError as exc:
        exc.seq = seq
        raise
    return header, specs, seq


def decode_request(frames: Sequence[Any], max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Request:
    """Parse and validate a request; raises :class:`ProtocolError` (with the seq when known)."""
    header, specs, seq = _unpack_header(frames, max_bytes)
    try:
        if seq < 0:
            raise ProtocolError(ErrorCode.BAD_FIELD, "seq must be an integer >= 0")
        cls = OPS.get(header["op"]) if isinstance(header["op"], str) else None
        if cls is None:
            raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {header['op']!r}; known: {list(OPS)}")
        msg = _build(cls, header["body"], header["op"])
        return Request(seq=seq, msg=msg, tensors=_decode_tensors(specs, frames[1:]))
    except ProtocolError as exc:
        exc.seq = seq
        raise


def decode_reply(frames: Sequence[Any], max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Reply:
    header, specs, seq = _unpack_header(frames, max_bytes)
    if header["op"] != "reply" or not isinstance(header["body"], dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "not a reply", seq)
    body = dict(header["body"])
    ok, server_id, error = body.pop("ok", False), body.pop("server_id", ""), body.pop("error", None)
    return Reply(seq=seq, ok=bool(ok), server_id=str(server_id), body=body,
                 tensors=_decode_tensors(specs, frames[1:]), error=error)
