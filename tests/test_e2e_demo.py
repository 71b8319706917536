"""``k3-accel demo`` and ``k3-accel probe`` as a user runs them (the installed console script)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3_accel.cli import main
from k3_accel.demo.child import child_env


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


@pytest.mark.e2e
@pytest.mark.vllm
@pytest.mark.parametrize("engine", ["ngram", "dflash"])
def test_demo_runs_with_no_flags_but_the_engine(engine, tmp_path):
    run = subprocess.run([*_cli(), "demo", "--engine", engine], capture_output=True, text=True, cwd=tmp_path,
                         env=child_env({"TMPDIR": str(tmp_path)}), timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    report = run.stdout
    assert "outputs identical with and without remote drafting: yes" in report
    assert f"{engine} engine" in report and "/metrics" in report
    assert "deferred ingests" in report and "per step, client means" in report
    assert "temp files removed" in report
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("k3-demo-")]   # cleaned up
