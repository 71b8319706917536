"""End to end on a real vLLM engine: a draft that guesses nothing switches speculation off.

The demo's untrained checkpoints (a random tiny target and a random DFlash draft: the target
accepts almost none of its drafts) through ``k3-draft-server --engine dflash``, with the
plugin's default per-step K controller. After a warm-up round, most steps ask the server for
no drafts and vLLM verifies few draft tokens — counts, not times — and every output is
identical to an engine without speculation.
"""
from __future__ import annotations

import pytest

from k3_accel.demo.child import run_in_child
from k3_accel.demo.main import build_tiny
from k3_accel.demo.scenario import Round, Run, Scenario

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

ENGINE = {"max_model_len": 512, "max_num_seqs": 8, "dtype": "float32"}
K = 4
PROMPTS = [[(11 * i + 3 * j) % 300 + 20 for j in range(12 + 2 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e-adaptive")
    target, draft = build_tiny(work, k=K)                    # random: the draft guesses nothing
    rounds = [Round(PROMPTS[:3], max_tokens=24, label="warm-up"), Round(PROMPTS, max_tokens=48, label="measured")]
    spec = {"method": "dflash", "model": draft, "num_speculative_tokens": K}
    scenario = Scenario(target=target, workdir=str(work), engine=ENGINE,
                        server_args=["--engine", "dflash", "--draft-model", draft, "--target-model", target,
                                     "--num-speculative-tokens", str(K)],
                        runs=[Run("none", rounds), Run("remote", rounds, speculative=spec, remote=True)])
    return {r["name"]: r for r in run_in_child(scenario, timeout=900)["runs"]}


def test_outputs_identical(result):
    assert [r["outputs"] for r in result["remote"]["rounds"]] == [r["outputs"] for r in result["none"]["rounds"]]


def test_e2e_useless_draft_turns_speculation_off(result):
    warm, measured = (r["client"]["controller"] for r in result["remote"]["rounds"])
    steps = measured["steps"] - warm["steps"]
    off = measured.get("off_steps", 0) - warm.get("off_steps", 0)
    assert steps > 20 and off > steps / 2, (warm, measured)          # most steps: no drafts at all
    spec = result["remote"]["rounds"][1]["spec"]
    tokens = sum(len(o) for o in result["remote"]["rounds"][1]["outputs"])
    assert spec["draft_tokens"] < tokens * K / 2, spec                # far fewer than K per token verified
    assert len(measured["acceptance_per_position"]) == K                # what it measured is visible
