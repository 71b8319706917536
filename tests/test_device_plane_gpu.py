"""The device data plane on a GPU: a target and a DFlash draft server on one host, hidden rows
GPU to GPU through CUDA IPC (the server on the same device here), control on the socket.

Every comparison is with the host path on the same steps against the same server (the drafts
must be the same: the same rows reach the same engine). No timing is asserted anywhere.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers.server import ServerProcess, src_env
from helpers.steps import settings, wait_until
from helpers.wire import Wire
from k3_accel import protocol as p
from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target
from k3_accel.transport.api import StepInput
from k3_accel.transport.client import DraftClient
from k3_accel.transport.device_plane import DeviceRing

pytestmark = pytest.mark.gpu
WIDTH, K, VOCAB = 256, 7, 512
DEV = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    target = write_tiny_target(root / "target")
    return target, write_tiny_dflash(root / "draft", target)


def gpu_server(checkpoints, *extra: str) -> ServerProcess:
    target, draft = checkpoints
    return ServerProcess("--engine", "dflash", "--draft-model", str(draft), "--target-model", str(target),
                         "--device", "cuda:0", "--memory-budget-mb", "64", *extra)


@pytest.fixture(scope="module")
def server(checkpoints):
    srv = gpu_server(checkpoints)
    yield srv
    assert srv.stop() == 0


def client(address: str, ring: DeviceRing | None = None, **kw) -> DraftClient:
    s = settings(address, context_width=WIDTH, num_speculative_tokens=K, target_vocab_size=VOCAB,
                 hidden_size=WIDTH // 2, aux_layer_ids=(0, 2), hidden_dtype=torch.bfloat16, max_rows=512, **kw)
    return DraftClient(s, device_ring=ring).start()


def context(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB - 1, (n,), generator=gen)
    return tokens.to(DEV), torch.randn(n, WIDTH, generator=gen).to(torch.bfloat16).to(DEV)


def steps(tokens, hidden, prefix: str = ""):
    """Deferred chunks, a propose of two requests (one mid-context, one new), then decode steps."""
    a, b = prefix + "a", prefix + "b"
    yield StepInput([a], [40], torch.arange(40, device=DEV), tokens[:40], [False], [int(tokens[40])], [40], k=K,
                    hidden=hidden[:40])
    yield StepInput([a, b], [20, 30], torch.cat([torch.arange(40, 60), torch.arange(30)]).to(DEV),
                    torch.cat([tokens[40:60], tokens[:30]]), [True, True], [int(tokens[60]), int(tokens[30])],
                    [60, 30], k=K, hidden=torch.cat([hidden[40:60], hidden[:30]]))
    for pos in range(60, 66):                        # decode: a one row each, b one row each
        yield StepInput([a, b], [1, 1], torch.tensor([pos, pos - 30], device=DEV),
                        torch.stack([tokens[pos], tokens[pos - 30]]), [True, True],
                        [int(tokens[pos + 1]), int(tokens[pos - 29])], [pos + 1, pos - 29], k=K,
                        hidden=torch.stack([hidden[pos], hidden[pos - 30]]))


def run(c: DraftClient, seed: int = 3, prefix: str = "") -> list:
    tokens, hidden = context(80, seed)
    out = [c.step(inp).drafts.tolist() for inp in steps(tokens, hidden, prefix)]
    c.flush()
    return out


def failures(c: DraftClient) -> dict:
    return {n: v for n, v in c.stats()["counters"].items() if n.startswith("failures.")}


def test_device_path_drafts_equal_the_host_path(server):
    host = client(server.address, device_plane="off")
    dev = client(server.address)
    try:
        assert dev.stats()["device_plane"]["path"] == "device", dev.stats()["device_plane"]
        assert host.stats()["device_plane"]["path"] == "host"
        before = dev.server_stats()["device_plane"]["fetches"]
        got, want = run(dev), run(host)
        assert got == want and all(x >= 0 for x in want[1][0] + want[1][1])   # the same, and real drafts
        assert not failures(dev) and not failures(host)
        stats = dev.server_stats()
        assert stats["device_plane"]["fetches"] - before >= 8 and stats["errors"] == {}
        assert dev.plane.ring.holds == [0] * dev.plane.ring.depth
    finally:
        dev.close()
        host.close()


def test_rows_in_the_slot_survive_the_target_overwriting_its_buffers(server):
    """The NaN-overwrite test on the IPC ring: deferred chunks from buffers the 'next forward'
    overwrites as soon as the step returns, while the compute stream is still held by a spin
    queued before the step; more chunks than slots, so slots are reused while earlier reads
    may be pending. The server must see every row as it was (NaN rows would fail the request,
    other rows would change the drafts)."""
    tokens, hidden = context(120, seed=5)
    dev = client(server.address, ring_depth=2)
    ref = client(server.address, device_plane="off")
    try:
        assert dev.stats()["device_plane"]["path"] == "device"
        src_tok = torch.empty(20, dtype=torch.int64, device=DEV)
        src_hid = torch.empty(20, WIDTH, dtype=torch.bfloat16, device=DEV)

        def chunk(lo: int, tok, hid) -> StepInput:
            return StepInput(["x"], [20], torch.arange(lo, lo + 20, device=DEV), tok, [False],
                             [int(tokens[lo + 20])], [lo + 20], k=K, hidden=hid)
        for lo in range(0, 100, 20):                                  # 5 chunks over 2 slots
            src_tok.copy_(tokens[lo:lo + 20])
            src_hid.copy_(hidden[lo:lo + 20])
            torch.cuda._sleep(200_000_000)                            # GPU spin queued before the step
            assert dev.step(chunk(lo, src_tok, src_hid)).deferred
            ref.step(chunk(lo, tokens[lo:lo + 20], hidden[lo:lo + 20]))   # the same chunks, host path
            src_tok.fill_(VOCAB - 1)                                  # the next forward writes them
            src_hid.fill_(float("nan"))
        last = StepInput(["x"], [16], torch.arange(100, 116, device=DEV), tokens[100:116], [True],
                         [int(tokens[116])], [116], k=K, hidden=hidden[100:116])
        got = dev.step(last).drafts
        assert not failures(dev), failures(dev)
        want = ref.step(last).drafts
        assert got.tolist() == want.tolist() and bool((got >= 0).all())
        assert dev.server_stats()["errors"] == {}
    finally:
        dev.close()
        ref.close()


def v2_batch(tokens, hidden, lo: int, n: int):
    """One request's rows ``lo .. lo + n`` as vLLM's V2 runner hands them to ``propose`` (an
    ``InputBatch`` stand-in on CUDA, the aux rows as two layers), the next token sampled."""
    import types

    import numpy as np
    qsl = np.array([0, n], dtype=np.int32)
    batch = types.SimpleNamespace(
        req_ids=["v"], num_reqs=1, idx_mapping=torch.zeros(1, dtype=torch.int32, device=DEV),
        idx_mapping_np=np.zeros(1, dtype=np.int32), query_start_loc=torch.from_numpy(qsl).to(DEV),
        query_start_loc_np=qsl, input_ids=tokens[lo:lo + n].to(torch.int32),
        positions=torch.arange(lo, lo + n, device=DEV))
    rows = hidden[lo:lo + n]
    last = torch.zeros(4, 1, dtype=torch.int64, device=DEV)
    last[0, 0] = tokens[lo + n]
    return (batch, [rows[:, : WIDTH // 2].contiguous(), rows[:, WIDTH // 2:].contiguous()],
            torch.ones(1, dtype=torch.int32, device=DEV), torch.zeros(1, dtype=torch.int32, device=DEV), last,
            torch.zeros(1, 4, dtype=torch.int32, device=DEV))


def test_the_v2_launch_compacts_into_the_ring_and_drafts_like_the_host_path(server):
    """V2 on the device plane: the launch writes the step's rows into a slot of the client's ring on
    the compute stream (no host read), the messages name it; a chunk longer than a slot takes the
    host path. The drafts are those of a client on the host path, step for step."""
    import numpy as np

    from helpers.standin import no_host_sync
    from k3_accel.vllm.spec_decode.v2_launch import DeviceRows, LaunchSlots, launch
    ring = DeviceRing(4, 48, WIDTH, torch.bfloat16, DEV)
    on, off = client(server.address, ring=ring), client(server.address, device_plane="off")
    tokens, hidden = context(100, seed=17)
    try:
        assert on.stats()["device_plane"]["path"] == "device"
        got, want, named = [], [], []
        for lo, n in [(0, 60), (60, 30), *((90 + i, 1) for i in range(6))]:    # 60 rows > a slot's 48
            for c, r in ((on, ring), (off, None)):
                rows = DeviceRows(64, WIDTH, torch.bfloat16, 4, DEV)
                slots = LaunchSlots(2, 64, WIDTH, torch.bfloat16, 4, pin=True)
                batch = v2_batch(tokens, hidden, lo, n)              # vLLM's buffers (built outside the check)
                torch.cuda.synchronize()
                with no_host_sync():
                    step = launch(rows, slots, *batch, np.arange(1), K, {}, None, 5.0, ring=r)
                step.wait_ready()
                inp = step.step_input()
                if r is not None:
                    named.append(ring.slot_of(inp.hidden) is not None)
                (got if r is not None else want).append(c.step(inp).drafts.tolist())
                step.release()
        on.flush()
        assert named == [False] + [True] * 7                      # the long chunk went through pinned memory
        assert got == want and all(x >= 0 for x in want[-1][0])  # the same drafts, and real ones
        assert not failures(on) and not failures(off)
        assert ring.holds == [0] * ring.depth
    finally:
        on.close()
        off.close()


def test_a_handle_that_does_not_open_falls_back_to_the_host_path(server):
    class Corrupt(DeviceRing):
        def export(self):
            msg = super().export()
            bad = [p.IpcTensor(**{**{f: getattr(t, f) for f in t.__struct_fields__}, "handle": b"\x01" * 64})
                   for t in msg.slots]
            return p.Attach(msg.host, msg.device, msg.dtype, msg.width, msg.capacity, bad, msg.ready)

    ring = Corrupt(2, 512, WIDTH, torch.bfloat16, DEV)
    c = client(server.address, ring=ring)
    host = client(server.address, device_plane="off")
    try:
        plane = c.stats()["device_plane"]
        assert plane["path"] == "host" and plane["reason"].startswith("the server could not open the ring")
        assert run(c, seed=7, prefix="c") == run(host, seed=7, prefix="h")
        assert not failures(c)
    finally:
        c.close()
        host.close()


def test_server_killed_mid_step_fails_closed_frees_its_slots_and_reattaches(checkpoints):
    srv = gpu_server(checkpoints)
    c = client(srv.address, timeout_ms=3000, propose_timeout_ms=1000)
    try:
        assert c.stats()["device_plane"]["path"] == "device"
        tokens, hidden = context(80, seed=11)
        first = list(steps(tokens, hidden, "k"))
        c.step(first[0])
        c.flush()
        srv.pause()                                                   # the step's messages wait ...
        out = c.step(first[1])
        assert out.drafts.tolist() == [[-1] * K, [-1] * K]            # ... and the step fails closed
        srv.restart()                                                 # killed with the slot named
        tokens2, hidden2 = context(80, seed=12)

        def recovered() -> bool:                                     # steps drive the reconnect; flush
            c.step(StepInput(["probe"], [1], torch.tensor([0], device=DEV), tokens2[:1], [False],
                             [int(tokens2[1])], [1], k=K, hidden=hidden2[:1]))
            c.flush()                                                 # reads the hello's and attach's replies
            plane = c.stats()["device_plane"]                         # (an ingest-only step reads nothing)
            return c.stats()["state"] == "ready" and plane["path"] == "device" and plane["attaches"] >= 2
        assert wait_until(recovered, timeout=120, interval=0.1)
        c.flush()
        assert c.plane.ring.holds == [0] * c.plane.ring.depth           # nothing holds a slot any more
        rounds = iter(range(10 ** 6))                                 # the new server's first proposes compile its

        def drafting() -> bool:                                      # kernels (seconds, past this test's 3 s
            again = run(c, seed=13, prefix=f"n{next(rounds)}")       # timeout): fresh requests until they draft
            return all(x >= 0 for x in again[1][0] + again[1][1])
        assert wait_until(drafting, timeout=120, interval=0.1)        # drafting again ...
        assert c.stats()["device_plane"]["path"] == "device"          # ... on the device path
        plane = c.server_stats()["device_plane"]
        assert plane["attached"] >= 1 and plane["sessions"] == 1        # the new server took the ring
    finally:
        c.close()
        srv.resume()
        srv.stop()


CHILD = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    from helpers.steps import settings
    from k3_accel.transport.api import StepInput
    from k3_accel.transport.client import DraftClient
    s = settings({address!r}, context_width={width}, num_speculative_tokens={k}, target_vocab_size={vocab},
                 hidden_size={width} // 2, aux_layer_ids=(0, 2), hidden_dtype=torch.bfloat16, max_rows=8192)
    c = DraftClient(s).start()
    dev = torch.device("cuda", 0)
    c.step(StepInput(["x"], [8], torch.arange(8, device=dev), torch.arange(1, 9, device=dev), [True], [9], [8],
                     k={k}, hidden=torch.randn(8, {width}, device=dev, dtype=torch.bfloat16)))
    c.flush()
    print(c.stats()["device_plane"]["path"], c.plane.ring.nbytes if c.plane.ring else 0, flush=True)
    os._exit(0)                                          # no goodbye
""")


def test_a_target_that_exits_without_goodbye_leaves_no_mapped_ring(checkpoints):
    srv = gpu_server(checkpoints, "--lease-s", "2")
    wire = None
    try:
        code = CHILD.format(tests=str(Path(__file__).parent), address=srv.address, width=WIDTH, k=K, vocab=VOCAB)
        done = subprocess.run([sys.executable, "-c", code], env=src_env(), capture_output=True, text=True,
                              timeout=120)
        path, ring_bytes = done.stdout.split()
        assert path == "device" and int(ring_bytes) > 0, done.stderr[-2000:]
        wire = Wire(srv.address)
        mapped = wire.call(p.Stats()).result["device_plane"]
        assert mapped["attached"] == 1

        def freed() -> bool:
            plane = wire.call(p.Stats()).result["device_plane"]
            return plane["sessions"] == 0 and plane["imported_bytes"] == 0 and plane["parked_reads"] == 0
        assert wait_until(freed, timeout=60, interval=0.2)
        plane = wire.call(p.Stats()).result["device_plane"]
        assert plane["dropped"] >= 1
        print(json.dumps({"lease_freed": plane}))
    finally:
        if wire is not None:
            wire.close()
        assert srv.stop() == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_request_whose_rows_are_not_finite_is_refused_as_on_the_host_path(server, bad):
    """The server checks rows read over the device plane as it checks the host path's: in one
    step of two requests, the one with a NaN or Inf row is refused (disabled, no drafts), the
    other is drafted, on both paths alike."""
    tokens, hidden = context(40, seed=11)
    rows = torch.cat([hidden[:20], hidden[:20]])
    rows[20 + 13, WIDTH - 3] = bad                       # request b's 14th row, one column
    got = {}
    for path in ("off", "auto"):
        c = client(server.address, device_plane=path)
        a, b = f"{path}-a", f"{path}-b"
        try:
            assert c.stats()["device_plane"]["path"] == ("host" if path == "off" else "device")
            out = c.step(StepInput([a, b], [20, 20], torch.arange(20, device=DEV).repeat(2),
                                   torch.cat([tokens[:20], tokens[:20]]), [True, True], [int(tokens[20])] * 2,
                                   [20, 20], k=K, hidden=rows))
            got[path] = (out.drafts[0].tolist(), bool((out.drafts[1] < 0).all()),
                         c.is_disabled(a), c.is_disabled(b), bool(failures(c)))
        finally:
            c.close()
    assert got["auto"] == got["off"]
    drafts_a, b_empty, a_off, b_off, failed = got["auto"]
    assert all(x >= 0 for x in drafts_a) and b_empty and not a_off and b_off and failed
