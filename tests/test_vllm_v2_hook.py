"""The V2 hook: ``init_speculator`` wrapped in both places, remote only when configured.

Real vLLM import (``VLLM_TARGET_DEVICE=cpu`` with the CUDA wheel), a real
``VllmConfig`` with ``method: dflash``, a real ngram draft server.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers.server import SRC
from test_vllm_v2_harness import Sim, tp_group, vllm_config  # noqa: F401 (fixtures)

pytestmark = pytest.mark.vllm
spec_decode = pytest.importorskip("vllm.v1.worker.gpu.spec_decode")

ADDRESS_ENV = "VLLM_K3_DRAFT_REMOTE_ADDRESS"


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC, "VLLM_TARGET_DEVICE": "cpu"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_install_wraps_both_names_and_is_idempotent():
    import vllm.v1.worker.gpu.model_runner as runner

    from k3_accel.vllm import speculator_v2 as sv

    sv.uninstall()
    stock = spec_decode.init_speculator
    assert not sv.is_wrapped(stock) and runner.init_speculator is stock
    try:
        assert sv.install() is True
        wrapped = spec_decode.init_speculator
        assert sv.is_wrapped(wrapped) and getattr(wrapped, sv.ORIGINAL_ATTR) is stock
        assert runner.init_speculator is wrapped          # the runner's own imported name too
        assert sv.install() is True
        assert spec_decode.init_speculator is wrapped and runner.init_speculator is wrapped
    finally:
        sv.uninstall()
    assert spec_decode.init_speculator is stock and runner.init_speculator is stock
    sv.install()


def test_runner_imported_after_register_sees_the_wrapper():
    run = _run("import k3_accel.plugin as kp\n"
               "on = kp.register()\n"
               "import vllm.v1.worker.gpu.model_runner as mr\n"
               "from k3_accel.vllm.speculator_v2 import is_wrapped\n"
               "print(on['speculator_v2'], is_wrapped(mr.init_speculator))")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-2:] == ["True", "True"]


def test_installing_the_v2_hook_is_cheap():
    run = _run("import sys, k3_accel.vllm.speculator_v2 as sv\nsv.install()\n"
               "print('vllm.v1.worker.gpu.spec_decode.speculator' in sys.modules,"
               " 'k3_accel.transport.client' in sys.modules,"
               " 'zmq' in sys.modules and 'k3_accel.transport' in sys.modules)")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-3:] == ["False", "False", "False"]


def test_dflash_with_an_address_gets_the_remote_speculator(vllm_config, tp_group, ngram_server, monkeypatch):
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator, DraftModelSpeculator

    from k3_accel.vllm import speculator_v2 as sv

    sv.install()
    monkeypatch.setenv(ADDRESS_ENV, ngram_server.address)
    assert vllm_config.speculative_config.method == "dflash"
    spec = spec_decode.init_speculator(vllm_config, torch.device("cpu"), Sim().req_states)
    try:
        assert type(spec).__name__ == "RemoteSpeculatorV2" and isinstance(spec, BaseSpeculator)
        assert not isinstance(spec, DraftModelSpeculator)      # no draft weights, no draft KV cache
        assert spec.draft_logits is None and spec.supports_mm_inputs is False
        assert spec.num_speculative_steps == 4 and tuple(spec.drafts.shape) == (4, 4)
        spec.init_cudagraph_manager(None)
        spec.capture()
        client = spec.session.client
        assert client is not None and client.stats()["state"] == "ready"
        ops = client.server_stats()["ops"]
        assert ops.get("hello") == 1 and not ops.get("ingest") and not ops.get("propose")
    finally:
        spec.close()


def test_the_address_may_come_from_additional_config(vllm_config, tp_group, ngram_server, monkeypatch):
    from k3_accel.vllm import speculator_v2 as sv

    sv.install()
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    monkeypatch.setattr(vllm_config, "additional_config", {"k3_accel": {"draft_address": ngram_server.address}})
    assert sv.wants_remote(vllm_config)
    spec = spec_decode.init_speculator(vllm_config, torch.device("cpu"), Sim().req_states)
    try:
        assert type(spec).__name__ == "RemoteSpeculatorV2"
    finally:
        spec.close()


def test_without_an_address_vllms_own_speculator_is_built(vllm_config, monkeypatch):
    import vllm.v1.worker.gpu.spec_decode.dflash.speculator as dflash

    from k3_accel.vllm import speculator_v2 as sv

    built = []

    class StockDFlash:                                   # stands in for the heavy stock class
        def __init__(self, cfg, device):
            built.append((cfg, device))

    sv.install()
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    monkeypatch.setattr(dflash, "DFlashSpeculator", StockDFlash)
    assert not sv.wants_remote(vllm_config)
    spec = spec_decode.init_speculator(vllm_config, torch.device("cpu"), Sim().req_states)
    assert isinstance(spec, StockDFlash) and built == [(vllm_config, torch.device("cpu"))]
