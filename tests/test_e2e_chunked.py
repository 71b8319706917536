"""End to end on a real vLLM engine: chunked prefill ships context without waiting.

A long prompt with a small ``max_num_batched_tokens`` is prefilled in chunks;
steps in which no request samples are pure context, which the transport
sends as deferred ingests. Outputs stay identical, and the remote drafts stay
equal to vLLM's in-tree DFlash drafts (the deferred context is right). The
second round repeats the long prompt next to a short one: a prefix-cache hit
whose context the client restores from the retained first request.
"""
from __future__ import annotations

import pytest

from k3_accel.demo.child import run_in_child
from k3_accel.demo.main import build_tiny
from k3_accel.demo.scenario import FIXED_K, Round, Run, Scenario

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

ENGINE = {"max_model_len": 1024, "max_num_batched_tokens": 64, "max_num_seqs": 4, "dtype": "float32"}
K = 3
LONG = [(i * 37) % 500 + 1 for i in range(400)]
SHARED = LONG[:390] + [3, 4, 5]       # vLLM's CPU KV blocks hold 128 tokens: 3 full blocks shared
SHORT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e-chunked")
    target, draft = build_tiny(work)
    rounds = [Round([LONG], max_tokens=12), Round([SHARED, SHORT], max_tokens=12)]
    spec = {"method": "dflash", "model": draft, "num_speculative_tokens": K}
    scenario = Scenario(target=target, workdir=str(work), engine=ENGINE,
                        server_args=["--engine", "dflash", "--draft-model", draft, "--target-model", target],
                        runs=[Run("none", rounds),
                              Run("in-tree", rounds, speculative=spec, record_drafts=True),
                              Run("remote", rounds, speculative=spec, remote=True, record_drafts=True, plugin=FIXED_K)])
    return {r["name"]: r for r in run_in_child(scenario, timeout=900)["runs"]}


def test_outputs_identical(result):
    expected = [r["outputs"] for r in result["none"]["rounds"]]
    assert [r["outputs"] for r in result["remote"]["rounds"]] == expected
    assert [r["outputs"] for r in result["in-tree"]["rounds"]] == expected


def test_prefill_chunks_go_out_as_deferred_ingests(result):
    first = result["remote"]["rounds"][0]
    counters, server = first["client"]["counters"], first["server"]
    assert counters.get("deferred_ingests", 0) > 0, counters
    assert server["ops"].get("ingest", 0) == counters["deferred_ingests"], server
    assert server["ingested_rows"] >= len(LONG)
    assert counters.get("disabled_requests", 0) == 0, counters


def test_remote_drafts_equal_in_tree_drafts_across_chunks(result):
    local, remote = result["in-tree"]["drafts"], result["remote"]["drafts"]
    long_key = " ".join(map(str, LONG))
    assert len(local[long_key]) >= 10
    assert remote[long_key] == local[long_key]


def test_prefix_cache_hit_keeps_drafting(result):
    local, remote = result["in-tree"]["drafts"], result["remote"]["drafts"]
    key = " ".join(map(str, SHARED))
    assert remote[key] == local[key]
    assert all(-1 not in d for d in remote[key])
    counters = result["remote"]["rounds"][1]["client"]["counters"]
    assert counters.get("reconnects", 0) >= 1, counters                 # the hit was restored, not re-sent
    assert counters.get("disabled_requests", 0) == 0, counters
