"""The draft server with the DFlash engine, over real sockets, against the independent float64
reference (``k3_accel.testing.dflash_reference``) under the precision rules of
``k3_accel.testing.precision``: chunked ingest, a rejection (rewind), reconnect, one bad
request (non-finite rows, anchors outside the vocabulary) failing only itself, top-k."""
from __future__ import annotations

import pytest
import torch

from helpers.server import ServerProcess
from helpers.wire import Wire, ints
from k3_accel import protocol as p
from k3_accel.testing.dflash_reference import DFlashReference
from k3_accel.testing.precision import check_drafts, check_logits, logit_tolerance
from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target

K = 5
WIRE = torch.bfloat16       # logits travel as bfloat16
ENGINE = torch.float32      # the engine's dtype on the CPU (drafts are its own argmax)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    target = write_tiny_target(root / "target")
    return write_tiny_dflash(root / "draft", target), target


@pytest.fixture(scope="module")
def ref(ckpt):
    return DFlashReference(*ckpt)


@pytest.fixture(scope="module")
def server(ckpt):
    s = ServerProcess("--engine", "dflash", "--draft-model", str(ckpt[0]), "--target-model", str(ckpt[1]),
                      "--block-size", "4", "--memory-budget-mb", "4", "--lease-s", "0")
    yield s
    assert s.stop() == 0


@pytest.fixture
def wire(server):
    w = Wire(server.address)
    yield w
    w.call(p.Bye())
    w.close()


def rows(n: int, width: int, seed: int) -> torch.Tensor:
    """Aux hidden rows as a target ships them (bfloat16)."""
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def none(width: int) -> torch.Tensor:
    return torch.empty(0, width, dtype=torch.bfloat16)


def check(reply: p.Reply, i: int, ref: DFlashReference, context: torch.Tensor, anchor: int) -> int:
    """Request i's logits and drafts against the reference over ``context``; clear positions."""
    want = ref.logits(context.double(), anchor, K)
    check_logits(reply.tensors["logits"][i].double(), want, WIRE)
    return check_drafts(reply.tensors["drafts"][i].long(), want, ENGINE)


def test_hello_describes_the_draft(wire):
    caps = wire.caps
    assert caps.engine == "dflash" and caps.needs_hidden_states and caps.context_width == 256
    assert caps.vocab_size == 512 and caps.hidden_size == 128 and caps.aux_layer_ids == [0, 2]
    assert caps.supports_logits and caps.supports_topk and caps.max_spec_tokens >= K
    assert caps.block_size == 4 and caps.pool_bytes <= 4 << 20


def test_drafts_over_sockets_match_the_reference_through_a_rejection(wire, ref):
    width = wire.caps.context_width
    ctx = rows(20, width, seed=3)
    tokens = list(range(10, 30))
    for lo, hi in ((0, 7), (7, 20)):                                  # two ingest chunks
        assert wire.ingest([(0, lo, tokens[lo:hi])], hidden=ctx[lo:hi]).raise_for_error().failures == []
    reply = wire.propose(K, [(0, 20, [], 42)], hidden=none(width), logits="full").raise_for_error()
    clear = check(reply, 0, ref, ctx, 42)
    # the target rejected from position 16 on: three new rows replace 16.., then the anchor
    new = rows(3, width, seed=4)
    reply = wire.propose(K, [(0, 16, [7, 8, 9], 5)], hidden=new, logits="full").raise_for_error()
    accepted = torch.cat([ctx[:16], new])
    clear += check(reply, 0, ref, accepted, 5)
    stale = ref.logits(torch.cat([ctx, new]).double(), 5, K)          # what a missed rewind would give
    assert ((stale - ref.logits(accepted.double(), 5, K)).abs() > 2 * logit_tolerance(WIRE, stale)).any()
    assert clear >= K                                                 # not vacuous


def test_one_bad_request_fails_only_itself(wire, ref):
    """Issue 7.4 with hidden rows: non-finite rows and anchors outside the vocabulary fail
    their own request; the others draft; the refused ones keep their stored context."""
    width, vocab = wire.caps.context_width, wire.caps.vocab_size
    ctx = {h: rows(6, width, seed=10 + h) for h in range(4)}
    wire.ingest([(h, 0, [1] * 6) for h in ctx], hidden=torch.cat(list(ctx.values()))).raise_for_error()
    new = rows(4, width, seed=20)
    poisoned = new.clone()
    poisoned[1, 3] = float("nan")
    reply = wire.propose(K, [(0, 6, [2], 7), (1, 6, [2], 7), (2, 6, [2], vocab), (3, 6, [2], 10 ** 9)],
                         hidden=poisoned, logits="full").raise_for_error()
    assert [f[:2] for f in reply.failures] == [(1, "NON_FINITE"), (2, "BAD_REQUEST"), (3, "BAD_REQUEST")]
    assert str(vocab - 1) in reply.failures[1][2]
    assert reply.tensors["drafts"][1:].tolist() == [[-1] * K] * 3
    clear = check(reply, 0, ref, torch.cat([ctx[0], new[:1]]), 7)
    # the refused requests still hold exactly their six rows
    again = wire.propose(K, [(1, 6, [], 7), (2, 6, [], 8), (3, 6, [], 9)], hidden=none(width),
                         logits="full").raise_for_error()
    assert again.failures == []
    for i, (h, anchor) in enumerate(((1, 7), (2, 8), (3, 9))):
        clear += check(again, i, ref, ctx[h], anchor)
    assert clear >= K


def test_top_k_is_the_top_of_the_full_logits(wire, ref):
    width = wire.caps.context_width
    wire.ingest([(0, 0, [3] * 9)], hidden=rows(9, width, seed=30)).raise_for_error()
    full = wire.propose(K, [(0, 9, [], 11)], hidden=none(width), logits="full").raise_for_error()
    top = wire.propose(K, [(0, 9, [], 11)], hidden=none(width), logits="topk", topk=4).raise_for_error()
    logits = full.tensors["logits"][0].float()                       # [K, V]
    values, indices = top.tensors["topk_values"][0].float(), top.tensors["topk_indices"][0].long()
    assert values.shape == indices.shape == (K, 4)
    tol = logit_tolerance(WIRE, logits)                                # [K, 1]
    assert (values[:, :-1] >= values[:, 1:] - tol).all()               # best first
    assert ((logits.gather(1, indices) - values).abs() <= tol).all()   # the values of those ids
    fifth = logits.topk(5, dim=-1).values[:, 4:]
    assert (values[:, -1:] >= fifth - tol).all()                       # nothing outside beats them
    assert (values[:, -1:] > logits.median(dim=-1, keepdim=True).values).all()   # (not the bottom k)
    too_many = wire.propose(K, [(0, 9, [], 11)], hidden=none(width), logits="topk", topk=wire.caps.vocab_size + 1)
    assert not too_many.ok and too_many.error[0] == "BAD_REQUEST"


def test_reconnect_reuses_only_a_context_that_covers_every_cached_token(wire, ref):
    width = wire.caps.context_width
    ctx, tokens = rows(20, width, seed=40), list(range(100, 120))
    wire.ingest([(0, 0, tokens)], hidden=ctx).raise_for_error()
    wire.call(p.Free([0])).raise_for_error()                            # retained
    assert wire.call(p.Reconnect(1, 16), ints(tokens[:16])).raise_for_error().result == {"restored": 16}
    partial = wire.call(p.Reconnect(2, 16), ints(tokens[:15] + [999 % 512]))
    assert not partial.ok and partial.error[0] == "PREFIX_MISMATCH"     # hidden rows cannot be rebuilt
    longer = wire.call(p.Reconnect(3, 24), ints(tokens + [1, 2, 3, 4]))  # a context covers 20 of the 24
    assert not longer.ok and longer.error[0] == "PREFIX_MISMATCH"
    new = rows(2, width, seed=41)
    reply = wire.propose(K, [(1, 16, [7, 8], 3)], hidden=new, logits="full").raise_for_error()
    assert check(reply, 0, ref, torch.cat([ctx[:16], new]), 3) >= 1


@pytest.mark.parametrize("hidden, width, code", [("bfloat16", 255, "BAD_REQUEST"), ("", 0, "BAD_REQUEST"),
                                                 ("float64", 256, "BAD_FIELD")])
def test_hidden_rows_must_fit_the_engine(wire, ref, hidden, width, code):
    ctx = rows(4, 256, seed=50)
    wire.ingest([(0, 0, [1] * 4)], hidden=ctx).raise_for_error()
    itemsize = {"bfloat16": 2, "float64": 8, "": 0}[hidden]
    frames = [p.Ingest(1, 2, hidden, width), *(_frames(width, itemsize))]
    reply = wire.call(*frames)
    assert not reply.ok and reply.error[0] == code, reply.error
    reply = wire.propose(K, [(0, 4, [], 9)], hidden=none(256), logits="full").raise_for_error()
    check(reply, 0, ref, ctx, 9)                                        # nothing was stored


def _frames(width: int, itemsize: int) -> list:
    from helpers.wire import meta
    out = [meta([0], [4], [2]), ints([5, 6])]
    return out + [b"\0" * (2 * width * itemsize)] if itemsize else out
