"""The V1 runner hook: lazy (patch on import), idempotent, undoable, only with an address and a served method."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from helpers.server import SRC
from k3_accel.vllm import patching
from k3_accel.vllm.spec_decode.methods import remote_enabled


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
    assert remote_enabled(_config(method, address)) is expected


def test_unsupported_method_stays_stock_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="k3_accel.vllm"):
        assert remote_enabled(_config("eagle3")) is False
    assert "method 'eagle3' is drafted locally" in caplog.text


def test_address_from_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", "tcp://127.0.0.1:6000")
    assert remote_enabled(_config("dflash", address=None)) is True


@pytest.mark.vllm
def test_install_is_lazy_and_idempotent():
    code = (
        "import sys\n"
        "from k3_accel.vllm import patching\n"
        "from k3_accel.vllm.spec_decode import hooks\n"
        "hooks.install_v1(); hooks.install_v1()\n"
        "assert hooks.RUNNER_MODULE not in sys.modules, 'install imported the runner'\n"
        "assert patching.applied('proposer_v1') == []\n"
        "import vllm.v1.worker.gpu_model_runner as gmr\n"
        "cls = gmr.GPUModelRunner\n"
        "init = cls.__init__\n"
        "record = patching.patched(cls, '__init__')\n"
        "assert record.hook == 'proposer_v1' and record.replacement is init and init.__wrapped__ is record.original\n"
        "hooks.patch_runner(gmr)\n"
        "assert cls.__init__ is init, 'patched twice'\n"
        "from vllm.v1.spec_decode.dflash import DFlashProposer\n"
        "assert gmr.DFlashProposer is DFlashProposer, 'names stay stock outside a remote runner build'\n"
        "assert sorted(p.name for p in patching.applied('proposer_v1')) == ['__init__', 'shutdown', 'take_draft_token_ids']\n"
        "patching.undo('proposer_v1')\n"
        "assert cls.__init__ is record.original and patching.patched(cls, '__init__') is None\n"
        "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": SRC, "VLLM_PLUGINS": ""}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")


@pytest.mark.vllm
def test_a_remote_runner_build_swaps_the_proposer_name_only_while_it_runs():
    """The swap goes through the patch helper: recorded while ``__init__`` runs, gone afterwards."""
    import vllm.v1.worker.gpu_model_runner as gmr
    from vllm.v1.spec_decode.dflash import DFlashProposer

    from k3_accel.vllm.spec_decode import hooks
    from k3_accel.vllm.spec_decode.v1 import RemoteDFlashProposer

    seen = []

    def stock_init(self, vllm_config, device):     # what the runner's __init__ looks up
        seen.append((gmr.DFlashProposer, patching.patched(gmr, "DFlashProposer").hook))
        self.drafter = None

    init = hooks._wrap_runner_init(stock_init)
    init(object.__new__(gmr.GPUModelRunner), _config("dflash"), "cpu")
    assert seen == [(RemoteDFlashProposer, "proposer_v1")]
    assert gmr.DFlashProposer is DFlashProposer and patching.patched(gmr, "DFlashProposer") is None
