"""The V2 hook: ``init_speculator`` wrapped in both places, remote only for the methods a draft server serves.

Real vLLM import (``VLLM_TARGET_DEVICE=cpu`` with the CUDA wheel), real
``VllmConfig`` / ``SpeculativeConfig`` objects, a real ngram draft server.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.server import SRC
from helpers.v2_sim import Sim, client_stats, server_stats

pytestmark = pytest.mark.vllm
spec_decode = pytest.importorskip("vllm.v1.worker.gpu.spec_decode")

ADDRESS_ENV = "VLLM_K3_DRAFT_REMOTE_ADDRESS"


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC, "VLLM_TARGET_DEVICE": "cpu"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_install_wraps_both_names_undo_restores_them():
    import vllm.v1.worker.gpu.model_runner as runner

    from k3_accel.vllm import patching
    from k3_accel.vllm.spec_decode import hooks

    patching.undo(hooks.HOOK_V2)
    stock = spec_decode.init_speculator
    assert patching.patched(spec_decode, "init_speculator") is None and runner.init_speculator is stock
    try:
        assert hooks.install_v2() is True
        wrapped = spec_decode.init_speculator
        record = patching.patched(spec_decode, "init_speculator")
        assert wrapped is not stock and record.original is stock and record.replacement is wrapped
        assert runner.init_speculator is wrapped                      # the runner's own imported name too
        assert hooks.install_v2() is True                             # idempotent
        assert spec_decode.init_speculator is wrapped and runner.init_speculator is wrapped
        with pytest.raises(patching.PatchError, match="already patched by hook 'speculator_v2'"):
            patching.patch(spec_decode, "init_speculator", stock, hook="someone-else")
        assert {p.site for p in patching.applied(hooks.HOOK_V2)} == {
            "vllm.v1.worker.gpu.spec_decode.init_speculator", "vllm.v1.worker.gpu.model_runner.init_speculator"}
    finally:
        patching.undo(hooks.HOOK_V2)
    assert spec_decode.init_speculator is stock and runner.init_speculator is stock
    assert patching.applied(hooks.HOOK_V2) == []
    hooks.install_v2()


def test_runner_imported_after_register_sees_the_wrapper_and_undo_restores_it():
    run = _run("import k3_accel.plugin as kp\n"
               "on = kp.register()\n"
               "import vllm.v1.worker.gpu.model_runner as mr, vllm.v1.worker.gpu.spec_decode as sd\n"
               "from k3_accel.vllm import patching\n"
               "wrapped = patching.patched(sd, 'init_speculator').replacement\n"
               "print(on['speculator_v2'], mr.init_speculator is wrapped)\n"
               "stock = patching.patched(sd, 'init_speculator').original\n"
               "patching.undo('speculator_v2')\n"
               "print(mr.init_speculator is stock, sd.init_speculator is stock)")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-4:] == ["True", "True", "True", "True"]


def test_installing_the_v2_hook_is_cheap():
    run = _run("import sys\nfrom k3_accel.vllm.spec_decode import hooks\nhooks.install_v2()\n"
               "print('vllm.v1.worker.gpu.spec_decode.speculator' in sys.modules,"
               " 'k3_accel.transport.client' in sys.modules,"
               " 'zmq' in sys.modules and 'k3_accel.transport' in sys.modules)")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-3:] == ["False", "False", "False"]


def test_dflash_with_an_address_gets_the_remote_speculator(vllm_config, tp_group, ngram_server, monkeypatch):
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator, DraftModelSpeculator

    from k3_accel.vllm.spec_decode import hooks

    hooks.install_v2()
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
        assert spec.core.session.client is not None and client_stats(spec)["state"] == "ready"
        ops = server_stats(spec)["ops"]
        assert ops.get("hello") == 1 and not ops.get("ingest") and not ops.get("propose")
    finally:
        spec.close()


def test_the_address_may_come_from_additional_config(vllm_config, tp_group, ngram_server, monkeypatch):
    from k3_accel.vllm.spec_decode import hooks
    from k3_accel.vllm.spec_decode.methods import remote_enabled

    hooks.install_v2()
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    monkeypatch.setattr(vllm_config, "additional_config", {"k3_accel": {"draft_address": ngram_server.address}})
    assert remote_enabled(vllm_config)
    spec = spec_decode.init_speculator(vllm_config, torch.device("cpu"), Sim().req_states)
    try:
        assert type(spec).__name__ == "RemoteSpeculatorV2"
    finally:
        spec.close()


def test_without_an_address_vllms_own_speculator_is_built(vllm_config, monkeypatch):
    import vllm.v1.worker.gpu.spec_decode.dflash.speculator as dflash

    from k3_accel.vllm.spec_decode import hooks
    from k3_accel.vllm.spec_decode.methods import remote_enabled

    built = []

    class StockDFlash:                                   # stands in for the heavy stock class
        def __init__(self, cfg, device):
            built.append((cfg, device))

    hooks.install_v2()
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    monkeypatch.setattr(dflash, "DFlashSpeculator", StockDFlash)
    assert not remote_enabled(vllm_config)
    spec = spec_decode.init_speculator(vllm_config, torch.device("cpu"), Sim().req_states)
    assert isinstance(spec, StockDFlash) and built == [(vllm_config, torch.device("cpu"))]


# ------------------------------------------------- other methods stay local (issue 7.2)
def _speculative(vllm_config, method: str, tmp_path, **kw):
    """A real ``SpeculativeConfig`` for ``method`` on the tiny target, in a copy of ``vllm_config``."""
    from vllm.config import SpeculativeConfig

    target = vllm_config.model_config
    model = None
    if method == "draft_model":
        model = target.model                                   # the target as its own draft
    elif method in ("eagle3", "mtp"):
        cfg = json.loads((Path(target.model) / "config.json").read_text())
        if method == "eagle3":
            cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1)
        else:                                                  # a DeepSeek-V3 config: vLLM derives its MTP draft
            cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                   "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"], "intermediate_size": 256,
                   "moe_intermediate_size": 64, "num_hidden_layers": 1, "num_nextn_predict_layers": 1,
                   "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
                   "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                   "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                   "v_head_dim": 32, "max_position_embeddings": 256, "n_group": 1, "topk_group": 1}
        model = tmp_path / method
        model.mkdir()
        (model / "config.json").write_text(json.dumps(cfg))
        model = str(model)
    if method == "extract_hidden_states":
        kw["draft_model_config"] = {"hf_config": {"eagle_aux_hidden_state_layer_ids": [0, 2]}}
    spec = SpeculativeConfig(method=method, model=model, num_speculative_tokens=kw.pop("k", 4),
                             target_model_config=target, target_parallel_config=vllm_config.parallel_config, **kw)
    assert spec.method == method
    config = copy.copy(vllm_config)
    config.speculative_config = spec
    return config


# method -> (module of vLLM's class, class name) that vLLM 0.33's init_speculator builds for it
LOCAL = {
    "eagle3": ("eagle.speculator", "EagleSpeculator"),
    "mtp": ("mtp.speculator", "MTPSpeculator"),
    "draft_model": ("standalone_ar.speculator", "StandaloneARSpeculator"),
    "ngram_gpu": ("ngram.speculator", "NgramGPUSpeculator"),
    "extract_hidden_states": ("extract_hidden_states", "ExtractHiddenStatesSpeculator"),
}


@pytest.mark.vllm033
@pytest.mark.parametrize("method", ["eagle3", "mtp", "draft_model", "ngram_gpu", "extract_hidden_states",
                                    "dflash", "ngram"])
def test_v2_other_methods_stay_local(method, vllm_config, tp_group, ngram_server, tmp_path, monkeypatch, caplog):
    """With an address set, only dflash and ngram get the remote speculator; every other method
    gets vLLM's own class, with one warning that the address is ignored for it."""
    import importlib

    from vllm.config import set_current_vllm_config

    from k3_accel.vllm.spec_decode import hooks

    hooks.install_v2()
    monkeypatch.setenv(ADDRESS_ENV, ngram_server.address)
    config = vllm_config if method == "dflash" else \
        _speculative(vllm_config, method, tmp_path, k=1 if method in ("mtp", "extract_hidden_states") else 4)
    built = []
    if method == "ngram_gpu":
        # vLLM's NgramGPUSpeculator refuses to start without Triton (none on this CPU box):
        # record that vLLM's chain reached it, with the arguments it passes
        module = importlib.import_module(f"{spec_decode.__name__}.ngram.speculator")
        monkeypatch.setattr(module, "NgramGPUSpeculator",
                            type("NgramGPUSpeculator", (), {"__init__": lambda s, *a: built.append(a)}))
    sim = Sim()
    with caplog.at_level(logging.WARNING, logger="k3_accel"), set_current_vllm_config(config):
        spec = spec_decode.init_speculator(config, torch.device("cpu"), sim.req_states)
    ignored = [r.getMessage() for r in caplog.records if "draft_address is ignored" in r.getMessage()]
    if method in ("dflash", "ngram"):
        try:
            assert type(spec).__name__ == "RemoteSpeculatorV2" and ignored == []
            assert client_stats(spec)["state"] == "ready"
        finally:
            spec.close()
        return
    module, name = LOCAL[method]
    cls = getattr(importlib.import_module(f"{spec_decode.__name__}.{module}"), name)
    assert type(spec) is cls and type(spec).__name__ == name          # vLLM's own speculator
    if method == "ngram_gpu":
        assert built == [(config, torch.device("cpu"), sim.req_states)]
    from k3_accel.vllm.spec_decode.methods import REMOTE_METHODS
    assert ignored == [f"k3-accel: draft_address is ignored: method {method!r} is drafted locally "
                       f"(remote methods: {list(REMOTE_METHODS)})"]
