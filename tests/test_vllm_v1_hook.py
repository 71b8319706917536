"""Installing the V1 runner hook: lazy, idempotent, only with an address and a supported method."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from helpers.server import SRC
from k3_accel.vllm import post_import, proposer_v1


def test_post_import_hook_runs_after_import(tmp_path, monkeypatch):
    (tmp_path / "k3_watched_mod.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    post_import.when_imported("k3_watched_mod", lambda m: seen.append(m.VALUE + 1))
    assert seen == []
    import k3_watched_mod  # noqa: F401
    assert seen == [42]
    post_import.when_imported("k3_watched_mod", lambda m: seen.append("now"))   # already imported: at once
    assert seen == [42, "now"]


def test_post_import_hook_failure_does_not_break_the_import(tmp_path, monkeypatch, caplog):
    (tmp_path / "k3_watched_bad.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def boom(module):
        raise RuntimeError("hook bug")

    post_import.when_imported("k3_watched_bad", boom)
    with caplog.at_level(logging.ERROR, logger="k3_accel"):
        import k3_watched_bad
    assert k3_watched_bad.VALUE == 1
    assert any("post-import hook for k3_watched_bad failed" in r.getMessage() for r in caplog.records)


def _config(method, address="tcp://127.0.0.1:5557"):
    spec = None if method is None else SimpleNamespace(method=method)
    extra = {"k3_accel": {"draft_address": address}} if address else {}
    return SimpleNamespace(speculative_config=spec, additional_config=extra)


@pytest.mark.parametrize("method,address,expected", [
    ("dflash", "tcp://127.0.0.1:5557", True),
    ("ngram", "tcp://127.0.0.1:5557", True),
    ("dflash", None, False),          # no address: stock vLLM
    (None, "tcp://127.0.0.1:5557", False),   # no speculation: nothing to draft
])
def test_remote_only_with_address_and_speculation(method, address, expected, monkeypatch):
    monkeypatch.delenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", raising=False)
    assert proposer_v1._wants_remote(_config(method, address)) is expected


def test_unsupported_method_stays_stock_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="k3_accel.vllm"):
        assert proposer_v1._wants_remote(_config("eagle3")) is False
    assert "method 'eagle3' is drafted locally" in caplog.text


def test_address_from_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", "tcp://127.0.0.1:6000")
    assert proposer_v1._wants_remote(_config("dflash", address=None)) is True


@pytest.mark.vllm
def test_install_is_lazy_and_idempotent():
    code = (
        "import sys\n"
        "from k3_accel.vllm import proposer_v1\n"
        "proposer_v1.install(); proposer_v1.install()\n"
        "assert proposer_v1.RUNNER_MODULE not in sys.modules, 'install imported the runner'\n"
        "import vllm.v1.worker.gpu_model_runner as gmr\n"
        "init = gmr.GPUModelRunner.__init__\n"
        "assert init._k3_remote and not hasattr(init.__wrapped__, '_k3_remote')\n"
        "proposer_v1.patch_runner(gmr)\n"
        "assert gmr.GPUModelRunner.__init__ is init\n"
        "from vllm.v1.spec_decode.dflash import DFlashProposer\n"
        "assert gmr.DFlashProposer is DFlashProposer, 'names stay stock outside a remote runner build'\n"
        "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": SRC, "VLLM_PLUGINS": ""}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")
