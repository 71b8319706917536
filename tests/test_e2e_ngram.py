"""End to end on a real vLLM engine: the ngram draft server (no hidden states needed).

One child process runs three engines over the same prompts: no speculation;
``method: "dflash"`` drafting remotely (the target computes aux hidden states,
the ngram server needs none, so none are shipped); ``method: "ngram"``
drafting remotely (tokens only; last, because it imports numba). The dflash
run starts with a batch of ``max_tokens=1`` requests, which must reach the
server not at all.
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
    "one two three four one two three four one two three four one two",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy",
    "Bread, cheese, apples, milk, honey and tea. Bread, cheese, apples, milk,",
    "Water boils at one hundred degrees",
    [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8],
]
ONE_TOKEN = ["Numbers like one, two", "The library opened", "Music played softly"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e-ngram")
    target, draft = build_tiny(work)
    rounds = [Round(PROMPTS, max_tokens=24)]
    dflash = {"method": "dflash", "model": draft, "num_speculative_tokens": K}
    ngram = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    scenario = Scenario(target=target, workdir=str(work), engine=ENGINE,
                        server_args=["--engine", "ngram", "--num-speculative-tokens", str(K)], runs=[
                            Run("stock", rounds),
                            Run("dflash-config", [Round(ONE_TOKEN, max_tokens=1)] + rounds, speculative=dflash,
                                remote=True, plugin=FIXED_K),
                            Run("ngram-config", rounds, speculative=ngram, remote=True, plugin=FIXED_K)])
    return {r["name"]: r for r in run_in_child(scenario, timeout=900)["runs"]}


@pytest.mark.parametrize("run", ["dflash-config", "ngram-config"])
def test_outputs_identical_to_no_speculation(result, run):
    expected = result["stock"]["rounds"][0]["outputs"]
    assert result[run]["rounds"][-1]["outputs"] == expected
    assert all(len(o) == 24 for o in expected)


@pytest.mark.parametrize("run", ["dflash-config", "ngram-config"])
def test_remote_drafts_are_accepted(result, run):
    last = result[run]["rounds"][-1]
    assert last["spec"]["accepted"] > 0, last["spec"]                  # vLLM's spec-decode counters
    assert last["server"]["proposals"] > 0 and last["server"]["tokens_proposed"] > 0
    assert last["client"]["counters"].get("disabled_requests", 0) == 0, last["client"]["counters"]


def test_the_runner_uses_the_remote_drafters(result):
    assert result["dflash-config"]["drafter"]["class"] == "RemoteDFlashProposer"
    assert result["ngram-config"]["drafter"]["class"] == "RemoteNgramProposer"
    assert result["ngram-config"]["drafter"]["engine"] == "ngram"


def test_ngram_config_asks_only_for_real_drafts(result):
    # method "ngram" returns draft lists cut at the first miss: vLLM verifies only real drafts
    spec = result["ngram-config"]["rounds"][-1]["spec"]
    assert spec["draft_tokens"] < spec["drafts"] * K


def test_a_batch_of_max_tokens_1_requests_reaches_no_server(result):
    first = result["dflash-config"]["rounds"][0]
    assert [len(o) for o in first["outputs"]] == [1, 1, 1]
    ops = first["server"]["ops"]
    assert "propose" not in ops and "ingest" not in ops, ops
    assert first["server"]["ingested_rows"] == 0
    assert first["spec"] == {"drafts": 0, "draft_tokens": 0, "accepted": 0, "preemptions": 0}
    # the same engine then drafts normally
    assert result["dflash-config"]["rounds"][1]["server"]["ops"].get("propose", 0) > 0
