"""The wire's ground floor: versions, typed errors, the dtypes that travel, frames as
zero-copy tensors and arrays (see :mod:`k3_accel.protocol`)."""
from __future__ import annotations

import math
import warnings
from enum import Enum
from typing import Any, Sequence

import msgpack
import msgspec
import numpy as np
import torch

PROTOCOL_VERSION = 2
SUPPORTED_VERSIONS = (2,)
DEFAULT_MAX_MESSAGE_BYTES = 2 << 30  # 2 GiB


class ErrorCode(str, Enum):
    BAD_FRAME = "BAD_FRAME"                  # frame 0 is not a message
    BAD_VERSION = "BAD_VERSION"
    UNKNOWN_OP = "UNKNOWN_OP"
    BAD_FIELD = "BAD_FIELD"                  # missing / extra / mistyped field
    FRAME_MISMATCH = "FRAME_MISMATCH"        # frame count or byte length vs header
    TOO_LARGE = "TOO_LARGE"
    NON_FINITE = "NON_FINITE"                # NaN / Inf in hidden rows
    BAD_REQUEST = "BAD_REQUEST"              # well-formed but inconsistent
    CONTEXT_GAP = "CONTEXT_GAP"              # rows start past the stored context
    UNKNOWN_REQUEST = "UNKNOWN_REQUEST"
    PREFIX_MISMATCH = "PREFIX_MISMATCH"
    CAPACITY = "CAPACITY"                    # the pool cannot hold the rows
    TOO_MANY_REQUESTS = "TOO_MANY_REQUESTS"
    K_TOO_LARGE = "K_TOO_LARGE"
    UNSUPPORTED = "UNSUPPORTED"
    NO_SESSION = "NO_SESSION"                # no hello on this connection yet
    NOT_OWNER = "NOT_OWNER"                  # the session belongs to another client key
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
HIDDEN_DTYPES = ("bfloat16", "float16", "float32")


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"dtype {dtype} cannot travel") from None


# Frames are read-only and never written to: torch's warning about that would cost a
# ``catch_warnings`` per frame on the hot path (that is slower than the frame itself).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
_encoder = msgspec.msgpack.Encoder()


# ------------------------------------------------------------------ frames
def tensor_frame(t: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU tensor's bytes (pinned memory included)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("only contiguous CPU tensors can be framed")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


def frame_bytes(frame: Any) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def _checked(frame: Any, itemsize: int, shape: Sequence[int], what: str) -> tuple[memoryview, int]:
    """The frame's bytes and their count, FRAME_MISMATCH unless the header's shape accounts for them."""
    buf = frame_bytes(frame)
    if any(d < 0 for d in shape):                 # [-2, -4] has the bytes of [2, 4]
        raise ProtocolError(ErrorCode.FRAME_MISMATCH, f"{what}: the header's shape {list(shape)} has a negative size")
    nbytes = math.prod(shape) * itemsize
    if buf.nbytes != nbytes:
        raise ProtocolError(ErrorCode.FRAME_MISMATCH,
                            f"{what}: frame has {buf.nbytes} bytes, header implies {nbytes}")
    return buf, nbytes


def frame_tensor(frame: Any, dtype: torch.dtype, shape: Sequence[int], what: str) -> torch.Tensor:
    """A (read-only, zero-copy) tensor over a frame; FRAME_MISMATCH if the size is wrong."""
    buf, nbytes = _checked(frame, dtype.itemsize, shape, what)
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(tuple(shape))


def frame_array(frame: Any, dtype: np.dtype, shape: Sequence[int], what: str) -> np.ndarray:
    buf, _ = _checked(frame, np.dtype(dtype).itemsize, shape, what)
    return np.frombuffer(buf, dtype=dtype).reshape(tuple(shape))


def _peek_version(raw: bytes) -> tuple[Any, int]:
    """(version, seq) of a frame 0 that did not decode as v2, for a useful error."""
    try:
        head = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001 - any garbage
        return None, -1
    if isinstance(head, dict):
        seq = head.get("seq", -1)
        return head.get("v"), seq if isinstance(seq, int) and not isinstance(seq, bool) else -1
    if isinstance(head, list) and len(head) >= 2:
        seq = head[1] if isinstance(head[1], int) and not isinstance(head[1], bool) else -1
        return head[0], seq
    return None, -1


def _version_message(version: Any) -> str:
    return (f"protocol version {version!r}; this server speaks "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))} (upgrade the client: pip install -U k3-accel)")

__all__ = ['PROTOCOL_VERSION', 'SUPPORTED_VERSIONS', 'DEFAULT_MAX_MESSAGE_BYTES', 'ErrorCode',
           'ProtocolError', 'DTYPES', 'HIDDEN_DTYPES', 'dtype_name', 'tensor_frame', 'frame_bytes',
           'frame_tensor', 'frame_array']
