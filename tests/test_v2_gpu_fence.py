"""On a GPU: the V2 step launches its context and returns; the compute stream, not the host,
waits for the draft server's reply (``cuStreamWaitValue64`` on a host-written word).

No vLLM needed: the batch is a stand-in with vLLM's ``InputBatch`` field names on CUDA;
the draft server is a real ``k3-draft-server --engine ngram`` process reached through a
relay that can hold replies back.
"""
from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest
import torch

from helpers.relay import Relay
from helpers.server import ServerProcess
from helpers.standin import dev, no_host_sync
from helpers.steps import settings
from helpers.v2_sim import expected

pytestmark = pytest.mark.gpu
K = 4


def _spin(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` milliseconds."""
    torch.cuda._sleep(int(ms * 1.98e6 / 1000 * 1000))


def test_the_stream_waits_for_the_host_word_and_the_host_does_not():
    from k3_accel.vllm.spec_decode.fence import StreamFence

    dev_ = torch.device("cuda")
    fence = StreamFence(dev_)
    reply = torch.zeros(4, dtype=torch.int64, pin_memory=True)
    out = torch.zeros(4, dtype=torch.int64, device=dev_)
    stream = torch.cuda.current_stream()
    fence.enqueue(1, stream)
    out.copy_(reply, non_blocking=True)
    done = torch.cuda.Event()
    done.record(stream)
    time.sleep(0.2)
    assert not done.query()                       # the host is here; the GPU still waits for the word
    reply.copy_(torch.arange(1, 5))
    fence.signal(1)
    done.synchronize()
    assert out.tolist() == [1, 2, 3, 4]
    fence.close()
    fence.enqueue(10 ** 9, stream)                 # released for good: never blocks again
    torch.cuda.synchronize()


def test_a_host_thread_waits_on_the_gpu_fence_until_signal_or_close():
    """The step thread's yield to the draft thread (``draft_priority``) waits on the real fence."""
    from k3_accel.vllm.spec_decode.fence import StreamFence
    from k3_accel.vllm.spec_decode.pipeline import DraftPipeline

    fence = StreamFence(torch.device("cuda"))
    assert not fence.wait(1, timeout=0.05)
    seen: list = []
    waiter = threading.Thread(target=lambda: seen.append(fence.wait(2, timeout=60)), daemon=True)
    waiter.start()
    fence.signal(1)
    waiter.join(0.3)
    assert waiter.is_alive()                      # 1 < 2: still waiting
    fence.signal(2)
    waiter.join(30)
    assert seen == [True]
    pipe = DraftPipeline(types.SimpleNamespace(start=lambda s: None, close=lambda: None), StreamFence(
        torch.device("cuda")), 4, 3, lambda kind, what: None, deadline_s=60, priority=True)
    assert pipe.priority                          # a fence the GPU waits on: the step thread yields
    waiter = threading.Thread(target=lambda: seen.append(pipe.yield_to_drafts(5)), daemon=True)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()
    pipe.close(5)                                 # releases the fence for good
    waiter.join(30)
    assert not waiter.is_alive() and pipe.fence.value() >= 4


def _batch(device, prompts: dict[str, list[int]]):
    """An InputBatch stand-in: every request's whole prompt as one proposing chunk."""
    ids = list(prompts)
    counts = np.array([len(p) for p in prompts.values()], dtype=np.int32)
    qsl = np.zeros(len(ids) + 1, dtype=np.int32)
    np.cumsum(counts, out=qsl[1:])
    tokens = torch.tensor([t for p in prompts.values() for t in p], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(len(p)) for p in prompts.values()]).to(device)
    slots = np.arange(len(ids))
    return types.SimpleNamespace(
        req_ids=ids, num_reqs=len(ids), idx_mapping=dev(torch.from_numpy(slots).to(device)),
        idx_mapping_np=slots, query_start_loc=dev(torch.from_numpy(qsl).to(device)), query_start_loc_np=qsl,
        input_ids=dev(tokens), positions=dev(positions), num_computed_tokens_np=np.zeros(len(ids), np.int32),
        num_computed_prefill_tokens_np=np.zeros(len(ids), np.int32), prefill_len_np=counts,
        num_scheduled_tokens=counts)


def test_a_drafting_step_returns_before_the_reply_and_the_drafts_follow(client_factory):
    from k3_accel.transport.client import DraftClient
    from k3_accel.vllm.spec_decode.fence import StreamFence
    from k3_accel.vllm.spec_decode.pipeline import DraftPipeline
    from k3_accel.vllm.spec_decode.v2_launch import DeviceRows, LaunchSlots, launch

    device = torch.device("cuda")
    server = ServerProcess("--engine", "ngram")
    relay = Relay(server.address)
    failures = []
    pipe = DraftPipeline(DraftClient(settings(relay.address, num_speculative_tokens=K, propose_timeout_ms=5000)),
                         StreamFence(device), 4, K, lambda kind, what: failures.append(kind))
    try:
        prompts = {"a": [1, 2, 3, 1, 2, 3, 1], "b": [5, 6, 7, 5, 6]}
        anchors = [2, 7]
        rows = DeviceRows(64, 0, torch.bfloat16, 4, device)
        slots = LaunchSlots(2, 64, 0, torch.bfloat16, 4, pin=True)
        last = dev(torch.tensor(anchors + [0, 0], dtype=torch.int64, device=device).reshape(4, 1))
        nxt = dev(torch.zeros(1, 4, dtype=torch.int32, device=device))
        out = torch.full((2, K), -1, dtype=torch.int64, device=device)
        pipe.call(lambda c: c.server_stats(), timeout=30)          # connected
        relay.pause()                                              # the reply will wait
        _spin(50)                                                  # the "forward" still runs
        batch = _batch(device, prompts)
        with no_host_sync():
            step = launch(rows, slots, batch, None, dev(torch.ones(2, dtype=torch.int32, device=device)),
                          dev(torch.zeros(2, dtype=torch.int32, device=device)), last, nxt, np.arange(2), K, {},
                          None, 5.0)
            seq = pipe.submit(step, propose=True)
            pipe.fence.enqueue(seq, torch.cuda.current_stream())
            out.copy_(pipe.reply_rows(seq, 2, K), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.3)
        assert not done.query()      # the step returned with the relay still holding the reply: the GPU waits
        relay.resume()
        done.synchronize()
        want = [expected(prompts["a"], 2), expected(prompts["b"], 7)]
        assert out.tolist() == want and failures == []
    finally:
        relay.resume()
        pipe.close(10)
        relay.close()
        server.stop()


def test_a_step_scheduled_fewer_drafts_than_k_gets_the_reply_that_comes_after_it():
    """vLLM's scheduler may ask a step for fewer drafts than K (``num_speculative_tokens_per_batch_size``).
    The first columns of the reply must reach the GPU as the draft thread writes them, after the
    step returned: a column slice of the pinned reply is not dense, and torch copies such a source
    from the host at once (before the reply is there), not when the stream reaches the copy."""
    from k3_accel.transport.api import StepOutput
    from k3_accel.vllm.spec_decode.core import RemoteDrafter
    from k3_accel.vllm.spec_decode.fence import StreamFence
    from k3_accel.vllm.spec_decode.pipeline import DraftPipeline
    from k3_accel.vllm.spec_decode.v2 import RemoteSpeculatorMixin
    from k3_accel.vllm.spec_decode.v2_launch import DeviceRows, LaunchSlots

    device, max_reqs, k = torch.device("cuda"), 4, 2
    go = threading.Event()

    def step(inp, while_waiting=None):           # the server's reply, once the test lets it come
        assert go.wait(30)
        return StepOutput(torch.arange(inp.num_requests * inp.k, dtype=torch.int64).reshape(-1, inp.k) + 100)

    client = types.SimpleNamespace(start=lambda s: None, close=lambda: None, step=step)
    pipe = DraftPipeline(client, StreamFence(device), max_reqs, K, lambda kind, what: None)
    session = types.SimpleNamespace(
        is_driver=True, ships_hidden=False, pipeline=pipe, client=client, wants_history=frozenset,
        settings=types.SimpleNamespace(timeout_s=30.0, propose_timeout_s=5.0), link_down=lambda ids: False,
        plane_ring=lambda: None, broadcast=lambda t: None, finish=lambda ids: None)
    spec = RemoteSpeculatorMixin.__new__(RemoteSpeculatorMixin)
    spec.device, spec.req_states, spec.num_speculative_steps, spec.vocab_size = device, None, K, 1000
    spec.sample_drafts, spec._server_confidence, spec.hold, spec._sampling = False, None, None, None
    spec.drafts = torch.full((max_reqs, K), -1, dtype=torch.int64, device=device)
    spec._confidence = torch.zeros((max_reqs, K), dtype=torch.float32, device=device)
    spec.core = RemoteDrafter(device)
    spec.core.session = session
    spec.rows = DeviceRows(64, 0, torch.bfloat16, max_reqs, device)
    spec.slots = LaunchSlots(2, 64, 0, torch.bfloat16, max_reqs, pin=True)
    try:
        prompts = {"a": [1, 2, 3, 1, 2, 3, 1], "b": [5, 6, 7, 5, 6]}
        last = torch.tensor([2, 7, 0, 0], dtype=torch.int64, device=device).reshape(max_reqs, 1)
        nxt = torch.zeros(1, max_reqs, dtype=torch.int32, device=device)
        ones, zeros = (torch.full((2,), v, dtype=torch.int32, device=device) for v in (1, 0))
        out = spec.propose(_batch(device, prompts), None, None, None, None, ones, zeros, last, nxt, None, None,
                           num_speculative_tokens=k)
        time.sleep(0.2)
        go.set()                                 # the reply comes after the step returned
        torch.cuda.synchronize()
        assert out.tolist() == [[100, 101, -1, -1], [104, 105, -1, -1]]
    finally:
        go.set()
        pipe.close(10)
