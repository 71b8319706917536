"""A device-tensor stand-in for CPU tests: any host read of it raises, like a sync would on a GPU.

``Dev`` tensors behave as device tensors for every device-side op (results
stay ``Dev``), but reading their values on the host — ``.cpu()``,
``.numpy()``, ``.tolist()``, ``.item()``, ``bool()`` / ``int()`` /
``float()``, iterating, ``np.asarray``, ``.to("cpu")``, a blocking copy into
a host tensor — raises :class:`HostRead`, as would ``torch.cuda``'s
synchronise calls made from the step thread (:func:`no_host_sync`). A copy
into a host tensor with ``non_blocking=True`` is allowed: on a GPU it is an
asynchronous copy into pinned memory whose event someone else waits on.
"""
from __future__ import annotations

import contextlib
import threading

import torch


class HostRead(AssertionError):
    """The step thread read device data on the host (a host synchronisation on a GPU)."""


_READS = {torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__,
          torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.__iter__,
          torch.Tensor.__array__}
_watched: set[int] = set()          # thread ids whose host reads raise


class Dev(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if threading.get_ident() in _watched:
            _check(func, args, kwargs)
        return super().__torch_function__(func, types, args, kwargs)


def _check(func, args, kwargs) -> None:
    name = getattr(func, "__name__", str(func))
    if func in _READS:
        raise HostRead(f"host read of a device tensor: Tensor.{name}")
    if func is torch.Tensor.to:
        device = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        if device is not None and torch.device(device).type == "cpu":
            raise HostRead("device tensor copied to the host with .to('cpu')")
    if func is torch.Tensor.copy_:
        dst, src = args[0], args[1]
        blocking = not kwargs.get("non_blocking", len(args) > 2 and args[2])
        if isinstance(src, Dev) and not isinstance(dst, Dev) and dst.device.type == "cpu" and blocking:
            raise HostRead("blocking device->host copy")


def dev(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a device-tensor stand-in (shares its memory)."""
    return t.as_subclass(Dev)


@contextlib.contextmanager
def no_host_sync():
    """Inside: this thread's host reads of ``Dev`` tensors and CUDA synchronise calls raise; on
    a GPU torch's sync check is set to raise too (it catches implicit syncs: a "non_blocking"
    D2H copy into memory that is not densely laid out, ``.item()``, ...)."""
    me = threading.get_ident()

    def refuse(*_a, **_k):
        if threading.get_ident() == me:
            raise HostRead("CUDA synchronise called from the step thread")

    patches = [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in patches]
    _watched.add(me)
    cuda = torch.cuda.is_available()
    mode = torch.cuda.get_sync_debug_mode() if cuda else 0
    try:
        for obj, name in patches:
            setattr(obj, name, refuse)
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(mode)
        _watched.discard(me)
        for obj, name, value in saved:
            setattr(obj, name, value)


def own_buffers_as_device(spec) -> None:
    """The V2 speculator's own device buffers as stand-ins too (a CPU "device" makes plain ones)."""
    spec.drafts, spec._confidence = dev(spec.drafts), dev(spec._confidence)
    if spec.rows is not None:
        for name in ("token_ids", "hidden", "meta", "rows", "ones"):
            setattr(spec.rows, name, dev(getattr(spec.rows, name)))


def _device_sim():
    from .v2_sim import Sim

    class DeviceSim(Sim):
        """Every tensor the runner hands ``propose`` is a device stand-in (host reads raise)."""

        def batch(self, sched, aux=True):
            import dataclasses
            ib, aux_states, num_sampled, num_rejected = super().batch(sched, aux)
            ib = dataclasses.replace(ib, idx_mapping=dev(ib.idx_mapping), query_start_loc=dev(ib.query_start_loc),
                                     input_ids=dev(ib.input_ids), positions=dev(ib.positions))
            self.last_batch = ib
            return ib, [dev(a) for a in aux_states or []] or None, dev(num_sampled), dev(num_rejected)

        def propose(self, speculator, sched, k=None, aux=True, **kw):
            rs = self.req_states
            saved = rs.last_sampled_tokens, rs.next_prefill_tokens, rs.all_token_ids.gpu
            rs.last_sampled_tokens, rs.next_prefill_tokens = dev(saved[0]), dev(saved[1])
            rs.all_token_ids.gpu = dev(saved[2])
            try:
                with no_host_sync():
                    out = super().propose(speculator, sched, k, aux, **kw)
            finally:
                rs.last_sampled_tokens, rs.next_prefill_tokens, rs.all_token_ids.gpu = saved
            return out.as_subclass(torch.Tensor)

    return DeviceSim


def DeviceSim(*args, **kwargs):   # noqa: N802 - a class factory (v2_sim needs vLLM)
    """A ``helpers.v2_sim.Sim`` whose ``propose`` hands the speculator device stand-ins only and
    runs inside :func:`no_host_sync`."""
    return _device_sim()(*args, **kwargs)


def host_ring(depth: int, capacity: int, width: int, dtype: torch.dtype = torch.bfloat16):
    """A :class:`~k3_accel.transport.device_plane.DeviceRing` whose slots are host memory: the
    ring's slot rules and the V2 launch's use of them on a machine without CUDA (its CUDA events,
    the only part missing here, are not touched when there is no compute stream)."""
    from k3_accel.transport.device_plane import DeviceRing
    ring = DeviceRing.__new__(DeviceRing)
    ring.device = torch.device("cpu")
    ring._slots(depth, capacity, width, dtype, [None] * depth)
    return ring


class ServerEvent:
    """Stands in for a draft server's released event (CUDA IPC, which this machine lacks) in a
    :func:`host_ring`: ``done`` is what ``query`` answers; ``gone`` makes it raise as an event of
    a dead server's context does."""

    def __init__(self, done: bool, gone: bool = False):
        self.done, self.gone = done, gone

    def query(self) -> bool:
        if self.gone:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.done
