"""The CUDA-graph runner of the propose step, on the CPU: a replay simulated as a function of the
static buffers captured (what a graph reads: the input block, temperatures, seeds) writing into the
outputs captured (what a graph writes) must draft what the eager step drafts — padded to a bucket,
greedy and sampled, for two numbers of draft tokens — and every proposal keeps its own drafts after
later replays (the server launches one replay per group of a batch before it reads any; a shared
host buffer let the sampled replay overwrite the greedy one's drafts on the H200). The input buffers are
not zeroed: a step reads only the block-table entries inside each request's context."""
from __future__ import annotations

import pytest
import torch

from dflash_support import Mirror, random_rows
from dspark_support import SHAPES, checkpoints
from k3_accel.server.engines.dflash import DSparkEngine
from graph_support import SimulatedGraphs

TEMPERATURES = [0.0, 0.5, 1.0, 2.0, 0.0, 1.0, 0.5]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return checkpoints(tmp_path_factory.mktemp("dspark_replay"))


def _setup(engine):
    m = Mirror(engine)
    gen = torch.Generator().manual_seed(1)
    sizes = (3, 17, 40, 1, 64, 9, 30)
    states = [m.new() for _ in sizes]
    m.ingest([(s, 0, random_rows(gen, n)) for s, n in zip(states, sizes)])
    m.ingest([(states[0], 1, random_rows(gen, 5))])                     # a rewind
    return m, states


@pytest.mark.parametrize("name", list(SHAPES))
def test_replays_draft_like_the_eager_step_and_keep_their_drafts(ckpts, name):
    draft, target = ckpts[name]
    engine = DSparkEngine(str(draft), str(target), block_size=4, budget_bytes=8 << 20,
                          max_batch=8, max_spec_tokens=6)
    assert engine.graphs is None                                        # the CPU: eager
    m, states = _setup(engine)
    runner = SimulatedGraphs(engine, max_batch=8)
    seeds = [(i * 7_919) << 33 | i for i in range(len(states))]
    kept, differ = [], 0
    for k in (6, 3):
        for r in (1, 4, 7):                                             # buckets 1, 4, 8 (padded)
            anchors = [11 * i + k for i in range(r)]
            sampling = dict(temperature=TEMPERATURES[:r], seeds=seeds[:r])
            engine.graphs = None
            eager = [m.propose(states[:r], anchors, k, logits="none"),
                     m.propose(states[:r], anchors, k, logits="none", **sampling)]
            engine.graphs = runner
            graph = [m.propose(states[:r], anchors, k, logits="none"),
                     m.propose(states[:r], anchors, k, logits="none", **sampling)]
            kept += [(k, r, g, e, g.tokens.clone()) for g, e in zip(graph, eager)]
            cold = torch.tensor(TEMPERATURES[:r]) == 0
            differ += int((graph[1].tokens[~cold] != graph[0].tokens[~cold]).sum())
    assert runner.captured_k == {6, 3}
    assert differ > 0                                                   # the hot requests sampled
    for k, r, g, e, first in kept:                                      # after every later replay
        assert torch.equal(g.tokens, first), (k, r)
        assert torch.equal(g.tokens, e.tokens), (k, r)
        if e.confidence is None:
            assert g.confidence is None
        else:
            torch.testing.assert_close(g.confidence, e.confidence, atol=1e-5, rtol=0)
