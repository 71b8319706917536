"""``draft_priority``: on the V2 runner, vLLM's step thread yields to the draft thread.

Right after it submits proposing step ``s`` the step thread waits (GIL released) until step
``s - 1`` has its drafts, never for step ``s`` itself, at most the GPU deadline, and not at all
with the setting off, or with a fence the host waits on anyway (a CPU device). Closing the
pipeline releases a waiting step thread.

Real pieces: the :class:`DraftPipeline` and its draft thread. Stand-ins: a launch whose copy
completes when the test says so, a client that is never reached (the step then fails closed,
which still signals its fence), and, for the fence the GPU waits on, a :class:`HostFence` that
says it is on the device: this machine has no CUDA. ``tests/test_v2_gpu_fence.py`` runs the
same rule with the real :class:`StreamFence` on a GPU.
"""
from __future__ import annotations

import threading

import pytest

from k3_accel.config import K3Config, load_config
from k3_accel.vllm.spec_decode.fence import HostFence
from k3_accel.vllm.spec_decode.pipeline import DraftPipeline


class DeviceFence(HostFence):
    """A fence the GPU would wait on (stand-in for :class:`StreamFence` on this CPU machine)."""
    on_device = True


class NoClient:
    def start(self, wait_s):
        pass

    def close(self):
        pass


class Launch:
    """A step's launch whose device copy completes on :meth:`done`."""

    def __init__(self):
        self.copied = threading.Event()

    def done(self):
        self.copied.set()

    def wait_ready(self):
        self.copied.wait()

    def release(self):
        pass


def _pipe(priority=True, fence=None, deadline_s=60.0) -> DraftPipeline:
    return DraftPipeline(NoClient(), fence if fence is not None else DeviceFence(), 4, 3,
                         lambda kind, what: None, deadline_s=deadline_s, priority=priority)


def _yield_in_thread(pipe: DraftPipeline, seq: int) -> tuple[threading.Thread, list]:
    seen: list = []

    def run():
        pipe.yield_to_drafts(seq)
        seen.append(pipe.fence.value())      # the fence when the step thread went on

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, seen


def test_the_step_thread_waits_for_the_step_before_never_for_its_own():
    pipe = _pipe()
    launches = [Launch() for _ in range(3)]
    try:
        first = pipe.submit(launches[0], propose=True)
        assert pipe.yield_to_drafts(first) == 0.0                # nothing before the first step
        second = pipe.submit(launches[1], propose=True)
        waiting, seen = _yield_in_thread(pipe, second)
        waiting.join(0.3)
        assert waiting.is_alive() and not seen                   # step 1 has no drafts yet: it waits
        launches[0].done()                                       # step 1 ends (fails closed: no client)
        waiting.join(30)
        assert not waiting.is_alive()
        assert seen[0] >= first and pipe.fence.value() < second  # went on without step 2's drafts
        third = pipe.submit(launches[2], propose=True)
        waiting, seen = _yield_in_thread(pipe, third)
        waiting.join(0.3)
        assert waiting.is_alive()                                # now it is step 2 it waits for
        launches[1].done()
        waiting.join(30)
        assert not waiting.is_alive() and seen[0] >= second
    finally:
        for launch in launches:
            launch.done()
        pipe.close(5)


@pytest.mark.parametrize("priority, fence", [(False, DeviceFence), (True, HostFence)])
def test_off_or_with_a_fence_the_host_waits_on_it_never_waits(priority, fence):
    pipe = _pipe(priority, fence())
    launches = [Launch(), Launch()]
    try:
        pipe.submit(launches[0], propose=True)
        second = pipe.submit(launches[1], propose=True)
        assert pipe.yield_to_drafts(second) == 0.0               # step 1 still unfinished
        assert pipe.fence.value() == 0
    finally:
        for launch in launches:
            launch.done()
        pipe.close(5)


@pytest.mark.parametrize("deadline_s", [None, 0.2])
def test_the_wait_ends_at_the_deadline(deadline_s):
    """Step 1's launch never completes, so it never has drafts: the wait ends by its deadline. With a
    GPU deadline the watchdog may release the fence at that same deadline (either may end the wait);
    without one nothing can move the fence, and the wait must end by itself."""
    pipe = _pipe(deadline_s=deadline_s)
    launches = [Launch(), Launch()]
    try:
        pipe.submit(launches[0], propose=True)
        second = pipe.submit(launches[1], propose=True)
        waiting, seen = _yield_in_thread(pipe, second)
        waiting.join(30)
        assert not waiting.is_alive() and not launches[0].copied.is_set()
        assert len(seen) == 1 and (seen[0] == 0 if deadline_s is None else 0 <= seen[0] <= second)
    finally:
        for launch in launches:
            launch.done()
        pipe.close(5)
    pipe = _pipe()
    launches = [Launch(), Launch()]
    pipe.submit(launches[0], propose=True)
    second = pipe.submit(launches[1], propose=True)
    waiting, seen = _yield_in_thread(pipe, second)
    waiting.join(0.3)
    assert waiting.is_alive()
    closer = threading.Thread(target=pipe.close, args=(0.5,), daemon=True)
    closer.start()                                               # the draft thread is stuck in step 1
    waiting.join(30)
    assert not waiting.is_alive()                                # released by close, not by step 1
    for launch in launches:
        launch.done()
    closer.join(30)


@pytest.mark.parametrize("raw, want", [(True, True), ("on", True), ("1", True), (False, False), ("off", False),
                                       ("0", False)])
def test_draft_priority_is_on_unless_switched_off(raw, want):
    assert K3Config().draft_priority is True
    assert load_config({"k3_accel": {"draft_priority": raw}}, environ={}).draft_priority is want
    assert load_config(None, environ={"VLLM_K3_DRAFT_PRIORITY": str(raw)}).draft_priority is want


def test_closing_the_pipeline_releases_a_waiting_step_thread():
    pipe = _pipe(deadline_s=600.0)           # neither the wait's deadline nor the watchdog's comes first
    launches = [Launch(), Launch()]
    pipe.submit(launches[0], propose=True)
    second = pipe.submit(launches[1], propose=True)
    waiting, seen = _yield_in_thread(pipe, second)
    waiting.join(0.3)
    assert waiting.is_alive() and not seen   # step 1 has no drafts: it waits
    closer = threading.Thread(target=pipe.close, args=(5,), daemon=True)
    closer.start()
    waiting.join(30)
    assert not waiting.is_alive() and len(seen) == 1 and not launches[0].copied.is_set()
    for launch in launches:
        launch.done()
    closer.join(30)
