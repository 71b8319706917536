"""The draft thread can never hang the engine: a step stuck on the draft thread (here a launch
whose copy never completes, a stand-in for a GPU event that never fires) releases the fence
after ``stall_s``, says where every thread was, and turns remote drafting off; nothing the step
thread does afterwards raises into vLLM."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from k3_accel.vllm.spec_decode.fence import HostFence
from k3_accel.vllm.spec_decode.pipeline import DraftPipeline, PipelineClosed


class NoClient:
    """The draft thread's client: nothing here is reached before the stuck launch."""
    def start(self, wait_s):
        pass

    def close(self):
        pass


class StuckLaunch:
    def __init__(self):
        self.gate = threading.Event()
        self.released = threading.Event()

    def wait_ready(self):
        self.gate.wait()                 # the copy's event never completes

    def release(self):
        self.released.set()


def _pipeline(stall_s: float, failures: list[str]) -> DraftPipeline:
    return DraftPipeline(NoClient(), HostFence(), 4, 3, lambda kind, what: failures.append(kind), stall_s=stall_s)


def test_a_stuck_step_releases_the_gpu_and_drafting_stays_off(capfd):
    failures: list[str] = []
    pipe = _pipeline(0.3, failures)
    launch = StuckLaunch()
    try:
        seq = pipe.submit(launch, propose=True)
        assert seq == 1
        assert pipe.fence.wait(seq, timeout=60)       # released without the draft thread
        assert pipe.stalled and failures == ["stalled"]
        assert "in wait_ready" in capfd.readouterr().err   # every thread's stack: where the step is stuck
        with pytest.raises(PipelineClosed):
            pipe.submit(StuckLaunch(), propose=True)   # v2._ship turns this into "no drafts"
        assert pipe.call(lambda c: None, wait=False) is None   # frees, link upkeep: never raise
        with pytest.raises(PipelineClosed):
            pipe.call(lambda c: None)
    finally:
        launch.gate.set()
        pipe.close(5)
    assert launch.released.wait(10)


@pytest.mark.parametrize("steps", [1, 3])
def test_finished_steps_are_never_overdue_however_long_the_engine_idles(steps):
    """A healthy engine that drafts, then serves nothing for longer than the stall bound, keeps
    drafting: only a step still unfinished counts (a watchdog that remembered finished steps would
    turn remote drafting off after every idle minute)."""
    failures: list[str] = []
    pipe = _pipeline(30, failures)
    launches = [StuckLaunch() for _ in range(steps)]
    try:
        seqs = [pipe.submit(launch, propose=True) for launch in launches]
        late = time.monotonic() + 1000                 # "now", long past every submission's bound
        assert pipe.overdue(late) == seqs[0]           # the oldest unfinished step
        assert not pipe.fence.wait(seqs[0], timeout=0.2)      # the GPU still waits for it...
        for launch in launches:
            launch.gate.set()                          # ...until the steps end (failing closed: no real client)
        assert pipe.fence.wait(seqs[-1], timeout=60)
        assert pipe.call(lambda c: "still here", timeout=60) == "still here"
        assert pipe.overdue(late) is None and pipe.overdue(late + 10 ** 6) is None
        assert not pipe.stalled and failures.count("stalled") == 0
    finally:
        for launch in launches:
            launch.gate.set()
        pipe.close(5)


class Out:
    def __init__(self, drafts):
        self.drafts, self.extra = drafts, {}


class GatedClient(NoClient):
    """The client's step waits for ``gate`` (a server that paused: a first-use compile, a full ring)."""
    def __init__(self):
        self.gate, self.entered, self.done = threading.Event(), threading.Event(), threading.Event()

    def step(self, inp, while_waiting=None):
        self.entered.set()
        self.gate.wait()
        self.done.set()
        return Out(torch.full((len(inp.keep), inp.k), 7, dtype=torch.int64))


class ReadyLaunch:
    """A launched step whose copy is done (no event): ``keep`` = the kept batch rows."""
    def __init__(self, keep, k):
        self.keep, self.k, self.released = np.asarray(keep), k, threading.Event()

    def wait_ready(self):
        pass

    def step_input(self):
        return self

    def release(self):
        self.released.set()


def test_the_gpu_waits_no_longer_than_the_deadline_and_late_drafts_are_never_written():
    """A proposing step whose drafts do not come within the deadline releases the GPU with "no
    drafts" while the draft thread is still at it; the pipeline is then behind (the speculator asks
    for nothing the GPU would wait on), the late drafts never land in the reply, and once the thread
    has caught up the next step drafts as usual. Nothing is turned off: a pause is not a failure."""
    failures: list[str] = []
    client = GatedClient()
    pipe = DraftPipeline(client, HostFence(), 4, 3, lambda kind, what: failures.append(kind),
                         stall_s=3600, deadline_s=0.05)
    try:
        first = ReadyLaunch([0, 2], 3)
        seq = pipe.submit(first, propose=True)
        assert client.entered.wait(60)
        assert pipe.fence.wait(seq, timeout=60)                # released ...
        assert not client.done.is_set()                        # ... while the step still waits for the server
        assert pipe.behind and failures == ["deadline"]
        assert (pipe.reply_rows(seq, 4, 3) == -1).all()
        client.gate.set()
        assert first.released.wait(60)
        assert pipe.call(lambda c: "caught up", timeout=60) == "caught up"
        assert not pipe.behind
        assert (pipe.reply_rows(seq, 4, 3) == -1).all()        # the late drafts were dropped, not written
        second = ReadyLaunch([1], 3)
        seq2 = pipe.submit(second, propose=True)
        assert pipe.fence.wait(seq2, timeout=60)
        assert pipe.reply_rows(seq2, 4, 3)[1].tolist() == [7, 7, 7]
        assert pipe.alive and not pipe.stalled and failures == ["deadline"]
    finally:
        client.gate.set()
        pipe.close(5)


def test_a_released_step_never_reads_the_drafts_its_slot_holds_from_two_steps_before():
    """Reply slots alternate between steps: a step the deadline releases before the draft thread even
    reached it (the thread still waits on the step before) reads "no drafts", not the drafts an earlier
    step left in the same slot (the GPU would verify another step's tokens)."""
    failures: list[str] = []
    client = GatedClient()
    pipe = DraftPipeline(client, HostFence(), 4, 3, lambda kind, what: failures.append(kind),
                         stall_s=3600, deadline_s=0.05)
    try:
        client.gate.set()
        first = pipe.submit(ReadyLaunch([0, 1], 3), propose=True)
        assert pipe.fence.wait(first, timeout=60)
        assert pipe.call(lambda c: "done", timeout=60) == "done"
        assert pipe.reply_rows(first, 4, 3)[:2].tolist() == [[7, 7, 7]] * 2
        client.gate.clear()
        client.entered.clear()
        pipe.submit(ReadyLaunch([0, 1], 3), propose=True)             # the server pauses on this one
        assert client.entered.wait(60)
        third = pipe.submit(ReadyLaunch([0, 1], 3), propose=True)     # queued behind it
        assert third % 2 == first % 2                                  # the first step's slot
        assert pipe.fence.wait(third, timeout=60)                      # released by the deadline
        assert (pipe.reply_rows(third, 4, 3) == -1).all()
        assert "deadline" in failures
    finally:
        client.gate.set()
        pipe.close(5)


def test_a_step_is_timed_from_when_the_gpu_reaches_it():
    """The deadline counts from the launch event's completion (the GPU got there), not from the
    submission: a step whose copy has not run yet is never released early."""
    class Event:
        done = False

        def query(self):
            return self.done

    pipe = DraftPipeline(GatedClient(), HostFence(), 4, 3, lambda kind, what: None)   # no watch thread:
    pipe.deadline_s = 1.0                                                                  # this test drives expire()
    launch = ReadyLaunch([0], 3)
    launch.ready = Event()
    try:
        with pipe._lock:
            pipe._pending[1] = [0.0, launch, None]
        assert pipe.expire(100.0) == []                         # long after submission, but not reached yet
        assert pipe.expire(105.0) == []                         # (nor counted from the first look)
        launch.ready.done = True
        assert pipe.expire(110.0) == []                         # reached now: its clock starts here
        assert pipe.expire(110.5) == [] and pipe.expire(111.0) == [1]
        assert pipe.fence.wait(1, timeout=0)
    finally:
        pipe.close(5)


def test_each_step_is_timed_by_phase_in_the_clients_timings():
    """Where a drafting step's time goes between its launch and its fence (the GPU waits for all of
    it on V2): each phase of the draft thread once per step, in the client's timings."""
    from k3_accel.transport.timing import Telemetry
    client = GatedClient()
    client.gate.set()
    client.telemetry = Telemetry()
    pipe = DraftPipeline(client, HostFence(), 4, 3, lambda kind, what: None)
    try:
        for _ in range(2):
            assert pipe.fence.wait(pipe.submit(ReadyLaunch([0], 3), propose=True), timeout=60)
        pipe.call(lambda c: None, timeout=60)
        phases = client.telemetry.snapshot()["phases"]
        names = ("v2.wait_ready", "v2.step_input", "v2.client_step", "v2.write")
        assert all(phases[n]["count"] == 2 for n in names), phases
    finally:
        pipe.close(5)


class StepLaunch(ReadyLaunch):
    """A launched step of two sampling requests (a real StepInput, for a real controller)."""
    def __init__(self, k):
        super().__init__([0, 1], k)

    def step_input(self):
        from k3_accel.transport.api import StepInput
        return StepInput(["a", "b"], [1, 1], torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                         [True, True], [3, 3], [1, 1], k=self.k)


class GatedStepClient(GatedClient):
    """Sends at once, then waits for ``gate`` (the reply, or a full ring); ``asked``: each step's K."""
    def __init__(self):
        super().__init__()
        self.asked = []

    def step(self, inp, while_waiting=None):
        self.asked.append(inp.k)
        self.entered.set()
        if while_waiting is not None and inp.k > 0:     # the propose is out, its reply on its way
            while_waiting()
        self.gate.wait()
        self.done.set()
        return Out(torch.full((len(inp.req_ids), inp.k), 7, dtype=torch.int64))


@pytest.mark.parametrize("state", ["drafting", "turns off", "stays off"])
def test_a_step_the_controller_drafts_nothing_for_releases_the_gpu_before_its_reply(state):
    """When the adaptive controller asks no drafts of a step, the GPU (waiting on V2 for that step's
    drafts) goes on as soon as that is decided, never after the step's reply (nor, while speculation
    is off, after its rows are staged and sent: the GPU would wait for the staging ring every off
    step). While speculation is on the step goes out as a propose first and the choice is made while
    its reply travels; one that then drafts nothing drops the drafts. A step that drafts waits."""
    from k3_accel.vllm.spec_decode.controller import Controller, ControllerSettings
    drafting = state == "drafting"
    controller = Controller(ControllerSettings(k_max=3, probe_interval=1000))
    controller.acceptance.tried[:] = 1000.0                         # measured: every draft rejected
    controller.acceptance.accepted[:] = 1000.0 if drafting else 0.0  # (or every one accepted)
    for tokens in (1, 2, 3, 4):
        controller.cost.observe(tokens, 0.010 + 0.001 * tokens)
    controller.cost.observe_round_trip(0.002)
    if state == "stays off":
        controller._off = 1                                          # the step before drafted nothing
    client = GatedStepClient()
    pipe = DraftPipeline(client, HostFence(), 4, 3, lambda kind, what: None, controller=controller)
    try:
        seq = pipe.submit(StepLaunch(3), propose=True)
        assert client.entered.wait(60)                               # the rows are being shipped ...
        assert pipe.fence.wait(seq, timeout=0 if drafting else 60) != drafting   # ... the GPU goes on only if off
        assert not client.done.is_set()
        assert (pipe.reply_rows(seq, 4, 3) == -1).all()              # "no drafts" (so far)
        if not drafting:                                             # shipping past the deadline: no "late"
            pipe.deadline_s = 0.0                                    # step, nothing behind, when the GPU went
            assert pipe.expire(time.monotonic() + 1.0) == [] and not pipe.behind      # on already
        client.gate.set()
        assert pipe.fence.wait(seq, timeout=60)
        assert pipe.call(lambda c: "done", timeout=60) == "done"
        want = [[7, 7, 7]] * 2 if drafting else [[-1, -1, -1]] * 2
        assert pipe.reply_rows(seq, 4, 3)[:2].tolist() == want
        assert client.asked == [0 if state == "stays off" else 3]   # off: an ingest, no propose
    finally:
        client.gate.set()
        pipe.close(5)


class VerifiedLaunch(StepLaunch):
    """The step after: the forward verified ``verified`` draft slots per request and kept none (V2
    without adaptive verification verifies K slots whatever they hold: "no draft" is a filler token)."""
    def __init__(self, k, verified):
        super().__init__(k)
        self.verified = verified

    def step_input(self):
        import dataclasses
        return dataclasses.replace(super().step_input(), num_verified=[self.verified] * 2)


def test_drafts_the_deadline_dropped_are_never_learnt_as_rejected():
    """A step the deadline released gave the GPU "no drafts"; the drafts that came late were never
    written. The controller must not take the filler the target then verified for its drafts'
    rejection: one late reply (a probe's, after an off stretch, is the likeliest) would read as a
    draft that stopped paying."""
    from k3_accel.vllm.spec_decode.controller import Controller, ControllerSettings
    controller = Controller(ControllerSettings(k_max=3, probe_interval=1000))
    controller.acceptance.tried[:] = controller.acceptance.accepted[:] = 1000.0   # measured: all accepted
    for tokens in (1, 2, 3, 4):
        controller.cost.observe(tokens, 0.010 + 0.001 * tokens)
    controller.cost.observe_round_trip(0.002)
    client = GatedStepClient()
    pipe = DraftPipeline(client, HostFence(), 4, 3, lambda kind, what: None, controller=controller,
                         stall_s=3600, deadline_s=0.05)
    try:
        seq = pipe.submit(StepLaunch(3), propose=True)
        assert pipe.fence.wait(seq, timeout=60) and pipe.behind          # released by the deadline
        client.gate.set()
        assert pipe.call(lambda c: "done", timeout=60) == "done"
        assert (pipe.reply_rows(seq, 4, 3) == -1).all()                  # the late drafts: never written
        before = controller.acceptance.global_rate().copy()
        assert pipe.fence.wait(pipe.submit(VerifiedLaunch(3, 3), propose=True), timeout=60)
        assert pipe.call(lambda c: "done", timeout=60) == "done"
        np.testing.assert_array_equal(controller.acceptance.global_rate(), before)
    finally:
        client.gate.set()
        pipe.close(5)


def test_closing_a_pipeline_the_watchdog_stopped_still_closes_its_client():
    """The watchdog turns remote drafting off, but the engine's shutdown must still close the
    client (its goodbye frees the session's contexts on the server, its socket and threads end):
    a stall is no reason to leak them."""
    class Client(NoClient):
        closed = 0

        def close(self):
            Client.closed += 1

    failures: list[str] = []
    pipe = DraftPipeline(Client(), HostFence(), 4, 3, lambda kind, what: failures.append(kind), stall_s=0.3)
    launch = StuckLaunch()
    try:
        seq = pipe.submit(launch, propose=True)
        assert pipe.fence.wait(seq, timeout=60) and pipe.stalled
    finally:
        launch.gate.set()
        pipe.close(5)
        pipe.close(5)                                  # idempotent
    assert Client.closed == 1
    pipe._thread.join(10)
    assert not pipe._thread.is_alive()                 # the draft thread was told to stop too


class BadConfidenceClient(GatedClient):
    """Drafts of the right shape, then a per-draft confidence of the wrong one (a server's bug): the
    reply cannot be written whole."""
    def step(self, inp, while_waiting=None):
        out = super().step(inp, while_waiting)
        out.extra = {"confidence": torch.ones(len(inp.keep) + 1, inp.k)}
        return out


def test_a_reply_that_cannot_be_written_fails_the_step_closed_and_is_counted():
    """Writing a step's drafts into the reply is part of the step: when it fails, the step's reply is
    "no drafts" throughout (never half a reply), the failure is counted like any draft-thread failure,
    and the pipeline goes on."""
    failures: list[str] = []
    client = BadConfidenceClient()
    client.gate.set()
    pipe = DraftPipeline(client, HostFence(), 4, 3, lambda kind, what: failures.append(kind), stall_s=3600)
    try:
        seq = pipe.submit(ReadyLaunch([0, 2], 3), propose=True)
        assert pipe.fence.wait(seq, timeout=60)
        assert pipe.call(lambda c: "done", timeout=60) == "done"
        assert failures == ["step"]
        assert (pipe.reply_rows(seq, 4, 3) == -1).all()
        assert pipe.alive
    finally:
        pipe.close(5)


class FailingFinishClient(NoClient):
    def finish(self, req_ids):
        raise RuntimeError("planted: the free could not be queued")


def test_a_free_that_fails_on_the_draft_thread_is_counted_and_the_controller_forgets():
    """A free runs on the draft thread, not waited for: its failure is counted (``failures.free``) like
    a free that fails on the step thread, and the controller still forgets the requests."""
    from k3_accel.vllm.spec_decode.controller import Controller, ControllerSettings
    controller = Controller(ControllerSettings(k_max=3))
    controller.given = {"a": 3, "b": 2}
    failures: list[str] = []
    pipe = DraftPipeline(FailingFinishClient(), HostFence(), 4, 3, lambda kind, what: failures.append(kind),
                         controller=controller, stall_s=3600)
    try:
        pipe.finish(["a"])
        assert pipe.call(lambda c: "done", timeout=60) == "done"
        assert failures == ["free"]
        assert controller.given == {"b": 2}
    finally:
        pipe.close(5)


def test_a_held_step_the_controller_cannot_count_is_counted_as_a_failure():
    """Counting a held step runs on the draft thread, not waited for: a failure there is counted like
    the draft thread's other failures, never only logged at debug level."""
    from k3_accel.vllm.spec_decode.controller import Controller, ControllerSettings

    class Broken(Controller):
        def step(self, *args, **kwargs):
            raise RuntimeError("planted: the held step could not be counted")
    failures: list[str] = []
    pipe = DraftPipeline(NoClient(), HostFence(), 4, 3, lambda kind, what: failures.append(kind),
                         controller=Broken(ControllerSettings(k_max=3)), stall_s=3600)
    try:
        pipe.count_held(object(), 0.0)
        assert pipe.call(lambda c: "done", timeout=60) == "done"
        assert failures == ["step"]
    finally:
        pipe.close(5)


def test_any_draft_thread_job_not_waited_for_that_fails_is_counted():
    """Link upkeep while the link is down (``session.link_down``) and the client's start run on the
    draft thread and nobody waits for them: a failure there is counted like the thread's others."""
    class Client(NoClient):
        def skip_step(self, req_ids):
            raise RuntimeError("planted: the link could not be serviced")
    failures: list[str] = []
    pipe = DraftPipeline(Client(), HostFence(), 4, 3, lambda kind, what: failures.append(kind), stall_s=3600)
    try:
        pipe.call(lambda c: c.skip_step(["a"]), wait=False, after_held=True)
        assert pipe.call(lambda c: "done", timeout=60) == "done"
        assert failures == ["step"]
        assert pipe.alive
    finally:
        pipe.close(5)
