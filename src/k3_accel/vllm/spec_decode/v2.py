"""Remote drafting on vLLM's V2 GPU model runner (the default runner on GPU in 0.33).

``RemoteSpeculatorV2`` (what the hooked ``init_speculator`` returns, see
:mod:`.hooks`) is a ``BaseSpeculator`` with no local model, like vLLM's
``NgramGPUSpeculator``: no draft weights, no draft KV cache, no-op CUDA-graph
hooks. ``propose(...)`` translates the runner's arguments for the
:class:`~.core.RemoteDrafter` and its drafts back:

* ``input_batch``: request ``i``'s rows are ``query_start_loc_np[i] ..
  query_start_loc_np[i+1]`` of ``positions`` / ``input_ids`` and of every aux
  hidden-state tensor; ``idx_mapping`` maps batch index -> request-state slot.
* ``num_sampled`` / ``num_rejected``: ``[num_reqs]``; the last ``num_rejected[i]``
  rows of a verify block are rejected drafts, not context.
* ``last_sampled``: ``[max_num_reqs, 1]`` (or ``[max_num_reqs]``) by slot;
  ``next_prefill_tokens``: ``[num_prefill_lookahead, max_num_reqs]`` by slot
  (row 0 is the next prompt token). The anchor is the last sampled token when
  the request sampled, else the next prompt token (vLLM's DFlash kernel rule).
* The skip rule reads ``max_tokens`` from ``RequestState`` (``max_seq_len -
  prompt_len``); vLLM dropping a request from ``req_id_to_index`` frees it.

``num_speculative_tokens=0`` (the scheduler's ``skip_drafts``) still ships
context. Dummy and profile runs return -1 without touching the network or the
TP group. "No draft" leaves this module as the request's last sampled token,
not -1: the V2 runner feeds drafts to the target's embedding unchecked, and -1
there is a CUDA index assert.

Importing this module is cheap: vLLM's ``BaseSpeculator`` module (which pulls
in attention and model-loader code) is imported when the first remote
speculator is built.
"""
from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch

from k3_accel.vllm.compat import require
from k3_accel.vllm.spec_decode.core import RemoteDrafter, finishes_after_prefill
from k3_accel.vllm.spec_decode.rows import BatchRows, gather_step

log = logging.getLogger("k3_accel.vllm")

SPECULATOR_MODULE = "vllm.v1.worker.gpu.spec_decode.speculator"


# ============================================================ V2 batch -> core
def _by_slot(t: torch.Tensor) -> torch.Tensor:
    """``last_sampled`` is ``[max_num_reqs, 1]`` in 0.33: read it flat like vLLM's kernels do."""
    return t.reshape(-1) if t.dim() > 1 and t.shape[-1] == 1 else t


def batch_rows(input_batch: Any, num_sampled: torch.Tensor, num_rejected: torch.Tensor) -> BatchRows:
    """Per-request row counts; one small device->host copy (sampled, rejected)."""
    r = int(input_batch.num_reqs)
    host = torch.stack([num_sampled[:r].to(torch.int64), num_rejected[:r].to(torch.int64)]).cpu().numpy()
    return BatchRows.from_counts(input_batch.req_ids[:r], input_batch.query_start_loc_np, host[1], host[0] > 0)


def skip_mask(input_batch: Any, req_states: Any) -> np.ndarray:
    """``[R]`` bool: :func:`~.core.finishes_after_prefill` over vLLM's host-side request state
    (``max_seq_len`` = prompt_len + max_tokens); all False when that state is not available."""
    r = int(input_batch.num_reqs)
    max_seq_len = getattr(req_states, "max_seq_len", None)
    prompt_len = getattr(getattr(req_states, "prompt_len", None), "np", None)
    if max_seq_len is None or prompt_len is None:
        return np.zeros(r, dtype=bool)
    slots = np.asarray(input_batch.idx_mapping_np[:r], dtype=np.int64)
    return finishes_after_prefill(np.asarray(max_seq_len)[slots].astype(np.int64)
                                  - np.asarray(prompt_len)[slots].astype(np.int64))


def build_step_input(input_batch: Any, aux_hidden_states: Sequence[torch.Tensor] | None, rows: BatchRows,
                     keep: np.ndarray, last_sampled: torch.Tensor, next_prefill_tokens: torch.Tensor, k: int, *,
                     ship_hidden: bool = True, prompt_of: Callable[[int], torch.Tensor | None] | None = None,
                     fresh: Sequence[str] = ()) -> Any:
    """The ``StepInput`` of the kept requests (``keep``: batch indices, ascending).

    ``prompt_of(i)`` gives batch request ``i``'s known tokens; it is asked only for
    requests in ``fresh`` (seen for the first time) whose context does not start
    at 0 (prefix-cache hit, resumed request), so the transport can reconnect them.
    """
    keep = np.asarray(keep, dtype=np.int64)
    device = input_batch.positions.device
    slots = input_batch.idx_mapping[: int(input_batch.num_reqs)].index_select(
        0, torch.from_numpy(keep).to(device, non_blocking=True))
    sampled = rows.sampled[keep]
    last = _by_slot(last_sampled)
    next_prompt = next_prefill_tokens[0] if next_prefill_tokens.dim() > 1 else next_prefill_tokens
    if sampled.all():
        anchors = last.index_select(0, slots).to(torch.int64)
    elif not sampled.any():
        anchors = next_prompt.index_select(0, slots).to(torch.int64)
    else:
        anchors = torch.where(torch.from_numpy(sampled).to(device, non_blocking=True),
                              last.index_select(0, slots).to(torch.int64),
                              next_prompt.index_select(0, slots).to(torch.int64))
    prompts = {}
    computed = getattr(input_batch, "num_computed_tokens_np", None)
    if prompt_of is not None and fresh and computed is not None:
        fresh = set(fresh)
        for i in keep.tolist():
            rid = input_batch.req_ids[i]
            if int(computed[i]) > 0 and rid in fresh:
                prompt = prompt_of(i)
                if prompt is not None:
                    prompts[rid] = prompt
    return gather_step(rows, keep, positions=input_batch.positions, token_ids=input_batch.input_ids,
                       hidden=aux_hidden_states if ship_hidden else None, anchor_tokens=anchors, k=k,
                       prompts=prompts)


def fill_missing(cols: torch.Tensor, input_batch: Any, last_sampled: torch.Tensor, vocab_size: int = 0) -> None:
    """Replace -1 (no draft), and any id outside the target's vocabulary, by the request's
    last sampled token, like vLLM's ``NgramGPUSpeculator``.

    The V2 runner copies these drafts into the next step's ``input_ids``
    unchecked (``_combine_sampled_and_draft_tokens_kernel``; with async
    scheduling every decode request gets K draft slots whatever we return),
    and an id of -1 trips CUDA's index assert in the embedding (seen on an
    H200). A real id there is verified like any draft, so the output is
    unchanged; the slots are computed either way.
    """
    slots = input_batch.idx_mapping[: cols.shape[0]]
    filler = _by_slot(last_sampled).index_select(0, slots).to(torch.int64).clamp_min_(0).unsqueeze(1)
    missing = (cols < 0) | (cols >= vocab_size) if vocab_size > 0 else cols < 0
    cols.copy_(torch.where(missing, filler, cols))


# ============================================================= the speculator
class RemoteSpeculatorMixin:
    """Everything of ``RemoteSpeculatorV2`` except the ``BaseSpeculator`` base."""

    # what the V2 runner reads off its speculator
    supports_mm_inputs = False
    num_query_per_req = 1
    num_extra_query_per_req = 0
    enable_adaptive_verification = False
    draft_token_confidence_probs = None
    # None: the rejection sampler treats drafts as point masses, which is exact
    # for the server's greedy drafts whatever the target's temperature.
    draft_logits = None
    # -1 ("no draft") must not reach the runner: see fill_missing
    fill_missing_drafts = True

    def __init__(self, vllm_config: Any, device: torch.device | str, req_states: Any = None):
        spec = vllm_config.speculative_config
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        self.req_states = req_states
        self.num_speculative_steps = int(spec.num_speculative_tokens)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.max_num_reqs = int(vllm_config.scheduler_config.max_num_seqs)
        self.drafts = torch.full((self.max_num_reqs, self.num_speculative_steps), -1,
                                 dtype=torch.int64, device=self.device)
        self.pcp_manager = None
        self.core = RemoteDrafter(self.device)
        self.core.open(vllm_config, self.device)
        self._finalizer = weakref.finalize(self, self.core.close)
        method = getattr(spec, "draft_sample_method", "greedy")
        if method != "greedy":
            log.info("k3-accel: draft_sample_method=%s: the draft server drafts greedily, so drafts are "
                     "verified as point masses (exact; acceptance may be lower than with draft logits)", method)

    # ------------------------------------------------------- runner hooks
    def init_cudagraph_manager(self, cudagraph_mode: Any) -> None:
        del cudagraph_mode

    def capture(self) -> None:
        return None

    def prepare_watermarking(self, *args: Any, **kwargs: Any) -> None:
        return None

    @torch.inference_mode()
    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                dp_sync_state=None, dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs=None, is_profile: bool = False,
                num_speculative_tokens: int | None = None) -> torch.Tensor:
        """Drafts ``[num_reqs, num_speculative_tokens]`` int64 on the device.

        Where the server gave no draft the column holds the request's last
        sampled token (:func:`fill_missing`); columns past this step's K are
        -1 (the runner overwrites them with -1 itself and never schedules
        them). Dummy/profile runs return -1 throughout (the runner discards them).
        """
        r = int(input_batch.num_reqs)
        out = self.drafts[:r]
        out.fill_(-1)
        if dummy_run or is_profile:          # warm-up, profiling, graph capture: never the network
            self.core.counters["dummy_runs"] += 1
            return out
        k = self.num_speculative_steps if num_speculative_tokens is None else \
            max(0, min(int(num_speculative_tokens), self.num_speculative_steps))

        def build(keep: np.ndarray, fresh: list[str]):
            return build_step_input(input_batch, aux_hidden_states,
                                    batch_rows(input_batch, num_sampled, num_rejected), keep, last_sampled,
                                    next_prefill_tokens, k, ship_hidden=self.core.ships_hidden,
                                    prompt_of=self._prompt_of(input_batch), fresh=fresh)

        live = getattr(self.req_states, "req_id_to_index", None)
        drafts = self.core.step(input_batch.req_ids[:r], skip=skip_mask(input_batch, self.req_states), k=k,
                                build=build, live=live)
        if k > 0:
            out[:, :k].copy_(drafts)
            if self.fill_missing_drafts:
                fill_missing(out[:, :k], input_batch, last_sampled, self.vocab_size)
        return out

    def _prompt_of(self, input_batch) -> Callable[[int], torch.Tensor | None] | None:
        states = self.req_states
        if states is None or not hasattr(states, "all_token_ids"):
            return None

        def prompt(i: int) -> torch.Tensor:
            slot = int(input_batch.idx_mapping_np[i])
            n = int(states.prefill_len.np[slot])
            return states.all_token_ids.gpu[slot, :n].to("cpu", torch.int64)
        return prompt

    # ------------------------------------------------------------- public
    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def close(self) -> None:
        self._finalizer()


@functools.lru_cache(maxsize=1)
def speculator_class() -> type:
    """``RemoteSpeculatorV2``: the mixin on vLLM's ``BaseSpeculator`` (imported on first use)."""
    base = require(SPECULATOR_MODULE, "BaseSpeculator")
    cls = type("RemoteSpeculatorV2", (RemoteSpeculatorMixin, base),
               {"__module__": __name__, "__doc__": RemoteSpeculatorMixin.__doc__})
    cls.__qualname__ = "RemoteSpeculatorV2"
    return cls


def create_speculator(vllm_config: Any, device: torch.device | str, req_states: Any = None):
    """Build the V2 remote speculator (what the hooked ``init_speculator`` returns)."""
    spec = vllm_config.speculative_config
    log.info("k3-accel: V2 runner drafts remotely (method=%s, num_speculative_tokens=%s)",
             spec.method, spec.num_speculative_tokens)
    return speculator_class()(vllm_config, device, req_states)


def __getattr__(name: str) -> Any:
    if name == "RemoteSpeculatorV2":
        return speculator_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RemoteSpeculatorMixin", "batch_rows", "build_step_input", "create_speculator", "fill_missing",
           "skip_mask", "speculator_class"]
