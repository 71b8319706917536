"""Which draft architectures go to a k3-draft-server, from vLLM 0.33's own registry (issue 25).

Under ``method="dflash"`` vLLM 0.33 drafts several architectures with code other than plain
(Qwen3) DFlash: DFlash2 and its beam variant, LiLiCorr, XPress, Laguna's DFlash. The server
drafts plain DFlash only, so every other one keeps vLLM's own drafting. The list is read from
vLLM's registry: an architecture vLLM adds later fails this test until the rule names it.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from k3_accel.vllm.spec_decode.methods import unserved_reason

PLAIN_DFLASH = "DFlashQwen3ForCausalLM"      # the class vLLM drafts plain DFlash with


def _spec(method: str, arch: str) -> SimpleNamespace:
    return SimpleNamespace(method=method, draft_model_config=SimpleNamespace(architectures=[arch]))


@pytest.mark.vllm033
def test_only_plain_dflash_architectures_go_remote():
    from vllm.config.speculative import XPRESS_ARCHITECTURES
    from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS as models

    dflash = {arch for arch, (module, cls) in models.items()
              if "dflash" in f"{arch} {module} {cls}".lower() or arch in XPRESS_ARCHITECTURES or "LiLiCorr" in arch}
    assert {"DFlash2DraftModel", "DFlash2BeamDraftModel", "LiLiCorrDraftModel", "DFlashQwen3XPressModel",
            "DFlashDraftModel"} <= dflash
    wrong = {arch: unserved_reason(_spec("dflash", arch)) for arch in sorted(dflash)
             if (unserved_reason(_spec("dflash", arch)) is None) != (models[arch][1] == PLAIN_DFLASH)}
    assert wrong == {}, f"gated against vLLM's registry: {wrong}"


@pytest.mark.parametrize("arch", ["DFlash2DraftModel", "DFlash2BeamDraftModel", "LiLiCorrDraftModel",
                                  "DFlashQwen3XPressModel", "DFlashLagunaForCausalLM"])
def test_other_dflash_architectures_stay_local(arch):
    why = unserved_reason(_spec("dflash", arch))
    assert why is not None and arch in why
    assert unserved_reason(_spec("dflash", "DFlashDraftModel")) is None


def _dspark(*archs: str) -> SimpleNamespace:
    return SimpleNamespace(method="dspark", draft_model_config=SimpleNamespace(architectures=list(archs)))


def test_only_a_qwen3_dspark_draft_goes_remote():
    """``dspark`` is served for the Qwen3 DSpark architecture only: another DSpark architecture, or a
    draft config that names none (nothing says it is Qwen3), keeps vLLM's own drafting."""
    assert unserved_reason(_dspark("Qwen3DSparkModel")) is None
    why = unserved_reason(_dspark("K3DSparkModel"))
    assert why is not None and "K3DSparkModel" in why
    why = unserved_reason(_dspark())
    assert why is not None and "(none)" in why
    assert unserved_reason(SimpleNamespace(method="dspark", draft_model_config=None)) is not None
