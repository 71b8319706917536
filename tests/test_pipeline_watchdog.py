"""The draft thread can never hang the engine: a step stuck on the draft thread (here a launch
whose copy never completes, a stand-in for a GPU event that never fires) releases the fence
after ``stall_s``, says where every thread was, and turns remote drafting off; nothing the step
thread does afterwards raises into vLLM."""
from __future__ import annotations

import threading

import pytest

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


def test_a_stuck_step_releases_the_gpu_and_drafting_stays_off(capfd):
    failures: list[str] = []
    fence = HostFence()
    pipe = DraftPipeline(NoClient(), fence, 4, 3, lambda kind, what: failures.append(kind), stall_s=0.3)
    launch = StuckLaunch()
    try:
        seq = pipe.submit(launch, propose=True)
        assert seq == 1
        assert fence.wait(seq, timeout=60)            # released without the draft thread
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


def test_a_slow_step_that_finishes_in_time_is_not_a_stall():
    failures: list[str] = []
    fence = HostFence()
    pipe = DraftPipeline(NoClient(), fence, 4, 3, lambda kind, what: failures.append(kind), stall_s=30)
    launch = StuckLaunch()
    try:
        seq = pipe.submit(launch, propose=True)
        assert not fence.wait(seq, timeout=0.5)        # the GPU still waits for the step...
        launch.gate.set()                             # ...which then ends (failing closed: no real client)
        assert fence.wait(seq, timeout=60)
        assert not pipe.stalled and "stalled" not in failures
        assert pipe.call(lambda c: "still here", timeout=60) == "still here"
    finally:
        launch.gate.set()
        pipe.close(5)
