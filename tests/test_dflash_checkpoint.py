"""DFlash checkpoint reading: the tiny checkpoint loads as written, the tensor-name
table matches it, and malformed checkpoints fail with errors naming the fault."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3_accel.server.engines.dflash import CheckpointError, draft_tensor_shapes, load_dflash
from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dflash")
    target = write_tiny_target(root / "target")
    draft = write_tiny_dflash(root / "draft", target)
    return draft, target


def test_tiny_checkpoint_loads(ckpt):
    draft, target = ckpt
    w = load_dflash(draft, target)
    cfg = w.config
    assert (cfg.num_layers, cfg.target_layer_ids, cfg.block_size) == (2, (0, 2), 8)
    assert (cfg.mask_token_id, cfg.vocab_size, cfg.context_width) == (511, 512, 256)
    assert w.fc.shape == (128, 256) and len(w.layers) == 2 and w.d2t is None
    tgt = load_file(str(target / "model.safetensors"))
    assert torch.equal(w.embed_tokens, tgt["model.embed_tokens.weight"])
    assert torch.equal(w.lm_head, tgt["lm_head.weight"])
    drafted = load_file(str(draft / "model.safetensors"))
    assert torch.equal(w.layers[1].k_proj, drafted["layers.1.self_attn.k_proj.weight"])
    assert torch.equal(w.layers[0].down_proj, drafted["layers.0.mlp.down_proj.weight"])
    tok_path = target / "tokenizer.json"
    if tok_path.exists():                                     # written when tokenizers imports
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(tok_path))
        assert tok.get_vocab_size() == 512 and tok.token_to_id("<|mask|>") == 511
        assert tok.token_to_id("<|endoftext|>") == 0
        assert tok.decode(tok.encode("the quick brown fox").ids) == "the quick brown fox"
    tcfg = json.loads((target / "config.json").read_text())
    assert tcfg["architectures"] == ["Qwen3ForCausalLM"] and tcfg["head_dim"] == 32


@pytest.mark.parametrize("bias", [False, True])
def test_tensor_table_matches_checkpoint(tmp_path, bias):
    """The one tensor-name table lists exactly the draft's required tensors and shapes."""
    target = write_tiny_target(tmp_path / "target")
    draft = write_tiny_dflash(tmp_path / "draft", target, attention_bias=bias)
    stored = {k: tuple(v.shape) for k, v in load_file(str(draft / "model.safetensors")).items()}
    table = draft_tensor_shapes(load_dflash(draft, target).config)
    assert table == stored
    assert any(".bias" in name for name in table) == bias


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
    ("rope_scaling", {"rope_type": "default", "rope_dim": 16.0}, "rope_parameters.rope_dim"),
    ("rope_scaling", {"rope_type": "default", "rope_dim": "16"}, "rope_parameters.rope_dim"),
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


def test_d2t_that_maps_a_draft_id_past_the_target_vocab_is_refused(ckpt, tmp_path):
    """Every draft id i must land on a target id i + d2t[i] inside [0, vocab): one offset that points
    past the end (or below 0) refuses the checkpoint instead of serving ids vLLM cannot verify."""
    _, target = ckpt
    base = write_tiny_dflash(tmp_path / "reduced", target, draft_vocab_size=64)
    w = load_dflash(base, target)                               # the unedited reduced-vocab draft loads
    vocab = w.config.vocab_size
    assert w.d2t is not None and int((torch.arange(64) + w.d2t).max()) < vocab
    for name, edit in (("past", lambda d2t: d2t.__setitem__(-1, vocab - 63)),      # 63 + (vocab - 63) = vocab
                       ("far", lambda d2t: d2t.__setitem__(0, 10 ** 6)),
                       ("below", lambda d2t: d2t.__setitem__(5, -6))):              # 5 - 6 = -1
        d = _copy(base, tmp_path / name)
        _edit_tensors(d, lambda t, edit=edit: edit(t["d2t"]))
        assert "outside the target vocab" in _load_error(d, target), name


def test_a_draft_that_does_not_fit_its_target_or_its_own_vocabulary_is_refused(ckpt, tmp_path):
    """A draft of another vocabulary size than its target, a target layer id the target lacks
    (ids count from 0: a 4-layer target has no layer 4) and a d2t table on a draft whose
    vocabulary is the target's each refuse the checkpoint, naming the fault."""
    draft, target = ckpt
    t = _copy(target, tmp_path / "target_1024")
    _edit_config(t, lambda c: c.__setitem__("vocab_size", 1024))
    assert "draft vocab_size 512 != target vocab_size 1024" in _load_error(draft, t)

    assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == 4
    d = _copy(draft, tmp_path / "layer4")
    _edit_config(d, lambda c: c["dflash_config"].__setitem__("target_layer_ids", [0, 4]))
    assert "target_layer_ids [4] do not exist" in _load_error(d, target)
    d = _copy(draft, tmp_path / "layer3")                        # the last layer the target has: fine
    _edit_config(d, lambda c: c["dflash_config"].__setitem__("target_layer_ids", [0, 3]))
    assert load_dflash(d, target).config.target_layer_ids == (0, 3)

    d = _copy(draft, tmp_path / "d2t_same_vocab")
    _edit_tensors(d, lambda x: x.__setitem__("d2t", torch.zeros(512, dtype=torch.int64)))
    assert "d2t" in _load_error(d, target) and "draft_vocab_size == vocab_size" in _load_error(d, target)


@pytest.mark.parametrize("ids", [[0, 0], [2, 0, 2]])
def test_target_layer_ids_listed_twice_are_refused(ckpt, tmp_path, ids):
    draft, target = ckpt
    d = _copy(draft, tmp_path / "dup")
    _edit_config(d, lambda c: c["dflash_config"].__setitem__("target_layer_ids", ids))
    assert "has duplicates" in _load_error(d, target)


def test_a_block_of_fewer_than_two_rows_is_refused(ckpt, tmp_path):
    """A DFlash block is the anchor plus at least one masked row: block_size 1 drafts nothing."""
    draft, target = ckpt
    for value in (1, 0):
        d = _copy(draft, tmp_path / f"block{value}")
        _edit_config(d, lambda c: c["dflash_config"].__setitem__("block_size", value))
        assert "dflash_config.block_size" in _load_error(d, target), value
    d = _copy(draft, tmp_path / "block2")
    _edit_config(d, lambda c: c["dflash_config"].__setitem__("block_size", 2))
    assert load_dflash(d, target).config.block_size == 2


@pytest.mark.parametrize("edit", [
    lambda c: c.pop("rope_theta"),
    lambda c: (c.pop("rope_theta"), c.__setitem__("rope_parameters", {"rope_type": "default"})),
])
def test_a_draft_config_without_rope_theta_gets_the_theta_vllm_reads(ckpt, tmp_path, edit):
    """vLLM 0.33 reads a draft config through transformers' config class, which fills a missing
    ``rope_theta`` with its own default (10000); vLLM's 1e6 fallback (``set_default_rope_theta``) never
    applies since the config always carries one. Another theta rotates every key and query: silently
    other drafts."""
    draft, target = ckpt
    d = _copy(draft, tmp_path / "no_theta")
    _edit_config(d, edit)
    assert load_dflash(d, target).config.rope_theta == 10000.0


def test_a_separate_mask_embedding_is_refused_not_ignored(ckpt, tmp_path):
    """vLLM 0.33's DFlash reads ``mask_embedding.pt`` from the draft directory and embeds every masked
    row with it instead of ``embed_tokens[mask_token_id]``; a server that skipped the file would draft
    other tokens. It is refused, naming the file. (vLLM's DSpark does not read the file: it loads.)"""
    from k3_accel.server.engines.dflash.dspark_weights import load_dspark
    from k3_accel.testing.tiny_dspark import write_tiny_dspark
    draft, target = ckpt
    d = _copy(draft, tmp_path / "mask_embedding")
    torch.save({"mask_token_id": 511, "embedding": torch.randn(128)}, d / "mask_embedding.pt")
    assert "mask_embedding.pt" in _load_error(d, target)
    spark = write_tiny_dspark(tmp_path / "dspark", target)
    torch.save(torch.randn(128), spark / "mask_embedding.pt")
    assert load_dspark(spark, target)[0].config.num_layers == 2


def test_a_qwen3_draft_config_without_head_dim_gets_the_head_dim_vllm_reads(tmp_path):
    """A ``model_type: qwen3`` draft config without ``head_dim``: vLLM 0.33 reads it through
    transformers' Qwen3Config, whose default is 128 (not hidden_size / heads). A draft of 4 heads of 128
    on a hidden size of 128 (hidden / heads = 32) loads in vLLM; the server loads it too."""
    target = write_tiny_target(tmp_path / "target", head_dim=128)
    d = write_tiny_dflash(tmp_path / "draft", target)
    _edit_config(d, lambda c: c.pop("head_dim"))
    cfg = load_dflash(d, target).config
    assert (cfg.hidden_size, cfg.num_heads, cfg.head_dim) == (128, 4, 128)


def test_sliding_layers_given_by_use_sliding_window_are_refused_like_layer_types(ckpt, tmp_path):
    """transformers (and so vLLM 0.33) makes layers from ``max_window_layers`` on sliding-window when a
    qwen3 config says ``use_sliding_window`` without ``layer_types``; the server, which has no sliding
    attention, must refuse such a draft rather than attend to the whole context (other drafts)."""
    draft, target = ckpt
    d = _copy(draft, tmp_path / "sliding")
    _edit_config(d, lambda c: c.update(use_sliding_window=True, max_window_layers=1, sliding_window=64))
    assert "sliding-window" in _load_error(d, target)
    _edit_config(d, lambda c: c.update(max_window_layers=c["num_hidden_layers"]))   # no layer slides: loads
    assert load_dflash(d, target).config.num_layers >= 1
