"""DSpark checkpoint rules written from ``dspark_weights`` / ``dspark_engine``: the confidence head
exists when the config enables it *and* both its tensors are there (as in vLLM); half a head is a
broken checkpoint, refused; the engine (and so its hello) advertises confidence only with the head."""
from __future__ import annotations

import pytest
from safetensors.torch import load_file, save_file

from k3_accel.server.engines.dflash import DSparkEngine
from k3_accel.server.engines.dflash.config import CheckpointError
from k3_accel.server.engines.dflash.dspark_weights import CONFIDENCE_B, CONFIDENCE_W, load_dspark
from k3_accel.testing.tiny import write_tiny_target
from k3_accel.testing.tiny_dspark import write_tiny_dspark


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_target(tmp_path_factory.mktemp("dspark_rules") / "target")


def _draft(tmp_path, target, name: str, drop: tuple[str, ...] = (), **options):
    d = write_tiny_dspark(tmp_path / name, target, **options)
    files = sorted(d.glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(str(files[0]))
    for key in drop:
        tensors.pop(key)
    save_file(tensors, str(files[0]))
    return d


@pytest.mark.parametrize("missing", [CONFIDENCE_W, CONFIDENCE_B])
def test_half_a_confidence_head_is_refused(tmp_path, target, missing):
    d = _draft(tmp_path, target, "half", drop=(missing,), confidence=True)
    with pytest.raises(CheckpointError, match="only one of"):
        load_dspark(d, target)
    with pytest.raises(CheckpointError):
        DSparkEngine(str(d), str(target), budget_bytes=1 << 22)


def test_confidence_is_advertised_only_with_the_head(tmp_path, target):
    with_head = DSparkEngine(str(_draft(tmp_path, target, "head", confidence=True)), str(target),
                             budget_bytes=1 << 22)
    assert with_head.caps.confidence is True and with_head.heads.confidence_w is not None
    # the config enables the head but the checkpoint has none of it: no head (vLLM's rule), none claimed
    absent = DSparkEngine(str(_draft(tmp_path, target, "absent", drop=(CONFIDENCE_W, CONFIDENCE_B),
                                     confidence=True)), str(target), budget_bytes=1 << 22)
    assert absent.heads.confidence_w is None and absent.caps.confidence is False
    off = DSparkEngine(str(_draft(tmp_path, target, "off", confidence=False)), str(target), budget_bytes=1 << 22)
    assert off.caps.confidence is False


@pytest.mark.vllm
@pytest.mark.vllm033
@pytest.mark.parametrize("cfg", [
    {"eagle_aux_hidden_state_layer_ids": [2, 5, 9]},                  # capture indices: layer id + 1
    {"dflash_config": {"target_layer_ids": [1, 4, 8]}},
    {"dspark_target_layer_ids": [0, 3]},
    {"target_layer_ids": [6]},
    {"eagle_aux_hidden_state_layer_ids": [3], "dspark_target_layer_ids": [7]},   # the first key wins
])
def test_dspark_layer_ids_are_the_ones_vllm_captures(cfg):
    """The server asks for the target layers vLLM's target captures for this draft config
    (vLLM's capture index = layer id + 1, whichever key the checkpoint uses)."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    from k3_accel.server.engines.dflash.dspark_config import layer_ids
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="qwen3", **cfg)))
    assert layer_ids(cfg) == [i - 1 for i in get_eagle3_aux_layers_from_config(spec)]


def test_the_tiny_dspark_markov_head_moves_the_drafts(tmp_path):
    """The tiny DSpark checkpoint every DSpark test runs on has a Markov head that matters: with it
    the drafts differ from the same backbone's without it (else the Markov tests would be vacuous)."""
    import torch

    from dflash_support import Mirror, random_rows
    target = write_tiny_target(tmp_path / "target")
    drafts = {}
    for std in (1.0, 0.0):
        ckpt = write_tiny_dspark(tmp_path / f"draft{std}", target, markov_std=std, confidence=False)
        m = Mirror(DSparkEngine(str(ckpt), str(target), budget_bytes=1 << 22))
        gen = torch.Generator().manual_seed(3)
        states = [m.new() for _ in range(6)]
        m.ingest([(s, 0, random_rows(gen, 12)) for s in states])
        drafts[std] = m.propose(states, [int(a) for a in torch.randint(0, 100, (6,), generator=gen)], 4,
                                logits="none").tokens
    assert not torch.equal(drafts[1.0], drafts[0.0])


def test_the_draft_topk_is_bounded_by_the_draft_vocabulary_not_the_target_one(tmp_path, target):
    """``dspark_draft_topk`` picks among the draft's own logits: with a 64-token draft vocabulary
    (512 in the target) a top-64 loads and a top-65 is refused, naming the field and the bound."""
    from k3_accel.server.engines.dflash.dspark_config import parse_dspark_config
    from k3_accel.testing.tiny_dspark import tiny_dspark_weights

    _, cfg = tiny_dspark_weights(target, draft_vocab_size=64, draft_topk=64)
    assert (cfg["vocab_size"], cfg["draft_vocab_size"]) == (512, 64)
    assert parse_dspark_config(cfg).draft_topk == 64
    with pytest.raises(CheckpointError, match=r"dspark_draft_topk' \(65\) must be <= the draft vocabulary \(64\)"):
        parse_dspark_config({**cfg, "dspark_draft_topk": 65})


@pytest.mark.vllm
@pytest.mark.vllm033
def test_a_missing_rope_theta_is_read_as_vllm_reads_it(tmp_path, target):
    """A DSpark config without ``rope_theta``: the server's theta is the one vLLM 0.33's own config
    loader gives the draft (``get_config``, then the draft layer's ``set_default_rope_theta``)."""
    import json

    from vllm.transformers_utils.config import get_config, set_default_rope_theta

    from k3_accel.server.engines.dflash.dspark_config import read_dspark_config
    d = write_tiny_dspark(tmp_path / "no_theta", target)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["rope_theta"]
    (d / "config.json").write_text(json.dumps(cfg))
    hf = get_config(str(d), trust_remote_code=False)
    set_default_rope_theta(hf, default_theta=1000000)
    assert read_dspark_config(str(d)).rope_theta == hf.rope_parameters["rope_theta"]


@pytest.mark.parametrize("top", [True, False])
def test_a_nested_sample_from_anchor_is_judged_as_vllm_judges_it(target, top):
    """vLLM 0.33's DSpark speculator runs DFlash's check first: ``dflash_config.sample_from_anchor``
    true is refused, false is accepted, and the layout is the top-level field's either way."""
    from k3_accel.server.engines.dflash.dspark_config import parse_dspark_config
    from k3_accel.testing.tiny_dspark import tiny_dspark_weights

    _, cfg = tiny_dspark_weights(target, sample_from_anchor=top)
    nested = {**cfg, "dflash_config": {**(cfg.get("dflash_config") or {}), "sample_from_anchor": False}}
    assert parse_dspark_config(nested).sample_from_anchor is top
    nested["dflash_config"]["sample_from_anchor"] = True
    with pytest.raises(CheckpointError, match="sample_from_anchor"):
        parse_dspark_config(nested)
