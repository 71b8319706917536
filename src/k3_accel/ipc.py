"""CUDA IPC between a target and a draft server on one host: who is where, and sharing
device memory and events across processes. Both sides use it (transport/device_plane.py
exports, server/device_plane.py opens); nothing here decides *whether* to use it.

Memory travels as the fields of torch's own ``reduce_tensor`` / ``rebuild_cuda_tensor``
(the storage's ``cudaIpcMemHandle``, its producer's ref counter and sharing event), so the
producer's caching allocator keeps a block alive while a consumer maps it. Events are
``torch.cuda.Event(interprocess=True)`` and their ``ipc_handle()``. Every function raises
:class:`IpcError` (never anything else) when it cannot do its job here.
"""
from __future__ import annotations

import hashlib
import socket
from pathlib import Path

import torch

from k3_accel import protocol as p

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class IpcError(RuntimeError):
    """CUDA IPC is not possible (no CUDA, another device, a handle that does not open)."""


def host_identity() -> str:
    """This host's identity: its boot id and host name, hashed (two processes that may share
    CUDA memory see the same value; a container with its own host name does not)."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        boot = ""
    return hashlib.sha256(f"{boot}|{socket.gethostname()}".encode()).hexdigest()[:24]


def cuda_available() -> bool:
    return torch.cuda.is_available()


def device_uuid(device: torch.device | int) -> str:
    """The UUID of a CUDA device (the same in every process, whatever CUDA_VISIBLE_DEVICES says)."""
    if not cuda_available():
        raise IpcError("no CUDA device in this process")
    return str(torch.cuda.get_device_properties(device).uuid)


def visible_devices() -> dict[str, int]:
    """UUID -> this process's index of every CUDA device it can use (empty without CUDA)."""
    if not cuda_available():
        return {}
    return {device_uuid(i): i for i in range(torch.cuda.device_count())}


# ----------------------------------------------------------------- memory
def export_tensor(t: torch.Tensor) -> p.IpcTensor:
    """What another process needs to map ``t`` (a contiguous CUDA tensor)."""
    if t.device.type != "cuda" or not t.is_contiguous():
        raise IpcError("only contiguous CUDA tensors can be shared")
    from torch.multiprocessing.reductions import reduce_tensor
    try:
        _, args = reduce_tensor(t)
    except Exception as exc:  # noqa: BLE001 - e.g. memory of expandable segments
        raise IpcError(f"this tensor's memory cannot be shared: {exc}") from exc
    (_, size, stride, offset, _, dtype, _, handle, size_bytes, offset_bytes, _, ref_counter, ref_offset,
     event, event_sync) = args
    return p.IpcTensor(list(size), list(stride), int(offset), p.dtype_name(dtype), bytes(handle),
                       int(size_bytes), int(offset_bytes), bytes(ref_counter), int(ref_offset),
                       bytes(event or b""), bool(event_sync))


def open_tensor(spec: p.IpcTensor, device_index: int) -> torch.Tensor:
    """Map a tensor another process exported (on this process's device ``device_index``)."""
    if not cuda_available():
        raise IpcError("no CUDA device in this process: a device slot cannot be opened")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, torch.Size(spec.shape), tuple(spec.stride), spec.offset, torch.storage.TypedStorage,
            p.DTYPES[spec.dtype], device_index, spec.handle, spec.size_bytes, spec.offset_bytes, False,
            spec.ref_counter, spec.ref_offset, spec.event or None, spec.event_sync)
    except Exception as exc:  # noqa: BLE001 - a handle of another host, process gone, bad bytes
        raise IpcError(f"the device slot does not open here: {exc}") from exc


# ----------------------------------------------------------------- events
def new_event(device: torch.device | int) -> "torch.cuda.Event":
    """An interprocess event, created on ``device`` (record it on that device's streams only)."""
    if not cuda_available():
        raise IpcError("no CUDA device in this process")
    with torch.cuda.device(device):
        event = torch.cuda.Event(interprocess=True)
        event.ipc_handle()               # creates it now, on this device
    return event


def event_handle(event: "torch.cuda.Event") -> bytes:
    return bytes(event.ipc_handle())


def open_event(handle: bytes, device_index: int) -> "torch.cuda.Event":
    if not cuda_available():
        raise IpcError("no CUDA device in this process: an event cannot be opened")
    try:
        return torch.cuda.Event.from_ipc_handle(device_index, handle)
    except Exception as exc:  # noqa: BLE001
        raise IpcError(f"the interprocess event does not open here: {exc}") from exc


__all__ = ["IpcError", "cuda_available", "device_uuid", "event_handle", "export_tensor", "host_identity",
           "new_event", "open_event", "open_tensor", "visible_devices"]
