"""The device data plane, server side: open a target's device ring, read its rows GPU to GPU.

hello advertises :attr:`ServerDevicePlane.offer` (this host's identity, the UUIDs of the
CUDA devices this process sees, whether it accepts a ring). ``attach`` opens the ring's
slots and ready events through CUDA IPC and answers with one *released* event per slot,
made here; any failure refuses the plane with ``UNSUPPORTED`` and the reason, and the
target stays on the host path. A session holds at most one ring, bound to the connection
that attached it (a message of an older connection of the session cannot read it).

A row message naming a slot is *fetched* before it is handled: on a stream of the slot's
device this server waits for the target's ready event (``stream.wait_event``: a device
wait, the loop goes on), copies the message's rows into a buffer of its own (same device,
or peer), records the slot's *released* event right after that copy, and copies each row's
largest magnitude bits to the host (which rows are not finite follows there); the slot's
*done* event says when all of it is done (one event a slot: a slot is read by one message at
a time, and a read recorded later on the same stream can only make an earlier one look late).
The loop polls that event and handles the message only then, so no server stream that other
sessions use ever waits on a target's event, and a target that dies mid-step stalls only its
own read.

Imports end with the session (bye, lease expiry, a new attach): the mapped slots and events
are dropped, except while a read of them is still in flight (kept until it completes).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from k3_accel import ipc
from k3_accel import protocol as p
from k3_accel.protocol import ErrorCode, ProtocolError
from k3_accel.on_device import OnDevice
from k3_accel.server.rows import nonfinite_top_bits, top_bits, word_dtype

log = logging.getLogger("k3_accel.server")

MODES = ("auto", "off", "always")


@dataclass(eq=False)
class Fetch:
    """One message's rows on their way from a target's slot into this server's buffer."""
    hidden: torch.Tensor                  # [rows, width] on the server's device
    bits: torch.Tensor                    # [rows], pinned host: each row's largest magnitude bits
    done: Any                             # CUDA event: the copy and the bits are complete
    ring: "Imported"

    def ready(self) -> bool:
        return self.done.query()

    @property
    def nonfinite(self) -> np.ndarray:
        """Which rows hold NaN or Inf (read once :meth:`ready`)."""
        return nonfinite_top_bits(self.bits.numpy(), self.hidden.dtype)


@dataclass(eq=False)
class Imported:
    """A session's mapped ring."""
    conn: bytes
    device: torch.device                  # where the slots live (this process's index)
    slots: list[torch.Tensor]
    ready: list[Any]
    released: list[Any]
    stream: Any                           # reads wait and copy here
    width: int
    dtype: str
    pending: list[Fetch] = field(default_factory=list)
    peer_stream: Any = None               # on the server's device, when the slots are on another
    bits: list[torch.Tensor] = field(init=False)    # per slot, pinned host: its read's rows' top bits
    done: list[Any] = field(init=False)             # per slot: its read is complete

    def __post_init__(self) -> None:
        words = word_dtype(p.DTYPES[self.dtype])
        self.bits = [torch.empty(int(t.shape[0]), dtype=words, pin_memory=True) for t in self.slots]
        self.done = [torch.cuda.Event() for _ in self.slots]

    @property
    def capacity(self) -> int:
        return int(self.slots[0].shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.slots)


@contextlib.contextmanager
def _both(stream: Any, out_stream: Any):
    """A peer read's streams current: the slots' device's, then the server's device's."""
    with torch.cuda.stream(stream), torch.cuda.stream(out_stream):
        yield


def _copy_rows(hidden: torch.Tensor, src: torch.Tensor, first: np.ndarray, counts: np.ndarray, rows: int) -> None:
    """The message's rows of slot ``src`` into ``hidden``, in message order (current stream)."""
    if len(first) == 1 or bool((first[1:] == first[:-1] + counts[:-1]).all()):      # one run
        hidden.copy_(src[int(first[0]):int(first[0]) + rows], non_blocking=True)
        return
    index = np.repeat(first - (np.cumsum(counts) - counts), counts) + np.arange(rows)
    hidden.copy_(src.index_select(0, torch.from_numpy(index).to(src.device, non_blocking=True)), non_blocking=True)


def _check_rows(hidden: torch.Tensor, bits: torch.Tensor) -> None:
    """Each row's largest magnitude bits, into pinned ``bits`` (current stream)."""
    bits.copy_(top_bits(hidden), non_blocking=True)


class ServerDevicePlane:
    """Every session's imported ring, and the offer hello makes."""

    def __init__(self, mode: str = "auto", device: torch.device | str | None = None, needs_hidden: bool = True,
                 home_stream: Any = None):
        if mode not in MODES:
            raise ValueError(f"device plane mode {mode!r}: allowed {list(MODES)}")
        self.mode = mode
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "cuda" and self.device.index is None \
                and ipc.cuda_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.home_stream = home_stream          # the engine's stream, which reads the buffers fetched here
        self.imports: dict[str, Imported] = {}
        self.parked: list[Fetch] = []
        self.counts = {"attached": 0, "refused": 0, "fetches": 0, "dropped": 0}
        why = ("device_plane=off" if mode == "off" else
               "the engine takes no hidden rows" if not needs_hidden else
               "the engine does not run on CUDA" if mode == "auto" and (self.device is None or
                                                                        self.device.type != "cuda") else "")
        devices = list(ipc.visible_devices()) if not why and ipc.cuda_available() else []
        self.offer = p.DeviceOffer(accepts=not why, host=ipc.host_identity(), devices=devices, why=why)

    @classmethod
    def for_engine(cls, engine: Any, mode: str = "auto") -> "ServerDevicePlane":
        device = getattr(engine, "device", None)
        return cls(mode, device, engine.caps.needs_hidden_states, getattr(engine, "stream", None))

    # ---------------------------------------------------------------- attach
    def attach(self, session_key: str, conn: bytes, msg: p.Attach) -> dict:
        """Open the ring of ``msg``; the result names this server's released events.
        Raises ProtocolError(UNSUPPORTED) with the reason when it cannot."""
        try:
            imported = self._open(conn, msg)
        except (ipc.IpcError, ProtocolError) as exc:
            self.counts["refused"] += 1
            why = exc.message if isinstance(exc, ProtocolError) else str(exc)
            log.info("device ring refused: %s", why)
            raise ProtocolError(ErrorCode.UNSUPPORTED, f"device plane: {why}") from None
        self.drop(session_key)
        self.imports[session_key] = imported
        self.counts["attached"] += 1
        return {"released": [ipc.event_handle(e) for e in imported.released], "device": str(imported.device)}

    def _open(self, conn: bytes, msg: p.Attach) -> Imported:
        if not self.offer.accepts:
            raise ipc.IpcError(self.offer.why)
        if msg.host != ipc.host_identity():
            raise ipc.IpcError("the target runs on another host")
        index = ipc.visible_devices().get(msg.device)
        if index is None:
            raise ipc.IpcError(f"CUDA device {msg.device} is not visible to this server")
        slots = [ipc.open_tensor(spec, index) for spec in msg.slots]
        ready = [ipc.open_event(h, index) for h in msg.ready]
        device = torch.device("cuda", index)
        released = [ipc.new_event(device) for _ in slots]
        return Imported(conn, device, slots, ready, released, torch.cuda.Stream(device), msg.width, msg.dtype)

    # ----------------------------------------------------------------- fetch
    def fetch(self, session_key: str, conn: bytes, req: p.Request) -> bool:
        """Start or poll the read of a row message's device rows; True once ``req.hidden`` holds
        them (at once for a message without a slot). ProtocolError refuses the message."""
        msg = req.msg
        if req.fetch is None:
            if not isinstance(msg, p.ROW_OPS) or msg.slot < 0:
                return True
            req.fetch = self._start(self.imports.get(session_key), conn, req)
            req.meta = req.meta[:, :-1]               # the slot-row column: read, not stored
        if not req.fetch.ready():
            return False
        req.hidden = req.fetch.hidden
        return True

    def _start(self, imp: Imported | None, conn: bytes, req: p.Request) -> Fetch:
        msg, meta = req.msg, req.meta
        if imp is None or imp.conn != conn:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "no device ring is attached on this connection")
        if msg.slot >= len(imp.slots) or msg.width != imp.width or msg.hidden != imp.dtype:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"slot {msg.slot} / {msg.hidden} x {msg.width}: the "
                                                     f"attached ring has {len(imp.slots)} slots of {imp.dtype} x "
                                                     f"{imp.width}")
        first, counts = meta[:, -1], meta[:, 2]
        if len(meta) and (int(first.min()) < 0 or int(counts.min()) < 0
                          or int((first + counts).max()) > imp.capacity):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"slot rows outside the slot's {imp.capacity} rows")
        if int(counts.sum()) != msg.rows:
            raise ProtocolError(ErrorCode.FRAME_MISMATCH, f"counts add up to {int(counts.sum())}, rows={msg.rows}")
        self.counts["fetches"] += 1
        fetch = self._read(imp, msg.slot, first, counts, msg.rows)
        imp.pending = [f for f in imp.pending if not f.ready()]
        imp.pending.append(fetch)
        return fetch

    def _read(self, imp: Imported, slot: int, first: np.ndarray, counts: np.ndarray, rows: int) -> Fetch:
        dest = self.device if self.device is not None and self.device.type == "cuda" else imp.device
        stream = imp.stream
        home = self.home_stream if self.home_stream is not None else torch.cuda.current_stream(dest)
        bits = imp.bits[slot][:rows]              # this slot's message is the only one read into it
        if dest.index == imp.device.index:            # one stream: wait, copy, release, check
            out_stream = stream
            current = OnDevice(dest.index, stream)
        else:                                         # peer: the copy runs on the slots' device's stream
            imp.peer_stream = imp.peer_stream or torch.cuda.Stream(dest)
            out_stream = imp.peer_stream
            current = _both(stream, out_stream)
        # The buffer is allocated on the stream that writes it, and marked as used by the engine's
        # stream, which reads it later: freed, it is reused only after the engine's work queued by
        # then. (Allocated on the engine's stream, it could be memory the engine freed a moment ago
        # and still reads in work queued behind a busy stream, which this copy, not ordered after
        # that work, would overwrite: most likely the illegal address P6 met on an H100.)
        with current:
            hidden = torch.empty((rows, imp.width), dtype=p.DTYPES[imp.dtype], device=dest)
            stream.wait_event(imp.ready[slot])       # on the device: the target wrote the slot
            if rows:
                _copy_rows(hidden, imp.slots[slot], first, counts, rows)
            imp.released[slot].record(stream)         # the slot may be written again
            if rows:
                _check_rows(hidden, bits)
            done = imp.done[slot]
            done.record(out_stream)
        hidden.record_stream(home)
        return Fetch(hidden, bits, done, imp)

    # ------------------------------------------------------------- lifetime
    def drop(self, session_key: str) -> None:
        """Forget a session's ring; reads still in flight keep it mapped until they complete."""
        imp = self.imports.pop(session_key, None)
        if imp is None:
            return
        self.counts["dropped"] += 1
        self.parked.extend(f for f in imp.pending if not f.ready())
        imp.pending.clear()

    def collect(self) -> None:
        """Let go of parked reads that completed (housekeeping)."""
        if self.parked:
            self.parked = [f for f in self.parked if not f.ready()]

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "accepts": self.offer.accepts, "why": self.offer.why,
                "sessions": len(self.imports), "imported_bytes": sum(i.nbytes for i in self.imports.values()),
                "parked_reads": len(self.parked)}


__all__ = ["Fetch", "Imported", "MODES", "ServerDevicePlane"]
