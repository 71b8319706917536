"""The draft's ``config.json`` (and the target's), validated into :class:`DFlashConfig`.

Layout accepted (what vLLM's ``qwen3_dflash`` loads, see notes/dflash.md): a
draft ``config.json`` with ``architectures: ["DFlashDraftModel"]`` and a
``dflash_config`` dict (``mask_token_id``, ``target_layer_ids``, ...). Every
error is a :class:`CheckpointError` whose message names the file and field.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

DEFAULT_ROPE_THETA = 10_000.0        # transformers' default, what vLLM 0.33 reads for a draft config without
                                    # one (its own 1e6 fallback never applies: the config object has a theta)
DEFAULT_BLOCK_SIZE = 16
QWEN3_MAX_WINDOW_LAYERS = 28         # Qwen3Config's max_window_layers default (layers from there on slide)
QWEN3_HEAD_DIM = 128                 # transformers' Qwen3Config default (vLLM reads a qwen3 draft config so)


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed or unsupported."""


# ---------------------------------------------------------------- config ---

@dataclass(frozen=True)
class DFlashConfig:
    """The draft's architecture, validated and with vLLM's defaults filled in."""
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int
    is_neox_style: bool
    max_position_embeddings: int
    attention_bias: bool
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    logit_scale: float
    mask_token_id: int
    target_layer_ids: tuple[int, ...]   # ascending (vLLM concatenates in layer order)
    block_size: int
    causal: bool
    v_scale: float | None

    @property
    def num_aux(self) -> int:
        return len(self.target_layer_ids)

    @property
    def context_width(self) -> int:
        """Width of one concatenated aux hidden row (input of ``fc``)."""
        return self.num_aux * self.target_hidden_size

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _field(cfg: Mapping[str, Any], key: str, where: str, default: Any = ...) -> Any:
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is ...:
        raise CheckpointError(f"{where}: missing required field '{key}'")
    return default


def _pos_int(value: Any, name: str, where: str, allow_zero: bool = False) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        need = "a non-negative integer" if allow_zero else "a positive integer"
        raise CheckpointError(f"{where}: field '{name}' must be {need}, got {value!r}")
    return value


def _pos_float(value: Any, name: str, where: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{where}: field '{name}' must be a positive number, got {value!r}")
    return float(value)


def _bool(value: Any, name: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: field '{name}' must be true or false, got {value!r}")
    return value


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object file, or raise CheckpointError naming the file."""
    if not path.is_file():
        raise CheckpointError(f"missing file {path}")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _rope(cfg: Mapping[str, Any], head_dim: int, where: str) -> tuple[float, int]:
    """(theta, rotary_dim) for plain (unscaled) RoPE; other rope types are refused."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{where}: field 'rope_parameters' must be an object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"{where}: rope_type {rope_type!r} is not supported (only 'default')")
    theta = params.get("rope_theta", cfg.get("rope_theta", DEFAULT_ROPE_THETA))
    theta = _pos_float(theta, "rope_theta", where)
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    factor = _pos_float(factor, "partial_rotary_factor", where)
    given = params.get("rope_dim")
    rotary_dim = _pos_int(given, "rope_parameters.rope_dim", where) if given is not None else int(head_dim * factor)
    if factor > 1.0 or rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise CheckpointError(f"{where}: bad rotary dimension {rotary_dim} for head_dim {head_dim}")
    return theta, rotary_dim


def _layer_ids(dcfg: Mapping[str, Any], where: str) -> tuple[int, ...]:
    ids = dcfg.get("target_layer_ids")
    if not isinstance(ids, list) or not ids:
        raise CheckpointError(
            f"{where}: field 'dflash_config.target_layer_ids' must be a non-empty list, got {ids!r}")
    for i in ids:
        _pos_int(i, "dflash_config.target_layer_ids", where, allow_zero=True)
    if len(set(ids)) != len(ids):
        raise CheckpointError(f"{where}: field 'dflash_config.target_layer_ids' has duplicates: {ids}")
    return tuple(sorted(ids))


def _causal(cfg: Mapping[str, Any], dcfg: Mapping[str, Any], where: str) -> bool:
    """Block causality as vLLM resolves it; sliding-window drafts are refused."""
    layer_types = cfg.get("layer_types") or []
    # without layer_types, transformers' Qwen3Config makes layers from max_window_layers on sliding
    layers, first_sliding = cfg.get("num_hidden_layers"), cfg.get("max_window_layers", QWEN3_MAX_WINDOW_LAYERS)
    by_flag = not layer_types and cfg.get("use_sliding_window") is True and isinstance(layers, int) \
        and isinstance(first_sliding, int) and first_sliding < layers
    if dcfg.get("use_swa") or "sliding_attention" in layer_types or by_flag:
        raise CheckpointError(f"{where}: sliding-window DFlash drafts are not supported")
    if dcfg.get("attention_sink_bias") or cfg.get("add_swa_attention_sink_bias"):
        raise CheckpointError(f"{where}: attention sink bias is not supported")
    if cfg.get("is_causal") is not None:
        return _bool(cfg["is_causal"], "is_causal", where)
    if dcfg.get("causal") is not None:
        return _bool(dcfg["causal"], "dflash_config.causal", where)
    return False


def parse_dflash_config(cfg: Mapping[str, Any], where: str = "config.json") -> DFlashConfig:
    """Validate a draft config dict; every bad field is named in the error."""
    archs = cfg.get("architectures") or []
    if "DFlashDraftModel" not in archs:
        raise CheckpointError(
            f"{where}: field 'architectures' must contain 'DFlashDraftModel', got {archs!r}")
    dcfg = cfg.get("dflash_config")
    if not isinstance(dcfg, dict):
        raise CheckpointError(f"{where}: missing required field 'dflash_config' (an object)")
    if dcfg.get("use_aux_hidden_state", True) is not True:
        raise CheckpointError(f"{where}: dflash_config.use_aux_hidden_state=false is not supported")
    if _field(cfg, "hidden_act", where, "silu") != "silu":
        raise CheckpointError(f"{where}: field 'hidden_act' must be 'silu', got {cfg['hidden_act']!r}")

    hidden = _pos_int(_field(cfg, "hidden_size", where), "hidden_size", where)
    heads = _pos_int(_field(cfg, "num_attention_heads", where), "num_attention_heads", where)
    kv_heads = _pos_int(_field(cfg, "num_key_value_heads", where, heads), "num_key_value_heads", where)
    if heads % kv_heads:
        raise CheckpointError(
            f"{where}: field 'num_key_value_heads' ({kv_heads}) must divide num_attention_heads ({heads})")
    default_head_dim = QWEN3_HEAD_DIM if cfg.get("model_type") == "qwen3" else hidden // heads
    head_dim = _pos_int(_field(cfg, "head_dim", where, default_head_dim), "head_dim", where)
    theta, rotary_dim = _rope(cfg, head_dim, where)
    vocab = _pos_int(_field(cfg, "vocab_size", where), "vocab_size", where)
    mask_id = _pos_int(_field(dcfg, "mask_token_id", where), "dflash_config.mask_token_id", where,
                       allow_zero=True)
    if mask_id >= vocab:
        raise CheckpointError(
            f"{where}: field 'dflash_config.mask_token_id' ({mask_id}) must be < vocab_size ({vocab})")
    block = dcfg.get("block_size", cfg.get("block_size", DEFAULT_BLOCK_SIZE))
    block = _pos_int(block, "dflash_config.block_size", where)
    if block < 2:
        raise CheckpointError(f"{where}: field 'dflash_config.block_size' must be >= 2, got {block}")
    v_scale = dcfg.get("attention_value_scale")
    return DFlashConfig(
        hidden_size=hidden,
        num_layers=_pos_int(_field(cfg, "num_hidden_layers", where), "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_pos_int(_field(cfg, "intermediate_size", where), "intermediate_size", where),
        rms_norm_eps=_pos_float(_field(cfg, "rms_norm_eps", where, 1e-6), "rms_norm_eps", where),
        rope_theta=theta,
        rotary_dim=rotary_dim,
        is_neox_style=_bool(_field(cfg, "is_neox_style", where, True), "is_neox_style", where),
        max_position_embeddings=_pos_int(_field(cfg, "max_position_embeddings", where, 32768),
                                         "max_position_embeddings", where),
        attention_bias=_bool(_field(cfg, "attention_bias", where, False), "attention_bias", where),
        vocab_size=vocab,
        draft_vocab_size=_pos_int(_field(cfg, "draft_vocab_size", where, vocab), "draft_vocab_size",
                                  where),
        target_hidden_size=_pos_int(_field(cfg, "target_hidden_size", where, hidden),
                                    "target_hidden_size", where),
        logit_scale=_pos_float(_field(cfg, "logit_scale", where, 1.0), "logit_scale", where),
        mask_token_id=mask_id,
        target_layer_ids=_layer_ids(dcfg, where),
        block_size=block,
        causal=_causal(cfg, dcfg, where),
        v_scale=None if v_scale is None else _pos_float(v_scale, "dflash_config.attention_value_scale",
                                                        where),
    )


@dataclass(frozen=True)
class TargetInfo:
    """What the draft needs to know about the target checkpoint."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    tie_word_embeddings: bool


def parse_target_config(cfg: Mapping[str, Any], where: str = "target config.json") -> TargetInfo:
    """Validate the target's config (top level, or ``text_config`` for wrappers)."""
    tie = cfg.get("tie_word_embeddings")
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
        tie = cfg.get("tie_word_embeddings", tie)
    return TargetInfo(
        vocab_size=_pos_int(_field(cfg, "vocab_size", where), "vocab_size", where),
        hidden_size=_pos_int(_field(cfg, "hidden_size", where), "hidden_size", where),
        num_layers=_pos_int(_field(cfg, "num_hidden_layers", where), "num_hidden_layers", where),
        tie_word_embeddings=_bool(False if tie is None else tie, "tie_word_embeddings", where),
    )


def read_dflash_config(draft_dir: str | os.PathLike) -> DFlashConfig:
    path = Path(draft_dir) / "config.json"
    return parse_dflash_config(read_json(path), str(path))
