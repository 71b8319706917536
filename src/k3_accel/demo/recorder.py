"""Recording every draft a V1 DFlash drafter makes (the peer oracle's evidence).

Wraps ``DFlashProposer.propose`` (vLLM's in-tree drafter) and
``RemoteDFlashProposer.propose`` at class level, in this process only, for
the runs that ask for it. Per request (keyed by its prompt token ids) it keeps
the drafts of every step in which the request sampled a token and can use
drafts (``max_tokens > 1``), in step order.
"""
from __future__ import annotations

from typing import Any

_state: dict[str, Any] = {"run": None, "drafts": {}, "calls": {}, "call": 0, "runner": None, "installed": False}


def start(run: str) -> None:
    _install()
    _state.update(run=run, drafts={}, calls={}, call=0)


def stop() -> tuple[dict[str, list[list[int]]], dict[str, list[int]]]:
    """The drafts recorded per request (prompt key), and the index of the drafter call that made
    each (a request absent from some calls between two of its own was preempted)."""
    drafts, calls = _state["drafts"], _state["calls"]
    _state.update(drafts={}, calls={}, run=None)
    return drafts, calls


def _install() -> None:
    if _state["installed"]:
        return
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from k3_accel.vllm.spec_decode.v1 import RemoteDFlashProposer

    _wrap_runner(GPUModelRunner)
    for cls in (DFlashProposer, RemoteDFlashProposer):
        _wrap_propose(cls)
    _state["installed"] = True


def _wrap_runner(cls: type) -> None:
    original = cls.propose_draft_token_ids

    def propose_draft_token_ids(self, *args, **kwargs):
        _state["runner"] = self
        return original(self, *args, **kwargs)

    cls.propose_draft_token_ids = propose_draft_token_ids


def _wrap_propose(cls: type) -> None:
    original = cls.propose

    def propose(self, *args, **kwargs):
        drafts = original(self, *args, **kwargs)
        if _state["run"] is not None and _state["runner"] is not None:
            _record(_state["runner"], drafts)
        return drafts

    cls.propose = propose


def _record(runner: Any, drafts: Any) -> None:
    _state["call"] += 1
    n = runner.input_batch.num_reqs
    discard = runner.discard_request_mask.np[:n]
    rows = drafts.tolist()
    for i, rid in enumerate(runner.input_batch.req_ids[:n]):
        req = runner.requests[rid]
        max_tokens = getattr(req.sampling_params, "max_tokens", None)
        if discard[i] or (max_tokens is not None and max_tokens <= 1):
            continue
        key = " ".join(map(str, req.prompt_token_ids))
        _state["drafts"].setdefault(key, []).append(rows[i])
        _state["calls"].setdefault(key, []).append(_state["call"])
