"""The draft thread can never hang the engine: a step stuck on the draft thread (here a launch
whose copy never completes, a stand-in for a GPU event that never fires) releases the fence
after ``stall_s``, says where every thread was, and turns remote drafting off; nothing the step
thread does afterwards raises into vLLM."""
from __future__ import annotations

import threading
import time

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
