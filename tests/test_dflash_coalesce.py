"""Coalesced ingest (DFlashEngine): small ingests of host rows wait for one projection, and a
request drafts exactly what it would had every ingest been projected at once, whatever comes
between (rewinds, forks with copy on write, releases whose blocks others reuse, proposes)."""
from __future__ import annotations

import random

import pytest
import torch

from dflash_support import Mirror, checkpoint, random_rows, reference
from k3_accel.server.engines.base import IngestBatch
from k3_accel.server.engines.dflash import DFlashEngine
from k3_accel.server.engines.dflash import engine as engine_module
from k3_accel.testing.dflash_reference import DFlashReference
from k3_accel.testing.precision import check_drafts, check_logits

BUDGET = 1 << 20


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("dflash-coalesce"))


@pytest.fixture(scope="module")
def ref(ckpt):
    return DFlashReference(*ckpt)


def _engine(ckpt, **kw) -> DFlashEngine:
    return DFlashEngine(str(ckpt[0]), str(ckpt[1]), budget_bytes=BUDGET, block_size=4, **kw)


@pytest.fixture
def projections(monkeypatch):
    """How many rows each projection of context rows took, in order."""
    seen: list[int] = []
    real = engine_module.context_projection

    def spy(weights, ops, hidden):
        seen.append(hidden.shape[0])
        return real(weights, ops, hidden)
    monkeypatch.setattr(engine_module, "context_projection", spy)
    return seen


def test_small_host_ingests_share_one_projection_and_large_ones_go_at_once(ckpt, projections):
    engine = _engine(ckpt, coalesce_rows=64)
    m, gen = Mirror(engine), torch.Generator().manual_seed(1)
    reqs = [m.new() for _ in range(3)]
    projections.clear()
    for step in range(5):                          # decode steps of three requests: nothing projected yet
        m.ingest([(r, step, random_rows(gen, 1)) for r in reqs])
    assert projections == []
    m.propose(reqs, [1, 2, 3], 3)
    assert projections == [15]                     # one projection of every waiting row
    m.ingest([(reqs[0], 5, random_rows(gen, 17))])  # a prefill-sized chunk (over a quarter): at once
    assert projections == [15, 17]
    for _ in range(22):                            # waiting rows go once they reach coalesce_rows
        m.ingest([(r, engine.length(r), random_rows(gen, 1)) for r in reqs])
    assert projections == [15, 17, 66]
    eager = _engine(ckpt, coalesce_rows=0)
    e = Mirror(eager)
    projections.clear()
    state = e.new()
    e.ingest([(state, 0, random_rows(gen, 1))])
    e.ingest([(state, 1, random_rows(gen, 1))])
    assert projections == [1, 1]


@pytest.fixture
def scatters(monkeypatch):
    """Install on an engine: the slots of every store into its K/V pool, one list per store."""
    seen: list[list[int]] = []

    def install(engine: DFlashEngine) -> list[list[int]]:
        real = engine.ops.store_context

        def spy(kv_proj, k_norms, cos_sin, positions, slots, kv, cfg):
            seen.append(slots.tolist())
            return real(kv_proj, k_norms, cos_sin, positions, slots, kv, cfg)
        monkeypatch.setattr(engine.ops, "store_context", spy)
        return seen
    return install


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("seed", range(6))
def test_coalesced_engine_drafts_what_the_reference_drafts_through_any_mix(ckpt, ref, scatters, seed, device):
    """Besides the drafts: no store writes one slot twice (rows a rewind replaced, or of blocks a
    release gave to another request, never share a scatter with their successors: on a GPU the
    order of such writes is undefined). On CUDA: bf16 and the kernels `auto` picks there."""
    rng = random.Random(seed)
    engine = _engine(ckpt, coalesce_rows=rng.choice([8, 32, 1024]), device=device)
    stores = scatters(engine)
    m, gen = Mirror(engine), torch.Generator().manual_seed(seed)
    live = [m.new() for _ in range(3)]
    checked = 0
    for _ in range(40):
        op = rng.random()
        if op < 0.45:                              # decode-like appends, some requests without rows
            items = [(s, engine.length(s), random_rows(gen, rng.randint(0, 3))) for s in live if rng.random() < 0.8]
            if items:
                m.ingest(items)
        elif op < 0.6 and live:                    # a rewind after rejected drafts, then new rows
            s = rng.choice(live)
            m.ingest([(s, max(0, engine.length(s) - rng.randint(1, 3)), random_rows(gen, rng.randint(0, 2)))])
        elif op < 0.7 and live:                    # a fork at a partial block: its next rows copy it
            s = rng.choice(live)
            fork = m.fork(s, rng.randint(0, engine.length(s)))
            live.append(fork)
            m.ingest([(fork, engine.length(fork), random_rows(gen, 1)), (s, engine.length(s), random_rows(gen, 1))])
        elif op < 0.8 and len(live) > 1:           # a release: its blocks go to the next new rows
            m.release(live.pop(rng.randrange(len(live))))
            live.append(m.new())
            m.ingest([(live[-1], 0, random_rows(gen, rng.randint(1, 6)))])
        else:
            states = [s for s in live if engine.length(s)]
            if not states:
                continue
            anchors = [rng.randrange(engine.caps.vocab_size) for _ in states]
            prop = m.propose(states, anchors, 3)
            for i, (state, anchor) in enumerate(zip(states, anchors)):
                want = reference(ref, m.rows[state], anchor, 3)
                check_logits(prop.logits[i], want, engine.dtype)
                check_drafts(prop.tokens[i], want, engine.dtype)
                checked += 1
    assert checked > 0 and stores
    assert all(len(set(slots)) == len(slots) for slots in stores)
    for s in list(m.rows):
        m.release(s)
    assert engine.pool.free_blocks == engine.pool.num_blocks


@pytest.mark.gpu
def test_rows_read_over_the_device_plane_are_projected_before_their_slot_is_reused(ckpt, ref, projections):
    """Device rows the caller owns (a ring slot the target refills once released) are projected in
    their own ingest, never left waiting, so scribbling over them afterwards changes no draft (host
    rows of the same size do wait)."""
    engine = _engine(ckpt, device="cuda", coalesce_rows=1024)
    m, gen = Mirror(engine), torch.Generator().manual_seed(7)
    states = [m.new() for _ in range(3)]
    projections.clear()                                               # the start-up's warm ingests
    m.ingest([(s, 0, random_rows(gen, 5)) for s in states])          # host rows: they wait
    assert projections == []
    sent = torch.cat([random_rows(gen, 2) for _ in states])
    slot = sent.to(device="cuda", dtype=engine.dtype)                 # the ring slot the server reads
    engine.ingest(IngestBatch(states, [5] * 3, [2] * 3, torch.tensor([5, 6] * 3), torch.zeros(6, dtype=torch.long),
                              slot))
    assert projections == [21]                                        # the waiting rows and these, at once
    for i, s in enumerate(states):
        m.rows[s] = torch.cat([m.rows[s], sent[2 * i:2 * i + 2]])
    torch.cuda.synchronize()                                          # the server's release event
    slot.fill_(float("nan"))                                          # the target reuses the slot
    anchors = [1, 2, 3]
    prop = m.propose(states, anchors, 3)
    for i, (state, anchor) in enumerate(zip(states, anchors)):
        want = reference(ref, m.rows[state], anchor, 3)
        check_logits(prop.logits[i], want, engine.dtype)
        check_drafts(prop.tokens[i], want, engine.dtype)


@pytest.mark.gpu
def test_device_rows_the_server_owns_wait_like_host_rows(ckpt, ref, projections):
    """The server reads a target's slot into a buffer of its own (``IngestBatch.owned``): those rows
    may wait for the next propose like host rows, and the drafts are the reference's."""
    engine = _engine(ckpt, device="cuda", coalesce_rows=1024)
    m, gen = Mirror(engine), torch.Generator().manual_seed(9)
    states = [m.new() for _ in range(3)]
    m.ingest([(s, 0, random_rows(gen, 5)) for s in states])
    projections.clear()
    sent = torch.cat([random_rows(gen, 2) for _ in states])
    engine.ingest(IngestBatch(states, [5] * 3, [2] * 3, torch.tensor([5, 6] * 3), torch.zeros(6, dtype=torch.long),
                              sent.to(device="cuda", dtype=engine.dtype), owned=True))
    assert projections == []                                          # they wait with the host rows
    for i, s in enumerate(states):
        m.rows[s] = torch.cat([m.rows[s], sent[2 * i:2 * i + 2]])
    anchors = [4, 5, 6]
    prop = m.propose(states, anchors, 3)
    assert projections == [21]                                        # one projection for all of them
    for i, (state, anchor) in enumerate(zip(states, anchors)):
        want = reference(ref, m.rows[state], anchor, 3)
        check_logits(prop.logits[i], want, engine.dtype)
        check_drafts(prop.tokens[i], want, engine.dtype)


def test_coalesce_rows_must_not_be_negative(ckpt):
    with pytest.raises(ValueError, match="coalesce_rows"):
        _engine(ckpt, coalesce_rows=-1)


@pytest.mark.parametrize("flag, rows", [([], 1024), (["--ingest-coalesce-rows", "0"], 0)])
def test_server_flag_sets_the_engines_coalescing(ckpt, flag, rows):
    from k3_accel.server.cli import build_engine, build_parser
    args = build_parser().parse_args(["--engine", "dflash", "--draft-model", str(ckpt[0]), "--target-model",
                                      str(ckpt[1]), "--memory-budget-mb", "1", *flag])
    assert build_engine(args).coalesce_rows == rows
