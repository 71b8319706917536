"""DFlashEngine on a CUDA GPU (run on the GPU machine; deselected where there is none):
compiled Triton kernels against the PyTorch ops, bf16 drafts against the float64
reference under the precision rule, CUDA-graph drafts against eager ones, calls
from another thread, and pool sizing from free memory."""
from __future__ import annotations

import threading

import pytest
import torch

import dflash_triton_check
from dflash_support import Mirror, checkpoint, random_rows, reference
from k3_accel.server.engines.base import ProposeBatch
from k3_accel.server.engines.dflash import DFlashEngine
from k3_accel.testing.dflash_reference import DFlashReference
from k3_accel.testing.precision import check_drafts, check_logits, clear_positions, logit_tolerance

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("dflash"))


@pytest.fixture(scope="module")
def ref(ckpt):
    return DFlashReference(*ckpt)


@pytest.fixture(scope="module")
def bf16(ckpt):
    engine = DFlashEngine(str(ckpt[0]), str(ckpt[1]), device="cuda", budget_bytes=8 << 20,
                          max_batch=8)
    assert engine.dtype == torch.bfloat16 and engine.graphs is not None       # CUDA defaults
    assert engine.graphs.captured_k == {7}
    return engine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernels_match_torch_ops(dtype):
    gen = torch.Generator().manual_seed(0)
    dflash_triton_check.kernels("cuda", dtype, gen)
    dflash_triton_check.engines("cuda", str(dtype).split(".")[1], gen)


def _setup(engine: DFlashEngine, sizes, seed=1) -> tuple[Mirror, list]:
    m = Mirror(engine)
    gen = torch.Generator().manual_seed(seed)
    states = [m.new() for _ in sizes]
    m.ingest([(s, 0, random_rows(gen, n)) for s, n in zip(states, sizes)])
    m.ingest([(states[0], max(0, sizes[0] - 2), random_rows(gen, 5))])      # a rewind
    return m, states


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_drafts_match_reference(ckpt, ref, dtype):
    engine = DFlashEngine(str(ckpt[0]), str(ckpt[1]), device="cuda", dtype=dtype,
                          budget_bytes=8 << 20, max_batch=8)
    m, states = _setup(engine, (3, 17, 40, 1, 64))
    anchors = [5, 50, 150, 250, 350]
    eager = m.propose(states, anchors, 7)                    # logits asked: eager path
    graphed = m.propose(states, anchors, 7, logits="none")   # CUDA graph (bucket 8)
    clear = 0
    for i, (s, a) in enumerate(zip(states, anchors)):
        want = reference(ref, m.rows[s], a, 7)
        check_logits(eager.logits[i], want, getattr(torch, dtype))
        clear += check_drafts(eager.tokens[i], want, getattr(torch, dtype))
        check_drafts(graphed.tokens[i], want, getattr(torch, dtype))
    assert clear >= len(states) * 7 // 4


def test_graphs_equal_eager_where_clear(bf16):
    """Replays for several batch sizes (padded into buckets), a k captured at start and
    one captured on first use, against the eager step of the same engine."""
    m, states = _setup(bf16, (9, 33, 2, 70, 16, 5, 48), seed=2)
    clear_total = total = 0
    for k in (7, 3):
        for r in (1, 3, 4, 7):
            anchors = [11 * i + k for i in range(r)]
            eager = m.propose(states[:r], anchors, k)
            graphed = m.propose(states[:r], anchors, k, logits="none")
            clear = clear_positions(eager.logits.double(),
                                    logit_tolerance(torch.bfloat16, eager.logits.double()))
            assert torch.equal(graphed.tokens[clear], eager.tokens[clear]), (k, r)
            clear_total, total = clear_total + int(clear.sum()), total + r * k
    assert clear_total >= total // 4                          # not vacuous
    assert bf16.graphs.captured_k == {7, 3}
    for s in states:
        m.release(s)
    assert bf16.pool.free_blocks == bf16.pool.num_blocks


def test_other_threads_and_stream_order(bf16):
    """Ingest and propose from a thread that did not build the engine: same drafts as
    from this one (all work is ordered on the engine's own stream)."""
    m, states = _setup(bf16, (20, 31), seed=3)
    here = m.propose(states, [1, 2], 7, logits="none").tokens
    there = {}

    def work():
        gen = torch.Generator().manual_seed(4)
        other = m.new()
        m.ingest([(other, 0, random_rows(gen, 25))])
        there["tokens"] = m.propose(states, [1, 2], 7, logits="none").tokens
        m.release(other)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert torch.equal(here, there["tokens"])
    stats = bf16.stats()
    assert stats["propose_batch"] == 2 and stats["ingest_rows"] == 25
    for s in states:
        m.release(s)


def test_replays_in_flight_keep_their_own_inputs_and_the_callers_stream(bf16):
    """Two proposes of one graph launched before either is read, behind a long kernel on the
    engine's stream (so the first one's input copy has not run when the second fills its
    inputs): each gets the drafts it gets alone. Afterwards the caller's stream (a side
    stream here) is current again, after ingest and propose alike."""
    m, states = _setup(bf16, (40, 23, 57), seed=5)
    alone = [m.propose(states, anchors, 7, logits="none").tokens for anchors in ([1, 2, 3], [40, 50, 60])]
    assert not torch.equal(alone[0], alone[1])                # the two batches draft differently
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with torch.cuda.stream(bf16.stream):
            torch.cuda._sleep(200_000_000)                    # about 0.1 s of device time
        pending = [bf16.propose(ProposeBatch(states, [[]] * 3, torch.tensor(anchors), 7))
                   for anchors in ([1, 2, 3], [40, 50, 60])]
        assert torch.cuda.current_stream() == side
        m.ingest([(states[1], 23, random_rows(torch.Generator().manual_seed(6), 2))])
        assert torch.cuda.current_stream() == side
    for proposal, want in zip(pending, alone):
        assert torch.equal(proposal.wait().tokens, want)
    for s in states:
        m.release(s)


def test_pool_from_free_memory(ckpt):
    free, _ = torch.cuda.mem_get_info()
    engine = DFlashEngine(str(ckpt[0]), str(ckpt[1]), device="cuda", memory_fraction=0.02,
                          cuda_graphs=False)
    block_bytes = engine.pool.block_rows * engine.bytes_per_row
    assert 0 < engine.cache.nbytes <= 0.02 * free
    assert engine.pool.num_blocks * block_bytes == engine.cache.nbytes
