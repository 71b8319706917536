"""vLLM-side rules the module mutants found unguarded (issue 25): the host fence's release, and that
without a draft address vLLM's engine arguments stay exactly stock."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from helpers.server import SRC
from k3_accel.vllm.spec_decode.fence import HostFence, make_fence

ADDRESS_ENV = "VLLM_K3_DRAFT_REMOTE_ADDRESS"


def test_a_closed_fence_releases_every_wait_now_and_later():
    fence = make_fence(torch.device("cpu"))
    assert isinstance(fence, HostFence)
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(fence.wait(7, timeout=20)))
    waiter.start()
    fence.signal(3)                          # an older step's signal does not release step 7
    assert not fence.wait(7, timeout=0)
    fence.close()                            # the draft thread is gone: nothing may wait on it any more
    waiter.join()
    assert result == [True]
    assert fence.wait(10 ** 9, timeout=0)    # and every later wait passes at once


def test_a_late_older_signal_never_takes_a_step_back():
    fence = HostFence()
    fence.signal(5)
    fence.signal(2)
    assert fence.wait(5, timeout=0) and not fence.wait(6, timeout=0)


@pytest.mark.vllm
@pytest.mark.parametrize("extra,spec_extra,expected", [
    (None, {}, None),                                                        # no address: stock
    ({"k3_accel": {"draft_address": "tcp://127.0.0.1:5557"}}, {}, 1),        # remote: the draft's TP is moot
    ({"k3_accel": {"draft_address": "tcp://127.0.0.1:5557"}}, {"draft_tensor_parallel_size": 2}, 2),
])
def test_draft_tp_is_set_only_for_a_remote_draft_the_user_left_unset(monkeypatch, tmp_path, extra, spec_extra,
                                                                     expected):
    from vllm.engine.arg_utils import EngineArgs

    from k3_accel.vllm.spec_decode.hooks import _wrap_create_spec
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    seen: list[dict] = []
    create = _wrap_create_spec(lambda self, *a, **k: seen.append(dict(self.speculative_config)))
    # existing directories: with HF_HUB_OFFLINE (set by other tests' imports) vLLM resolves the paths
    target, draft = tmp_path / "target", tmp_path / "draft"
    target.mkdir(), draft.mkdir()
    spec = {"method": "dflash", "model": str(draft), "num_speculative_tokens": 4, **spec_extra}
    args = EngineArgs(model=str(target), speculative_config=dict(spec), additional_config=extra or {})
    create(args)
    assert seen[-1].get("draft_tensor_parallel_size") == expected
    assert {k: v for k, v in seen[-1].items() if k != "draft_tensor_parallel_size"} == \
        {k: v for k, v in spec.items() if k != "draft_tensor_parallel_size"}


@pytest.mark.vllm
@pytest.mark.parametrize("spec", [
    {"method": "dflash", "architectures": ["DFlash2DraftModel"]},     # DFlash2: vLLM drafts it
    {"method": "dflash", "architectures": ["LagunaForCausalLM"]},     # vLLM's DFlashLagunaForCausalLM
    {"method": "dspark", "architectures": ["Gemma4DSparkModel"]},     # not a Qwen3 DSpark draft
    {"method": "dspark"},                                             # DeepSeek's, in the target checkpoint
])
def test_draft_tp_stays_stock_for_a_draft_that_stays_local(monkeypatch, tmp_path, spec):
    """A draft the server does not draft keeps vLLM's own drafting, draft TP included: with an address
    set, a DFlash2 draft (or a non-Qwen3 DSpark draft) must still run at the TP vLLM gives it."""
    from vllm.engine.arg_utils import EngineArgs

    from k3_accel.vllm.spec_decode.hooks import _wrap_create_spec
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    seen: list[dict] = []
    create = _wrap_create_spec(lambda self, *a, **k: seen.append(dict(self.speculative_config)))
    target = tmp_path / "target"
    target.mkdir()
    cfg = {"method": spec["method"], "num_speculative_tokens": 4}
    if "architectures" in spec:
        draft = tmp_path / "draft"
        draft.mkdir()
        (draft / "config.json").write_text(json.dumps({"architectures": spec["architectures"],
                                                       "model_type": "qwen3"}))
        cfg["model"] = str(draft)
    args = EngineArgs(model=str(target), speculative_config=dict(cfg),
                      additional_config={"k3_accel": {"draft_address": "tcp://127.0.0.1:5557"}})
    create(args)
    assert seen[-1] == cfg


@pytest.mark.vllm
def test_register_reports_a_hook_that_does_not_apply_here_as_off():
    """The DMA communicator applies only on a CUDA platform: register() says off where it is not,
    and on (with every other hook) where it is, in a fresh process like vLLM's."""
    code = ("import json, vllm, k3_accel.plugin as kp\n"
            "from vllm.platforms import current_platform\n"
            "print(json.dumps({'on': kp.register(), 'cuda': bool(current_platform.is_cuda())}))")
    env = {**os.environ, "PYTHONPATH": SRC, "VLLM_TARGET_DEVICE": "cpu"}
    env.pop(ADDRESS_ENV, None)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["on"]["communicator"] is result["cuda"]
    assert result["on"]["custom_op"] is True and result["on"]["proposer_v1"] is True


@pytest.mark.vllm
def test_a_v1_step_gives_the_drafts_to_the_request_that_asked_not_to_a_skipped_one(
        vllm_config, tp_group, ngram_server, monkeypatch):
    """The V1 runners' step: a skipped request (it finishes with this step) gets no draft, and the
    drafts of the request after it land in that request's row, not in the skipped one's."""
    import numpy as np

    from helpers.oracles import ngram_lookup
    from helpers.steps import step as rows
    from k3_accel.vllm.spec_decode.core import RemoteDrafter
    monkeypatch.setenv(ADDRESS_ENV, ngram_server.address)
    monkeypatch.setenv("VLLM_K3_DRAFT_ADAPTIVE", "off")
    k, history = 4, [1, 2, 1, 2, 1]
    want = ngram_lookup([*history, 2], k)
    drafter = RemoteDrafter()
    drafter.open(vllm_config, "cpu")
    kept: list[list[int]] = []
    try:
        for n in range(300):                      # the client connects on its own thread: step until it drafts
            rid = f"a{n}"

            def build(keep, fresh, rid=rid):
                kept.append(keep.tolist())
                return rows([rid], [(0, history)], anchors=[2], k=k)
            out = drafter.step(["done", rid, "also-done"], skip=np.array([True, False, True]), k=k, build=build)
            if (out[1] >= 0).any():
                break
        assert kept[-1] == [1]
        assert out[0].tolist() == [-1] * k and out[2].tolist() == [-1] * k
        assert out[1].tolist() == want + [-1] * (k - len(want)) and want
    finally:
        drafter.close()
