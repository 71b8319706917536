"""The scheduler gate: on the V2 runner, speculation that is off costs a plain decode.

With async scheduling vLLM's scheduler gives every decode request its draft
slots before the drafts exist (``num_spec_tokens_to_schedule`` placeholders),
so a step the adaptive controller drafts nothing for still verifies K filler
tokens per request, unless vLLM's adaptive verification trims them (at the
price of a host sync each step). The gate moves the controller's on/off to the
scheduler instead, through vLLM's own per-step draft count (the dynamic
speculative decoding path): while :meth:`~.controller.Controller.stays_off`,
the driver rank's draft thread writes 0 to a one-word shared file named by the
engine (the engine core's process id, :func:`engine_key`), and the scheduler (patched in
:mod:`.hooks`) schedules ``min(its own K, the gate's)`` draft slots; the next
step is a plain decode and its ``propose`` gets ``num_speculative_tokens=0``.
The controller opens the gate ``HOLD_MARGIN`` steps before a probe is due.

Every TP rank runs what the one scheduler scheduled, so the ranks agree. A gate
the scheduler cannot read (none written yet, another host) is no gate: vLLM's
own K. Outputs never depend on it (fewer drafts, never different tokens).

``adaptive_gate``: ``auto`` (the default) turns it on exactly where it was measured
to pay, with vLLM's ``enable_adaptive_verification`` (whose varlen decode graphs
take one token per request); ``on`` / ``off`` force it. Measured on the H200
(vLLM 0.33, default CUDA graphs, Qwen3-8B shape): with adaptive verification
and every draft rejected, 0.91 / 0.91 / 0.85 of no speculation at B = 1 / 8 / 32
against 0.84 / 0.80 / 0.68 for the controller alone, and the best of all variants
at acceptance lengths 4 and 6.5. Without adaptive verification the plain decodes
it schedules run on vLLM's piecewise graphs (a speculative engine captures full
graphs only for 1 + K tokens per request) and cost more than verifying K filler
tokens: 0.57 / 0.66 / 0.46, against 0.87 / 0.87 / 0.71 without the gate.
"""
from __future__ import annotations

import logging
import mmap
import os
import struct
import tempfile
from typing import Any

from k3_accel.config import ConfigError, from_vllm

log = logging.getLogger("k3_accel.vllm")

_WORD = struct.Struct("<i")
LOCAL_BACKENDS = (None, "uni", "mp")       # executors whose driver worker is the engine core or its child


def why_not(vllm_config: Any) -> str | None:
    """Why this engine's scheduler follows no gate (None: it does). A gate needs ``adaptive_gate``
    (``on``, or ``auto`` with vLLM's adaptive verification) and remote drafting on the V2 runner with
    the adaptive controller free to turn speculation off (``adaptive``, ``adaptive_min_k`` 0)."""
    from k3_accel.vllm.spec_decode.methods import remote_enabled
    if getattr(vllm_config, "speculative_config", None) is None:
        return "no speculative decoding"
    if not getattr(vllm_config, "use_v2_model_runner", False):
        return "the V1 runner schedules only the drafts it has"
    backend = getattr(getattr(vllm_config, "parallel_config", None), "distributed_executor_backend", None)
    if backend not in LOCAL_BACKENDS:
        return f"executor {backend!r}: the draft thread may not share a host with the scheduler"
    try:
        config = from_vllm(vllm_config)
    except ConfigError as exc:
        return f"bad setting: {exc}"
    if config.adaptive_gate == "off":
        return "adaptive_gate is off"
    if config.adaptive_gate == "auto" and \
            not getattr(vllm_config.speculative_config, "enable_adaptive_verification", False):
        return "adaptive_gate is auto and vLLM's adaptive verification is off"
    if not config.adaptive or config.adaptive_min_k != 0:
        return "the adaptive controller is off or may not turn speculation off (adaptive_min_k > 0)"
    if not remote_enabled(vllm_config):
        return "the method is not drafted remotely"
    return None


# what this process's gates did (``stats()["gate"]``): the writer of the driver rank and, where the
# scheduler runs in this process (one GPU: the engine core hosts the worker), the scheduler's reader
STATE: dict[str, dict[str, Any] | None] = {"writer": None, "scheduler": None}


def engine_key(vllm_config: Any, writer: bool) -> str:
    """What names the engine on both sides: the engine core's process id. The scheduler runs in the
    engine core; the draft thread runs in the driver worker, which is the engine core itself with
    one GPU (``uni``) and its child with several (``mp``). Not ``instance_id``: vLLM rebuilds the
    config between the worker's start and the scheduler's (a new id, seen on the H200)."""
    backend = getattr(getattr(vllm_config, "parallel_config", None), "distributed_executor_backend", None)
    return f"pid{os.getppid() if writer and backend == 'mp' else os.getpid()}"


def gate_path(key: str) -> str:
    """The engine's gate file: in ``/dev/shm`` where there is one (memory, not disk)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in str(key))
    return os.path.join(base, f"k3-accel-gate-{os.getuid()}-{safe}")


class Gate:
    """One int32 in a shared file: the most drafts per request the scheduler may schedule."""

    def __init__(self, path: str, writer: bool, k: int = 0):
        self.path = path
        self.writer = writer
        self._map: mmap.mmap | None = None
        self._value: int | None = None
        if writer:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, _WORD.size)
                self._map = mmap.mmap(fd, _WORD.size)
            finally:
                os.close(fd)
            self.set(k)

    @classmethod
    def for_engine(cls, vllm_config: Any, writer: bool) -> "Gate | None":
        """The engine's gate (None when :func:`why_not` gives a reason); the writer starts at K."""
        why = why_not(vllm_config)
        if not writer:
            STATE["scheduler"] = {"why_not": why, "reads": 0, "unreadable": 0, "capped": 0, "last": None}
        elif why is not None:
            STATE["writer"] = {"why_not": why}
        if why is not None:
            return None
        k = int(vllm_config.speculative_config.num_speculative_tokens)
        try:
            gate = cls(gate_path(engine_key(vllm_config, writer)), writer, k)
            if writer:
                STATE["writer"] = {"path": gate.path, "value": k, "sets": 0}
            else:
                STATE["scheduler"]["path"] = gate.path
            return gate
        except OSError as exc:
            log.warning("k3-accel: no scheduler gate (%s): speculation that is off still verifies K per request",
                        exc)
            return None

    def set(self, k: int) -> None:
        """Writer: the next steps may schedule at most ``k`` drafts per request."""
        if self._map is not None and k != self._value:
            _WORD.pack_into(self._map, 0, int(k))
            self._value = k
            if STATE["writer"] is not None and STATE["writer"].get("path") == self.path:
                STATE["writer"].update(value=int(k), sets=STATE["writer"]["sets"] + 1)

    def get(self) -> int | None:
        """Reader: the gate's value (None: no gate readable, vLLM's own K applies)."""
        if self._map is None:
            try:
                fd = os.open(self.path, os.O_RDONLY)
            except OSError:
                return None
            try:
                if os.fstat(fd).st_size < _WORD.size:
                    return None
                self._map = mmap.mmap(fd, _WORD.size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        return _WORD.unpack_from(self._map, 0)[0]

    def close(self) -> None:
        """Writer: the scheduler goes back to vLLM's own K; the file is removed."""
        if self._map is None:
            return
        if self.writer:
            self._value = None
            self.set(2 ** 31 - 1)
            try:
                os.unlink(self.path)
            except OSError:
                pass
        self._map.close()
        self._map = None


def gate_value(controller: Any) -> int:
    """What the draft thread writes after each step: 0 while the controller stays off (no probe due
    within ``HOLD_MARGIN`` steps), else its K."""
    return 0 if controller.stays_off() else controller.s.k_max


def gated(k_scheduled: int, gate: Gate | None) -> int:
    """What the scheduler schedules: its own K, capped by a readable gate."""
    value = gate.get() if gate is not None else None
    out = k_scheduled if value is None else max(0, min(k_scheduled, value))
    seen = STATE["scheduler"]
    if gate is not None and seen is not None and seen.get("path") == gate.path:
        seen["reads"] += 1
        seen["unreadable"] += value is None
        seen["capped"] += out < k_scheduled
        seen["last"] = value
    return out


__all__ = ["STATE", "Gate", "engine_key", "gate_path", "gate_value", "gated", "why_not"]
