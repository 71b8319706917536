"""The request messages (tagged, array-encoded msgspec structs), what a server offers at
hello (:class:`Caps`), and requests encoded, decoded and checked: the one validator of what
a server accepts (see :mod:`k3_accel.protocol` for the wire)."""
from __future__ import annotations

import re
from typing import Any, Optional, Sequence, Union

import msgpack
import msgspec
import numpy as np
import torch

from k3_accel.protocol.base import (DEFAULT_MAX_MESSAGE_BYTES, DTYPES, HIDDEN_DTYPES, PROTOCOL_VERSION,
                                    ErrorCode, ProtocolError, _encoder, _peek_version, _version_message,
                                    frame_array, frame_bytes, frame_tensor)

# ------------------------------------------------------------------- messages
class _Msg(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Trailing fields at their defaults are left off the wire (:func:`encode_request`), so a
    peer that predates a new optional field (``slot``) decodes every message that does not use it."""


SESSION_KEY_CHARS = (16, 128)   # a session key's length: a secret that cannot be guessed


class Hello(_Msg, tag="hello"):
    session: str                 # the namespace key: secret, stable across this client's reconnects
    client: str = ""             # a label for logs and metrics


class Ingest(_Msg, tag="ingest"):
    n: int                       # requests (rows of meta)
    rows: int                    # context rows in all
    hidden: str = ""             # dtype of the hidden frame, "" = none
    width: int = 0
    slot: int = -1               # >= 0: the hidden rows are in this device slot (no hidden frame)


class Propose(_Msg, tag="propose"):
    k: int
    n: int
    rows: int
    hidden: str = ""
    width: int = 0
    logits: str = "none"         # none | full | topk
    topk: int = 0
    slot: int = -1               # as Ingest.slot
    sampling: bool = False       # + temperature and seeds frames (a server with Caps.sampling)


class Free(_Msg, tag="free"):
    handles: list[int]
    retain: bool = True          # keep the context as a reconnect source


class Clear(_Msg, tag="clear"):
    pass


class Reconnect(_Msg, tag="reconnect"):
    """Give ``handle`` the context whose tokens are the ``tokens`` frame, reusing the
    longest matching context the namespace holds (the request's own retained one
    included); the rest is rebuilt from the tokens when the engine needs no hidden rows."""
    handle: int
    length: int


class IpcTensor(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One CUDA tensor shared through CUDA IPC: the fields of torch's ``reduce_tensor`` that
    ``rebuild_cuda_tensor`` needs (the storage's IPC handle, its producer's ref counter and event)."""
    shape: list[int]
    stride: list[int]
    offset: int                  # storage offset, in elements
    dtype: str
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter: bytes
    ref_offset: int
    event: bytes
    event_sync: bool


class Attach(_Msg, tag="attach"):
    """Offer the target's device ring (``depth`` slots of ``[capacity, width]`` hidden rows of
    ``dtype`` on CUDA device ``device``, a UUID, on host ``host``) and an interprocess event per
    slot that completes when the slot is written. The reply's ``released`` are the server's
    event handles, one per slot, recorded when it has read it; an error reply refuses the plane."""
    host: str
    device: str
    dtype: str
    width: int
    capacity: int
    slots: list[IpcTensor]
    ready: list[bytes]


class Ping(_Msg, tag="ping"):
    pass


class Bye(_Msg, tag="bye"):
    """Free everything of this session and end it."""


class Stats(_Msg, tag="stats"):
    pass


Message = Union[Hello, Ingest, Propose, Free, Clear, Reconnect, Attach, Ping, Bye, Stats]
OPS = {cls.__struct_config__.tag: cls for cls in Message.__args__}
ROW_OPS = (Ingest, Propose)
META_COLUMNS = {Ingest: 3, Propose: 4}


class _Envelope(msgspec.Struct, array_like=True):
    v: int
    seq: int
    msg: Message


class DeviceOffer(msgspec.Struct, frozen=True, kw_only=True):
    """A server's device plane (hello): where it runs and whether it takes a target's ring."""
    accepts: bool = False        # it will try to open a ring (``attach``)
    host: str = ""               # host identity (boot id and host name, hashed)
    devices: list[str] = []      # UUIDs of the CUDA devices it can open memory of
    why: str = ""                # why it does not accept, when it does not


class Caps(msgspec.Struct, frozen=True, kw_only=True):
    """What a server offers (the ``hello`` result). New fields get defaults."""
    engine: str
    needs_hidden_states: bool
    context_width: int
    hidden_dtypes: list[str]
    supports_logits: bool
    supports_topk: bool
    max_spec_tokens: int
    block_size: int
    vocab_size: int
    hidden_size: int = 0
    aux_layer_ids: list[int] = []
    mask_token_id: int = -1
    max_requests: int = 0                # active requests per session
    max_requests_total: int = 0          # active requests over all sessions
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    pool_blocks: int = 0
    pool_bytes: int = 0
    lease_s: float = 0.0                 # idle time after which a session is reclaimed (0 = never)
    fair_share: bool = False             # the pool, requests and retained contexts are shared fairly
    share_weight: int = 0                # this session's weight in that division (fair_share only)
    share_blocks: int = 0                # pool blocks this session was guaranteed at hello
    share_requests: int = 0              # active requests it was guaranteed at hello
    draft: dict[str, Any] = {}           # the draft's facts a target's draft config must match (DSpark; n-gram sizes)
    confidence: bool = False             # propose replies carry ``confidence`` [n, k] float32
    sampling: bool = False               # proposes may carry temperatures and seeds (sampled drafts)
    device_plane: DeviceOffer = msgspec.field(default_factory=DeviceOffer)
    protocol: int = PROTOCOL_VERSION


_request_decoder = msgspec.msgpack.Decoder(_Envelope)


# ---------------------------------------------------------------- requests
class Request(msgspec.Struct):
    """A decoded request. For row ops: ``meta`` ``[n, 3|4]`` int64, ``tokens`` ``[rows]``
    int64 (numpy, read-only), ``hidden`` ``[rows, width]`` tensor or None."""
    seq: int
    msg: Any
    meta: Optional[np.ndarray] = None
    tokens: Optional[np.ndarray] = None
    hidden: Optional[torch.Tensor] = None
    temperature: Optional[np.ndarray] = None   # [n] float32, finite, >= 0 (propose with sampling)
    seeds: Optional[np.ndarray] = None         # [n] int64
    fetch: Any = None            # server side: the device-plane read of its rows (server/device_plane.py)

    @property
    def op(self) -> str:
        return self.msg.__struct_config__.tag


def encode_request(seq: int, msg: Message, *frames: Any) -> list:
    """Frames of a request: the header, then the op's frames (memoryviews or bytes, sent as given)."""
    return [_encoder.encode((PROTOCOL_VERSION, seq, _trimmed(msg))), *frames]


_DEFAULTS: dict[type, tuple[int, tuple]] = {}


def _trimmed(msg: Message) -> Any:
    """``msg`` as its wire array without the trailing fields that hold their defaults (msgspec
    writes every field of an array-like struct, and a peer that predates a field refuses it)."""
    cls = type(msg)
    spec = _DEFAULTS.get(cls)
    if spec is None:
        spec = _DEFAULTS[cls] = (len(cls.__struct_fields__) - len(cls.__struct_defaults__), cls.__struct_defaults__)
    first, defaults = spec
    if not defaults:
        return msg
    values = msgspec.structs.astuple(msg)
    end = len(values)
    while end > first and values[end - 1] == defaults[end - 1 - first]:
        end -= 1
    return msg if end == len(values) else (cls.__struct_config__.tag, *values[:end])


def decode_request(frames: Sequence[Any], max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Request:
    """Parse and check a request; raises :class:`ProtocolError` (with the seq when known)."""
    if not frames:
        raise ProtocolError(ErrorCode.BAD_FRAME, "empty message")
    raw = frame_bytes(frames[0])
    try:
        env = _request_decoder.decode(raw)
    except msgspec.DecodeError as exc:
        version, seq = _peek_version(bytes(raw))
        if version is not None and version != PROTOCOL_VERSION:
            raise ProtocolError(ErrorCode.BAD_VERSION, _version_message(version), seq) from None
        text = str(exc)
        if isinstance(exc, msgspec.ValidationError) and " - at `$" in text:
            code = ErrorCode.UNKNOWN_OP if text.startswith("Invalid value") and "`$[2][0]`" in text \
                else ErrorCode.BAD_FIELD
            raise ProtocolError(code, f"header: {text}{_field_name(text, bytes(raw))}", seq) from None
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame 0 is not a v{PROTOCOL_VERSION} header", seq) from None
    if env.v != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION, _version_message(env.v), env.seq)
    try:
        if env.seq < 0:
            raise ProtocolError(ErrorCode.BAD_FIELD, "seq must be >= 0")
        total = sum(frame_bytes(f).nbytes for f in frames)
        if total > max_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"the message has {total} bytes, the limit is {max_bytes}")
        return _attach_frames(Request(env.seq, env.msg), frames[1:], max_bytes)
    except ProtocolError as exc:
        exc.seq = env.seq
        raise


def _field_name(text: str, raw: bytes) -> str:
    """" (op.field)" for a validation error at ``$[2][i]`` of a header, else ""."""
    match = re.search(r"`\$\[2\]\[(\d+)\]`", text)
    try:
        tag = msgpack.unpackb(raw, raw=False, strict_map_key=False)[2][0]
        fields = OPS[tag].__struct_fields__
        return f" ({tag}.{fields[int(match.group(1)) - 1]})" if match and int(match.group(1)) > 0 else ""
    except Exception:  # noqa: BLE001 - no name to add
        return ""


def sampling(msg: Any) -> bool:
    """A propose that carries temperatures and seeds."""
    return isinstance(msg, Propose) and msg.sampling


def _attach_frames(req: Request, frames: Sequence[Any], max_bytes: int) -> Request:
    msg = req.msg
    if isinstance(msg, ROW_OPS):
        device = msg.slot >= 0
        cols = META_COLUMNS[type(msg)] + device          # + the slot row of each request
        if msg.n < 0 or msg.rows < 0 or msg.width < 0 or msg.slot < -1:
            raise ProtocolError(ErrorCode.BAD_FIELD, "n, rows and width must be >= 0, slot >= -1")
        if device and not msg.hidden:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{req.op}.slot: a device slot needs the hidden dtype")
        want = (3 if msg.hidden and not device else 2) + 2 * sampling(msg)
        if len(frames) != want:
            raise ProtocolError(ErrorCode.FRAME_MISMATCH, f"{req.op} needs {want} frames, got {len(frames)}")
        if msg.hidden and msg.hidden not in HIDDEN_DTYPES:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"hidden={msg.hidden!r}: allowed {list(HIDDEN_DTYPES)}")
        if msg.hidden and not device and msg.rows * msg.width * DTYPES[msg.hidden].itemsize > max_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"hidden rows declare more than {max_bytes} bytes")
        req.meta = frame_array(frames[0], np.int64, (msg.n, cols), "meta")
        req.tokens = frame_array(frames[1], np.int64, (msg.rows,), "tokens")
        if msg.hidden and not device:
            req.hidden = frame_tensor(frames[2], DTYPES[msg.hidden], (msg.rows, msg.width), "hidden")
        if sampling(msg):
            req.temperature = frame_array(frames[-2], np.float32, (msg.n,), "temperature")
            req.seeds = frame_array(frames[-1], np.int64, (msg.n,), "seeds")
            if not (np.isfinite(req.temperature) & (req.temperature >= 0)).all():
                raise ProtocolError(ErrorCode.BAD_FIELD, "temperature: every value must be finite and >= 0")
    elif isinstance(msg, Attach):
        if frames:
            raise ProtocolError(ErrorCode.FRAME_MISMATCH, f"attach takes no frames, got {len(frames)}")
        if msg.dtype not in HIDDEN_DTYPES or msg.width < 1 or msg.capacity < 1 or not msg.slots \
                or len(msg.slots) != len(msg.ready) or any(
                    t.shape != [msg.capacity, msg.width] or t.dtype != msg.dtype for t in msg.slots):
            raise ProtocolError(ErrorCode.BAD_FIELD, "attach: a hidden dtype, width and capacity >= 1, "
                                                     "slots of [capacity, width] of that dtype, one ready "
                                                     "event per slot")
    elif isinstance(msg, Reconnect):
        if len(frames) != 1 or msg.length < 0:
            raise ProtocolError(ErrorCode.FRAME_MISMATCH, "reconnect needs one tokens frame of length >= 0")
        req.tokens = frame_array(frames[0], np.int64, (msg.length,), "tokens")
    elif frames:
        raise ProtocolError(ErrorCode.FRAME_MISMATCH, f"{req.op} takes no frames, got {len(frames)}")
    return req

__all__ = ['SESSION_KEY_CHARS', 'Hello', 'Ingest', 'Propose', 'Free', 'Clear', 'Reconnect', 'IpcTensor',
           'Attach', 'Ping', 'Bye', 'Stats', 'Message', 'OPS', 'ROW_OPS', 'META_COLUMNS', 'DeviceOffer',
           'Caps', 'Request', 'encode_request', 'decode_request', 'sampling']
