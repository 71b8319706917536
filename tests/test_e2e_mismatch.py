"""End to end on a real vLLM engine: a draft server that does not fit this target fails closed.

The server is built on another target checkpoint with a larger vocabulary
(same hidden size): hello refuses it, drafting stays off for the whole
engine with one clear error naming both values, and generation is exactly
that of an engine without speculation.
"""
from __future__ import annotations

import pytest

from k3_accel.demo.child import run_in_child
from k3_accel.demo.checkpoints import build_tiny
from k3_accel.demo.scenario import FIXED_K, Round, Run, Scenario
from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

ENGINE = {"max_model_len": 512, "max_num_seqs": 4, "dtype": "float32"}
PROMPTS = ["The quick brown fox jumps over the lazy dog", [5, 6, 7, 8, 9, 10, 11, 12]]


def test_e2e_mismatched_server_fails_closed(tmp_path):
    target, draft = build_tiny(tmp_path)
    big = write_tiny_target(tmp_path / "big-target", vocab_size=1024)     # the tiny target has 512
    big_draft = write_tiny_dflash(tmp_path / "big-draft", big)
    spec = {"method": "dflash", "model": draft, "num_speculative_tokens": 3}
    rounds = [Round(PROMPTS, max_tokens=12)]
    result = run_in_child(Scenario(
        target=target, workdir=str(tmp_path), engine=ENGINE,
        server_args=["--engine", "dflash", "--draft-model", str(big_draft), "--target-model", str(big)],
        runs=[Run("none", rounds), Run("remote", rounds, speculative=spec, remote=True, plugin=FIXED_K)]), timeout=900)
    runs = {r["name"]: r for r in result["runs"]}
    assert runs["remote"]["rounds"][0]["outputs"] == runs["none"]["rounds"][0]["outputs"]
    client = runs["remote"]["rounds"][0]["client"]
    assert client["state"] == "incompatible"
    assert "vocabulary: server drafts ids 0..1023, target vocabulary is 512" in client["incompatible"]
    assert runs["remote"]["rounds"][0]["spec"]["accepted"] == 0
    log = open(result["log"]).read()
    assert log.count("does not fit this target, drafting is OFF") == 1
