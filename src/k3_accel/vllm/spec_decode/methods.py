"""Which speculative methods a ``k3-draft-server`` drafts for: the one gating rule.

Every other method keeps vLLM's own drafting, on both runners, with one
warning that the draft address is ignored for it.
"""
from __future__ import annotations

import logging
from typing import Any

from k3_accel.config import from_vllm

log = logging.getLogger("k3_accel.vllm")

# speculative methods a k3-draft-server drafts for (and, of them, those that ship aux hidden states)
REMOTE_METHODS = ("dflash", "ngram")
HIDDEN_METHODS = ("dflash",)
# DFlash-method draft architectures that are not plain DFlash (vLLM drafts them with other code)
_OTHER_DFLASH_ARCHS = ("DFlash2DraftModel", "DFlash2BeamDraftModel", "LiLiCorrDraftModel")


def unserved_reason(spec: Any) -> str | None:
    """Why a k3-draft-server cannot draft for this speculative config (None: it can)."""
    if spec.method not in REMOTE_METHODS:
        return f"method {spec.method!r} is drafted locally (remote methods: {list(REMOTE_METHODS)})"
    archs = getattr(getattr(spec, "draft_model_config", None), "architectures", None) or ()
    other = [a for a in archs if a in _OTHER_DFLASH_ARCHS or "XPress" in a]
    if spec.method == "dflash" and other:
        return f"draft architecture {other[0]} is not plain DFlash"
    return None


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
