"""The failure queue under concurrent producers, and the handshake checks."""
from __future__ import annotations

import threading

import pytest
import torch

from k3_accel import protocol as p
from k3_accel.transport import handshake
from k3_accel.transport.failures import FailureKind, FailureQueue, IncompatibleServer

PRODUCERS, PER_PRODUCER = 8, 2000


def test_concurrent_failures_are_drained_exactly_once_and_in_order():
    queue = FailureQueue()
    start = threading.Barrier(PRODUCERS + 1)

    def produce(n: int) -> None:
        start.wait()
        for i in range(PER_PRODUCER):
            queue.push(FailureKind.TRANSPORT, [f"p{n}-{i}"], detail=str(i))

    threads = [threading.Thread(target=produce, args=(n,)) for n in range(PRODUCERS)]
    for t in threads:
        t.start()
    start.wait()
    drained = []
    while any(t.is_alive() for t in threads) or len(queue):
        drained.extend(queue.drain())                  # races with the producers on purpose
    for t in threads:
        t.join()
    drained.extend(queue.drain())
    ids = [f.ids[0] for f in drained]
    assert len(ids) == PRODUCERS * PER_PRODUCER == len(set(ids))
    for n in range(PRODUCERS):                          # each producer's failures keep their order
        mine = [int(f.detail) for f in drained if f.ids[0].startswith(f"p{n}-")]
        assert mine == list(range(PER_PRODUCER))
    assert queue.drain() == []


def test_drain_is_atomic_snapshot():
    queue = FailureQueue()
    queue.push("request", ["a"])
    queue.push(FailureKind.SERVER_RESTART, all_requests=True)
    got = queue.drain()
    assert [f.kind for f in got] == [FailureKind.REQUEST, FailureKind.SERVER_RESTART]
    assert got[1].all_requests and len(queue) == 0


def test_unknown_failure_kind_is_rejected():
    with pytest.raises(ValueError):
        FailureQueue().push("nonsense")


def caps(**kw) -> p.Caps:
    base = dict(engine="dflash", needs_hidden_states=True, context_width=3 * 64,
                hidden_dtypes=["bfloat16"], supports_logits=False, supports_topk=True,
                max_requests=8, max_spec_tokens=7, block_size=16, vocab_size=1000, hidden_size=64,
                aux_layer_ids=[1, 4, 7])
    base.update(kw)
    return p.Caps(**base)


def hello_reply(c: p.Caps) -> p.Reply:
    import msgspec
    return p.Reply(seq=1, ok=True, server_id="s", result=msgspec.to_builtins(c))


NEEDS = handshake.TargetNeeds(context_width=192, hidden_dtype=torch.bfloat16, num_speculative_tokens=7,
                              vocab_size=1000, hidden_size=64, aux_layer_ids=(1, 4, 7), max_requests=8)


def test_matching_caps_pass():
    assert handshake.check(hello_reply(caps()), NEEDS).context_width == 192


@pytest.mark.parametrize("server_caps, needs, words", [
    (caps(context_width=128), NEEDS, "context width: server 128, target ships 192"),
    (caps(), handshake.TargetNeeds(0, torch.bfloat16, 7), "ships none"),
    (caps(hidden_dtypes=["float32"]), NEEDS, "dtype"),
    (caps(max_spec_tokens=4), NEEDS, "K: target asks for 7, server allows 4"),
    (caps(), handshake.TargetNeeds(192, torch.bfloat16, 7, logits="full"), "logits"),
    (caps(supports_topk=False), handshake.TargetNeeds(192, torch.bfloat16, 7, logits="topk", topk=4), "top-k"),
    (caps(protocol=p.PROTOCOL_VERSION + 1), NEEDS, "protocol"),
    (caps(vocab_size=1024), NEEDS, "vocabulary: server drafts ids 0..1023, target vocabulary is 1000"),
    (caps(hidden_size=32, context_width=96, aux_layer_ids=[1, 4, 7]), NEEDS, "hidden size: server 32, target 64"),
    (caps(aux_layer_ids=[1, 4, 8]), NEEDS, r"aux layer ids: server \[1, 4, 8\], target captures \[1, 4, 7\]"),
])
def test_each_mismatch_fails_closed_with_a_reason(server_caps, needs, words):
    with pytest.raises(IncompatibleServer, match=words):
        handshake.check(hello_reply(server_caps), needs)


def test_aux_layer_mismatch_is_incompatible_at_equal_width():
    assert caps(aux_layer_ids=[0, 4, 7]).context_width == NEEDS.context_width
    found = handshake.problems(caps(aux_layer_ids=[0, 4, 7]), NEEDS)
    assert found == ["aux layer ids: server [0, 4, 7], target captures [1, 4, 7]"]


def test_fewer_server_slots_than_max_num_seqs_is_a_warning_not_a_refusal():
    small = caps(max_requests=4)
    assert handshake.problems(small, NEEDS) == []
    assert handshake.warnings(small, NEEDS) == [
        "capacity: target runs up to 8 requests (max_num_seqs), the server admits 4 per client: "
        "the excess is not drafted"]


def test_no_hidden_engine_ignores_width():
    ngram = caps(engine="ngram", needs_hidden_states=False, context_width=0)
    assert handshake.problems(ngram, NEEDS) == []


def test_wrong_protocol_version_reply_is_incompatible():
    import msgpack
    frame = msgpack.packb({"v": 1, "op": "reply", "seq": 1, "body": {}, "tensors": []})
    with pytest.raises(p.ProtocolError) as err:
        p.decode_reply([frame])
    assert err.value.code is p.ErrorCode.BAD_VERSION
    reply = p.Reply(seq=1, ok=False, server_id="", error=(err.value.code.value, "x"))
    with pytest.raises(IncompatibleServer, match="BAD_VERSION"):
        handshake.check(reply, NEEDS)


def test_refused_hello_is_incompatible():
    with pytest.raises(IncompatibleServer, match="no valid caps"):
        handshake.check(p.Reply(seq=1, ok=True, server_id="s", result={}), NEEDS)


def test_other_ngram_sizes_are_a_warning_not_a_refusal():
    """vLLM's prompt_lookup_min/max (5/5 when unset) against the server's --ngram-min/--ngram-max:
    another size still drafts usefully, so the target connects and is told how to match."""
    server = caps(engine="ngram", needs_hidden_states=False, context_width=0,
                  draft={"prompt_lookup_min": 1, "prompt_lookup_max": 3})
    target = handshake.TargetNeeds(0, torch.bfloat16, 4, draft={"engine": "ngram", "prompt_lookup_min": 5,
                                                                "prompt_lookup_max": 5})
    assert handshake.problems(server, target) == []
    assert handshake.warnings(server, target) == [
        "n-gram sizes: the server matches grams of 1..3 tokens, the target's prompt_lookup_min/max are 5..5: "
        "its drafts differ from vLLM's own ngram (start the server with --ngram-min 5 --ngram-max 5)"]
    same = handshake.TargetNeeds(0, torch.bfloat16, 4, draft={"engine": "ngram", "prompt_lookup_min": 1,
                                                              "prompt_lookup_max": 3})
    assert handshake.warnings(server, same) == [] and handshake.problems(server, same) == []
    dflash = caps(draft={})
    assert "draft engine: the target's method needs a ngram server, the server runs dflash" in \
        handshake.problems(dflash, same)


def test_the_ngram_target_names_vllm_sizes_and_the_server_its_own():
    from types import SimpleNamespace

    from k3_accel.server.engines.ngram import NgramEngine
    from k3_accel.vllm.spec_decode.methods import draft_signature
    spec = SimpleNamespace(method="ngram", prompt_lookup_min=2, prompt_lookup_max=4)
    assert draft_signature(spec) == {"engine": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert NgramEngine(min_n=2, max_n=4).caps.draft == {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
