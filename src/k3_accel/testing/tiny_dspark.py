"""Tiny random DSpark drafts for tests and demos, in the layout vLLM 0.33's
``Qwen3DSparkForCausalLM.load_weights`` loads.

A DSpark checkpoint is a DFlash backbone (the same unprefixed tensors, see
:mod:`.tiny`) plus ``markov_head.markov_w1.weight [V, r]`` (indexed by the
previous *target* token id), ``markov_head.markov_w2.weight [draft_V, r]`` and,
with ``enable_confidence_head``, ``confidence_head.proj.{weight,bias}``
(``[1, H (+ r with confidence_head_with_markov)]``, ``[1]``). Its config says
``architectures: ["Qwen3DSparkModel"]``, the target layers at top level
(``dspark_target_layer_ids`` by default, or ``target_layer_ids``) and the mask
token as ``mask_token_id``; ``sample_from_anchor`` picks the layout (vLLM's
default: true).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from k3_accel.testing.tiny import tiny_dflash_weights, write_dflash

LAYER_KEYS = ("dspark_target_layer_ids", "target_layer_ids", "dflash_config")


def tiny_dspark_weights(target_dir: str | Path, *, markov_rank: int = 16, confidence: bool = True,
                        confidence_with_markov: bool = True, sample_from_anchor: bool | None = None,
                        layer_key: str = "dspark_target_layer_ids", draft_topk: int | None = None,
                        markov_std: float = 1.0, seed: int = 7, **options: Any
                        ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The random tensors (fp32) and ``config.json`` dict of a DSpark draft; ``options`` go
    to :func:`~.tiny.tiny_dflash_weights` (layers, block size, reduced vocabulary, ...)."""
    if layer_key not in LAYER_KEYS:
        raise ValueError(f"layer_key must be one of {LAYER_KEYS}")
    tensors, config = tiny_dflash_weights(target_dir, **options)
    dflash = config.pop("dflash_config")
    h, vocab = config["hidden_size"], config["vocab_size"]
    draft_vocab = config.get("draft_vocab_size", vocab)
    gen = torch.Generator().manual_seed(seed)
    tensors["markov_head.markov_w1.weight"] = torch.randn(vocab, markov_rank, generator=gen) * markov_std
    tensors["markov_head.markov_w2.weight"] = (torch.randn(draft_vocab, markov_rank, generator=gen)
                                               * (4.0 / math.sqrt(markov_rank)))
    if confidence:
        width = h + (markov_rank if confidence_with_markov else 0)
        tensors["confidence_head.proj.weight"] = torch.randn(1, width, generator=gen) / math.sqrt(width)
        tensors["confidence_head.proj.bias"] = torch.randn(1, generator=gen)
    config.update(architectures=["Qwen3DSparkModel"], markov_rank=markov_rank,
                  mask_token_id=dflash.pop("mask_token_id"), enable_confidence_head=confidence,
                  confidence_head_with_markov=confidence_with_markov, block_size=dflash.pop("block_size"))
    ids = dflash.pop("target_layer_ids")
    if layer_key == "dflash_config":
        dflash["target_layer_ids"] = ids
    else:
        config[layer_key] = ids
    if dflash:
        config["dflash_config"] = dflash
    if sample_from_anchor is not None:
        config["sample_from_anchor"] = sample_from_anchor
    if draft_topk is not None:
        config["dspark_draft_topk"] = draft_topk
    return tensors, config


def write_tiny_dspark(dir: str | Path, target_dir: str | Path, *, dtype: str = "float32",
                      **options: Any) -> Path:
    """Write a random DSpark draft for the target in ``target_dir``; returns the path."""
    tensors, config = tiny_dspark_weights(target_dir, **options)
    return write_dflash(dir, tensors, config, dtype)
