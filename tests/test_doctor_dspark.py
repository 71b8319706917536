"""``k3-accel doctor`` for a DSpark server and a DSpark ``--speculative-config``: a fitting
server gets a yes; a server whose draft does not fit the target's draft config (layout) or
that runs another engine gets a FAIL naming both values and exit 1."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.server import ServerProcess, src_env
from k3_accel.testing.tiny import write_tiny_target
from k3_accel.testing.tiny_dspark import write_tiny_dspark


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor_dspark")
    target = write_tiny_target(root / "target")
    kw = dict(layer_key="target_layer_ids")
    return target, write_tiny_dspark(root / "anchor", target, **kw), \
        write_tiny_dspark(root / "fill_in", target, sample_from_anchor=False, **kw)


@pytest.fixture(scope="module")
def server(models):
    target, anchor, _ = models
    srv = ServerProcess("--engine", "dspark", "--draft-model", str(anchor), "--target-model", str(target),
                        "--memory-budget-mb", "4", "--lease-s", "600")
    yield srv
    assert srv.stop() == 0


def doctor(address: str, target, draft, k: int = 4, **spec_extra) -> subprocess.CompletedProcess:
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": k, **spec_extra}
    cmd = [sys.executable, "-m", "k3_accel.cli", "doctor", address, "--model", str(target),
           "--speculative-config", json.dumps(spec), "--timeout-ms", "20000", "--max-num-seqs", "8"]
    return subprocess.run(cmd, env=src_env(), capture_output=True, text=True, timeout=300)


def test_a_fitting_dspark_server_gets_a_yes(server, models):
    target, anchor, _ = models
    run = doctor(server.address, target, anchor)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "engine dspark" in run.stdout and "VERDICT: vLLM would draft with this server." in run.stdout


def test_probabilistic_drafting_is_reported(server, models):
    target, anchor, _ = models
    run = doctor(server.address, target, anchor, draft_sample_method="probabilistic")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "the server samples each request's drafts with its temperature and seed" in run.stdout
    assert "probabilistic" not in doctor(server.address, target, anchor).stdout


def test_a_dspark_server_with_another_layout_is_a_failure_naming_both(server, models):
    target, _, fill_in = models
    run = doctor(server.address, target, fill_in)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "draft sample_from_anchor: server True, target's draft config False" in run.stdout


def test_a_dflash_server_for_a_dspark_target_is_a_failure(models):
    from k3_accel.testing.tiny import write_tiny_dflash
    target, anchor, _ = models
    dflash = write_tiny_dflash(anchor.parent / "dflash", target)
    srv = ServerProcess("--engine", "dflash", "--draft-model", str(dflash), "--target-model", str(target),
                        "--memory-budget-mb", "4")
    try:
        run = doctor(srv.address, target, anchor)
        assert run.returncode == 1 and "needs a dspark server, the server runs dflash" in run.stdout, run.stdout
    finally:
        assert srv.stop() == 0


def test_a_top_k_set_in_the_speculative_config_is_the_one_checked(server, models):
    """vLLM 0.33 takes ``dspark_draft_topk`` from the speculative config over the draft config's: the
    target then asks for top-k drafts, which this server (no top-k in its checkpoint) does not make.
    The doctor says so, as the plugin's handshake would, instead of a yes."""
    target, anchor, _ = models
    run = doctor(server.address, target, anchor, dspark_draft_topk=3)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "draft draft_topk: server None, target's draft config 3" in run.stdout


def test_without_num_speculative_tokens_k_is_the_draft_block_size(models):
    """vLLM 0.33 takes a dspark draft's K from its block size when the speculative config gives none
    (``num_speculative_tokens`` is optional for dspark): the doctor accepts that config and checks it."""
    from k3_accel.doctor import target_needs
    target, anchor, _ = models
    block = json.loads((anchor / "config.json").read_text())["block_size"]
    needs, _ = target_needs(str(target), {"method": "dspark", "model": str(anchor)}, 8)
    assert needs.num_speculative_tokens == block

