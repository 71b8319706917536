"""The device data plane, target side: hidden rows GPU to GPU on one host, control on the socket.

When the target runs on CUDA and the server says at hello that it runs on the same host
and accepts a ring (``Caps.device_plane``), the client offers its :class:`DeviceRing`
(``attach``): ``depth`` slots of ``[capacity, width]`` hidden rows on the target's device,
shared through CUDA IPC, and an interprocess *ready* event per slot. The server proves it
can open them by answering with its own *released* events; otherwise, or when anything
about it fails, every step takes the host path (pinned staging, hidden frames on the
socket), chosen here, logged once per reason and reported in ``stats()["device_plane"]``.

Per step on the device path the rows go into a slot on the target's compute stream and the
slot's *ready* event is recorded; the messages carry only control (slot, per-request slot
rows, counts, anchors, tokens). A slot is held (host side) by every message that names it
until that message's reply, and the server answers only once its read of the slot has
completed (its *released* event with it), so a slot that no message names is free to write.
The target's streams never wait on a server's event: a server whose CUDA context died
leaves its events pending for ever, and a stream waiting on one would stall the target's
GPU. A slot whose hold went without a reply (the link failed) and whose *released* event
has not completed is not written: :meth:`DeviceRing.take` skips it, :meth:`DeviceRing.acquire`
waits for it until its deadline. A slot the V2 launch already compacted its rows into
(:meth:`DeviceRing.slot_of`) is named as it is, without a copy.

Losing the link detaches the plane (the server's events are not looked at again); the next
hello decides the path again.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from k3_accel import ipc
from k3_accel import protocol as p
from k3_accel.transport.failures import RingTimeout

log = logging.getLogger("k3_accel.transport")

MODES = ("auto", "off")


class DeviceRing:
    """``depth`` device slots of ``capacity`` hidden rows, each with its ready event (ours)
    and, once a server took the ring, its released event (the server's)."""

    def __init__(self, depth: int, capacity: int, width: int, dtype: torch.dtype, device: torch.device | str):
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ipc.IpcError(f"a device ring needs a CUDA device, not {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._slots(depth, capacity, width, dtype, [ipc.new_event(self.device) for _ in range(depth)])

    def _slots(self, depth: int, capacity: int, width: int, dtype: torch.dtype, ready: list[Any]) -> None:
        self.capacity, self.width, self.dtype = capacity, width, dtype
        self.hidden = [torch.empty((capacity, width), dtype=dtype, device=self.device) for _ in range(depth)]
        self.ready = ready
        self.released: list[Any] = [None] * depth
        self.holds = [0] * depth
        self._next = 0
        self._cond = threading.Condition()

    @property
    def depth(self) -> int:
        return len(self.hidden)

    @property
    def nbytes(self) -> int:
        return self.depth * self.capacity * self.width * self.dtype.itemsize

    def export(self) -> p.Attach:
        """The attach message that offers this ring (raises :class:`ipc.IpcError`)."""
        return p.Attach(ipc.host_identity(), ipc.device_uuid(self.device), p.dtype_name(self.dtype), self.width,
                        self.capacity, [ipc.export_tensor(t) for t in self.hidden],
                        [ipc.event_handle(e) for e in self.ready])

    def attach(self, released: list[bytes]) -> None:
        if len(released) != self.depth:
            raise ipc.IpcError(f"the server sent {len(released)} released events for {self.depth} slots")
        self.released = [ipc.open_event(h, self.device.index) for h in released]

    def detach(self) -> None:
        self.released = [None] * self.depth

    def slot_of(self, t: torch.Tensor) -> tuple[int, int] | None:
        """``(slot, first row)`` when ``t`` is a row range of one of the slots, else None."""
        if t.device != self.device or t.dtype != self.dtype or t.dim() != 2 or t.shape[1] != self.width \
                or not t.is_contiguous():
            return None
        row_bytes = self.width * self.dtype.itemsize
        for i, buf in enumerate(self.hidden):
            off = t.data_ptr() - buf.data_ptr()
            if 0 <= off and off % row_bytes == 0 and off // row_bytes + t.shape[0] <= self.capacity:
                return i, off // row_bytes
        return None

    # ------------------------------------------------------------ lifetime
    def hold(self, i: int, n: int = 1) -> None:
        with self._cond:
            self.holds[i] += n

    def release(self, i: int, n: int = 1) -> None:
        with self._cond:
            if self.holds[i] < n:
                raise RuntimeError(f"device slot {i}: release of {n} with {self.holds[i]} hold(s)")
            self.holds[i] -= n
            self._cond.notify_all()

    def busy(self, i: int) -> bool:
        """A message names slot ``i``, or the server's last read of it is not known complete."""
        with self._cond:
            return self.holds[i] > 0 or not self.read_done(i)

    def read_done(self, i: int) -> bool:
        """Whether the server's last read of slot ``i`` has completed, as far as this process can
        tell: no event (no server took the ring, or the link was lost) or one that cannot be
        queried any more (its server is gone) counts as done."""
        event = self.released[i]
        if event is None:
            return True
        try:
            return bool(event.query())
        except RuntimeError:
            self.released[i] = None
            return True

    def wait_free(self, i: int, timeout: float) -> bool:
        """Host wait until no message names slot ``i`` (its replies came); False at the timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.holds[i] == 0, timeout)

    def take(self) -> int | None:
        """The first slot from the next one on (round robin) that no message names now, held once
        for the caller; None without waiting when every slot is named (the V2 launch: the step
        thread never waits for a reply)."""
        with self._cond:
            for j in range(self.depth):
                i = (self._next + j) % self.depth
                if self.holds[i] == 0 and self.read_done(i):
                    self.holds[i] = 1
                    self._next = (i + 1) % self.depth
                    return i
            return None

    def acquire(self, deadline: float, progress: Callable[[Any, float], None]) -> int:
        """The next slot (round robin) once no message names it; ``progress`` reads replies meanwhile."""
        i = self._next
        while self.busy(i):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RingTimeout(f"device slot {i} still named by {self.holds[i]} message(s) or read by the "
                                  f"server at the deadline")
            progress(None, left)
        self._next = (i + 1) % self.depth
        return i

    def write(self, i: int, rows: torch.Tensor) -> None:
        """Copy ``rows`` (input order) into slot ``i`` on the current stream of their device, then
        record the slot's ready event; the caller took the slot (:meth:`take`, :meth:`acquire`), so
        the server's last read of it is over. A ring in host memory (tests on a machine without
        CUDA) has no events: a plain copy."""
        self.hidden[i][:rows.shape[0]].copy_(rows, non_blocking=True)
        if self.device.type == "cuda":
            self.ready[i].record(torch.cuda.current_stream(self.device))


@dataclass
class DeviceRows:
    """Where a step's hidden rows are: ring slot ``slot``; request ``i`` (input index), whose
    rows start at position ``starts[i]``, has its first row at slot row ``rows[i]``."""
    ring: DeviceRing
    slot: int
    rows: np.ndarray             # [R]
    starts: np.ndarray | None = None

    def meta_column(self, reqs: np.ndarray, part_starts: np.ndarray) -> np.ndarray:
        """The slot row of each request's first row *in one message* (a part may start mid-request)."""
        return self.rows[reqs] + (part_starts - self.starts[reqs])


class DevicePlane:
    """Whether this client's steps ship hidden rows over the device plane, and why (not)."""

    def __init__(self, mode: str, ring: DeviceRing | None, why_not: str = ""):
        self.mode, self.ring = mode, ring
        self.state = "off"                   # off | pending | on
        self.reason = why_not or ("" if ring is not None else "no device ring")
        self.attaches = 0
        self._logged: str | None = None

    @classmethod
    def create(cls, mode: str, depth: int, capacity: int, width: int, dtype: torch.dtype,
               device: str | None, ring: DeviceRing | None = None) -> "DevicePlane":
        """The plane for a client: ``ring`` when given (the V2 speculator allocates it before
        vLLM profiles memory), else one made here when the target is on CUDA and ships rows."""
        if mode == "off":
            return cls(mode, None, "device_plane=off")
        if ring is not None:
            return cls(mode, ring)
        if width <= 0:
            return cls(mode, None, "the target ships no hidden rows")
        if not ipc.cuda_available():
            return cls(mode, None, "no CUDA on the target")
        try:
            return cls(mode, DeviceRing(depth, capacity, width, dtype, device or "cuda"))
        except Exception as exc:  # noqa: BLE001 - the host path always works
            return cls(mode, None, f"no device ring: {exc}")

    @property
    def on(self) -> bool:
        return self.state == "on"

    def refusal(self, offer: p.DeviceOffer) -> str | None:
        """Why the device plane cannot work with this server (None: try to attach)."""
        if self.ring is None:
            return self.reason
        if not offer.accepts:
            return f"the server takes no device ring ({offer.why or 'an older server'})"
        if offer.host != ipc.host_identity():
            return "the server runs on another host"
        return None

    def offer(self, caps: p.Caps, send: Callable[..., Any]) -> None:
        """The link is ready: attach the ring when this server can take it (``send(msg, on_reply=,
        on_abandon=)`` posts the message), else the host path."""
        self.lost()
        why = self.refusal(caps.device_plane)
        if why is not None:
            self._host(why)
            return
        try:
            msg = self.ring.export()
        except ipc.IpcError as exc:
            self._host(f"the ring cannot be shared: {exc}")
            return
        self.state = "pending"
        send(msg, on_reply=self._answered, on_abandon=lambda item, exc: self._host(f"attach: {exc}"))

    def _answered(self, item: Any) -> None:
        reply = item.reply
        if not reply.ok:
            code, message = reply.error or ("?", "")
            self._host(f"the server could not open the ring: {code}: {message}")
            return
        try:
            self.ring.attach(list((reply.result or {}).get("released", [])))
        except (ipc.IpcError, TypeError) as exc:
            self._host(f"the server's events do not open here: {exc}")
            return
        self.state, self.reason = "on", ""
        self.attaches += 1
        self._log("device", logging.INFO, "k3 draft transport: device data plane on (hidden rows GPU to GPU, "
                                          "%d slots of %d rows)", self.ring.depth, self.ring.capacity)

    def lost(self) -> None:
        """The link or the server's state is gone: never wait on the server's events again."""
        if self.ring is not None:
            self.ring.detach()
        if self.state != "off":
            self.state, self.reason = "off", "link lost (the next hello decides again)"

    def _host(self, why: str) -> None:
        if self.ring is not None:
            self.ring.detach()
        self.state, self.reason = "off", why
        self._log(why, logging.WARNING if self.ring is not None else logging.INFO,
                  "k3 draft transport: hidden rows take the host path: %s", why)

    def _log(self, key: str, level: int, fmt: str, *args: Any) -> None:
        if self._logged != key:               # once per decision, again when it changes
            self._logged = key
            log.log(level, fmt, *args)

    def usable(self, hidden: torch.Tensor | None) -> bool:
        """Whether this step's rows can go over the device plane."""
        return self.on and hidden is not None and hidden.device == self.ring.device

    def stage(self, hidden: torch.Tensor, counts: np.ndarray, starts: np.ndarray, deadline: float,
              progress: Callable[[Any, float], None]) -> DeviceRows:
        """Put the step's rows (input order) into a slot, or name the slot they are already in."""
        src = np.cumsum(counts) - counts
        ref = self.ring.slot_of(hidden)
        if ref is not None:
            return DeviceRows(self.ring, ref[0], ref[1] + src, starts)
        slot = self.ring.acquire(deadline, progress)
        if hidden.shape[0] > self.ring.capacity:
            raise ValueError(f"{hidden.shape[0]} rows exceed the device slot's {self.ring.capacity}")
        self.ring.write(slot, hidden)
        return DeviceRows(self.ring, slot, src, starts)

    def stats(self) -> dict[str, Any]:
        ring = self.ring
        return {"path": "device" if self.on else "host", "state": self.state, "reason": self.reason,
                "attaches": self.attaches, "slots": ring.depth if ring else 0,
                "ring_bytes": ring.nbytes if ring else 0, "holds": list(ring.holds) if ring else []}


__all__ = ["DevicePlane", "DeviceRing", "DeviceRows", "MODES"]
