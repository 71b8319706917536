"""The DSpark engine against vLLM 0.33's in-tree DSpark (``tests/dspark_oracle.py``: vLLM's own
``Qwen3DSparkForCausalLM`` and ``DSparkSpeculator._sample_sequential``), on tiny checkpoints
written in vLLM's layout in three shapes (both layouts; with and without the confidence head;
a mapped vocabulary; the top-k Markov path), over chunked prefill, decode steps with partial
acceptance, a rewind and a reconnect: the same drafts and confidence at every step in float32,
and under the precision rule (``k3_accel.testing.precision``) in bfloat16. In process
(``test_dspark_matches_vllm_module``) and through a real draft server over its socket
(``test_dspark_drafts_match_in_tree``). Sampled drafting (``test_dspark_sampled_matches_in_tree``):
per-request temperatures and seeds, against the speculator's probabilistic path and vLLM's own
``gumbel_sample``: the same draws in float32, in process and over the socket."""
from __future__ import annotations

import pytest
import torch

from dflash_support import Mirror
from dspark_support import (SHAPES, MirrorDriver, Scenario, check_fp32, check_low_precision, checkpoints,
                            run_oracle)
from helpers.server import ServerProcess
from helpers.wire import Wire, ints
from k3_accel import protocol as p
from k3_accel.server.engines.dflash import DSparkEngine

pytestmark = [pytest.mark.vllm, pytest.mark.vllm033]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return checkpoints(tmp_path_factory.mktemp("dspark"))


def test_dspark_matches_vllm_module(ckpts, tmp_path):
    ours, jobs = {}, []
    for name, (draft, target) in ckpts.items():
        for dtype in ("float32", "bfloat16"):
            engine = DSparkEngine(str(draft), str(target), dtype=dtype, block_size=4, budget_bytes=1 << 20)
            ours[name, dtype] = Scenario(MirrorDriver(Mirror(engine)), seed=1).run().steps
        jobs.append({"name": name, "draft": draft, "target": target, "steps": ours[name, "float32"],
                     "dir": tmp_path})
    for job, theirs in zip(jobs, run_oracle(jobs)):
        name, confidence = job["name"], SHAPES[job["name"]]["confidence"]
        check_fp32(ours[name, "float32"], theirs, confidence)
        clear = 0
        for s, step in enumerate(ours[name, "bfloat16"]):
            clear += check_low_precision(step.drafts, theirs, s, torch.bfloat16)
            clear += check_low_precision(theirs[f"bfloat16/s{s}drafts"], theirs, s, torch.bfloat16)  # vLLM too
            if confidence:                    # where the bf16 prefix is the fp32 one
                same = (step.drafts == theirs[f"float32/s{s}drafts"]).long().cumprod(1).bool()
                diff = (step.confidence - theirs[f"float32/s{s}confidence"]).abs()
                assert (diff[same] < 0.05).all(), (name, s, diff)
        assert clear >= len(ours[name, "bfloat16"]) * 2, (name, clear)       # not vacuous


def test_dspark_sampled_matches_in_tree(ckpts, tmp_path):
    jobs, ours, greedy = [], {}, {}
    for name, (draft, target) in ckpts.items():
        engine = DSparkEngine(str(draft), str(target), dtype="float32", block_size=4, budget_bytes=1 << 20)
        ours[name] = Scenario(MirrorDriver(Mirror(engine)), seed=3, sampled=True).run().steps
        greedy[name] = Scenario(MirrorDriver(Mirror(engine)), seed=3).run().steps
        jobs.append({"name": name, "draft": draft, "target": target, "steps": ours[name], "dir": tmp_path,
                     "dtypes": ["float32"]})
    for job, theirs in zip(jobs, run_oracle(jobs)):
        name = job["name"]
        check_fp32(ours[name], theirs, SHAPES[name]["confidence"])
        differ = 0
        for step, plain in zip(ours[name], greedy[name]):
            cold = torch.tensor(step.temperature) == 0
            assert torch.equal(step.drafts[cold], plain.drafts[cold])          # temperature 0 is greedy
            differ += int((step.drafts[~cold] != plain.drafts[~cold]).sum())
        assert differ > 0, name                                               # the hot requests sampled


class WireDriver:
    """The same scenario through a draft server's socket (ingest, propose, free + reconnect)."""

    def __init__(self, wire: Wire):
        self.wire, self.handles = wire, {}

    def _h(self, name):
        return self.handles.setdefault(name, len(self.handles))

    def ingest(self, items):
        hidden = torch.cat([rows for _, _, rows, _ in items])
        self.wire.ingest([(self._h(n), start, toks) for n, start, _, toks in items], hidden=hidden).raise_for_error()

    def propose(self, spans, k, temperature=None, seeds=None):
        hidden = torch.cat([s[2] for s in spans])
        sampling = {} if temperature is None else {"temperature": temperature, "seeds": seeds}
        reply = self.wire.propose(k, [(self._h(n), start, toks, anchor) for n, start, _, toks, anchor in spans],
                                  hidden=hidden, **sampling).raise_for_error()
        assert reply.failures == []
        conf = reply.tensors.get("confidence")
        return reply.tensors["drafts"].long().clone(), None if conf is None else conf.clone()

    def fork(self, src, dst, length, tokens):
        self.wire.call(p.Free([self._h(src)])).raise_for_error()
        reply = self.wire.call(p.Reconnect(self._h(dst), length), ints(tokens)).raise_for_error()
        return int(reply.result["restored"])


def test_dspark_drafts_match_in_tree(ckpts, tmp_path):
    ours, jobs = {}, []
    for name, (draft, target) in ckpts.items():
        server = ServerProcess("--engine", "dspark", "--draft-model", str(draft), "--target-model", str(target),
                               "--block-size", "4", "--memory-budget-mb", "2", "--lease-s", "0",
                               "--num-speculative-tokens", "8")
        try:
            wire = Wire(server.address)
            caps = wire.caps
            assert caps.engine == "dspark" and caps.confidence == SHAPES[name]["confidence"]
            assert caps.draft["sample_from_anchor"] == SHAPES[name].get("sample_from_anchor", True)
            assert not caps.supports_logits and caps.aux_layer_ids == [0, 2] and caps.sampling
            ours[name] = Scenario(WireDriver(wire), seed=2).run().steps
            wire.call(p.Clear()).raise_for_error()
            ours[name, "sampled"] = Scenario(WireDriver(wire), seed=3, sampled=True).run().steps
            wire.call(p.Bye())
            wire.close()
        finally:
            assert server.stop() == 0
        for key in (name, (name, "sampled")):
            jobs.append({"name": "-".join(key) if isinstance(key, tuple) else key, "key": key, "draft": draft,
                         "target": target, "steps": ours[key], "dir": tmp_path, "dtypes": ["float32"]})
    for job, theirs in zip(jobs, run_oracle(jobs)):
        name = job["key"][0] if isinstance(job["key"], tuple) else job["key"]
        check_fp32(ours[job["key"]], theirs, SHAPES[name]["confidence"])
