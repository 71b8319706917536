"""The driver rank's draft thread: the one thread that talks to the draft server.

The step thread never blocks on the GPU or the server for remote drafting.
It hands this thread work in step order:

* :meth:`DraftPipeline.submit` — a step whose inputs are still being copied
  device -> pinned host (:class:`~.v2_launch.Launch`). The thread waits for
  the copy's event (here, not in the step), builds the step's
  :class:`~k3_accel.transport.api.StepInput`, runs the client's step, writes
  the drafts into a pinned reply buffer and signals the :mod:`.fence` the
  compute stream waits on. Whatever happens, the fence is signalled.
* :meth:`DraftPipeline.call` — anything else (frees, stats, a V1 step whose
  input is already on the host), run in order and awaited.

The GPU never waits for the draft thread longer than ``deadline_s`` per step,
and a watchdog closes the pipeline when a step stalls for ``stall_s``
(:mod:`.watch`).

A step the adaptive controller asks no drafts of releases its fence as soon as
that is decided, before its rows are staged and sent: the GPU never waits for
the shipping of a step it gets no drafts for. While speculation is off and no
probe is due (:meth:`~.controller.Controller.stays_off`) the step thread launches
the step as an ingest (``held``): nothing on the GPU waits for this thread at all.

The client is started on this thread too, so an unreachable server never
delays the runner's construction.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from k3_accel import threads
from k3_accel.transport.api import StepOutput
from k3_accel.transport.staging import pinning_available
from k3_accel.vllm.spec_decode.gate import gate_value
from k3_accel.vllm.spec_decode.off_rows import OffRows
from k3_accel.vllm.spec_decode.watch import StepWatch

log = logging.getLogger("k3_accel.vllm")

_STOP = object()


class PipelineClosed(RuntimeError):
    """The draft thread is gone (closed, or it died): no drafts from here on."""


class DraftPipeline(StepWatch):
    """Owns ``client`` (a started-on-demand :class:`~k3_accel.transport.client.DraftClient`)."""

    def __init__(self, client: Any, fence: Any, max_reqs: int, k: int, on_failure: Callable[[str, str], None],
                 start_wait_s: float = 1.0, controller: Any = None, stall_s: float | None = None,
                 deadline_s: float | None = None, gate: Any = None, priority: bool = False):
        self.client = client
        self.priority = priority and fence.on_device    # see yield_to_drafts
        self.controller = controller
        self.gate = gate                               # the scheduler's draft slots follow the controller (.gate)
        self.off_rows = OffRows(getattr(getattr(client, "settings", None), "max_rows", 8192))
        self.fence = fence
        self.on_failure = on_failure
        self.reply = torch.full((2, max(max_reqs, 1), max(k, 1)), -1, dtype=torch.int64,
                                pin_memory=pinning_available() and fence.on_device)
        # the server's per-draft confidence (DSpark), -1 where it sent none (see .confidence)
        self.confidence = torch.full(self.reply.shape, -1.0, dtype=torch.float32,
                                     pin_memory=pinning_available() and fence.on_device)
        self._seq = 0
        self._off_budget = 0                          # V1 steps that may go unwaited for (step_v1)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False                           # no more work taken (close, or the watchdog)
        self._shut = False                             # close() ran: the thread stopped, the client closed
        self._thread = threads.start(self._run, "k3-draft")
        self._pending: dict[int, list] = {}           # fence value -> [submitted, launch, GPU reached it] (monotonic)
        self._expired: set[int] = set()                # released by the deadline, still running
        self._released: set[int] = set()               # released because the controller drafts nothing
        self.deadline_s = deadline_s
        self._where: dict[str, Any] = {"jobs": 0, "last_done": 0}   # the draft thread's progress (diagnosis)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self.stalled = False
        self.stall_s = stall_s
        if stall_s is not None or deadline_s is not None:
            threads.start(self._watch, "k3-draft-watchdog")
        self.call(lambda c: c.start(start_wait_s), wait=False)

    # ------------------------------------------------------------ step thread
    def submit(self, launch: Any, propose: bool, held: bool = False) -> int | None:
        """Queue a launched step; returns the fence value its drafts will be signalled with
        (None for an ingest-only step: nothing waits for it). ``held``: an ingest-only step the
        step thread launched so on :meth:`~.controller.Controller.stays_off` (the controller
        still counts it as a step it drafted nothing for)."""
        if self._closed or not self._thread.is_alive():
            launch.release()
            raise PipelineClosed("the draft thread is closed")
        seq = None
        if propose:
            self._seq += 1
            seq = self._seq
            with self._lock:
                self._pending[seq] = [time.monotonic(), launch, None]
                self._wake.notify()
        self._jobs.put((lambda client: self._step(launch, seq, held), None))
        return seq

    def yield_to_drafts(self, seq: int) -> float:
        """Step thread, right after it submitted proposing step ``seq``: wait (GIL released) until
        the step before it has its drafts, at most ``deadline_s``; the seconds waited.

        The draft thread works on step ``seq - 1`` while vLLM's step thread would prepare the step
        after ``seq`` (its output processing, scheduling, ``execute_model``), milliseconds of Python
        that the GPU needs only once step ``seq``'s forward, queued already, is done. Sharing the GIL,
        both went at half speed, and the draft thread's half is the one the GPU waits for (its fence).
        Waiting here leaves that work for after the drafts, still ahead of the GPU while the step
        thread's Python per step is shorter than the forward. ``priority`` off (``draft_priority``),
        a fence the host waits on anyway, or the first step: no wait."""
        if not self.priority or seq <= 1 or self.fence.value() >= seq - 1:
            return 0.0
        start = time.perf_counter()
        self.fence.wait(seq - 1, self.deadline_s if self.deadline_s is not None else 0.1)
        waited = time.perf_counter() - start
        telemetry = getattr(self.client, "telemetry", None)
        if telemetry is not None:
            telemetry.add("v2.yield", waited)
        return waited

    def count_held(self, facts: Any, at: float) -> None:
        """A step the step thread held (:mod:`.v2_held`): the controller counts it, in step order,
        as one it drafted nothing for (``at``: when it reached the plugin); nothing is shipped."""
        controller = self.controller

        def count(client):
            try:
                controller.step(facts, _nothing, held=True, at=at)
            except Exception:  # noqa: BLE001 - counted like the thread's other failures
                self.on_failure("step", "counting a held step")
            finally:
                if self.gate is not None:
                    self.gate.set(gate_value(controller))
        self.call(count, wait=False)

    def submit_held(self, launch: Any) -> None:
        """Queue a region of held steps (:class:`~.v2_held.HeldLaunch`): once its copies are done,
        their rows go to the server as one ingest, ahead of anything queued after them (step by step
        where they cannot merge: :meth:`~.v2_held.HeldLaunch.merged`)."""
        if self._closed or not self._thread.is_alive():
            launch.release()
            raise PipelineClosed("the draft thread is closed")

        def held(client):
            try:
                launch.wait_ready()
                merged = launch.merged()
                for inp in launch.step_inputs() if merged is None else (merged,):
                    self._ship(inp)
            except Exception:  # noqa: BLE001 - fail closed: the requests see a gap and stop drafting
                self.on_failure("step_input", "shipping the held steps' rows")
            finally:
                launch.release()
        self.call(held, wait=False)

    def reply_rows(self, seq: int, rows: int, k: int) -> torch.Tensor:
        """The pinned reply of step ``seq`` (``[rows, k]``), valid once the fence passed ``seq``."""
        return self.reply[seq % 2, :rows, :k]

    def confidence_rows(self, seq: int, rows: int, k: int) -> torch.Tensor:
        """The pinned confidence of step ``seq`` (``[rows, k]``, -1 = none), valid like :meth:`reply_rows`."""
        return self.confidence[seq % 2, :rows, :k]

    def call(self, fn: Callable[[Any], Any], wait: bool = True, timeout: float | None = None,
             after_held: bool = False) -> Any:
        """Run ``fn(client)`` on the draft thread after everything queued; its result (or
        exception) when ``wait``. On a closed pipeline a call not waited for is dropped (the
        step thread's frees and link upkeep must never raise into vLLM). ``after_held``: the
        rows :attr:`off_rows` holds go to the server first (frees, flushes, link upkeep)."""
        if self._closed:
            if not wait:
                return None
            raise PipelineClosed("the draft thread is closed")
        if after_held:
            inner = fn

            def fn(client):
                self.ship_held()
                return inner(client)
        done = threading.Event() if wait else None
        box: list = []
        self._jobs.put((fn, (done, box)))
        if done is None:
            return None
        if not done.wait(timeout):
            raise TimeoutError("the draft thread did not answer in time")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def run_step(self, inp: Any, decided: Callable[[bool], None] | None = None, held: bool = False,
                 hold_rows: bool = False, at: float | None = None, owned: bool = False) -> Any:
        """The client's step, through the controller when there is one (draft thread only);
        ``decided``, ``held``, ``at``: see :meth:`~.controller.Controller.step`. ``hold_rows``: the
        rows of a step that drafts nothing while speculation stays off may wait in
        :attr:`off_rows` and go with a later message (V1: :mod:`.off_rows`); ``owned``: they are
        copies already (:meth:`.OffRows.own`)."""
        if self.controller is None:
            return self.client.step(inp)
        run = (lambda i, w=None: self._hold_or_ship(i, owned, w)) if hold_rows else self._ship
        try:
            return self.controller.step(inp, run, decided, held, at)
        finally:
            if self.gate is not None:
                self.gate.set(gate_value(self.controller))

    def step_v1(self, inp: Any, timeout: float) -> Any | None:
        """A V1 step (step thread): the step's :class:`StepOutput` once the draft thread has run it,
        or None without waiting while the controller's choice is known to be "nothing"
        (:meth:`~.controller.Controller.off_budget`, counted at the last step waited for, when the
        draft thread was idle, and 0 as soon as that thread finds drafting would pay again: then a
        step already handed over drafts one step late, otherwise the decisions are the ones waiting
        every step gives) and the rows are on the host: the step drafts nothing, and its rows
        (copied first: the runner reuses its buffers) go to the draft thread to be held like any off
        step's. Its failures are recorded there; the caller's step has no drafts either way."""
        ctl = self.controller
        if ctl is None or self._off_budget <= 0 or ctl.off_budget() <= 0 or not OffRows.host_only(inp):
            def waited(client):
                out = self.run_step(inp, hold_rows=True)
                self._off_budget = ctl.off_budget() if ctl is not None else 0
                return out
            self._off_budget = 0
            return self.call(waited, timeout=timeout)
        self._off_budget -= 1
        owned, at = OffRows.own(inp), ctl.clock()

        def held(client):
            try:
                self.run_step(owned, held=True, hold_rows=True, at=at, owned=True)
            except Exception:  # noqa: BLE001 - fail closed, like a step waited for
                self.on_failure("step", "the remote draft step")
        self.call(held, wait=False)
        return None

    def _hold_or_ship(self, inp: Any, owned: bool = False, while_waiting: Callable[[], None] | None = None) -> Any:
        if inp.k == 0 and self.controller.stays_off() and self.off_rows.fits(inp):
            self.off_rows.add(inp, owned)
            return StepOutput(torch.full((inp.num_requests, 0), -1, dtype=torch.int64), deferred=True)
        return self._ship(inp, while_waiting)

    def _ship(self, inp: Any, while_waiting: Callable[[], None] | None = None) -> Any:
        self.ship_held()
        return self.client.step(inp, while_waiting)

    def ship_held(self) -> None:
        """Send the rows :attr:`off_rows` holds (draft thread only): before anything else that
        reaches the server, so it sees every request's rows in order."""
        merged = self.off_rows.take()
        if merged is not None:
            self.client.step(merged)

    def finish(self, req_ids: list[str]) -> None:
        """Free requests vLLM dropped (not waited for): the rows :attr:`off_rows` holds for them are
        forgotten, never shipped after their free (the other requests' stay held); the controller
        forgets them."""
        controller = self.controller

        def finish(client):
            try:
                self.off_rows.drop(req_ids)
                client.finish(req_ids)
            except Exception:  # noqa: BLE001 - counted like a free that fails on the step thread
                self.on_failure("free", "freeing departed requests")
            finally:
                if controller is not None:
                    controller.forget(req_ids)
        self.call(finish, wait=False)

    def flush(self, timeout: float) -> None:
        """Wait until everything handed to the draft thread, held rows included, is on the server."""
        self.call(lambda c: c.flush(), timeout=timeout, after_held=True)

    def close(self, timeout: float) -> None:
        """Stop the thread after the queued work (bounded), close the client; the fence is
        released for good either way. Idempotent; a pipeline the watchdog stopped is closed too."""
        if self._shut:
            return
        self._shut = self._closed = True
        self._jobs.put(_STOP)
        self._thread.join(timeout)
        self.fence.close()
        if self.gate is not None:
            self.gate.close()
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - shutdown must not raise
            log.debug("k3-accel: closing the draft client failed", exc_info=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    # ----------------------------------------------------------- draft thread
    def _run(self) -> None:
        try:
            while True:
                job = self._jobs.get()
                if job is _STOP:
                    return
                fn, reply = job
                self._where["jobs"] += 1
                try:
                    value = fn(self.client)
                    if reply is not None:
                        reply[1].append((True, value))
                except BaseException as exc:  # noqa: BLE001 - reported to the caller / failure log
                    if reply is not None and reply[0] is not None:
                        reply[1].append((False, exc))
                    else:                    # nobody waits for it: counted like the thread's other failures
                        self.on_failure("step", "a draft-thread job")
                finally:
                    if reply is not None and reply[0] is not None:
                        reply[0].set()
        finally:
            self.fence.close()          # nothing may wait on this thread any more

    def _step(self, launch: Any, seq: int | None, held: bool = False) -> None:
        rows = self.reply[seq % 2] if seq is not None else None
        self._where.update(step=seq, since=time.monotonic())
        self._enter("wait_ready")
        try:
            try:
                # the slot's previous reply (step seq - 2) is copied to the device before this
                # step's launch event: only then may it be overwritten
                launch.wait_ready()
                if rows is not None:
                    rows.fill_(-1)
                    self.confidence[seq % 2].fill_(-1.0)
                self._enter("step_input")
                inp = launch.step_input()
            except Exception:  # noqa: BLE001 - fail closed: the reply is -1
                if rows is not None:
                    rows.fill_(-1)
                self.on_failure("step_input", "building the step input")
                return
            try:
                self._enter("client_step")
                out = self.run_step(inp, None if seq is None else lambda proposing: proposing or self._release(seq),
                                    held)
            except Exception:  # noqa: BLE001
                self.on_failure("step", "the remote draft step")
                return
            self._enter("write")
            if rows is not None and inp.k > 0 and out.drafts.numel():
                keep = torch.from_numpy(np.asarray(launch.keep, dtype=np.int64))
                with self._lock:                   # a step released early keeps its "no drafts"
                    if seq not in self._expired and seq not in self._released:
                        try:
                            rows[keep, :inp.k] = out.drafts
                            if "confidence" in out.extra:
                                self.confidence[seq % 2][keep, :inp.k] = out.extra["confidence"].float()
                        except Exception:  # noqa: BLE001 - fail closed: never half a reply
                            rows.fill_(-1)
                            self.confidence[seq % 2].fill_(-1.0)
                            if self.controller is not None:
                                self.controller.given = {}
                            self.on_failure("step", "writing the step's drafts")
                    elif self.controller is not None:   # the GPU went on without them: none is verified
                        self.controller.given = {}
        finally:
            launch.release()
            if seq is not None:
                self.fence.signal(seq)
                with self._lock:
                    self._pending.pop(seq, None)
                    self._expired.discard(seq)
                    self._released.discard(seq)
                self._where["last_done"] = seq
            self._enter(None)

    def _release(self, seq: int) -> None:
        """The controller asks no drafts of step ``seq``: the GPU goes on now (its reply is all "no
        draft" since the step began), while the step's rows are still being shipped."""
        with self._lock:
            self._released.add(seq)
        self.fence.signal(seq)

    def _enter(self, phase: str | None) -> None:
        """The draft thread moves on to ``phase`` (None: the step is done); the time it spent in the
        previous one goes to the client's phase timings as ``v2.<phase>``: where a step's time
        goes between its launch and its fence (``wait_ready`` includes the GPU reaching the launch)."""
        now = time.perf_counter()
        prev, since = self._where.get("phase"), self._where.get("t")
        telemetry = getattr(self.client, "telemetry", None)
        if telemetry is not None and prev not in (None, "done") and since is not None:
            telemetry.add(f"v2.{prev}", now - since)
        self._where.update(phase=phase or "done", t=now)


def _nothing(inp: Any, while_waiting: Any = None) -> StepOutput:
    return StepOutput(torch.full((len(inp.req_ids), 0), -1, dtype=torch.int64), deferred=True)


__all__ = ["DraftPipeline", "PipelineClosed"]
