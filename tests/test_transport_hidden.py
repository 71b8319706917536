"""Hidden-row shipping against a real DFlash draft server (tiny random checkpoint, CPU)."""
from __future__ import annotations

import pytest
import torch

from helpers.server import ServerProcess
from k3_accel.testing.dflash_reference import DFlashReference
from k3_accel.testing.precision import check_drafts, check_logits
from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target
from k3_accel.transport.api import StepInput

WIDTH, K, VOCAB = 256, 7, 512          # tiny DFlash: 2 aux layers x hidden 128, block 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    target = write_tiny_target(root / "target")
    return target, write_tiny_dflash(root / "draft", target)


@pytest.fixture(scope="module")
def dflash(checkpoints):
    target, draft = checkpoints
    srv = ServerProcess("--engine", "dflash", "--draft-model", str(draft), "--target-model", str(target))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(checkpoints):
    """The independent float64 DFlash reference over the same checkpoint."""
    target, draft = checkpoints
    return DFlashReference(draft, target)


def assert_drafts_follow_reference(drafts: torch.Tensor, reference, hidden: torch.Tensor, anchor: int) -> None:
    """Drafts equal the reference's argmax wherever its top-1 margin leaves no doubt in float32
    (the server's dtype here); never a comparison that depends on one machine's rounding."""
    logits = reference.logits(hidden.double(), anchor, K)
    assert check_drafts(drafts, logits, torch.float32) >= K // 2      # not vacuous


def context(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and hidden rows of positions 0..n-1 (a target would compute the same for the same prefix)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB - 1, (n,), generator=gen)
    hidden = torch.randn(n, WIDTH, generator=gen).to(torch.bfloat16)
    return tokens, hidden


def step(req: str, start: int, stop: int, tokens, hidden, *, sampled=True, prompt=None) -> StepInput:
    return StepInput([req], [stop - start], torch.arange(start, stop), tokens[start:stop], [sampled],
                     [int(tokens[stop]) if stop < len(tokens) else 1], [stop], k=K, hidden=hidden[start:stop],
                     prompt_token_ids=None if prompt is None else {req: prompt})


def make(client_factory, dflash, **kw):
    kw = {"target_vocab_size": VOCAB, "hidden_size": WIDTH // 2, "aux_layer_ids": (0, 2), **kw}
    return client_factory(dflash.address, context_width=WIDTH, num_speculative_tokens=K, **kw)


def test_deferred_zero_copy_hidden_rows_give_the_same_drafts_as_synchronous(dflash, client_factory, reference):
    tokens, hidden = context(97)
    deferred = make(client_factory, dflash, ring_depth=2)
    assert deferred.step(step("a", 0, 40, tokens, hidden, sampled=False)).deferred
    assert deferred.step(step("a", 40, 80, tokens, hidden, sampled=False)).deferred
    got = deferred.step(step("a", 80, 96, tokens, hidden)).drafts
    sync = make(client_factory, dflash, ring_depth=0)
    ref = sync.step(step("b", 0, 96, tokens, hidden)).drafts
    assert got.shape == (1, K) and bool((got >= 0).all())
    anchor = int(tokens[96])
    assert_drafts_follow_reference(got[0], reference, hidden[:96], anchor)   # chunked, deferred
    assert_drafts_follow_reference(ref[0], reference, hidden[:96], anchor)   # one synchronous message
    assert deferred.stats()["ring"]["pinned"] == torch.cuda.is_available()


def test_full_and_topk_logits_come_back_in_request_order(dflash, client_factory, reference):
    tokens, hidden = context(33, seed=3)
    full = make(client_factory, dflash, logits="full")
    inp = StepInput(["x", "y"], [16, 16], torch.cat([torch.arange(16), torch.arange(16)]),
                    torch.cat([tokens[:16], tokens[16:32]]), [False, True], [int(tokens[16]), int(tokens[32])],
                    [16, 16], k=K, hidden=torch.cat([hidden[:16], hidden[16:32]]))
    out = full.step(inp)
    assert out.logits.shape == (2, K, VOCAB)
    assert bool((out.logits[0] == 0).all()) and not bool((out.logits[1] == 0).all())   # x did not sample
    assert out.drafts[0].tolist() == [-1] * K
    assert torch.equal(out.logits[1].float().argmax(-1), out.drafts[1])
    topk = make(client_factory, dflash, logits="topk", topk=5)
    out_k = topk.step(StepInput(["z"], [16], torch.arange(16), tokens[16:32], [True], [int(tokens[32])], [16],
                                k=K, hidden=hidden[16:32]))
    values, indices = out_k.extra["topk_values"][0].float(), out_k.extra["topk_indices"][0].long()
    assert values.shape == indices.shape == (K, 5)
    full_y = out.logits[1].float()                     # y above: the same context and anchor
    check_logits(full_y, reference.logits(hidden[16:32].double(), int(tokens[32]), K), torch.bfloat16)
    # the largest five (not the smallest): every value is a logit of its index, in descending order,
    # and none of the other logits exceeds the fifth (bf16 on the wire: compare within its rounding)
    assert torch.allclose(full_y.gather(-1, indices), values, rtol=2 ** -7, atol=1e-3)
    assert bool((values[:, :-1] >= values[:, 1:]).all())
    rest = full_y.scatter(-1, indices, float("-inf"))
    assert bool((rest.max(-1).values <= values[:, -1] + values[:, -1].abs() * 2 ** -7 + 1e-3).all())


def test_prefix_hit_reconnects_with_hidden_context(dflash, client_factory, reference):
    tokens, hidden = context(57, seed=5)
    client = make(client_factory, dflash)
    client.step(step("src", 0, 40, tokens, hidden))
    client.finish(["src"])
    # the target's prefix cache covers 32 tokens of "hit": only rows 32.. are computed
    hit = client.step(step("hit", 32, 56, tokens, hidden, prompt=tokens[:56])).drafts
    assert bool((hit >= 0).all())
    assert_drafts_follow_reference(hit[0], reference, hidden[:56], int(tokens[56]))
    assert client.stats()["counters"]["reconnects"] == 1
    assert client.server_stats()["errors"] == {}


def test_a_request_that_lost_rows_still_serves_its_prefix(dflash, client_factory, reference):
    """A request whose rows were lost after its prompt (a launch that failed on the GPU path) is
    disabled, but what the server holds of it is a correct prefix (the server checks a reattach by
    token ids): a later request with the same prompt, a prefix-cache hit, reattaches to it and
    drafts. Before, such a request was freed without being kept, and on the H200 every later run of
    its prompt failed to reattach (PREFIX_MISMATCH), a whole batch without drafts for good."""
    tokens, hidden = context(57, seed=9)
    client = make(client_factory, dflash)
    client.step(step("lost", 0, 40, tokens, hidden))
    client.step(step("lost", 44, 45, tokens, hidden))                    # rows 40..43 never came: a gap
    assert client.is_disabled("lost")
    client.finish(["lost"])
    hit = client.step(step("again", 32, 56, tokens, hidden, prompt=tokens[:56])).drafts
    assert bool((hit >= 0).all()) and not client.is_disabled("again")
    assert_drafts_follow_reference(hit[0], reference, hidden[:56], int(tokens[56]))
    assert "PREFIX_MISMATCH" not in client.server_stats()["errors"]


def test_prefix_hit_without_retained_context_is_disabled(dflash, client_factory):
    tokens, hidden = context(50, seed=7)
    client = make(client_factory, dflash)
    out = client.step(step("cold", 32, 48, tokens, hidden, prompt=tokens[:48]))
    assert out.drafts.tolist() == [[-1] * K] and client.is_disabled("cold")
    assert client.stats()["counters"]["failures.reconnect"] == 1     # hidden rows cannot be rebuilt
    assert client.server_stats()["errors"]["PREFIX_MISMATCH"] == 1


def test_missing_hidden_rows_are_a_typed_error(dflash, client_factory):
    from k3_accel.transport.failures import StepInputError
    tokens, hidden = context(20)
    client = make(client_factory, dflash)
    inp = step("a", 0, 16, tokens, hidden)
    inp.hidden = None
    with pytest.raises(StepInputError):
        client.step(inp)


def test_context_width_mismatch_fails_closed(dflash, client_factory):
    client = client_factory(dflash.address, context_width=128, num_speculative_tokens=K)
    assert client.state.value == "incompatible"


def test_vocab_mismatch_is_incompatible(tmp_path, client_factory):
    """A server built on a larger-vocabulary target checkpoint refuses this target at hello."""
    target = write_tiny_target(tmp_path / "big-target", vocab_size=2 * VOCAB)
    draft = write_tiny_dflash(tmp_path / "draft", target)
    srv = ServerProcess("--engine", "dflash", "--draft-model", str(draft), "--target-model", str(target))
    try:
        client = make(client_factory, srv)
        assert client.state.value == "incompatible"
        assert f"vocabulary: server drafts ids 0..{2 * VOCAB - 1}, target vocabulary is {VOCAB}" in \
            client.stats()["incompatible"]
        tokens, hidden = context(20)
        assert client.step(step("a", 0, 16, tokens, hidden)).drafts.tolist() == [[-1] * K]
    finally:
        srv.stop()


def test_aux_layer_mismatch_is_incompatible(dflash, client_factory):
    """Same width, other layers: the rows would mean something else to the draft."""
    client = make(client_factory, dflash, aux_layer_ids=(1, 2))
    assert client.state.value == "incompatible"
    assert "aux layer ids: server [0, 2], target captures [1, 2]" in client.stats()["incompatible"]


@pytest.mark.gpu
def test_cuda_inputs_are_staged_through_pinned_memory(dflash, client_factory):
    tokens, hidden = context(61, seed=11)
    client = make(client_factory, dflash, ring_depth=2)
    assert client.ring.pinned and client.ring.slots[0].hidden.is_pinned()
    dev = torch.device("cuda")
    on_gpu = StepInput(["g"], [60], torch.arange(60, device=dev), tokens[:60].to(dev), [True],
                       torch.tensor([int(tokens[60])], device=dev), torch.tensor([60], device=dev), k=K,
                       hidden=hidden[:60].to(dev))
    got = client.step(on_gpu).drafts
    ref = client.step(step("c", 0, 60, tokens, hidden)).drafts
    assert torch.equal(got, ref) and bool((got >= 0).all())


@pytest.mark.gpu
def test_cuda_deferred_chunks_survive_the_target_overwriting_its_buffers(dflash, client_factory, reference):
    """Deferred chunks from CUDA tensors that the 'next forward' overwrites as soon as the step
    returns, while the chunk's copy is still pending (the compute stream is held up by a GPU spin
    queued before the step): the server must still get the rows as they were (else NaN rows
    disable the request, or the drafts follow the wrong tokens)."""
    tokens, hidden = context(97, seed=5)
    dev = torch.device("cuda")
    client = make(client_factory, dflash, ring_depth=2)
    src_tok = torch.empty(40, dtype=torch.int64, device=dev)
    src_hid = torch.empty(40, WIDTH, dtype=torch.bfloat16, device=dev)
    for lo in (0, 40):
        src_tok.copy_(tokens[lo:lo + 40])
        src_hid.copy_(hidden[lo:lo + 40])
        torch.cuda._sleep(1_000_000_000)                             # ~0.5 s of GPU spin, queued first
        assert client.step(StepInput(["x"], [40], torch.arange(lo, lo + 40, device=dev), src_tok, [False],
                                     [int(tokens[lo + 40])], [lo + 40], k=K, hidden=src_hid)).deferred
        assert not torch.cuda.current_stream().query()               # the rows are not copied yet
        src_tok.fill_(VOCAB - 1)                                     # the next forward writes them
        src_hid.fill_(float("nan"))
    got = client.step(step("x", 80, 96, tokens, hidden)).drafts
    assert not {n: v for n, v in client.stats()["counters"].items() if n.startswith("failures.")}
    assert bool((got >= 0).all())
    assert_drafts_follow_reference(got[0], reference, hidden[:96], int(tokens[96]))


def test_a_step_over_the_message_limit_is_split_with_its_hidden_rows(checkpoints, client_factory, reference):
    """A DFlash step whose hidden rows (512 B a row in bf16) pass ``--max-message-mb 1`` goes out in
    several messages, each request's rows with their own hidden rows, in order: the drafts are the
    reference's over the whole context."""
    target, draft = checkpoints
    srv = ServerProcess("--engine", "dflash", "--draft-model", str(draft), "--target-model", str(target),
                        "--max-message-mb", "1", "--memory-budget-mb", "16")
    try:
        client = make(client_factory, srv, max_rows=8192, timeout_ms=120_000)
        tokens, hidden = context(3601, seed=11)
        small_tokens, small_hidden = context(41, seed=12)
        inp = StepInput(["long", "short"], [3600, 40], torch.cat([torch.arange(3600), torch.arange(40)]),
                        torch.cat([tokens[:3600], small_tokens[:40]]), [True, True],
                        [int(tokens[3600]), int(small_tokens[40])], [3600, 40], k=K,
                        hidden=torch.cat([hidden[:3600], small_hidden[:40]]))
        out = client.step(inp)
        assert client.stats()["counters"]["split_messages"] >= 2
        stats = client.server_stats()
        assert stats["errors"] == {} and stats["ingested_rows"] == 3640
        assert_drafts_follow_reference(out.drafts[0], reference, hidden[:3600], int(tokens[3600]))
        assert_drafts_follow_reference(out.drafts[1], reference, small_hidden[:40], int(small_tokens[40]))
    finally:
        assert srv.stop() == 0


def test_a_prefix_hit_never_overtakes_the_deferred_rows_it_attaches_to(dflash, client_factory, reference,
                                                                        monkeypatch):
    """A request's last prompt rows go out deferred (their copy still running), it leaves, and the
    next request is a prefix-cache hit on that prompt. Its reconnect must reach the server after
    those rows (and the free that retains them): sent ahead of them, a DFlash server cannot match
    the prefix (hidden rows cannot be rebuilt from tokens) and the new request sits out for good."""
    import threading

    from helpers.steps import held_copies
    tokens, hidden = context(57, seed=11)
    client = make(client_factory, dflash, ring_depth=2)
    errors = client.server_stats()["errors"]          # the module's server: other tests' errors too
    client.step(step("src", 0, 32, tokens, hidden))
    copied = held_copies(monkeypatch)                 # the deferred rows' copy is still running
    assert client.step(step("src", 32, 40, tokens, hidden, sampled=False)).deferred
    monkeypatch.undo()
    client.finish(["src"])
    threading.Timer(0.5, copied.set).start()    # the hit's propose waits for the sender: let the copy end
    hit = client.step(step("hit", 40, 56, tokens, hidden, prompt=tokens[:56])).drafts
    assert not client.is_disabled("hit") and bool((hit >= 0).all())
    assert_drafts_follow_reference(hit[0], reference, hidden[:56], int(tokens[56]))
    assert client.server_stats()["errors"] == errors
