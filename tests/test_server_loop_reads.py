"""The server loop starts a device-plane read as soon as its message arrives, also while the engine
works on another client's propose, so that the next round finds the rows read and batches that
message with the others (one server, several targets, on the device plane).

In-process: a real ``ServerLoop`` on a real socket, a real ``DraftService`` with the tiny DFlash
engine on the CPU. Two stand-ins for what this machine lacks: the engine's proposal completes only
when the test says (a GPU's event), and the device plane's read is a host tensor handed over at
once (the CUDA IPC read), which notes when it was started.
"""
from __future__ import annotations

import threading
import types

import pytest
import torch
import zmq

from helpers.steps import wait_until
from helpers.wire import Wire, ints, meta
from k3_accel import protocol as p
from k3_accel.server.device_plane import ServerDevicePlane
from k3_accel.server.engines.dflash import DFlashEngine
from k3_accel.server.loop import ServerLoop
from k3_accel.server.metrics import ServerMetrics
from k3_accel.server.rows import nonfinite_top_bits, top_bits
from k3_accel.server.service import DraftService
from k3_accel.server.state import RequestStore
from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target

K, ROWS = 3, 8


class Gate:
    """A device event the test completes."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def query(self) -> bool:
        return self.open.is_set()

    def synchronize(self) -> None:
        assert self.open.wait(60), "the test never let the engine finish"


class GatedEngine(DFlashEngine):
    """The tiny DFlash engine whose proposals are done only once the gate opens."""

    def _build(self, weights, **options) -> None:
        super()._build(weights, **options)
        self.gate, self.proposes = Gate(), 0

    def propose(self, batch):
        out = super().propose(batch)
        self.proposes += 1
        out.ready = self.gate
        return out


class HostReads(ServerDevicePlane):
    """A device plane whose reads complete at once, with the rows the test put in ``rows``; notes
    each read's message seq and whether the engine's proposal was still in flight then."""

    def __init__(self, engine: GatedEngine) -> None:
        super().__init__("off")
        self.engine, self.rows, self.started = engine, None, []

    def fetch(self, session_key: str, conn: bytes, req: p.Request) -> bool:
        if req.fetch is None:
            if not isinstance(req.msg, p.ROW_OPS) or req.msg.slot < 0:
                return True
            self.started.append((req.seq, self.engine.gate.query()))
            req.fetch = types.SimpleNamespace(nonfinite=nonfinite_top_bits(top_bits(self.rows).numpy(),
                                                                             self.rows.dtype))
            req.meta, req.hidden = req.meta[:, :-1], self.rows
        return True


@pytest.fixture
def server(tmp_path):
    target = write_tiny_target(tmp_path / "target")
    draft = write_tiny_dflash(tmp_path / "draft", target)
    engine = GatedEngine(str(draft), str(target), max_spec_tokens=K, budget_bytes=64 << 20)
    plane = HostReads(engine)
    service = DraftService(engine, RequestStore(engine, max_requests=16, max_requests_total=64, max_retained=0), ServerMetrics(),
                           device_plane=plane)
    ctx = zmq.Context()
    loop = ServerLoop(service, ["tcp://127.0.0.1:0"], 1 << 26, ctx=ctx)
    stop = threading.Event()
    thread = threading.Thread(target=loop.serve, args=(stop,), daemon=True)
    thread.start()
    assert loop.ready.wait(30)
    yield loop, engine, plane
    engine.gate.open.set()
    stop.set()
    thread.join(30)
    ctx.term()


def test_a_device_read_starts_while_the_engine_works_on_another_clients_propose(server):
    loop, engine, plane = server
    width, dtype = engine.caps.context_width, engine.caps.hidden_dtypes[0]
    rows = torch.randn(ROWS, width, generator=torch.Generator().manual_seed(0)).to(p.DTYPES[dtype])
    plane.rows = rows
    tokens = list(range(5, 5 + ROWS))
    a, b = Wire(loop.endpoints[0]), Wire(loop.endpoints[0])
    try:
        a.send_propose(K, [(1, 0, tokens, 3)], hidden=rows)                       # host path
        assert wait_until(lambda: engine.proposes == 1, timeout=60)               # a's batch is in flight
        b.send(p.Propose(K, 1, ROWS, dtype, width, slot=0), meta([2], [0], [ROWS], [3], [0]), ints(tokens))
        wait_until(lambda: plane.started, timeout=30)
        assert plane.started == [(b.seq, False)], "b's read waited for a's batch to finish"
        engine.gate.open.set()
        ra, rb = a.recv(), b.recv()
        assert ra.ok and rb.ok and not ra.failures and not rb.failures
        drafts = ra.tensors["drafts"].tolist()
        assert drafts == rb.tensors["drafts"].tolist() and min(drafts[0]) >= 0   # the same rows, the same drafts
    finally:
        a.close()
        b.close()
