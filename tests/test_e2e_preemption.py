"""End to end on a real vLLM engine: preempted requests keep drafting after they resume.

The KV cache is cut to a few blocks so that the scheduler preempts running
requests and resumes them later (recomputing from what its prefix cache
kept). With the DFlash draft server, every preempted request gets drafts
proposed for it again after it resumes (none is disabled), and outputs are
identical to an engine without speculation.
"""
from __future__ import annotations

import pytest

from k3_accel.demo.child import run_in_child
from k3_accel.demo.checkpoints import build_tiny
from k3_accel.demo.scenario import FIXED_K, Round, Run, Scenario

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

K = 3
PROMPTS = [[10 + i, 20 + i, 30 + i, 40 + i, 50 + i] * 4 for i in range(4)]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e-preemption")
    target, draft = build_tiny(work)
    engine = {"max_model_len": 512, "max_num_seqs": 4, "dtype": "float32", "num_gpu_blocks_override": 6,
              "max_num_batched_tokens": 512}
    spec = {"method": "dflash", "model": draft, "num_speculative_tokens": K}
    rounds = [Round(PROMPTS, max_tokens=160)]
    scenario = Scenario(target=target, workdir=str(work), engine=engine,
                        server_args=["--engine", "dflash", "--draft-model", draft, "--target-model", target],
                        runs=[Run("none", rounds),
                              Run("remote", rounds, speculative=spec, remote=True, record_drafts=True, plugin=FIXED_K)])
    return {r["name"]: r for r in run_in_child(scenario, timeout=1500)["runs"]}


def test_e2e_preemption_keeps_drafting(result):
    remote = result["remote"]
    rnd = remote["rounds"][0]
    assert rnd["outputs"] == result["none"]["rounds"][0]["outputs"]
    assert rnd["spec"]["preemptions"] > 0, "the KV cache was not small enough to preempt"
    assert rnd["client"]["counters"].get("disabled_requests", 0) == 0, rnd["client"]["counters"]
    resumed = 0
    for key, calls in remote["draft_calls"].items():
        drafts = remote["drafts"][key]
        gaps = [i for i, (a, b) in enumerate(zip(calls, calls[1:])) if b > a + 1]
        if not gaps:
            continue
        after = drafts[gaps[-1] + 1:]                      # the drafts of the last stretch after a gap
        assert after and all(-1 not in d for d in after), f"no drafts after resuming: {key[:30]}"
        resumed += 1
    assert resumed >= 1
