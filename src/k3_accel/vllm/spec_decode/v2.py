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

``num_speculative_tokens=0`` (the scheduler's ``skip_drafts``, or the adaptive controller's
scheduler gate, :mod:`.gate`) still ships context; fewer than K: the server still drafts the
whole block, as in-tree DFlash does (a K of its own is another block, and new CUDA graphs on
the server mid-run). Dummy and profile runs, and the steps of vLLM's kernel warm-up (request
ids ``_warmup_*`` / ``_v2_mixed_warmup_*``), return without touching the network or the TP
group. "No draft" leaves this module as the request's last sampled token, not -1: the V2
runner feeds drafts to the target's embedding unchecked, and -1 there is a CUDA index assert.
Importing this module is cheap: vLLM's ``BaseSpeculator`` module is imported when the first
remote speculator is built.
"""
from __future__ import annotations

import functools
import logging
import time
import weakref
from typing import Any, Sequence

import numpy as np
import torch

from k3_accel.vllm.compat import require
from k3_accel.vllm.spec_decode import confidence
from k3_accel.vllm.spec_decode.core import RemoteDrafter, finishes_after_prefill
from k3_accel.vllm.spec_decode.session import every_rank
from k3_accel.vllm.spec_decode.v2_held import HeldFacts, HeldSteps
from k3_accel.vllm.spec_decode.v2_launch import DeviceRows, LaunchSlots, launch, samples_host, step_rows

log = logging.getLogger("k3_accel.vllm")

SPECULATOR_MODULE = "vllm.v1.worker.gpu.spec_decode.speculator"


# ============================================================ V2 batch -> core
WARMUP_PREFIXES = ("_warmup_", "_v2_mixed_warmup")   # vLLM's warm-up steps (v1/worker/gpu/warmup.py)
LAUNCH_DEPTH = 2                                      # pinned launch slots (the draft thread's lag)


def _by_slot(t: torch.Tensor) -> torch.Tensor:
    """``last_sampled`` is ``[max_num_reqs, 1]`` in 0.33: read it flat like vLLM's kernels do."""
    return t.reshape(-1) if t.dim() > 1 and t.shape[-1] == 1 else t


def is_warmup(req_ids: Sequence[str]) -> bool:
    """A step of vLLM's kernel warm-up (real steps of synthetic requests): nothing goes remote."""
    return bool(req_ids) and all(rid.startswith(WARMUP_PREFIXES) for rid in req_ids)


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


def history_rows(input_batch: Any, keep: np.ndarray, wanted: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Request id -> (batch index, tokens to copy) for the kept requests in ``wanted`` whose
    context does not start at 0 (prefix-cache hit, resumed request, drafting again); the
    count is the host's (upper-bound) number of computed tokens."""
    computed = getattr(input_batch, "num_computed_tokens_np", None)
    if computed is None or not wanted:
        return {}
    wanted = set(wanted)
    return {input_batch.req_ids[i]: (i, int(computed[i])) for i in keep.tolist()
            if input_batch.req_ids[i] in wanted and int(computed[i]) > 0}


def fill_missing(cols: torch.Tensor, input_batch: Any, last_sampled: torch.Tensor, vocab_size: int = 0) -> None:
    """Replace -1 (no draft), and any id outside the target's vocabulary, by the request's
    last sampled token, like vLLM's ``NgramGPUSpeculator``.

    The V2 runner copies these drafts into the next step's ``input_ids``
    unchecked (``_combine_sampled_and_draft_tokens_kernel``; with async
    scheduling every decode request gets K draft slots whatever we return),
    and an id of -1 trips CUDA's index assert in the embedding (seen on an
    H200). A real id there is verified like any draft, so the output is
    unchanged; with adaptive verification on, such a position's confidence
    is 0 and it is not verified at all.
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
    # None: the rejection sampler treats drafts as point masses, which is exact whatever
    # the drafts and the target's temperature (no draft logits cross the wire).
    draft_logits = None
    # -1 ("no draft") must not reach the runner: see fill_missing
    fill_missing_drafts = True

    def __init__(self, vllm_config: Any, device: torch.device | str, req_states: Any = None):
        spec = vllm_config.speculative_config
        self.vllm_config = vllm_config
        self.device = torch.device(device)
        self.req_states = req_states
        self.num_speculative_steps = k = int(spec.num_speculative_tokens)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.max_num_reqs = int(vllm_config.scheduler_config.max_num_seqs)
        # adaptive verification (opt-in in vLLM's speculative config) sizes verification from
        # these: 1 where a draft came, 0 where none did (so a request without drafts costs a plain decode)
        self.enable_adaptive_verification = bool(getattr(spec, "enable_adaptive_verification", False))
        self._confidence = torch.zeros((self.max_num_reqs, k), dtype=torch.float32, device=self.device)
        self.draft_token_confidence_probs = self._confidence
        # the reply's confidence (a DSpark server's, or the controller's; -1 = none) for adaptive verification
        self._server_confidence = (torch.full((self.max_num_reqs, k), confidence.NONE, device=self.device)
                                   if confidence.wanted(spec) else None)
        self.drafts = torch.full((self.max_num_reqs, k), -1, dtype=torch.int64, device=self.device)
        self.pcp_manager = None
        self.core = RemoteDrafter(self.device)
        self.rows = self.slots = self.hold = None
        self.disabled: str | None = None
        try:
            self.core.open(vllm_config, self.device, ring=self.device.type == "cuda")
            session = self.core.session
            if session.is_driver:      # every device buffer now, at its final size (vLLM profiles after)
                f = session.facts
                self.rows = DeviceRows(f.max_rows, f.context_width, f.hidden_dtype, self.max_num_reqs, self.device)
                self.slots = LaunchSlots(LAUNCH_DEPTH, f.max_rows, f.context_width, f.hidden_dtype,
                                         self.max_num_reqs, pin=self.device.type == "cuda")
                if session.pipeline.controller is not None:      # off steps are held from the launch on
                    self.hold = HeldSteps.sized(f.max_rows, f.context_width, f.hidden_dtype, self.max_num_reqs,
                                                pin=self.device.type == "cuda")
                    self.core.on_free = self.hold.drop
        except Exception as exc:  # noqa: BLE001 - a hook must never take vLLM down
            self.disabled = f"{type(exc).__name__}: {exc}"
        if not every_rank(self.disabled is None) and self.disabled is None:   # on every rank or none: one
            self.disabled = "another TP rank could not start it"       # alone would wait in the broadcast
        if self.disabled is not None:
            log.error("k3-accel: remote drafting is OFF for this engine (%s); the target runs without drafts",
                      self.disabled)
            self.core.close()
        self._finalizer = weakref.finalize(self, self.core.close)
        # draft_sample_method "probabilistic": the runner's per-request temperatures and seeds go
        # with each propose and a server that offers sampling (DSpark) draws as vLLM does in-tree
        self.sample_drafts = getattr(spec, "draft_sample_method", "greedy") == "probabilistic"
        self._sampling: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.sample_drafts:
            log.info("k3-accel: draft_sample_method=probabilistic: a DSpark server samples the drafts with "
                     "each request's temperature and seed as vLLM does in-tree (others draft greedily); they "
                     "are verified as point masses (exact; no draft logits cross the wire, so acceptance is "
                     "lower than in-tree, and usually than greedy drafts)")

    # ------------------------------------------------------- runner hooks
    def init_cudagraph_manager(self, cudagraph_mode: Any) -> None:
        del cudagraph_mode

    def capture(self) -> None:
        """vLLM's graph capture, before serving: with adaptive verification, its slot ranking is
        compiled now rather than inside the first step whose budget binds (:func:`.confidence.warm_budget`)."""
        if self.enable_adaptive_verification and self.disabled is None:
            try:
                confidence.warm_budget(self.device, self.max_num_reqs, self.num_speculative_steps)
            except Exception as exc:  # noqa: BLE001 - a warm-up; the runner compiles it when needed
                log.warning("k3-accel: could not compile vLLM's adaptive-verification ranking ahead of "
                            "serving (%s: %s); the first step whose budget binds compiles it", type(exc).__name__, exc)

    def prepare_watermarking(self, *args: Any, **kwargs: Any) -> None:
        return None

    @torch.inference_mode()
    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                dp_sync_state=None, dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs=None, is_profile: bool = False,
                num_speculative_tokens: int | None = None) -> torch.Tensor:
        """Drafts ``[num_reqs, num_speculative_tokens]`` int64 on the device.

        Nothing here waits for this step's GPU work or reply (``draft_priority``: only for the step
        before's drafts, :meth:`~.pipeline.DraftPipeline.yield_to_drafts`): the context is launched
        (:mod:`.v2_launch`), the draft thread (:mod:`.pipeline`) ships it, and the compute stream
        waits (:mod:`.fence`) for the reply, copied into the returned buffer. No draft: the request's
        last sampled token (:func:`fill_missing`), confidence 0; columns past this step's K are -1;
        dummy/profile runs: -1 throughout (the runner discards them).
        """
        r = int(input_batch.num_reqs)
        self._sampling = (temperature, seeds) if self.sample_drafts else None
        out = self.drafts[:r]
        out.fill_(-1)
        self._confidence[:r].zero_()
        if self._server_confidence is not None:
            self._server_confidence[:r].fill_(confidence.NONE)
        if dummy_run or is_profile:          # profiling, graph capture: never the network
            self.core.counters["dummy_runs"] += 1
            return out
        start, waited = time.perf_counter(), 0.0
        k = self.num_speculative_steps if num_speculative_tokens is None else \
            max(0, min(int(num_speculative_tokens), self.num_speculative_steps))
        req_ids = input_batch.req_ids[:r]
        if is_warmup(req_ids):               # vLLM's kernel warm-up: real steps of synthetic requests
            self.core.counters["warmup_steps"] += 1
        else:
            plan = self.core.admit(req_ids, skip_mask(input_batch, self.req_states),
                                   getattr(self.req_states, "req_id_to_index", None))
            if plan is not None and k > 0 and samples_host(input_batch, r)[plan[0]].any():
                waited = self._draft(plan, input_batch, aux_hidden_states, num_sampled, num_rejected,
                                     last_sampled, next_prefill_tokens, k, out[:, :k])
            elif plan is not None:          # K = 0 (the scheduler gate, vLLM's skip_drafts) or nobody samples:
                self._ship(plan, input_batch, aux_hidden_states, num_sampled, num_rejected, last_sampled,
                           next_prefill_tokens, 0, held=self._controlled())   # a step the controller counts as off
        if k > 0:
            confidence.fill(self._confidence[:r, :k], out[:, :k],
                            None if self._server_confidence is None else self._server_confidence[:r, :k])
            if self.fill_missing_drafts:
                fill_missing(out[:, :k], input_batch, last_sampled, self.vocab_size)
        self._host_time(time.perf_counter() - start - waited)
        return out

    def _host_time(self, seconds: float) -> None:
        """The driver's phase ``v2.propose``: the host time of this call on vLLM's step thread (what
        the plugin adds to it per step, off steps included)."""
        pipeline = getattr(self.core.session, "pipeline", None)
        telemetry = getattr(getattr(pipeline, "client", None), "telemetry", None)
        if telemetry is not None:
            telemetry.add("v2.propose", seconds)

    def _ship(self, plan, input_batch, aux, num_sampled, num_rejected, last_sampled, next_prefill_tokens,
              k: int, held: bool = False) -> int | None:
        """Driver: launch the step and hand it to the draft thread; the fence value its drafts
        will carry (None: nothing to wait for). Fails closed."""
        session = self.core.session
        if not session.is_driver:
            return None
        keep, fresh = plan
        aux = aux if session.ships_hidden else None
        prompts = history_rows(input_batch, keep, fresh)
        if held and self.hold is not None and HeldSteps.eligible(input_batch, prompts) and \
                self._hold(session, input_batch, aux, num_sampled, num_rejected, last_sampled, next_prefill_tokens,
                           keep):
            return None
        self._hand_over_held()                # what is held reaches the server before this step
        if session.link_down([input_batch.req_ids[i] for i in keep.tolist()]):
            return None
        try:
            ring = session.plane_ring()
            step = launch(self.rows, self.slots, input_batch, aux, num_sampled, num_rejected, last_sampled,
                          next_prefill_tokens, keep, k, prompts, self._token_rows(), self._slot_wait_s(session),
                          self._sampling if k > 0 else None, ring)
            if ring is not None and step.ring_slot is None and step.width:
                self.core.counters["ring_host_steps"] += 1     # the plane is on, this step's rows went pinned
            return session.pipeline.submit(step, propose=k > 0, held=held)
        except Exception:  # noqa: BLE001 - fail closed
            self.core.failures.record("step_input", "launching the step's context")
            return None

    def _hold(self, session, input_batch, aux, num_sampled, num_rejected, last_sampled, next_prefill_tokens,
              keep: np.ndarray) -> bool:
        """Hold an off step (:mod:`.v2_held`): its rows wait in pinned memory, the controller counts it.
        False: not held (the link is down, or no region has room), the caller launches it."""
        client = session.client
        if client is None or client.down:
            return False
        r, n = step_rows(input_batch, aux)
        if not self.hold.fits(n):
            self._hand_over_held()
            if not self.hold.fits(n):
                return False
        pipeline = session.pipeline
        try:
            at = pipeline.controller.clock()
            self.hold.add(self.rows, input_batch, aux, num_sampled, num_rejected, last_sampled, next_prefill_tokens,
                          keep)
            qsl = np.asarray(input_batch.query_start_loc_np, dtype=np.int64)
            pipeline.count_held(HeldFacts([input_batch.req_ids[i] for i in keep.tolist()],
                                          (qsl[keep + 1] - qsl[keep]).tolist(), samples_host(input_batch, r)[keep].tolist(),
                                          [0] * int(keep.size)), at)
            self.core.counters["held_at_launch"] += 1
        except Exception:  # noqa: BLE001 - fail closed
            self.core.failures.record("step_input", "holding an off step's rows")
        if HeldSteps.early(pipeline.controller.off_budget(), len(self.hold)):
            self._hand_over_held()            # a probe nears: its drafts wait for these rows
        return True

    def _hand_over_held(self) -> None:
        """The held steps' rows go to the draft thread (ahead of anything launched after)."""
        if self.hold is None or not len(self.hold):
            return
        try:
            held = self.hold.take(self.core.known.ids)
            self.core.session.pipeline.submit_held(held)
            self.core.counters["held_regions"] += 1
        except Exception:  # noqa: BLE001 - fail closed: the requests see a gap and stop drafting
            self.core.failures.record("step_input", "handing over the held steps")

    def _draft(self, plan, input_batch, aux, num_sampled, num_rejected, last_sampled, next_prefill_tokens,
               k: int, cols: torch.Tensor) -> float:
        """Ship the step with a propose and put the drafts into ``cols`` (every rank); the seconds the
        step thread then yielded to the draft thread (:meth:`~.pipeline.DraftPipeline.yield_to_drafts`)."""
        session = self.core.session
        held = False
        if session.is_driver and session.pipeline.behind:
            k = 0        # a step the deadline released still runs: ask for nothing the GPU would wait on,
            self.core.counters["behind_steps"] += 1     # ship the rows (every rank broadcasts)
        elif session.is_driver and session.pipeline.controller is not None and session.pipeline.controller.stays_off():
            k, held = 0, True   # speculation off, no probe due: an ingest, nothing on the GPU waits for the thread
        # the whole block whatever this step's K, as in-tree (the runner blanks the columns past it)
        seq = self._ship(plan, input_batch, aux, num_sampled, num_rejected, last_sampled, next_prefill_tokens,
                         self.num_speculative_steps if k > 0 else 0, held)
        r, width, conf = cols.shape[0], self.num_speculative_steps, self._server_confidence
        if seq is not None:     # whole K-wide rows: torch copies a column slice of the pinned reply (not
            fence, now = session.pipeline.fence, session.pipeline.fence.on_device   # dense) from the host at once
            try:
                if now:
                    fence.enqueue(seq, torch.cuda.current_stream(self.device))
                if now or fence.wait(seq, session.settings.timeout_s + session.settings.propose_timeout_s):
                    self.drafts[:r].copy_(session.pipeline.reply_rows(seq, r, width), non_blocking=now)
                    self.drafts[:r, k:].fill_(-1)                # past this step's K: no drafts
                    if conf is not None:
                        conf[:r].copy_(session.pipeline.confidence_rows(seq, r, width), non_blocking=now)
                        conf[:r, k:].fill_(confidence.NONE)
            except Exception:  # noqa: BLE001 - fail closed: no drafts, and every rank still broadcasts
                self.drafts[:r].fill_(-1)
                if conf is not None:
                    conf[:r].fill_(confidence.NONE)
                self.core.failures.record("step", "waiting for the step's drafts")
        conf = None if conf is None else conf[:r, :cols.shape[1]]    # every rank's K: the driver's k may be 0
        session.broadcast(cols)
        if conf is not None:
            session.broadcast(conf)
        return 0.0 if seq is None else session.pipeline.yield_to_drafts(seq)   # all of this step is queued now

    def _controlled(self) -> bool:
        session = self.core.session
        return bool(session is not None and session.is_driver and session.pipeline.controller is not None)

    @staticmethod
    def _slot_wait_s(session) -> float:
        """How long the step thread may wait for a launch slot once the GPU reached the step holding
        it: the GPU deadline (:class:`~.v2_launch.LaunchSlots`), never the transport's timeout; past
        it the step's requests fail closed rather than the engine waiting for a server that paused."""
        deadline = session.pipeline.deadline_s
        return session.settings.timeout_s if deadline is None else deadline

    def _token_rows(self) -> torch.Tensor | None:
        """vLLM's ``all_token_ids`` by slot (UVA or device): the history of requests to attach."""
        return getattr(getattr(self.req_states, "all_token_ids", None), "gpu", None)

    # ------------------------------------------------------------- public
    def stats(self) -> dict[str, Any]:
        out = self.core.stats()
        if self.slots is not None:       # steps launched while both fixed slots were held (vLLM's host ahead)
            out["adapter"]["spill_slots"] = self.slots.spills
        return out

    def flush(self) -> None:
        """Wait until every step handed to the draft thread is on the server (tests, shutdown)."""
        if self.core.session is not None:
            self._hand_over_held()
            self.core.session.flush()

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


__all__ = ["RemoteSpeculatorMixin", "create_speculator", "fill_missing", "history_rows", "is_warmup",
           "skip_mask", "speculator_class"]
