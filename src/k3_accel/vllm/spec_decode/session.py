"""The target's facts, the TP-rank-0 client and the broadcast that gives every rank the same drafts.

Rank 0 of the TP group owns the :class:`DraftClient`; every rank calls
:meth:`RemoteDraftSession.step` in lockstep and gets the same drafts. "No
draft" comes from the transport (-1, :meth:`StepOutput.empty` when a step
fails); the runner adapters convert it to what their runner needs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch

from k3_accel.config import from_vllm
from k3_accel.transport.api import ClientSettings, StepInput, StepOutput
from k3_accel.vllm.spec_decode.methods import HIDDEN_METHODS

if TYPE_CHECKING:
    from k3_accel.vllm.spec_decode.core import FailureLog

log = logging.getLogger("k3_accel.vllm")


@dataclass(frozen=True)
class TargetFacts:
    """What the client must know about the target (from vLLM's config, never from the server)."""
    method: str
    num_speculative_tokens: int
    aux_layer_ids: tuple[int, ...]     # target layers whose outputs are shipped (empty: none)
    hidden_size: int
    hidden_dtype: torch.dtype
    max_rows: int
    vocab_size: int = 0
    max_num_seqs: int = 0

    @property
    def context_width(self) -> int:
        return len(self.aux_layer_ids) * self.hidden_size


def _aux_layer_ids(spec: Any) -> tuple[int, ...]:
    if spec.method not in HIDDEN_METHODS:
        return ()
    hf = spec.draft_model_config.hf_config
    dflash = getattr(hf, "dflash_config", None) or {}
    ids = dflash.get("target_layer_ids") or getattr(hf, "target_layer_ids", None)
    if not ids:
        raise ValueError(f"draft config of {spec.model} names no dflash_config.target_layer_ids")
    return tuple(int(i) for i in ids)


def target_facts(vllm_config: Any) -> TargetFacts:
    spec = vllm_config.speculative_config
    model = vllm_config.model_config
    sched = vllm_config.scheduler_config
    return TargetFacts(method=spec.method, num_speculative_tokens=int(spec.num_speculative_tokens),
                       aux_layer_ids=_aux_layer_ids(spec), hidden_size=int(model.get_hidden_size()),
                       hidden_dtype=model.dtype, max_rows=int(sched.max_num_batched_tokens),
                       vocab_size=int(model.get_vocab_size()), max_num_seqs=int(sched.max_num_seqs))


def _client_name(vllm_config: Any) -> str:
    """``vllm-dp<rank>`` (a label for the server's logs and metrics; the session key is random)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return f"vllm-dp{int(getattr(parallel, 'data_parallel_rank', 0) or 0)}"


def _tp_group():
    from vllm.distributed.parallel_state import get_tp_group
    return get_tp_group()


class RemoteDraftSession:
    """The rank-0 client plus the broadcast that gives every TP rank the same drafts."""

    def __init__(self, vllm_config: Any, device: torch.device, failures: FailureLog):
        self.facts = target_facts(vllm_config)
        self.device = device
        self.failures = failures
        self.group = _tp_group()
        self.client = None
        if self.group.rank_in_group == 0:
            from k3_accel.transport.client import DraftClient
            f = self.facts
            settings = ClientSettings.from_config(
                from_vllm(vllm_config), max_rows=f.max_rows, context_width=f.context_width,
                hidden_dtype=f.hidden_dtype, num_speculative_tokens=f.num_speculative_tokens,
                target_vocab_size=f.vocab_size, hidden_size=f.hidden_size if f.aux_layer_ids else 0,
                aux_layer_ids=f.aux_layer_ids, max_requests=f.max_num_seqs,
                client_name=_client_name(vllm_config))
            self.client = DraftClient(settings).start()
            log.info("k3-accel: remote drafting via %s (method=%s, K=%d, context width %d)",
                     settings.address, self.facts.method, self.facts.num_speculative_tokens,
                     self.facts.context_width)

    @property
    def ships_hidden(self) -> bool:
        return self.facts.context_width > 0

    @property
    def is_driver(self) -> bool:
        """This rank owns the client (TP rank 0) and must build the step input."""
        return self.client is not None

    def step(self, inp: StepInput | None, num_requests: int, k: int) -> torch.Tensor:
        """Drafts ``[num_requests, k]`` int64 on ``self.device``, identical on every rank.

        The driver passes the step's input (None: no drafts this step); other
        ranks pass None. Never raises on the driver for a client error: the
        step fails closed (no drafts) so every rank still reaches the broadcast.
        """
        drafts = None
        if self.client is not None and inp is not None:
            drafts = self._drive(inp, num_requests, k)
        if drafts is None:
            drafts = StepOutput.empty(num_requests, k).drafts.to(self.device)
        if self.group.world_size > 1:
            drafts = self.group.broadcast(drafts, src=0)
        return drafts

    def _drive(self, inp: StepInput, num_requests: int, k: int) -> torch.Tensor | None:
        try:
            out: StepOutput = self.client.step(inp)
            if tuple(out.drafts.shape) != (num_requests, k):
                raise ValueError(f"drafts shape {list(out.drafts.shape)} != [{num_requests}, {k}]")
            return out.drafts.to(self.device, non_blocking=True)
        except Exception:  # noqa: BLE001 - fail closed; the transport disabled what it had to
            self.failures.record("step", "the remote draft step")
            return None

    def finish(self, req_ids: Iterable[str]) -> None:
        if self.client is not None:
            self.client.finish(list(req_ids))

    def stats(self) -> dict:
        return self.client.stats() if self.client is not None else {}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
