"""The general-plugin entry point against a real vLLM install."""
from __future__ import annotations

import importlib.metadata
import logging
import os
import subprocess
import sys

import pytest

from helpers.server import SRC

pytestmark = pytest.mark.vllm


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": SRC, "VLLM_TARGET_DEVICE": "cpu", **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)


def test_entry_point_is_declared():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.name == "k3_accel" and ep.value == "k3_accel.plugin:register" for ep in eps)


def test_vllm_loads_the_plugin_once():
    run = _run("import vllm.plugins as vp, k3_accel.plugin as kp\n"
               "vp.load_general_plugins(); first = kp._installed\n"
               "assert first is not None, 'register() did not run'\n"
               "assert kp.register() is first\n"
               "print(sorted(first))")
    assert run.returncode == 0, run.stderr
    assert "communicator" in run.stdout


def test_bad_setting_fails_at_start_with_a_clear_error():
    run = _run("import vllm.plugins as vp; vp.load_general_plugins()", VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS="never")
    assert run.returncode != 0
    assert "VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS='never': expected an integer > 0" in run.stderr


def test_missing_vllm_symbol_turns_only_that_hook_off(tmp_path, monkeypatch, caplog):
    (tmp_path / "k3_fake_hook.py").write_text(
        "from k3_accel.vllm.compat import require\n"
        "def install():\n    require('vllm', 'symbol_that_does_not_exist')\n")
    (tmp_path / "k3_good_hook.py").write_text("calls = []\ndef install():\n    calls.append(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import k3_accel.plugin as plugin
    monkeypatch.setattr(plugin, "HOOKS", (("fake", "k3_fake_hook:install"), ("good", "k3_good_hook:install")))
    monkeypatch.setattr(plugin, "_installed", None)
    with caplog.at_level(logging.WARNING, logger="k3_accel"):
        assert plugin.register() == {"fake": False, "good": True}
        assert plugin.register() == {"fake": False, "good": True}
    import k3_good_hook
    assert k3_good_hook.calls == [1]                       # idempotent: installed once
    import vllm
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [f"k3-accel: hook fake off: vLLM {vllm.__version__} lacks vllm.symbol_that_does_not_exist"]


def test_register_is_cheap():
    """register() installs its hooks without pulling in k3-accel's sockets, server or client
    (zmq may come with vLLM's own modules, never through ours)."""
    run = _run("import sys, vllm, k3_accel.plugin as kp\n"
               "on = kp.register()\n"
               "heavy = ('k3_accel.transport.connection', 'k3_accel.transport.client', 'k3_accel.server',\n"
               "         'k3_accel.doctor', 'k3_accel.demo', 'k3_accel.testing')\n"
               "print(sum(on.values()), sorted(m for m in sys.modules if m.startswith(heavy)))")
    assert run.returncode == 0, run.stderr
    installed, loaded = run.stdout.strip().split(" ", 1)
    assert int(installed) >= 2 and loaded == "[]", run.stdout
