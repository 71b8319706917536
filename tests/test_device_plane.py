"""The device data plane where it cannot work (CPU): refused cleanly, the host path carries the
same rows, the drafts are the host path's. Real ZMQ and a real DFlash draft server process
(tiny random checkpoint) offering the plane (``--device-plane always``), so the client's
decision and the server's attach both run; plus the wire rules of the plane's messages."""
from __future__ import annotations

import logging

import msgspec
import numpy as np
import pytest
import torch

from helpers.server import ServerProcess
from helpers.steps import settings, wait_until
from helpers.wire import Wire, ints, meta
from k3_accel import ipc
from k3_accel import protocol as p
from k3_accel.protocol import ErrorCode, ProtocolError
from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target
from k3_accel.transport.api import StepInput
from k3_accel.transport.client import DraftClient

WIDTH, K, VOCAB = 256, 7, 512


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    target = write_tiny_target(root / "target")
    return target, write_tiny_dflash(root / "draft", target)


@pytest.fixture(scope="module")
def offering(checkpoints):
    """A DFlash server that offers the device plane though it cannot open a ring (no CUDA here)."""
    target, draft = checkpoints
    srv = ServerProcess("--engine", "dflash", "--draft-model", str(draft), "--target-model", str(target),
                        "--device-plane", "always")
    yield srv
    assert srv.stop() == 0


class FakeRing:
    """What the client's plane needs of a device ring, with handles that open nowhere."""
    device = torch.device("cuda", 0)
    depth, capacity, width, dtype = 2, 64, WIDTH, torch.bfloat16
    nbytes = 2 * 64 * WIDTH * 2
    holds = [0, 0]

    def __init__(self):
        self.attached = 0

    def export(self) -> p.Attach:
        spec = p.IpcTensor([self.capacity, self.width], [self.width, 1], 0, "bfloat16", b"\0" * 64,
                           self.nbytes // 2, 0, b"/torch_0_0", 0, b"\0" * 64, False)
        return p.Attach(ipc.host_identity(), "GPU-00000000-fake", "bfloat16", self.width, self.capacity,
                        [spec, spec], [b"\0" * 64, b"\0" * 64])

    def attach(self, released) -> None:
        self.attached += 1

    def detach(self) -> None:
        pass


def context(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB - 1, (n,), generator=gen), torch.randn(n, WIDTH, generator=gen).to(torch.bfloat16)


def steps(tokens, hidden):
    """A deferred chunk, then a propose of two requests (one a second chunk, one new)."""
    yield StepInput(["a"], [40], torch.arange(40), tokens[:40], [False], [int(tokens[40])], [40], k=K,
                    hidden=hidden[:40])
    yield StepInput(["a", "b"], [20, 30], torch.cat([torch.arange(40, 60), torch.arange(30)]),
                    torch.cat([tokens[40:60], tokens[:30]]), [True, True], [int(tokens[60]), int(tokens[30])],
                    [60, 30], k=K, hidden=torch.cat([hidden[40:60], hidden[:30]]))


def client(address: str, ring=None, **kw) -> DraftClient:
    s = settings(address, context_width=WIDTH, num_speculative_tokens=K, target_vocab_size=VOCAB,
                 hidden_size=WIDTH // 2, aux_layer_ids=(0, 2), hidden_dtype=torch.bfloat16, **kw)
    return DraftClient(s, device_ring=ring).start()


def drafts_of(c: DraftClient) -> list:
    tokens, hidden = context(61, seed=3)
    out = [c.step(inp).drafts.tolist() for inp in steps(tokens, hidden)]
    c.flush()
    return out


@pytest.fixture(scope="module")
def host_drafts(offering):
    c = client(offering.address, device_plane="off")
    try:
        assert c.stats()["device_plane"]["reason"] == "device_plane=off"
        got = drafts_of(c)
        assert all(d >= 0 for d in got[-1][0] + got[-1][1])          # not vacuous: real drafts
        return got
    finally:
        c.close()


def test_the_server_offers_the_plane_at_hello_with_its_host(offering):
    wire = Wire(offering.address)
    try:
        offer = wire.caps.device_plane
        assert offer.accepts and offer.host == ipc.host_identity()
        assert offer.devices == list(ipc.visible_devices())          # none on a CPU-only host
    finally:
        wire.close()


def test_no_cuda_on_the_target_takes_the_host_path_with_the_same_drafts(offering, host_drafts, monkeypatch):
    monkeypatch.setattr(ipc, "cuda_available", lambda: False)        # (so on a GPU host too)
    c = client(offering.address)
    try:
        plane = c.stats()["device_plane"]
        assert plane["path"] == "host" and plane["reason"] == "no CUDA on the target" and plane["ring_bytes"] == 0
        assert drafts_of(c) == host_drafts
        assert c.server_stats()["device_plane"]["attached"] == 0
    finally:
        c.close()


def test_a_server_on_another_host_is_not_asked(offering, host_drafts, monkeypatch):
    monkeypatch.setattr(ipc, "host_identity", lambda: "another-host")
    c = client(offering.address, ring=FakeRing())
    try:
        plane = c.stats()["device_plane"]
        assert plane["path"] == "host" and plane["reason"] == "the server runs on another host"
        stats = c.server_stats()
        assert stats["device_plane"]["refused"] == 0 and "UNSUPPORTED" not in stats["errors"]   # no attach sent
        assert drafts_of(c) == host_drafts
    finally:
        c.close()


def test_a_ring_the_server_cannot_open_is_refused_and_the_host_path_is_used(offering, host_drafts, caplog):
    ring = FakeRing()
    before = Wire(offering.address)
    refused = before.call(p.Stats()).result["device_plane"]["refused"]
    before.close()
    with caplog.at_level(logging.WARNING, logger="k3_accel.transport"):
        c = client(offering.address, ring=ring)
    try:
        plane = c.stats()["device_plane"]
        assert plane["path"] == "host" and plane["state"] == "off" and ring.attached == 0
        assert plane["reason"].startswith("the server could not open the ring: UNSUPPORTED: device plane: ")
        assert "not visible to this server" in plane["reason"]
        assert c.server_stats()["device_plane"]["refused"] == refused + 1
        assert drafts_of(c) == host_drafts
        assert [r for r in caplog.records if "host path" in r.getMessage()]      # logged ...
        c.step(next(steps(*context(61, seed=9))))
        c.link.rehello("test: a new session")                         # the next hello decides again
        c.flush()
        assert c.stats()["device_plane"]["reason"] == plane["reason"]
        assert len([r for r in caplog.records if "host path" in r.getMessage()]) == 1   # ... once
    finally:
        c.close()


def test_a_server_without_cuda_does_not_offer_and_says_why(checkpoints, host_drafts):
    target, draft = checkpoints
    srv = ServerProcess("--engine", "dflash", "--draft-model", str(draft), "--target-model", str(target))
    try:
        c = client(srv.address, ring=FakeRing())
        try:
            plane = c.stats()["device_plane"]
            assert plane["reason"] == "the server takes no device ring (the engine does not run on CUDA)"
            assert drafts_of(c) == host_drafts
        finally:
            c.close()
    finally:
        assert srv.stop() == 0


def test_an_older_server_means_the_host_path():
    """A hello result without ``device_plane`` (a server before it) decodes to "not offered"."""
    caps = p.caps_from_result({"engine": "dflash", "needs_hidden_states": True, "context_width": WIDTH,
                               "hidden_dtypes": ["bfloat16"], "supports_logits": False, "supports_topk": False,
                               "max_spec_tokens": K, "block_size": 16, "vocab_size": VOCAB})
    assert caps.device_plane == p.DeviceOffer() and not caps.device_plane.accepts


def test_device_rows_on_a_connection_without_a_ring_are_refused(offering):
    wire = Wire(offering.address)
    try:
        msg = p.Propose(K, 1, 2, "bfloat16", WIDTH, slot=0)
        reply = wire.call(msg, meta([1], [0], [2], [5], [0]), ints([3, 4]))
        assert not reply.ok and reply.error[0] == ErrorCode.BAD_REQUEST.value
        assert "no device ring is attached" in reply.error[1]
        assert wire.call(p.Ping()).ok                                     # the server goes on
    finally:
        wire.close()


# ------------------------------------------------------------------ wire rules
# the row messages as the first v2 servers knew them (no ``slot``)
class _OldIngest(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True, tag="ingest"):
    n: int
    rows: int
    hidden: str = ""
    width: int = 0


class _OldPropose(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True, tag="propose"):
    k: int
    n: int
    rows: int
    hidden: str = ""
    width: int = 0
    logits: str = "none"
    topk: int = 0


class _OldEnvelope(msgspec.Struct, array_like=True):
    v: int
    seq: int
    msg: _OldIngest | _OldPropose


@pytest.mark.parametrize("msg", [p.Ingest(2, 5, "bfloat16", WIDTH), p.Ingest(1, 3),
                                 p.Propose(K, 2, 5, "bfloat16", WIDTH, "topk", 4), p.Propose(K, 1, 0)])
def test_a_host_path_message_decodes_on_a_server_that_predates_the_device_plane(msg):
    old = msgspec.msgpack.decode(p.encode_request(7, msg)[0], type=_OldEnvelope)
    known = len(type(old.msg).__struct_fields__)       # the fields an old server knows; the new ones are
    assert old.seq == 7 and msgspec.structs.astuple(old.msg) == msgspec.structs.astuple(msg)[:known]  # off


def test_a_device_row_message_has_the_slot_row_column_and_no_hidden_frame():
    msg = p.Propose(K, 2, 3, "bfloat16", WIDTH, slot=1)
    req = p.decode_request(p.encode_request(1, msg, meta([1, 2], [0, 0], [1, 2], [5, 6], [0, 1]), ints([1, 2, 3])))
    assert req.msg.slot == 1 and req.meta.shape == (2, 5) and req.hidden is None
    with pytest.raises(ProtocolError) as exc:                            # the host layout is not enough
        p.decode_request(p.encode_request(1, msg, meta([1, 2], [0, 0], [1, 2], [5, 6]), ints([1, 2, 3])))
    assert exc.value.code is ErrorCode.FRAME_MISMATCH
    with pytest.raises(ProtocolError) as exc:                            # a slot needs the hidden dtype
        p.decode_request(p.encode_request(1, p.Ingest(1, 1, slot=0), meta([1], [0], [1], [0]), ints([1])))
    assert exc.value.code is ErrorCode.BAD_FIELD


def test_an_attach_whose_slots_do_not_match_its_shape_is_refused():
    good = FakeRing().export()
    assert p.decode_request(p.encode_request(1, good)).msg == good
    bad = msgspec.structs.replace(good, capacity=good.capacity + 1)
    with pytest.raises(ProtocolError) as exc:
        p.decode_request(p.encode_request(1, bad))
    assert exc.value.code is ErrorCode.BAD_FIELD
    few = msgspec.structs.replace(good, ready=good.ready[:1])
    with pytest.raises(ProtocolError):
        p.decode_request(p.encode_request(1, few))


def test_the_slot_rows_of_a_split_request_follow_its_part():
    from k3_accel.transport.device_plane import DeviceRows
    rows = DeviceRows(None, 0, np.array([0, 40]), np.array([100, 7]))
    # request 0 starts at position 100 in slot row 0; a part that carries its rows from 130 on
    assert rows.meta_column(np.array([0, 1]), np.array([130, 7])).tolist() == [30, 40]


def test_a_restarted_server_is_offered_the_ring_again_and_drafts(checkpoints):
    """The server dies while a step's messages wait: that step fails closed, and once the server is
    back the client says hello again, offers it the ring again (the offer is what a CPU-only server
    refuses; on the H200 the new server attaches it) and the requests after it draft."""
    target, draft = checkpoints
    srv = ServerProcess("--engine", "dflash", "--draft-model", str(draft), "--target-model", str(target),
                        "--device-plane", "always")
    c = client(srv.address, ring=FakeRing(), timeout_ms=3000, propose_timeout_ms=1000)
    offers = []
    offer = c.plane.offer
    c.plane.offer = lambda *a: (offers.append(1), offer(*a))[1]
    try:
        tokens, hidden = context(61, seed=11)
        first = list(steps(tokens, hidden))
        c.step(first[0])
        c.flush()
        srv.pause()
        assert c.step(first[1]).drafts.tolist() == [[-1] * K, [-1] * K]      # fails closed
        srv.restart()
        probe = context(2, seed=12)

        def recovered() -> bool:
            c.step(StepInput(["probe"], [1], torch.tensor([0]), probe[0][:1], [False], [int(probe[0][1])], [1],
                             k=K, hidden=probe[1][:1]))
            c.flush()
            return c.stats()["state"] == "ready" and len(offers) >= 1
        assert wait_until(recovered, timeout=120, interval=0.1)
        tokens, hidden = context(61, seed=13)
        again = [c.step(StepInput([f"n{r}" for r in inp.req_ids], inp.counts, inp.positions, inp.token_ids,
                                  inp.sampled, inp.anchor_tokens, inp.anchor_positions, k=K, hidden=inp.hidden)
                        ).drafts.tolist() for inp in steps(tokens, hidden)]
        assert all(d >= 0 for d in again[1][0] + again[1][1])               # drafting again
    finally:
        c.close()
        srv.resume()
        srv.stop()


@pytest.mark.parametrize("where", ["cpu", "meta"])
def test_rows_read_over_the_plane_reach_the_engine_as_the_servers_own(where):
    """Rows of a message on a device are always the server's own read of a target's slot (a
    buffer of its own): the engine is told it may keep them past the call (and so coalesce their
    projection like host rows'); host rows view the message's frames and are not. ``meta`` stands
    in for the CUDA device this machine lacks (only the rows' device is read here)."""
    from helpers.service import LocalService
    from k3_accel.server import rows as r

    svc = LocalService()
    seen = []
    svc.engine.ingest = lambda batch, inner=svc.engine.ingest: (seen.append(batch), inner(batch))
    session = svc.session("s" * 32)
    n, width = 5, 8
    msg = r.RowMessage(np.array([1, 2]), np.array([0, 0]), np.array([2, 3]), np.array([0, 2, 5]),
                       np.arange(n, dtype=np.int64) + 1, torch.zeros(n, width, device=where), None,
                       nonfinite=np.zeros(n, dtype=bool))
    admitted = r.admit(svc.store, session, msg)
    assert admitted.index == [0, 1] and r.apply(svc.store, msg, admitted) == n
    assert [b.owned for b in seen] == [where != "cpu"]


def test_a_slot_whose_server_read_is_not_known_complete_is_waited_for_until_the_deadline():
    """The V1 path's ``acquire``: a slot no message names but whose last server read has not
    completed (its hold went without a reply) is not written before that read is over; at the
    step's deadline the step fails (``RingTimeout``), and a dead server's event does not block it."""
    import time

    from helpers.standin import ServerEvent, host_ring
    from k3_accel.transport.failures import RingTimeout
    ring = host_ring(2, 8, 16)
    ring.released = [ServerEvent(False), ServerEvent(True)]
    polls = []
    with pytest.raises(RingTimeout, match="read by the server"):
        ring.acquire(time.monotonic() + 0.05, lambda _, left: polls.append(left) or time.sleep(0.01))
    assert polls and ring.holds == [0, 0]               # it read replies meanwhile, and took nothing

    def read_ends(_, left):
        ring.released[0].done = True
    assert ring.acquire(time.monotonic() + 5, read_ends) == 0
    ring.released = [ServerEvent(False, gone=True), ServerEvent(True)]
    assert ring.acquire(time.monotonic() + 5, lambda *_: pytest.fail("waited on a dead server")) == 1
    assert ring.acquire(time.monotonic() + 5, lambda *_: pytest.fail("waited on a dead server")) == 0
    assert ring.released[0] is None
