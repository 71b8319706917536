"""The DSpark peer oracle, run as a script in the vLLM 0.33 environment (see dspark_support.run_oracle).

vLLM's own ``Qwen3DSparkForCausalLM`` (its weight loader, fc, hidden norm, context K/V
projection, Qwen3 layers, Markov and confidence heads, vocabulary mapping) and the in-tree
``DSparkSpeculator._sample_sequential`` (or ``_sample_sequential_topk``) on a bare speculator
whose buffers are filled as vLLM's prepare kernel fills them. Stood in for, because this CPU
build has no such kernels: the attention (SDPA over the captured context K/V plus the block,
non-causal) and two custom ops (``rms_norm``, ``rotary_embedding``: vLLM's own native math).
A step with temperatures and seeds runs the speculator's ``draft_sample_method: probabilistic``
path: vLLM's own ``gumbel_sample`` kernel, loaded against the real Triton and run by its
interpreter (this CPU build of vLLM stands Triton in with a placeholder).

argv[1]: JSON list of jobs ``{draft, target, case, out, k}``; a case holds, per propose step
``s``, ``s{s}n`` requests with ``s{s}r{i}`` context rows and ``s{s}anchors``.
"""
import json
import os
import sys
from types import SimpleNamespace

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRITON_INTERPRET"] = "1"          # before anything imports triton
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding  # noqa: E402


def rms_norm(out, x, weight, eps):            # weight [L, d] applies per outermost index of x
    w = weight.view(weight.shape[0], *([1] * (x.dim() - 2)), weight.shape[1]) if weight.dim() == 2 else weight
    xf = x.float()
    out.copy_((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype))


def rotary_embedding(positions, query, key, head_size, cache, is_neox):
    q, k = RotaryEmbedding.forward_static(positions, query, key, head_size, cache.shape[-1], cache, is_neox)
    query.copy_(q)
    if key is not None:
        key.copy_(k)


ops.rms_norm, ops.rotary_embedding = rms_norm, rotary_embedding

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.model_loader.utils import process_weights_after_loading  # noqa: E402
from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id  # noqa: E402

from helpers.vllm_attention import captured, init_world, stand_in  # noqa: E402


def interpreted_gumbel_sample():
    """vLLM's ``gumbel_sample`` from its own source, with the real Triton (interpreted)."""
    import importlib.util
    import triton
    import triton.language as tl
    import vllm.triton_utils as tu
    saved = tu.triton, tu.tl
    tu.triton, tu.tl = triton, tl
    try:
        spec = importlib.util.find_spec("vllm.v1.worker.gpu.sample.gumbel")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        tu.triton, tu.tl = saved
    return module.gumbel_sample


import vllm.v1.worker.gpu.spec_decode.dspark.speculator as dspark_speculator  # noqa: E402
dspark_speculator.gumbel_sample = interpreted_gumbel_sample()

import vllm.model_executor.layers.utils as layer_utils  # noqa: E402
# vLLM's CUDA wheel, run here on the CPU, has no CPU kernels: on a CPU with AMX its GEMM dispatch picks
# the packed bf16 kernels (torch.ops._C.convert_weight_packed) and fails; elsewhere it takes torch's
# linear. Torch's linear on every machine.
layer_utils.check_cpu_sgl_kernel = lambda *args, **kwargs: False


def build(vc, draft, target, dtype):
    with set_default_torch_dtype(dtype):
        model = Qwen3DSparkForCausalLM(vllm_config=vc, prefix="")
    own = load_file(os.path.join(draft, "model.safetensors"))
    model.load_weights(own.items())
    shared = load_file(os.path.join(target, "model.safetensors"))   # what load_dspark_model shares
    if "embed_tokens.weight" not in own:
        model.model.embed_tokens.weight.copy_(shared["model.embed_tokens.weight"])
    if "lm_head.weight" not in own:
        model.lm_head.weight.copy_(shared["lm_head.weight"])
    process_weights_after_loading(model, vc.speculative_config.draft_model_config, torch.device("cpu"))
    stand_in(model)
    return model


def speculator(model, hf, k, r, ids):
    """A bare DSparkSpeculator with the buffers vLLM's prepare kernel would have filled."""
    spec = DSparkSpeculator.__new__(DSparkSpeculator)
    from_anchor = getattr(hf, "sample_from_anchor", True)
    q = k if from_anchor else k + 1
    spec.model, spec.num_speculative_steps = model, k
    spec._draft_topk = getattr(hf, "dspark_draft_topk", None)
    spec.use_confidence_head = model.model.confidence_head is not None   # adaptive verification on
    spec.draft_logits, spec.acceptance_estimator, spec.draft_watermarker = None, None, None
    spec._step_cols = torch.arange(k, dtype=torch.int32)
    spec.draft_tokens = torch.zeros(r, k, dtype=torch.int64)
    spec.draft_token_confidence_probs = torch.zeros(r, k, dtype=torch.float32)
    spec._anchor_idx = torch.arange(r) * q
    spec.input_buffers = SimpleNamespace(input_ids=ids)
    spec.sample_indices = (torch.arange(r)[:, None] * q + (0 if from_anchor else 1)
                           + torch.arange(k)[None]).flatten()
    spec.sample_idx_mapping = torch.arange(r).repeat_interleave(k)
    spec.sample_pos = torch.zeros(r * k, dtype=torch.int64)
    spec._d2t_scatter_index = spec._draft_scatter_buf = None
    return spec, q


def probabilistic(spec, model, hf, temperature, seeds, lengths):
    """The speculator's buffers as ``draft_sample_method: probabilistic`` has them; the sampled
    position of draft ``j`` is ``length + 1 + j`` (vLLM's prepare kernel, both layouts)."""
    r, k = len(lengths), spec.num_speculative_steps
    spec.draft_logits = torch.zeros(r, k, hf.vocab_size)
    spec.temperature, spec.seeds, spec.use_fp64_gumbel = temperature, seeds, False
    spec.sample_pos = (torch.tensor(lengths)[:, None] + 1 + torch.arange(k)[None]).flatten()
    d2t = model.draft_id_to_target_id
    if d2t is not None:
        spec._d2t_scatter_index = torch.arange(d2t.shape[0]) + d2t
        spec._draft_scatter_buf = torch.full((r, hf.vocab_size), float("-inf"))


def run(job, dtype_name, first):
    dtype, k = getattr(torch, dtype_name), int(job["k"])
    vc = EngineArgs(model=job["target"], dtype=dtype_name, enforce_eager=True, max_model_len=512,
                    compilation_config={"custom_ops": ["none"]},
                    speculative_config={"method": "dspark", "model": job["draft"],
                                        "num_speculative_tokens": k}).create_engine_config()
    out = {}
    with set_current_vllm_config(vc), torch.no_grad():
        if first:
            init_world()
        model = build(vc, job["draft"], job["target"], dtype)
        hf = vc.speculative_config.draft_model_config.hf_config
        mask = get_parallel_drafting_token_id(hf)
        case = load_file(job["case"])
        for s in range(int(case["steps"])):
            n, anchors = int(case[f"s{s}n"]), case[f"s{s}anchors"]
            spec, q = speculator(model, hf, k, n, None)
            ids = torch.tensor([[int(a)] + [mask] * (q - 1) for a in anchors.tolist()]).flatten()
            spec.input_buffers.input_ids = ids
            if f"s{s}temperature" in case:
                lengths = [case[f"s{s}r{i}"].shape[0] for i in range(n)]
                probabilistic(spec, model, hf, case[f"s{s}temperature"], case[f"s{s}seeds"], lengths)
            hidden = []
            for i in range(n):
                rows = case[f"s{s}r{i}"].to(dtype)
                p = rows.shape[0]
                captured.clear()
                model.precompute_and_store_context_kv(model.combine_hidden_states(rows), torch.arange(p),
                                                      torch.arange(p))
                hidden.append(model(ids[i * q:(i + 1) * q], torch.arange(p, p + q)))
            seen, base = [], []
            inner = spec._sample_logits
            spec._sample_logits = lambda lg, idx, pos, st: (seen.append(lg.float().clone()), inner(lg, idx, pos, st))[1]
            draft_logits = type(model).compute_draft_logits        # the base logits, before a top-k cut
            model.compute_draft_logits = lambda h: (lambda t: (base.append(t.float().clone()), t)[1])(
                draft_logits(model, h))
            spec._sample_sequential(n, torch.cat(hidden))
            del model.compute_draft_logits
            out[f"s{s}base"] = base[0].view(n, k, -1)              # [n, k, draft V], no Markov bias
            out[f"s{s}drafts"] = spec.draft_tokens.clone()
            if spec.use_confidence_head:
                out[f"s{s}confidence"] = spec.draft_token_confidence_probs.clone()
            out[f"s{s}logits"] = torch.stack(seen, dim=1)          # [n, k, draft V], Markov bias included
    return out


def main():
    jobs = json.loads(sys.argv[1])
    first = True
    for job in jobs:
        result = {}
        for dtype_name in job.get("dtypes", ["float32", "bfloat16"]):
            result.update({f"{dtype_name}/{key}": t for key, t in run(job, dtype_name, first).items()})
            first = False
        save_file(result, job["out"])


if __name__ == "__main__":
    main()
