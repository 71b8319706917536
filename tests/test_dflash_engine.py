"""DFlashEngine (CPU, PyTorch ops) against the independent float64 reference:
batched chunked ingest, rewinds after rejection, forks and copy on write,
config variants, logits/top-k, and what the engine reports."""
from __future__ import annotations

import pytest
import torch

from dflash_support import WIDTH, Mirror, checkpoint, random_rows, reference
from k3_accel.server.engines.dflash import DFlashEngine
from k3_accel.testing.dflash_reference import DFlashReference
from k3_accel.testing.precision import check_drafts, check_logits, logit_tolerance

BUDGET = 1 << 20          # 1 MiB: 64 blocks of 16 fp32 rows (1 KiB a row)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("dflash"))


@pytest.fixture(scope="module")
def ref(ckpt):
    return DFlashReference(*ckpt)


def _engine(ckpt, **kw) -> DFlashEngine:
    return DFlashEngine(str(ckpt[0]), str(ckpt[1]), budget_bytes=kw.pop("budget_bytes", BUDGET), **kw)


def _check(mirror: Mirror, ref: DFlashReference, states, anchors, k, dtype=torch.float32) -> int:
    """Propose for ``states``; every request's logits and drafts obey the precision rule
    against the reference over its mirrored rows. Returns the clear positions."""
    prop = mirror.propose(states, anchors, k)
    assert prop.tokens.shape == (len(states), k) and prop.tokens.dtype == torch.int64
    assert prop.logits.shape == (len(states), k, mirror.engine.caps.vocab_size)
    clear = 0
    for i, (state, anchor) in enumerate(zip(states, anchors)):
        want = reference(ref, mirror.rows[state], anchor, k)
        check_logits(prop.logits[i], want, dtype)
        clear += check_drafts(prop.tokens[i], want, dtype)
    return clear


def test_caps_and_sizes(ckpt):
    engine = _engine(ckpt)
    caps = engine.caps
    assert caps.kind == "dflash" and caps.needs_hidden_states and caps.supports_logits
    assert caps.supports_topk and caps.block_size == 16 and caps.hidden_size == 128
    assert (caps.context_width, caps.max_spec_tokens, caps.vocab_size) == (256, 7, 512)
    assert (caps.mask_token_id, caps.aux_layer_ids) == (511, (0, 2))
    assert engine.dtype == torch.float32 and engine.device.type == "cpu"
    assert engine.bytes_per_row == 2 * 2 * 2 * 32 * 4          # K+V, 2 layers, 2 kv heads x 32, fp32
    assert engine.pool.num_blocks == BUDGET // (16 * engine.bytes_per_row)
    assert engine.cache.nbytes == engine.pool.num_blocks * 16 * engine.bytes_per_row
    assert _engine(ckpt, dtype="bfloat16").bytes_per_row == 2 * 2 * 2 * 32 * 2
    assert _engine(ckpt, max_spec_tokens=3).caps.max_spec_tokens == 3
    assert _engine(ckpt, max_spec_tokens=99).caps.max_spec_tokens == 7
    with pytest.raises(ValueError):
        _engine(ckpt, budget_bytes=16 * engine.bytes_per_row - 1)    # not one block
    stats = engine.stats()
    assert stats["pool_used_blocks"] == 0 and stats["pool_total_blocks"] == engine.pool.num_blocks


def test_start_up_runs_each_ingest_row_class_and_leaves_the_pool_as_it_was(ckpt, monkeypatch):
    """The server's start runs the eager ingest once per row-count class (Triton compiles anew for a
    count of 1, one divisible by 16, an unaligned pointer): a target's first steps never pay it."""
    from k3_accel.server.engines.dflash import engine as engine_module
    seen = []
    ingest = DFlashEngine.ingest

    def spy(self, batch):
        seen.append(sum(batch.counts))
        return ingest(self, batch)
    monkeypatch.setattr(DFlashEngine, "ingest", spy)
    engine = _engine(ckpt)
    assert seen == list(engine_module.WARM_INGEST_ROWS) and {1, 16} <= set(seen)
    stats = engine.stats()
    assert stats["pool_used_blocks"] == 0 and engine.pool.free_blocks == engine.pool.num_blocks
    assert stats.get("ingest_rows", 0) == 0


def test_batched_chunked_ingest_matches_reference(ckpt, ref):
    """Several requests per ingest, chunks crossing block boundaries, a request with no
    context, several proposals of different k in one batch each."""
    engine = _engine(ckpt)
    m = Mirror(engine)
    gen = torch.Generator().manual_seed(1)
    a, b, c, empty = m.new(), m.new(), m.new(), m.new()
    m.ingest([(a, 0, random_rows(gen, 5)), (b, 0, random_rows(gen, 16)), (c, 0, random_rows(gen, 1))])
    m.ingest([(c, 1, random_rows(gen, 30)), (a, 5, random_rows(gen, 11))])
    m.ingest([(a, 16, random_rows(gen, 1)), (b, 16, random_rows(gen, 17))])
    m.check_lengths()
    assert [engine.length(s) for s in (a, b, c, empty)] == [17, 33, 31, 0]
    assert engine.pool.used_blocks == 2 + 3 + 2
    clear = sum(_check(m, ref, [a, b, c, empty], [10, 20, 30, 40], k) for k in (7, 3, 1))
    assert clear >= 0.9 * 4 * (7 + 3 + 1)
    drafts = m.propose([a, b, c], [10, 20, 30], 7, logits="none").tokens
    assert len(set(drafts.reshape(-1).tolist())) > 1                  # not degenerate


def test_rewind_after_rejection(ckpt, ref):
    """A verify block's rows are ingested, then rejected: the next ingest rewinds into
    them (start < length) with different rows. The drafts must follow the accepted
    rows only; the test first makes sure an un-rewound context would draft otherwise."""
    engine = _engine(ckpt)
    m = Mirror(engine)
    gen = torch.Generator().manual_seed(2)
    req = m.new()
    m.ingest([(req, 0, random_rows(gen, 20))])
    m.ingest([(req, 20, random_rows(gen, 8))])                        # verify block of k=7
    stale = m.rows[req].clone()
    fresh = random_rows(gen, 3)
    m.ingest([(req, 22, fresh)])                                      # 2 accepted, rewind, 3 new
    assert engine.length(req) == 25 and engine.pool.used_blocks == 2
    right = reference(ref, m.rows[req], 77, 7)
    unrewound = reference(ref, torch.cat([stale, fresh]), 77, 7)     # appended after the stale rows
    kept_stale = reference(ref, torch.cat([stale[:22], fresh[:0], stale[22:25]]), 77, 7)
    tol = logit_tolerance(torch.float32, right)
    for wrong in (unrewound, kept_stale):
        assert ((wrong - right).abs() > 100 * tol).any()             # the test can tell them apart
    assert _check(m, ref, [req], [77], 7) >= 5
    m.ingest([(req, 10, torch.empty(0, WIDTH, dtype=torch.bfloat16))])   # a bare rewind
    assert engine.length(req) == 10 and engine.pool.used_blocks == 1
    assert _check(m, ref, [req], [77], 7) >= 5


def test_fork_shares_blocks_and_copies_on_write(ckpt, ref):
    engine = _engine(ckpt)
    pool = engine.pool
    m = Mirror(engine)
    gen = torch.Generator().manual_seed(3)
    src = m.new()
    m.ingest([(src, 0, random_rows(gen, 20))])                        # blocks: full + 4 rows
    used = pool.used_blocks
    at_boundary = m.fork(src, 16)                                     # shares the full block
    assert pool.used_blocks == used and pool.refcount(src.blocks[0]) == 2
    partial = m.fork(src, 20)                                         # shares it, copies 4 rows
    assert pool.used_blocks == used + 1 and pool.refcount(src.blocks[0]) == 3
    assert partial.blocks[0] == src.blocks[0] and partial.blocks[1] != src.blocks[1]
    before = {s: reference(ref, m.rows[s], 5, 7) for s in (src, at_boundary, partial)}
    # Write into the shared full block through src: copy on write must keep the forks intact.
    m.ingest([(src, 10, random_rows(gen, 9))])
    assert src.blocks[0] not in (at_boundary.blocks[0], partial.blocks[0])
    assert pool.refcount(at_boundary.blocks[0]) == 2
    after = reference(ref, m.rows[src], 5, 7)
    assert ((after - before[src]).abs() > 100 * logit_tolerance(torch.float32, after)).any()
    _check(m, ref, [src, at_boundary, partial], [5, 5, 5], 7)
    # And into the forks: the source and each other stay as they were.
    m.ingest([(partial, 20, random_rows(gen, 13)), (at_boundary, 3, random_rows(gen, 2))])
    _check(m, ref, [src, at_boundary, partial], [5, 6, 7], 7)
    for s in list(m.rows):
        m.release(s)
    assert pool.free_blocks == pool.num_blocks


def test_propose_leaves_state_unchanged(ckpt):
    engine = _engine(ckpt)
    m = Mirror(engine)
    gen = torch.Generator().manual_seed(4)
    req = m.new()
    m.ingest([(req, 0, random_rows(gen, 9))])
    engine.flush()                     # the ingest's own projection (coalesced: it waits for a propose)
    blocks, kv = list(req.blocks), engine.cache.kv.clone()
    first = m.propose([req], [4], 7)
    m.propose([req], [99], 5)
    again = m.propose([req], [4], 7)
    assert req.blocks == blocks and engine.length(req) == 9 and torch.equal(engine.cache.kv, kv)
    assert torch.equal(first.tokens, again.tokens) and torch.equal(first.logits, again.logits)


def test_logits_modes(ckpt):
    engine = _engine(ckpt)
    m = Mirror(engine)
    gen = torch.Generator().manual_seed(5)
    reqs = [m.new(), m.new()]
    m.ingest([(reqs[0], 0, random_rows(gen, 7)), (reqs[1], 0, random_rows(gen, 40))])
    full = m.propose(reqs, [1, 2], 6)
    top = m.propose(reqs, [1, 2], 6, logits="topk", topk=5)
    plain = m.propose(reqs, [1, 2], 6, logits="none")
    assert plain.logits is None and plain.topk_values is None and torch.equal(plain.tokens, full.tokens)
    assert full.logits.dtype == torch.float32 and full.logits.device.type == "cpu"
    assert top.logits is None and top.topk_indices.shape == (2, 6, 5)
    want_values, want_indices = full.logits.topk(5, dim=-1)
    assert torch.equal(top.topk_values, want_values) and torch.equal(top.topk_indices, want_indices)
    assert torch.equal(top.topk_indices[..., 0], full.tokens)
    empty = m.propose(reqs, [1, 2], 0)
    assert empty.tokens.shape == (2, 0) and empty.logits.shape == (2, 0, 512)
    assert m.propose([], [], 4, logits="none").tokens.shape == (0, 4)
    stats = engine.stats()
    assert stats["propose_batch"] == 2 and stats["propose_seconds"] > 0
    assert stats["ingest_rows"] == 47 and stats["pool_used_blocks"] == 1 + 3


@pytest.mark.parametrize("variant", [
    {"attention_bias": True}, {"causal": True}, {"logit_scale": 0.5}, {"value_scale": 0.5},
    {"distinct_k_norm": True}, {"draft_vocab_size": 200},
])
def test_config_variants_match_reference(tmp_path, ckpt, ref, variant):
    """Each knob takes effect (output differs from the plain draft) and is computed as
    the reference computes it."""
    draft, target = checkpoint(tmp_path, target=ckpt[1], name="variant", **variant)
    gen = torch.Generator().manual_seed(6)
    rows = random_rows(gen, 21)
    m = Mirror(_engine((draft, target)))
    req = m.new()
    m.ingest([(req, 0, rows[:4])])
    m.ingest([(req, 4, rows[4:])])
    variant_ref = DFlashReference(draft, target)
    assert _check(m, variant_ref, [req], [9], 7) >= 3
    plain = reference(ref, rows, 9, 7)
    mine = reference(variant_ref, rows, 9, 7)
    assert not torch.allclose(plain, mine, atol=1e-3, equal_nan=True)
    if "draft_vocab_size" in variant:
        tokens = m.propose([req], [9], 7, logits="none").tokens
        assert bool((tokens % 2 == 0).all()) and bool((tokens < 400).all())   # id i -> 2i


def test_causal_block_ignores_later_masks(tmp_path, ckpt):
    """Causal: offset 1 sees only the anchor and the context, so k=1 equals the first
    draft of k=7; non-causal it sees every mask token and differs."""
    gen = torch.Generator().manual_seed(7)
    rows = random_rows(gen, 12)
    out = {}
    for causal in (True, False):
        draft, target = checkpoint(tmp_path, target=ckpt[1], name=f"c{causal}", causal=causal)
        m = Mirror(_engine((draft, target)))
        req = m.new()
        m.ingest([(req, 0, rows)])
        out[causal] = (m.propose([req], [3], 1).logits[0, 0], m.propose([req], [3], 7).logits[0, 0])
    one, seven = out[True]
    torch.testing.assert_close(one, seven, atol=1e-5, rtol=1e-5)
    one, seven = out[False]
    assert not torch.allclose(one, seven, atol=1e-3)
