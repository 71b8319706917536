"""End to end on a real vLLM engine: the DFlash draft server, and the peer oracle.

The checkpoints are the demo's: the tiny target trained on its built-in text
and a DFlash draft distilled from it (seeded), so drafts get accepted. One
child process runs three engines over the same prompts: no speculation;
vLLM's own in-tree DFlash proposer with the draft checkpoint (no draft
address: stock vLLM); and remote drafting through ``k3-draft-server --engine
dflash`` with the same checkpoint. Every draft both make is recorded: for the
same checkpoint the remote engine (an independent PyTorch implementation)
must propose, step by step, exactly the drafts vLLM's proposer makes locally,
and the target must accept some of them (a useless draft fails the test).
"""
from __future__ import annotations

import pytest

from k3_accel.demo.child import run_in_child
from k3_accel.demo.main import build_tiny
from k3_accel.demo.scenario import FIXED_K, Round, Run, Scenario

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

ENGINE = {"max_model_len": 512, "max_num_seqs": 8, "dtype": "float32"}
K = 4
PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "one two three one two three one two",
    "Speculative decoding lets a small draft model propose several tokens",
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25],
]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e-dflash")
    target, draft = build_tiny(work, trained=True, k=K)
    rounds = [Round(PROMPTS, max_tokens=[20, 24, 16, 20])]
    spec = {"method": "dflash", "model": draft, "num_speculative_tokens": K}
    scenario = Scenario(target=target, workdir=str(work), engine=ENGINE,
                        server_args=["--engine", "dflash", "--draft-model", draft, "--target-model", target,
                                     "--num-speculative-tokens", str(K)],
                        runs=[Run("none", rounds),
                              Run("in-tree", rounds, speculative=spec, record_drafts=True),
                              Run("remote", rounds, speculative=spec, remote=True, record_drafts=True, plugin=FIXED_K)])
    return {r["name"]: r for r in run_in_child(scenario, timeout=900)["runs"]}


def test_outputs_identical_to_no_speculation(result):
    expected = result["none"]["rounds"][0]["outputs"]
    assert [len(o) for o in expected] == [20, 24, 16, 20]
    assert result["remote"]["rounds"][0]["outputs"] == expected
    assert result["in-tree"]["rounds"][0]["outputs"] == expected


def test_without_an_address_vllm_drafts_as_stock(result):
    assert result["in-tree"]["drafter"]["class"] == "DFlashProposer"
    assert result["remote"]["drafter"]["class"] == "RemoteDFlashProposer"


def test_hidden_states_reach_the_server(result):
    rnd = result["remote"]["rounds"][0]
    server = rnd["server"]
    prompt_rows = sum(len(p) for p in rnd["prompt_token_ids"])
    assert server["ingested_rows"] >= prompt_rows, server
    assert server["ops"]["propose"] > 0 and not server["errors"], server
    assert rnd["client"]["engine"] == "dflash"
    assert rnd["client"]["counters"].get("disabled_requests", 0) == 0, rnd["client"]["counters"]


def test_the_target_accepts_distilled_drafts(result):
    remote, local = result["remote"]["rounds"][0]["spec"], result["in-tree"]["rounds"][0]["spec"]
    assert remote["draft_tokens"] > 0 and remote["accepted"] > 0, remote     # typically ~30 % accepted
    assert remote["accepted"] == local["accepted"], (remote, local)           # same drafts, same verdicts


def test_peer_oracle_remote_drafts_equal_in_tree_drafts_step_by_step(result):
    local, remote = result["in-tree"]["drafts"], result["remote"]["drafts"]
    assert sorted(local) == sorted(remote) and len(local) == len(PROMPTS)
    compared = 0
    for prompt, steps in local.items():
        assert len(remote[prompt]) == len(steps), prompt
        for i, (a, b) in enumerate(zip(steps, remote[prompt])):
            assert b == a, f"prompt {prompt[:30]}..., step {i}: remote {b} != in-tree {a}"
            assert len(a) == K and -1 not in a
            compared += 1
    # every request drafts at least once per K+1 tokens it generates
    assert compared >= sum(n // (K + 1) for n in [20, 24, 16, 20])
