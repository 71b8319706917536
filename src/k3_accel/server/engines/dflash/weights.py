"""DFlash weights: the tensor-name table, and loading a draft plus its target's
embedding / lm_head into :class:`DFlashWeights`.

Tensor names (what vLLM's ``qwen3_dflash`` loads): draft tensors are
**unprefixed** (:func:`draft_tensor_shapes` lists every required one), with
optional ``embed_tokens.weight``, ``lm_head.weight`` and ``d2t``; the target
holds ``model.embed_tokens.weight`` / ``lm_head.weight`` (HF names).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from .config import CheckpointError, DFlashConfig, parse_target_config, read_dflash_config, read_json
from .tensors import read_tensors, tensor_files

TARGET_EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
TARGET_LM_HEAD_NAMES = ("lm_head.weight",)
OPTIONAL_DRAFT_TENSORS = ("embed_tokens.weight", "lm_head.weight", "d2t")
# vLLM's DFlash embeds masked rows with this file's vector when the draft ships it (its DSpark does not)
MASK_EMBEDDING_FILE = "mask_embedding.pt"


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


# ------------------------------------------------------ tensor-name table ---

Shape = Callable[[DFlashConfig], tuple[int, ...]]
_H: Shape = lambda c: (c.hidden_size,)                               # noqa: E731
# LayerWeights field -> (name inside ``layers.{i}.``, shape); the one list of layer tensors.
LAYER_TENSORS: dict[str, tuple[str, Shape]] = {
    "input_layernorm": ("input_layernorm.weight", _H),
    "post_attention_layernorm": ("post_attention_layernorm.weight", _H),
    "q_proj": ("self_attn.q_proj.weight", lambda c: (c.q_size, c.hidden_size)),
    "k_proj": ("self_attn.k_proj.weight", lambda c: (c.kv_size, c.hidden_size)),
    "v_proj": ("self_attn.v_proj.weight", lambda c: (c.kv_size, c.hidden_size)),
    "o_proj": ("self_attn.o_proj.weight", lambda c: (c.hidden_size, c.q_size)),
    "q_norm": ("self_attn.q_norm.weight", lambda c: (c.head_dim,)),
    "k_norm": ("self_attn.k_norm.weight", lambda c: (c.head_dim,)),
    "gate_proj": ("mlp.gate_proj.weight", lambda c: (c.intermediate_size, c.hidden_size)),
    "up_proj": ("mlp.up_proj.weight", lambda c: (c.intermediate_size, c.hidden_size)),
    "down_proj": ("mlp.down_proj.weight", lambda c: (c.hidden_size, c.intermediate_size)),
}
LAYER_BIAS_TENSORS: dict[str, tuple[str, Shape]] = {      # only when ``attention_bias``
    "q_bias": ("self_attn.q_proj.bias", lambda c: (c.q_size,)),
    "k_bias": ("self_attn.k_proj.bias", lambda c: (c.kv_size,)),
    "v_bias": ("self_attn.v_proj.bias", lambda c: (c.kv_size,)),
    "o_bias": ("self_attn.o_proj.bias", _H),
}
GLOBAL_TENSORS: dict[str, Shape] = {
    "fc.weight": lambda c: (c.hidden_size, c.context_width),
    "hidden_norm.weight": _H,
    "norm.weight": _H,
}


def layer_tensors(cfg: DFlashConfig) -> dict[str, tuple[str, Shape]]:
    """The per-layer table for ``cfg`` (biases included when ``attention_bias``)."""
    return {**LAYER_TENSORS, **(LAYER_BIAS_TENSORS if cfg.attention_bias else {})}


def draft_tensor_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every required draft tensor name (unprefixed) and its shape, in checkpoint order."""
    shapes = {name: shape(cfg) for name, shape in GLOBAL_TENSORS.items()}
    for i in range(cfg.num_layers):
        shapes.update({f"layers.{i}.{name}": shape(cfg) for name, shape in layer_tensors(cfg).values()})
    return shapes


# ---------------------------------------------------------------- loading ---

def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise CheckpointError(
            f"tensor {name} has shape {list(tensor.shape)}, expected {list(shape)}")
    if not tensor.is_floating_point():
        raise CheckpointError(f"tensor {name} has dtype {tensor.dtype}, expected a float dtype")


def _read_draft(root: Path, cfg: DFlashConfig) -> dict[str, torch.Tensor]:
    """Required draft tensors plus the optional embed/lm_head/d2t, shape-checked."""
    files = tensor_files(root)
    shapes = draft_tensor_shapes(cfg)
    for name in shapes:
        if name not in files:
            raise CheckpointError(f"missing tensor {name} in draft checkpoint {root}")
    optional = [n for n in OPTIONAL_DRAFT_TENSORS if n in files]
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


def load_dflash(draft_dir: str | os.PathLike, target_dir: str | os.PathLike,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                config: DFlashConfig | None = None) -> DFlashWeights:
    """Load and validate a DFlash draft plus the shared target tensors.

    ``embed_tokens`` / ``lm_head`` come from the draft when it ships them (as
    vLLM keeps a draft's own copies) and otherwise from the target. Guarantees
    on return: every tensor has the shape the config implies, float tensors are
    ``dtype`` on ``device``, ``d2t`` is int64 or None. ``config``: the draft's config
    already parsed (a DSpark backbone), else its ``config.json`` read as DFlash.
    """
    root = Path(draft_dir)
    if config is None and (root / MASK_EMBEDDING_FILE).exists():
        raise CheckpointError(f"{root / MASK_EMBEDDING_FILE}: a separate mask embedding is not supported")
    cfg = config or read_dflash_config(root)
    draft = _read_draft(root, cfg)
    d2t = _check_d2t(draft, cfg, root)
    shared = _read_target(Path(target_dir), cfg, "embed_tokens.weight" not in draft,
                          "lm_head.weight" not in draft)
    tensors = {**shared, **draft}

    def get(name: str) -> torch.Tensor:
        return tensors[name].to(device=device, dtype=dtype).contiguous()

    layers = [LayerWeights(**{f: get(f"layers.{i}.{name}")
                              for f, (name, _) in layer_tensors(cfg).items()})
              for i in range(cfg.num_layers)]
    return DFlashWeights(
        config=cfg, fc=get("fc.weight"), hidden_norm=get("hidden_norm.weight"),
        norm=get("norm.weight"), layers=layers, embed_tokens=get("embed_tokens.weight"),
        lm_head=get("lm_head.weight"), d2t=None if d2t is None else d2t.to(device))
