"""Off steps' rows on the V2 runner, held from the launch on: what an off step costs the target.

While the adaptive controller keeps speculation off and no probe is due
(:meth:`~.controller.Controller.stays_off`), a step's rows are only context for a
later draft. Launched like any other step (:mod:`.v2_launch`), each such step cost
vLLM's step thread the full scatter (the meta and row kernels, one ``index_copy_``
per aux layer, a pinned launch slot, the copy's event), woke the draft thread to
wait for that copy, build the step's input and ship it, and made the server ingest
it, on the GPU it may share with the target (P6 on an H100: the plugin's ``propose``
took 0.97 ms of the step thread with the controller at K = 0 for 126 of 128 steps).

:class:`HeldSteps` keeps them instead, in pinned host memory, from the launch on.
For a held step the step thread only

1. runs the launch's meta kernel (valid rows, anchors, first positions: what only the
   GPU knows) with every request kept (the host applies its skip rule later),
2. concatenates the step's aux rows (one ``torch.cat``) and converts its token ids on
   the device, uncompacted,
3. copies the meta and the raw rows device -> pinned, on the launch's side stream, to
   the end of the current *region*;

and the draft thread only counts the step for the controller (:meth:`~.pipeline.
DraftPipeline.count_held`). Nothing is compacted, shipped or ingested. A probe's drafts
need every held row on the server first, and the GPU waits for them, so a region goes
early once a probe is due within :data:`HAND_OVER_AHEAD` steps (:meth:`HeldSteps.early`);
the next step that is not held (a probe, speculation back on, a flush, the link going
down), or a step that no longer fits, also hands it over (:meth:`HeldSteps.take`). The
draft thread gathers the valid rows of each held step's kept, still live requests on the
host, once, into one ingest (:meth:`HeldLaunch.merged`; step by step where a request's rows
would not continue: :meth:`HeldLaunch.step_inputs`), ahead of anything else it ships. Two
regions: one fills while the draft thread reads the other; with both busy, the step
launches as before.

A step is held only when the host knows its rows exactly: no drafts were verified in
it (``num_draft_tokens == 0``, so every row of a kept request is valid: with the
scheduler gate, :mod:`.gate`, every off step), no request needs its token history
attached (the launch copies it), and the link is up. A step that verifies drafts may be
verifying a probe's (the step thread can run ahead of the controller's verdict): the
controller must learn from the GPU's count of its valid rows, so it is launched.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from k3_accel.transport.api import StepInput
from k3_accel.vllm.spec_decode.off_rows import MAX_BYTES
from k3_accel.vllm.spec_decode.v2_launch import META_ROWS, DeviceRows, copy_out, step_rows

HOLD_STEPS = 32          # steps one region holds (a decode step of B requests is B rows)
HAND_OVER_AHEAD = 16     # a probe due within this many steps: what is held goes early ...
HAND_OVER_MIN = 4        # ... once a region holds this many steps


@dataclass
class HeldFacts:
    """What the controller counts of a held step (host-known: see the module docstring)."""
    req_ids: list[str]
    counts: list[int]
    sampled: list[bool]
    num_verified: list[int]
    k: int = 0


@dataclass
class _Step:
    req_ids: list[str]        # the batch's request ids
    keep: np.ndarray          # kept batch indices
    offset: int               # its first raw row in the region
    hidden: bool              # its aux rows were copied


@dataclass
class _Region:
    token_ids: torch.Tensor
    hidden: torch.Tensor | None
    meta: torch.Tensor        # [HOLD_STEPS, META_ROWS, max_reqs]
    steps: list[_Step] = field(default_factory=list)
    rows: int = 0
    ready: Any = None         # the event of its last copy (None: on the host already)
    busy: bool = False        # handed to the draft thread and not released yet


class HeldSteps:
    """Two pinned regions of ``capacity`` raw rows and :data:`HOLD_STEPS` steps (module docstring)."""

    def __init__(self, capacity: int, width: int, dtype: torch.dtype, max_reqs: int, pin: bool):
        self.capacity, self._width, self._dtype = capacity, width, dtype
        self._scratch: torch.Tensor | None = None      # a region's rows gathered request by request

        def region() -> _Region:
            return _Region(torch.empty(capacity, dtype=torch.int64, pin_memory=pin),
                           torch.empty((capacity, width), dtype=dtype, pin_memory=pin) if width else None,
                           torch.empty((HOLD_STEPS, META_ROWS, max_reqs), dtype=torch.int64, pin_memory=pin))
        self._regions = [region(), region()]
        self._cur = 0
        self._lock = threading.Lock()

    @classmethod
    def sized(cls, max_rows: int, width: int, dtype: torch.dtype, max_reqs: int, pin: bool) -> "HeldSteps":
        """Regions of :data:`HOLD_STEPS` full decode steps, within a launch slot's rows and
        :data:`~.off_rows.MAX_BYTES` (what the draft thread merges into one ingest)."""
        row_bytes = 8 + width * dtype.itemsize
        return cls(max(1, min(max_rows, HOLD_STEPS * max_reqs, MAX_BYTES // row_bytes)), width, dtype, max_reqs, pin)

    def __len__(self) -> int:
        """Steps held in the region being filled."""
        return len(self._regions[self._cur].steps)

    @staticmethod
    def eligible(input_batch: Any, prompts: dict) -> bool:
        """Whether the host knows the step's rows exactly (module docstring)."""
        return getattr(input_batch, "num_draft_tokens", None) == 0 and not prompts

    @staticmethod
    def early(off_budget: int, held: int) -> bool:
        """Whether ``held`` steps go to the draft thread now, with a probe due in ``off_budget`` steps:
        the probe's drafts wait for every held row to reach the server, and the GPU waits for them
        (P6 on an H200 at B = 32: a region of 32 steps handed over at the probe missed the 100 ms
        deadline). Far from a probe nothing goes; near one, a region goes once it holds a few steps."""
        return off_budget < HAND_OVER_AHEAD and held >= HAND_OVER_MIN

    def scratch(self, rows: int) -> torch.Tensor:
        """Host rows a region is gathered into for its one ingest (draft thread; reused: the client
        copies them into its staging slot before the step returns)."""
        if self._scratch is None:
            self._scratch = torch.empty((self.capacity, self._width), dtype=self._dtype)
        return self._scratch[:rows]

    def fits(self, rows: int) -> bool:
        reg = self._regions[self._cur]
        with self._lock:
            busy = reg.busy
        return not busy and len(reg.steps) < HOLD_STEPS and reg.rows + rows <= self.capacity

    def add(self, rows: DeviceRows, input_batch: Any, aux: Sequence[torch.Tensor] | None, num_sampled: torch.Tensor,
            num_rejected: torch.Tensor, last_sampled: torch.Tensor, next_prefill_tokens: torch.Tensor,
            keep: np.ndarray) -> None:
        """Hold the step (call when :meth:`fits` its rows): launches only, no host read of device data."""
        reg = self._regions[self._cur]
        r, n = step_rows(input_batch, aux)
        compute = torch.cuda.current_stream(rows.device) if rows.cuda else None
        if compute is not None and rows.copied is not None:
            compute.wait_event(rows.copied)          # the last copy out of the device buffers is done
        last = last_sampled.reshape(-1) if last_sampled.dim() > 1 else last_sampled
        nxt = next_prefill_tokens[0] if next_prefill_tokens.dim() > 1 else next_prefill_tokens
        positions = input_batch.positions[0] if input_batch.positions.dim() == 2 else input_batch.positions
        rows.scatter(rows, r, 0, input_batch.query_start_loc[: r + 1], num_rejected[:r], rows.ones[:r],
                     num_sampled[:r], last, nxt, input_batch.idx_mapping[:r], positions, input_batch.input_ids[:0])
        j, at = len(reg.steps), reg.rows
        pairs = [(reg.meta[j], rows.meta)]
        hidden = bool(aux) and rows.hidden is not None and reg.hidden is not None
        if n:
            rows.token_ids[:n].copy_(input_batch.input_ids[:n])
            pairs.append((reg.token_ids[at:at + n], rows.token_ids[:n]))
            if hidden:
                torch.cat([h[:n] for h in aux], dim=1, out=rows.hidden[:n])
                pairs.append((reg.hidden[at:at + n], rows.hidden[:n]))
        reg.ready = copy_out(rows, pairs, compute)
        reg.steps.append(_Step(list(input_batch.req_ids[:r]), np.asarray(keep, dtype=np.int64), at, hidden))
        reg.rows += n

    def drop(self, req_ids: Sequence[str]) -> None:
        """vLLM dropped ``req_ids`` (their free goes out now): their rows held so far are never shipped,
        not even for a request of the same id added again (a preempted request that resumes). A region
        handed over already ships before the free."""
        reg, gone = self._regions[self._cur], set(req_ids)
        with self._lock:
            if reg.busy:
                return
        for s in reg.steps:
            s.keep = np.asarray([i for i in s.keep.tolist() if s.req_ids[i] not in gone], dtype=np.int64)

    def take(self, live: Any) -> "HeldLaunch | None":
        """The region being filled, for the draft thread (None when it holds nothing); the next
        held step goes to the other one. ``live``: the requests whose rows may still be shipped
        (the others were freed after their rows were held)."""
        reg = self._regions[self._cur]
        if not reg.steps:
            return None
        with self._lock:
            reg.busy = True
        self._cur ^= 1
        return HeldLaunch(self, reg, frozenset(live))

    def release(self, reg: _Region) -> None:
        with self._lock:
            reg.steps, reg.rows, reg.ready, reg.busy = [], 0, None, False


@dataclass
class HeldLaunch:
    """A region of held steps, handed to the draft thread (:meth:`~.pipeline.DraftPipeline.submit_held`)."""
    owner: HeldSteps
    region: _Region
    live: frozenset

    def wait_ready(self) -> None:
        if self.region.ready is not None:
            self.region.ready.synchronize()

    def release(self) -> None:
        self.owner.release(self.region)

    def _rows(self) -> Iterator[tuple[_Step, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Per held step with a kept live request: ``(step, keep, meta, valid, positions, rows)``: the
        valid rows of its kept live requests, request after request (their positions and region rows).
        ValueError: a kept request without a valid row (the host cannot place its rows)."""
        reg = self.region
        for j, s in enumerate(reg.steps):
            meta = reg.meta[j].numpy()[:, : len(s.req_ids)]
            ran = meta[6]
            starts = np.cumsum(ran) - ran                # the device's query_start_loc (maybe trimmed)
            keep = np.asarray([i for i in s.keep.tolist() if s.req_ids[i] in self.live], dtype=np.int64)
            valid, first = meta[0, keep], meta[3, keep]
            if (valid < 1).any():
                bad = s.req_ids[int(keep[np.flatnonzero(valid < 1)[0]])]
                raise ValueError(f"request {bad!r}: no valid context row in a held step")
            if keep.size == 0:
                continue
            within = np.arange(int(valid.sum()), dtype=np.int64) - np.repeat(np.cumsum(valid) - valid, valid)
            yield s, keep, meta, valid, np.repeat(first, valid) + within, \
                s.offset + np.repeat(starts[keep], valid) + within

    def step_inputs(self) -> Iterator[StepInput]:
        """Each held step's ingest (call after :meth:`wait_ready`): the valid rows of its kept live
        requests, compacted request after request, copied out of the region."""
        reg = self.region
        for s, keep, meta, valid, positions, rows in self._rows():
            index = torch.from_numpy(rows)
            yield StepInput(
                req_ids=[s.req_ids[i] for i in keep.tolist()], counts=valid.tolist(),
                positions=torch.from_numpy(positions), token_ids=reg.token_ids.index_select(0, index),
                sampled=(meta[1, keep] > 0).tolist(), anchor_tokens=meta[2, keep].copy(),
                anchor_positions=positions[np.cumsum(valid) - 1] + 1, k=0,
                hidden=reg.hidden.index_select(0, index) if s.hidden else None,
                num_verified=[0] * int(keep.size))

    def merged(self) -> StepInput | None:
        """The region as one ingest (call after :meth:`wait_ready`): what :class:`~.off_rows.OffRows`
        would merge of its steps' inputs (each request's rows step after step, requests in order of first
        appearance, each one's last anchor), gathered straight out of the region, once, into
        :meth:`HeldSteps.scratch`. A region of 32 steps at B = 32 is 42 MB of rows at Qwen3-8B's
        width: the per-step copies, their merge and its reorder (three fresh 42 MB tensors) took the
        draft thread 9.8 ms on the H200's host, this 1.5 ms (``held_hand_over.py``). None: nothing is
        kept, some request's rows do not continue from one step to the next, or steps differ in
        carrying aux rows (:meth:`step_inputs` then ships step by step). ValueError: as
        :meth:`step_inputs`."""
        reg, code_of = self.region, {}
        codes, positions, rows, anchors, hidden = [], [], [], [], set()
        for s, keep, meta, valid, pos, src in self._rows():
            code = np.fromiter((code_of.setdefault(s.req_ids[i], len(code_of)) for i in keep.tolist()),
                               dtype=np.int64, count=keep.size)
            codes.append(np.repeat(code, valid))
            positions.append(pos)
            rows.append(src)
            anchors.append((code, meta[2, keep], pos[np.cumsum(valid) - 1] + 1))
            hidden.add(s.hidden)
        if not codes or len(hidden) > 1:
            return None
        code = np.concatenate(codes)
        order = np.argsort(code, kind="stable")
        code, position = code[order], np.concatenate(positions)[order]
        index = torch.from_numpy(np.concatenate(rows)[order])
        same = code[1:] == code[:-1]
        if (position[1:][same] != position[:-1][same] + 1).any():
            return None
        tokens, ends = np.empty(len(code_of), dtype=np.int64), np.empty(len(code_of), dtype=np.int64)
        for c, tok, end in anchors:                     # later steps overwrite: each request's last
            tokens[c], ends[c] = tok, end
        out = None
        if hidden.pop():
            out = torch.index_select(reg.hidden, 0, index, out=self.owner.scratch(int(index.numel())))
        return StepInput(req_ids=list(code_of), counts=np.bincount(code, minlength=len(code_of)).tolist(),
                         positions=torch.from_numpy(position), token_ids=reg.token_ids.index_select(0, index),
                         sampled=[False] * len(code_of), anchor_tokens=tokens, anchor_positions=ends, k=0,
                         hidden=out)


__all__ = ["HAND_OVER_AHEAD", "HAND_OVER_MIN", "HOLD_STEPS", "HeldFacts", "HeldLaunch", "HeldSteps"]
