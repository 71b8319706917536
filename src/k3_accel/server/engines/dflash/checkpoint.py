"""Reading a DFlash draft checkpoint (and the target's embedding / lm_head).

Layout accepted (what vLLM's ``qwen3_dflash`` loads, see notes/dflash.md):

* draft ``config.json`` with ``architectures: ["DFlashDraftModel"]`` and a
  ``dflash_config`` dict (``mask_token_id``, ``target_layer_ids``, ...);
* draft tensors with **unprefixed** names: ``fc.weight``, ``hidden_norm.weight``,
  ``norm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (+ ``.bias``
  when ``attention_bias``), ``layers.{i}.self_attn.{q,k}_norm.weight``,
  ``layers.{i}.{input,post_attention}_layernorm.weight``,
  ``layers.{i}.mlp.{gate,up,down}_proj.weight``; optional ``embed_tokens.weight``,
  ``lm_head.weight``, ``d2t``;
* target tensors with HF names ``model.embed_tokens.weight`` / ``lm_head.weight``.

Every error is a :class:`CheckpointError` whose message names the file, field,
tensor or path at fault.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
TARGET_EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
TARGET_LM_HEAD_NAMES = ("lm_head.weight",)
DEFAULT_ROPE_THETA = 1_000_000.0     # vLLM's default for DFlash drafts
DEFAULT_BLOCK_SIZE = 16


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
    rotary_dim = params.get("rope_dim") or int(head_dim * factor)
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
    if dcfg.get("use_swa") or "sliding_attention" in layer_types:
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
    head_dim = _pos_int(_field(cfg, "head_dim", where, hidden // heads), "head_dim", where)
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


# ---------------------------------------------------------- safetensors ---

def _contained(root: Path, rel: str, what: str) -> Path:
    """``root/rel`` resolved, guaranteed to lie inside ``root`` (symlinks followed)."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel):
        raise CheckpointError(f"{what}: file path {rel!r} escapes checkpoint directory {root}")
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(root / rel))
    if real != real_root and real_root not in real.parents:
        raise CheckpointError(f"{what}: file path {rel!r} escapes checkpoint directory {root}")
    if not real.is_file():
        raise CheckpointError(f"{what}: missing weight file {root / rel}")
    return real


def tensor_files(root: str | os.PathLike) -> dict[str, Path]:
    """Map tensor name -> safetensors file for a checkpoint directory.

    Uses ``model.safetensors.index.json`` when present, else every
    ``*.safetensors`` file in the directory. Every file is checked to lie
    inside ``root``; a name stored in two files is an error.
    """
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    index = root / INDEX_FILE
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: missing or empty 'weight_map'")
        return {name: _contained(root, rel, str(index)) for name, rel in weight_map.items()}
    files = sorted(p.name for p in root.iterdir() if p.name.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files and no {INDEX_FILE}")
    out: dict[str, Path] = {}
    for rel in files:
        path = _contained(root, rel, str(root))
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in out:
                    raise CheckpointError(f"{root}: tensor {name} is stored in two files")
                out[name] = path
    return out


def read_tensors(files: Mapping[str, Path], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read only ``names`` (each must be in ``files``), grouped per file."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for path, group in by_file.items():
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                stored = set(f.keys())
                for name in group:
                    if name not in stored:
                        raise CheckpointError(f"missing tensor {name} (index names {path.name})")
                    out[name] = f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:  # corrupt file: safetensors raises its own types
            raise CheckpointError(f"{path}: cannot read safetensors ({exc})") from exc
    return out


# -------------------------------------------------------------- weights ---

@dataclass
class LayerWeights:
    """One draft decoder layer (Qwen3 layout, separate q/k/v projections)."""
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


@dataclass
class DFlashWeights:
    """All tensors the draft math reads, in one dtype on one device."""
    config: DFlashConfig
    fc: torch.Tensor                 # [H, A*Ht]
    hidden_norm: torch.Tensor        # [H]
    norm: torch.Tensor               # [H]
    layers: list[LayerWeights]
    embed_tokens: torch.Tensor       # [V, H]
    lm_head: torch.Tensor            # [draft_V, H]
    d2t: torch.Tensor | None = None  # [draft_V] int64 offsets (draft id + d2t = target id)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.device


_LAYER_FIELDS = {
    "input_layernorm": "input_layernorm.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}
_BIAS_FIELDS = {
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "o_bias": "self_attn.o_proj.bias",
}


def expected_draft_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every required draft tensor name (unprefixed) and its shape."""
    h, hd, ffn = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    per_layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (cfg.q_size, h),
        "self_attn.k_proj.weight": (cfg.kv_size, h),
        "self_attn.v_proj.weight": (cfg.kv_size, h),
        "self_attn.o_proj.weight": (h, cfg.q_size),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (ffn, h),
        "mlp.up_proj.weight": (ffn, h),
        "mlp.down_proj.weight": (h, ffn),
    }
    if cfg.attention_bias:
        per_layer.update({
            "self_attn.q_proj.bias": (cfg.q_size,),
            "self_attn.k_proj.bias": (cfg.kv_size,),
            "self_attn.v_proj.bias": (cfg.kv_size,),
            "self_attn.o_proj.bias": (h,),
        })
    shapes = {"fc.weight": (h, cfg.context_width), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(cfg.num_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise CheckpointError(
            f"tensor {name} has shape {list(tensor.shape)}, expected {list(shape)}")
    if not tensor.is_floating_point():
        raise CheckpointError(f"tensor {name} has dtype {tensor.dtype}, expected a float dtype")


def _read_draft(root: Path, cfg: DFlashConfig) -> dict[str, torch.Tensor]:
    """Required draft tensors plus the optional embed/lm_head/d2t, shape-checked."""
    files = tensor_files(root)
    shapes = expected_draft_shapes(cfg)
    for name in shapes:
        if name not in files:
            raise CheckpointError(f"missing tensor {name} in draft checkpoint {root}")
    optional = [n for n in ("embed_tokens.weight", "lm_head.weight", "d2t") if n in files]
    tensors = read_tensors(files, [*shapes, *optional])
    for name, shape in shapes.items():
        _check_shape(name, tensors[name], shape)
    h = cfg.hidden_size
    if "embed_tokens.weight" in tensors:
        _check_shape("embed_tokens.weight", tensors["embed_tokens.weight"], (cfg.vocab_size, h))
    if "lm_head.weight" in tensors:
        _check_shape("lm_head.weight", tensors["lm_head.weight"], (cfg.draft_vocab_size, h))
    return tensors


def _check_d2t(tensors: Mapping[str, torch.Tensor], cfg: DFlashConfig, root: Path) -> torch.Tensor | None:
    """The draft->target id offsets, required exactly when the vocabularies differ."""
    d2t = tensors.get("d2t")
    if cfg.draft_vocab_size == cfg.vocab_size:
        if d2t is not None:
            raise CheckpointError(f"tensor d2t in {root} but draft_vocab_size == vocab_size")
        return None
    if d2t is None or "lm_head.weight" not in tensors:
        raise CheckpointError(
            f"draft_vocab_size {cfg.draft_vocab_size} != vocab_size {cfg.vocab_size}: "
            f"missing tensor {'d2t' if d2t is None else 'lm_head.weight'} in {root}")
    if tuple(d2t.shape) != (cfg.draft_vocab_size,) or d2t.is_floating_point():
        raise CheckpointError(
            f"tensor d2t has shape {list(d2t.shape)} dtype {d2t.dtype}, "
            f"expected [{cfg.draft_vocab_size}] integer")
    target_ids = torch.arange(cfg.draft_vocab_size) + d2t.long()
    if target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size:
        raise CheckpointError(f"tensor d2t maps draft ids outside the target vocab [0, {cfg.vocab_size})")
    return d2t.long()


def _read_target(root: Path, cfg: DFlashConfig, need_embed: bool, need_head: bool
                 ) -> dict[str, torch.Tensor]:
    """The target's embedding and/or lm_head (only those tensors are read)."""
    info = parse_target_config(read_json(root / "config.json"), str(root / "config.json"))
    if info.vocab_size != cfg.vocab_size:
        raise CheckpointError(
            f"draft vocab_size {cfg.vocab_size} != target vocab_size {info.vocab_size} ({root})")
    bad = [i for i in cfg.target_layer_ids if i >= info.num_layers]
    if bad:
        raise CheckpointError(
            f"dflash_config.target_layer_ids {bad} do not exist in the target "
            f"({info.num_layers} layers)")
    if not (need_embed or need_head):
        return {}
    files = tensor_files(root)
    embed_name = next((n for n in TARGET_EMBED_NAMES if n in files), None)
    head_name = next((n for n in TARGET_LM_HEAD_NAMES if n in files), None)
    use_embed_as_head = need_head and info.tie_word_embeddings
    if (need_embed or use_embed_as_head) and embed_name is None:
        raise CheckpointError(f"missing tensor {TARGET_EMBED_NAMES[0]} in target checkpoint {root}")
    if need_head and not use_embed_as_head and head_name is None:
        raise CheckpointError(f"missing tensor lm_head.weight in target checkpoint {root} "
                              f"(and tie_word_embeddings is not true)")
    names = [n for n, want in ((embed_name, need_embed or use_embed_as_head),
                               (head_name, need_head and not use_embed_as_head)) if want]
    raw = read_tensors(files, names)
    out: dict[str, torch.Tensor] = {}
    shape = (cfg.vocab_size, cfg.hidden_size)
    if embed_name in raw:
        _check_shape(embed_name, raw[embed_name], shape)
        out["embed_tokens.weight"] = raw[embed_name]
    if need_head:
        name = embed_name if use_embed_as_head else head_name
        _check_shape(name, raw[name], shape)
        out["lm_head.weight"] = raw[name]
    if not need_embed:
        out.pop("embed_tokens.weight", None)
    return out


def read_dflash_config(draft_dir: str | os.PathLike) -> DFlashConfig:
    path = Path(draft_dir) / "config.json"
    return parse_dflash_config(read_json(path), str(path))


def load_dflash(draft_dir: str | os.PathLike, target_dir: str | os.PathLike,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                ) -> DFlashWeights:
    """Load and validate a DFlash draft plus the shared target tensors.

    ``embed_tokens`` / ``lm_head`` come from the draft when it ships them (as
    vLLM keeps a draft's own copies) and otherwise from the target. Guarantees
    on return: every tensor has the shape the config implies, float tensors are
    ``dtype`` on ``device``, ``d2t`` is int64 or None.
    """
    root = Path(draft_dir)
    cfg = read_dflash_config(root)
    draft = _read_draft(root, cfg)
    d2t = _check_d2t(draft, cfg, root)
    shared = _read_target(Path(target_dir), cfg, "embed_tokens.weight" not in draft,
                          "lm_head.weight" not in draft)
    tensors = {**shared, **draft}

    def get(name: str) -> torch.Tensor:
        return tensors[name].to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(cfg.num_layers):
        fields = {f: get(f"layers.{i}.{n}") for f, n in _LAYER_FIELDS.items()}
        if cfg.attention_bias:
            fields.update({f: get(f"layers.{i}.{n}") for f, n in _BIAS_FIELDS.items()})
        layers.append(LayerWeights(**fields))
    return DFlashWeights(
        config=cfg, fc=get("fc.weight"), hidden_norm=get("hidden_norm.weight"),
        norm=get("norm.weight"), layers=layers, embed_tokens=get("embed_tokens.weight"),
        lm_head=get("lm_head.weight"), d2t=None if d2t is None else d2t.to(device))
