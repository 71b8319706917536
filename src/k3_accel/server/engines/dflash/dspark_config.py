"""The DSpark draft's ``config.json``, validated into :class:`DSparkConfig`.

What vLLM 0.33 loads as ``Qwen3DSparkForCausalLM`` (``architectures``
``["Qwen3DSparkModel"]``, or ``["DSparkDraftModel"]`` with ``model_type``
``qwen3``, which vLLM renames): a DFlash backbone (every DFlash field, see
:mod:`.config`) plus ``markov_rank``, ``enable_confidence_head``,
``confidence_head_with_markov``, ``sample_from_anchor`` (default true: N query
rows, each predicting the next token; false: DFlash's 1 + N fill-in block) and
``dspark_draft_topk``. The target layers and the mask token are looked up where
vLLM looks (``get_eagle3_aux_layers_from_config``, ``get_parallel_drafting_token_id``).
No torch here: the target side and ``k3-accel doctor`` use :func:`dspark_signature`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .config import (CheckpointError, DFlashConfig, _bool, _pos_int, parse_dflash_config, read_json)

QWEN3_ARCHS = ("Qwen3DSparkModel",)
# DSpark drafts vLLM runs with other model code (MLA, multimodal, other backbones): not served
OTHER_ARCHS = ("Qwen3OmniDSparkModel", "K3DSparkModel", "MuseSparkDSparkModel", "Gemma4DSparkModel",
               "DSparkV41DraftModel")
# fields the target's draft config and the server's checkpoint must agree on (the handshake)
SIGNATURE_KEYS = ("sample_from_anchor", "draft_vocab_size", "markov_rank", "draft_topk")


@dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    markov_rank: int = 0
    confidence_head: bool = False        # the config enables it (vLLM also needs its tensors)
    confidence_with_markov: bool = False  # the head reads [hidden | markov embedding]
    sample_from_anchor: bool = True
    draft_topk: int | None = None        # Markov bias only on the base logits' top-k

    def query_rows(self, k: int) -> int:
        """Rows of one request's query block for ``k`` drafts."""
        return k if self.sample_from_anchor else k + 1

    @property
    def max_k(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1


def is_qwen3_dspark(cfg: Mapping[str, Any]) -> bool:
    archs = cfg.get("architectures") or []
    return any(a in QWEN3_ARCHS for a in archs) or (
        "DSparkDraftModel" in archs and cfg.get("model_type") == "qwen3")


def layer_ids(cfg: Mapping[str, Any]) -> list[int] | None:
    """Target layer ids (0-based, the residual stream after the layer), in vLLM's lookup order:
    ``eagle_aux_hidden_state_layer_ids`` (capture indices, id + 1), ``dflash_config.target_layer_ids``,
    ``dspark_target_layer_ids``, ``target_layer_ids``; None when there are none."""
    captured = cfg.get("eagle_aux_hidden_state_layer_ids")
    if captured:
        return [int(i) - 1 for i in captured]
    for ids in ((cfg.get("dflash_config") or {}).get("target_layer_ids"), cfg.get("dspark_target_layer_ids"),
                cfg.get("target_layer_ids")):
        if ids:
            return list(ids)
    return None


def mask_token_id(cfg: Mapping[str, Any]) -> Any:
    dflash = cfg.get("dflash_config") or {}
    for value in (dflash.get("mask_token_id"), cfg.get("mask_token_id"), cfg.get("dspark_noise_token_id")):
        if value is not None:
            return value
    return None


def dspark_signature(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What a target's DSpark draft config says about the drafts it expects (the handshake
    compares it with the server's checkpoint): layout, draft vocabulary, Markov rank, top-k."""
    vocab = cfg.get("vocab_size")
    return {"sample_from_anchor": bool(cfg.get("sample_from_anchor", True)),
            "draft_vocab_size": cfg.get("draft_vocab_size") or vocab,
            "markov_rank": cfg.get("markov_rank"), "draft_topk": cfg.get("dspark_draft_topk")}


def parse_dspark_config(cfg: Mapping[str, Any], where: str = "config.json") -> DSparkConfig:
    """Validate a DSpark draft config dict; every bad field is named in the error."""
    archs = cfg.get("architectures") or []
    other = [a for a in archs if a in OTHER_ARCHS]
    if other:
        raise CheckpointError(f"{where}: DSpark architecture {other[0]} is not served (only Qwen3 DSpark)")
    if not is_qwen3_dspark(cfg):
        raise CheckpointError(f"{where}: field 'architectures' must contain 'Qwen3DSparkModel' "
                              f"(or 'DSparkDraftModel' with model_type qwen3), got {archs!r}")
    if cfg.get("markov_head_type", "vanilla") != "vanilla":
        raise CheckpointError(f"{where}: markov_head_type {cfg['markov_head_type']!r} is not supported")
    dflash = dict(cfg.get("dflash_config") or {})
    if dflash.pop("sample_from_anchor", False):      # vLLM: DFlash's check, run first; the layout is top-level
        raise CheckpointError(f"{where}: dflash_config.sample_from_anchor=true is refused (as vLLM refuses it); "
                              f"a DSpark layout is the top-level 'sample_from_anchor'")
    ids, mask = layer_ids(cfg), mask_token_id(cfg)
    if ids is None:
        raise CheckpointError(f"{where}: no target layer ids (dspark_target_layer_ids, target_layer_ids "
                              f"or dflash_config.target_layer_ids)")
    if mask is None:
        raise CheckpointError(f"{where}: no mask token (mask_token_id, dspark_noise_token_id or "
                              f"dflash_config.mask_token_id)")
    block = cfg.get("block_size", cfg.get("dspark_block_size"))
    dflash.update(target_layer_ids=ids, mask_token_id=mask,
                  **({"block_size": block} if block is not None else {}))
    base = parse_dflash_config({**cfg, "architectures": ["DFlashDraftModel"], "dflash_config": dflash}, where)
    rank = _pos_int(cfg.get("markov_rank"), "markov_rank", where)
    topk = cfg.get("dspark_draft_topk")
    if topk is not None:
        topk = _pos_int(topk, "dspark_draft_topk", where)
        if topk > base.draft_vocab_size:
            raise CheckpointError(f"{where}: field 'dspark_draft_topk' ({topk}) must be <= the draft "
                                  f"vocabulary ({base.draft_vocab_size})")
    return DSparkConfig(
        **{f: getattr(base, f) for f in DFlashConfig.__dataclass_fields__},
        markov_rank=rank,
        confidence_head=_bool(cfg.get("enable_confidence_head", False), "enable_confidence_head", where),
        confidence_with_markov=_bool(cfg.get("confidence_head_with_markov", False),
                                     "confidence_head_with_markov", where),
        sample_from_anchor=_bool(cfg.get("sample_from_anchor", True), "sample_from_anchor", where),
        draft_topk=topk)


def read_dspark_config(draft_dir: str) -> DSparkConfig:
    path = Path(draft_dir) / "config.json"
    return parse_dspark_config(read_json(path), str(path))
