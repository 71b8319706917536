"""The demo's own rules (issue 25's module mutants found them unguarded): option checks, scenario
checks, and which checkpoints a demo builds."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.ports import free_port
from k3_accel.demo.checkpoints import build_tiny
from k3_accel.demo.dspark import K, _speculate, exit_status
from k3_accel.demo.main import DemoError, DemoOptions
from k3_accel.demo.scenario import Round, Run, Scenario, ScenarioError
from k3_accel.testing.target_data import target_sequences
from k3_accel.testing.tiny import write_tiny_target
from k3_accel.testing.tiny_lm import RECORD
from k3_accel.transport.api import ClientSettings
from k3_accel.transport.client import DraftClient


def _checkpoint(tmp_path, name: str) -> str:
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text("{}")
    return str(tmp_path / name)


@pytest.mark.parametrize("kw,words", [
    (dict(engine="dflash", target="T"), "--draft"),              # a real target's DFlash needs its draft
    (dict(engine="ngram", draft="D"), "--target"),               # a draft alone has no embeddings
    (dict(engine="dflash", target="T", draft="D", untrained=True), "--untrained"),
    (dict(engine="eagle"), "expected dflash, ngram or dspark"),
])
def test_demo_options_that_cannot_run_are_refused_by_name(tmp_path, kw, words):
    kw = {k: _checkpoint(tmp_path, v) if k in ("target", "draft") else v for k, v in kw.items()}
    with pytest.raises(DemoError, match=words):
        DemoOptions(**kw).check()


def test_demo_options_that_can_run_pass(tmp_path):
    DemoOptions("dflash", _checkpoint(tmp_path, "T"), _checkpoint(tmp_path, "D")).check()
    DemoOptions("ngram", _checkpoint(tmp_path, "T2")).check()
    DemoOptions("dflash").check()                                # the built-in tiny checkpoints


def test_a_remote_run_without_a_draft_server_is_refused():
    runs = [Run("with", [Round([[1, 2, 3]])], remote=True)]
    with pytest.raises(ScenarioError, match="no server"):
        Scenario(target="T", runs=runs).validate()
    Scenario(target="T", runs=runs, server_address="tcp://127.0.0.1:1").validate()
    Scenario(target="T", runs=runs, server_args=["--engine", "ngram"]).validate()


def test_a_round_action_must_be_known_and_complete():
    for action in ({"step": 1, "do": "explode"}, {"step": "1", "do": "kill"}, {"step": 1, "do": "touch"}):
        runs = [Run("with", [Round([[1]], actions=[action])], remote=True)]
        with pytest.raises(ScenarioError, match="bad action"):
            Scenario(target="T", runs=runs, server_args=[]).validate()


def test_the_default_demo_trains_its_target_and_untrained_is_random(tmp_path):
    trained, _ = build_tiny(tmp_path / "trained", with_draft=False, trained=True)
    record = json.loads((tmp_path / "trained" / "target" / RECORD).read_text())
    assert record["loss_last"] < record["loss_first"]            # it learnt the built-in text
    random_target, _ = build_tiny(tmp_path / "random", with_draft=False, trained=False)
    assert not (tmp_path / "random" / "target" / RECORD).exists()
    assert trained != random_target


def test_the_dspark_demo_fails_when_a_step_gets_no_drafts(tmp_path):
    """The DSpark demo's drafting loop against a server that is not there: every step fails closed
    (no drafts), the loop counts them, and the demo's verdict is a failure; with every step drafted
    it is a success."""
    target = write_tiny_target(tmp_path / "target", num_layers=2)
    config = json.loads((target / "config.json").read_text())
    layers, hidden = (0, 1), config["hidden_size"]
    data = target_sequences(target, layers, (8,), 2, 3 * K, seed=1)
    client = DraftClient(ClientSettings(
        address=f"tcp://127.0.0.1:{free_port()}", timeout_ms=200, propose_timeout_ms=200, ring_depth=0,
        context_width=len(layers) * hidden, hidden_dtype=torch.float32, num_speculative_tokens=K,
        target_vocab_size=config["vocab_size"], hidden_size=hidden, aux_layer_ids=layers, draft={"engine": "dspark"})).start(wait_s=0.2)
    try:
        counts = _speculate(client, data)
    finally:
        client.close()
    assert counts["steps"] > 0 and counts["steps_without_drafts"] == counts["steps"]
    assert exit_status(counts) == 1
    assert exit_status({**counts, "steps_without_drafts": 0}) == 0
