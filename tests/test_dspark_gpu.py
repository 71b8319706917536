"""DSparkEngine on a CUDA GPU (run on the GPU machine; deselected where there is none): the
compiled seeded Gumbel-max kernel against the PyTorch one, the fused Markov step at the production
shape, the CUDA-graph step (Triton kernels,
the Markov loop and the sampling inside the graph) against the same engine's eager step, greedy
and sampled (position by position while the drafted prefixes agree), on the three checkpoint shapes of the peer-oracle test, and the Triton engine's
float32 drafts against the PyTorch engine's."""
from __future__ import annotations

import pytest
import torch

from dflash_support import Mirror, random_rows
from dspark_support import SHAPES, checkpoints
from k3_accel.server.engines.dflash import DSparkEngine, gumbel, ops_torch, ops_triton

pytestmark = pytest.mark.gpu
TEMPERATURES = [0.0, 0.5, 1.0, 2.0, 0.0, 1.0, 0.5]    # powers of two: the division is exact in both


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return checkpoints(tmp_path_factory.mktemp("dspark_gpu"))


def test_compiled_gumbel_kernel_matches_torch():
    gen = torch.Generator(device="cuda").manual_seed(0)
    r, v = 64, 151_936
    x = torch.randn(r, v, device="cuda", generator=gen) * 4
    temps = torch.tensor(TEMPERATURES * 10, device="cuda")[:r]
    seeds = torch.randint(-2**62, 2**62, (r,), device="cuda", generator=gen)
    lens = torch.randint(0, 100_000, (r,), device="cuda", dtype=torch.int32, generator=gen)
    keys = torch.arange(v, device="cuda") * 2 + 3                         # a mapped vocabulary
    clear = total = 0
    for step in (0, 3):
        for k in (None, keys):
            got = ops_triton.gumbel_argmax(x, temps, seeds, lens, step, k)
            want = ops_torch.gumbel_argmax(x, temps, seeds, lens, step, k)
            # where the best noised value leads the runner-up clearly, libdevice's and PyTorch's
            # float32 log cannot change the winner
            hot = temps[:, None] != 0
            kk = torch.arange(v, device="cuda") if k is None else k
            noised = torch.where(hot, x / torch.where(hot, temps[:, None], 1.0)
                                 + gumbel.noise(gumbel.step_seeds(seeds, step),
                                                lens.long() + step + gumbel.SALT, kk), x)
            top = noised.topk(2, dim=-1).values
            sure = (top[:, 0] - top[:, 1]) > 1e-4 * top[:, 0].abs().clamp_min(1)
            assert torch.equal(got[sure], want[sure]), step
            clear, total = clear + int(sure.sum()), total + r
    assert clear >= total * 9 // 10                                     # not vacuous


def test_fused_markov_step_at_the_production_shape():
    """The fused Markov step (bias GEMM, sum and pick in one pass) picks what the PyTorch step picks
    wherever the float64 reference's winner is clear, at the benchmark's shape (vocabulary 151,936,
    rank 256, bf16) for 1 to 64 requests, greedy and sampled (dflash_triton_check.markov)."""
    from dflash_triton_check import markov
    shapes = [(b, 151_936, 256, scale) for b, scale in ((1, 1.0), (8, 1.0), (32, 0.5), (64, 1.0))]
    markov("cuda", torch.bfloat16, torch.Generator().manual_seed(3), shapes)


def _setup(engine, seed=1):
    m = Mirror(engine)
    gen = torch.Generator().manual_seed(seed)
    sizes = (3, 17, 40, 1, 64, 9, 30)
    states = [m.new() for _ in sizes]
    m.ingest([(s, 0, random_rows(gen, n)) for s, n in zip(states, sizes)])
    m.ingest([(states[0], 1, random_rows(gen, 5))])                     # a rewind
    return m, states


def _agree(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """Positions where two drafts agree with their whole prefix (a later draft is conditioned on it)."""
    return int((a == b).long().cumprod(1).sum()), a.numel()


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_equal_eager_greedy_and_sampled(ckpts, name, dtype):
    """The graph replays (padded to a bucket: other GEMM shapes and attention splits than the eager
    step, so rounding may differ) draft what the eager step drafts at nearly every position, greedy
    and sampled; a graph that lost the temperatures or seeds would not. Within one graph, a request
    at temperature 0 drafts exactly its greedy drafts while the others sample."""
    draft, target = ckpts[name]
    engine = DSparkEngine(str(draft), str(target), device="cuda", dtype=dtype, block_size=4,
                          budget_bytes=8 << 20, max_batch=8, max_spec_tokens=6)
    assert engine.graphs is not None and engine.ops is ops_triton and engine.caps.sampling
    m, states = _setup(engine)
    seeds = [(i * 7_919) << 33 | i for i in range(len(states))]
    differ, agree = 0, [0, 0]
    for k in (6, 3):
        for r in (1, 4, 7):
            anchors = [11 * i + k for i in range(r)]
            sampling = dict(temperature=TEMPERATURES[:r], seeds=seeds[:r])
            greedy_graph = m.propose(states[:r], anchors, k, logits="none")
            sampled_graph = m.propose(states[:r], anchors, k, logits="none", **sampling)
            graphs, engine.graphs = engine.graphs, None                  # the same kernels, eagerly
            greedy_eager = m.propose(states[:r], anchors, k, logits="none")
            sampled_eager = m.propose(states[:r], anchors, k, logits="none", **sampling)
            engine.graphs = graphs
            for a, b in ((greedy_graph, greedy_eager), (sampled_graph, sampled_eager)):
                agree = [x + y for x, y in zip(agree, _agree(a.tokens, b.tokens))]
            if SHAPES[name]["confidence"]:
                same = (sampled_graph.tokens == sampled_eager.tokens).long().cumprod(1).bool()
                diff = (sampled_graph.confidence - sampled_eager.confidence).abs()
                assert (diff[same] < (1e-4 if dtype == "float32" else 0.05)).all(), (k, r)
            cold = torch.tensor(TEMPERATURES[:r]) == 0
            assert torch.equal(sampled_graph.tokens[cold], greedy_graph.tokens[cold]), (k, r)
            differ += int((sampled_graph.tokens[~cold] != greedy_graph.tokens[~cold]).sum())
    assert agree[0] >= agree[1] * 9 // 10, agree
    assert differ > 0                                                    # the hot requests sampled
    assert engine.graphs.captured_k == {6, 3}


@pytest.mark.parametrize("name", list(SHAPES))
def test_triton_engine_drafts_like_the_torch_engine(ckpts, name):
    """float32: the compiled path (graphs) and the PyTorch path (eager) draft the same tokens, greedy
    and sampled, request by request while their drafted prefixes agree (a later draft is conditioned
    on it), at nearly every position (float32 rounding of two kernel sets may flip a near tie)."""
    draft, target = ckpts[name]
    fast = DSparkEngine(str(draft), str(target), device="cuda", dtype="float32", block_size=4,
                        budget_bytes=8 << 20, max_batch=8, max_spec_tokens=6)
    plain = DSparkEngine(str(draft), str(target), device="cuda", dtype="float32", block_size=4,
                         budget_bytes=8 << 20, max_batch=8, max_spec_tokens=6, kernels="torch")
    (mf, sf), (mp, sp) = _setup(fast), _setup(plain)
    same = total = 0
    for sampling in ({}, {"temperature": TEMPERATURES, "seeds": list(range(-3, 4))}):
        anchors = [13 * i + 1 for i in range(len(sf))]
        a = mf.propose(sf, anchors, 6, logits="none", **sampling).tokens
        b = mp.propose(sp, anchors, 6, logits="none", **sampling).tokens
        same, total = same + _agree(a, b)[0], total + a.numel()
    assert same >= total * 9 // 10, (same, total)
