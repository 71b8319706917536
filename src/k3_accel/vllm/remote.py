"""What both runner adapters share: target facts, the rank-0 client, the TP broadcast.

Rank 0 of the TP group owns the :class:`DraftClient`; every rank calls
:meth:`RemoteDraftSession.step` in lockstep and gets the same drafts.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from k3_accel.config import from_vllm
from k3_accel.transport.api import ClientSettings, StepInput, StepOutput

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


@dataclass(frozen=True)
class TargetFacts:
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

    def __init__(self, vllm_config: Any, device: torch.device):
        self.facts = target_facts(vllm_config)
        self.device = device
        self.group = _tp_group()
        self.client = None
        self.errors = 0
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
        ranks pass None. Never raises on the driver: an error fails the step
        closed (all -1) so every rank still reaches the broadcast.
        """
        drafts = None
        if self.client is not None and inp is not None:
            drafts = self._drive(inp, num_requests, k)
        if drafts is None:
            drafts = torch.full((num_requests, k), -1, dtype=torch.int64, device=self.device)
        if self.group.world_size > 1:
            drafts = self.group.broadcast(drafts, src=0)
        return drafts

    def _drive(self, inp: StepInput, num_requests: int, k: int) -> torch.Tensor | None:
        try:
            out: StepOutput = self.client.step(inp)
        except Exception:
            self.errors += 1
            if self.errors <= 3:
                log.exception("k3-accel: remote draft step failed; this step gets no drafts")
            return None
        if tuple(out.drafts.shape) != (num_requests, k):
            log.error("k3-accel: drafts shape %s != [%d, %d]; no drafts", list(out.drafts.shape), num_requests, k)
            return None
        return out.drafts.to(self.device, non_blocking=True)

    def finish(self, req_ids: Iterable[str]) -> None:
        if self.client is not None:
            self.client.finish(list(req_ids))

    def stats(self) -> dict:
        return self.client.stats() if self.client is not None else {}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
