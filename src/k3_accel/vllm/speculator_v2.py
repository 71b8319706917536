"""Remote drafting on vLLM's V2 GPU model runner (the default runner on GPU in 0.33).

The V2 runner builds its speculator with
``vllm.v1.worker.gpu.spec_decode.init_speculator(vllm_config, device, req_states)``
(an if/elif chain, no registry) and ``vllm.v1.worker.gpu.model_runner``
imports that name at import time. :func:`install` wraps the function in the
``spec_decode`` package and, when ``model_runner`` is already imported, the
name there too. The wrapper returns a :class:`RemoteSpeculatorV2` only when
:func:`k3_accel.vllm.remote.remote_enabled` says so (speculation configured
and a draft server address set); otherwise it calls vLLM's function unchanged.

``RemoteSpeculatorV2`` is a ``BaseSpeculator`` with no local model (like
vLLM's ``NgramGPUSpeculator``): no draft weights, no draft KV cache, no-op
CUDA-graph hooks. Each real step it turns ``propose(...)``'s arguments into a
:class:`~k3_accel.transport.api.StepInput` (see :mod:`k3_accel.vllm.v2_inputs`)
on TP rank 0 and calls :meth:`RemoteDraftSession.step`, which runs the
client on rank 0 and broadcasts the drafts over the TP group so every rank
verifies the same tokens. ``num_speculative_tokens=0`` (the scheduler's
``skip_drafts``) still ships context. Dummy and profile runs return ``-1``
drafts without touching the network or the TP group. Any failure gives no
drafts (the target's output is unchanged). "No draft" leaves this module as
the request's last sampled token, not -1: the V2 runner feeds drafts to the
target's embedding unchecked, and -1 there is a CUDA index assert.

Requests with ``max_tokens <= 1`` are left out of every step (no ingest, no
draft): they sample once at the end of prefill and finish, so their context
would never be used. A step holding only such requests does no remote work
at all. (vLLM 0.33's scheduler already turns such a step into
``skip_drafts`` -> K=0; K=0 alone would still ship their context.)

Importing this module is cheap: vLLM's ``BaseSpeculator`` module (which pulls
in attention and model-loader code) is imported only when the first remote
speculator is built.
"""
from __future__ import annotations

import collections
import functools
import importlib.util
import logging
import sys
import weakref
from typing import Any, Callable

import numpy as np
import torch

from k3_accel.vllm.compat import MissingSymbol, require

log = logging.getLogger("k3_accel.vllm")

SPEC_DECODE = "vllm.v1.worker.gpu.spec_decode"
SPECULATOR_MODULE = SPEC_DECODE + ".speculator"
MODEL_RUNNER = "vllm.v1.worker.gpu.model_runner"
ORIGINAL_ATTR = "__k3_original__"

_MAX_LOGGED_FAILURES = 3


# ================================================================== the hook
def is_wrapped(fn: Any) -> bool:
    return getattr(fn, ORIGINAL_ATTR, None) is not None


def wants_remote(vllm_config: Any) -> bool:
    from k3_accel.vllm.remote import remote_enabled
    return remote_enabled(vllm_config)


def _wrap(original: Callable) -> Callable:
    @functools.wraps(original)
    def init_speculator(vllm_config, device, req_states, *args, **kwargs):
        if wants_remote(vllm_config):
            return create_speculator(vllm_config, device, req_states)
        return original(vllm_config, device, req_states, *args, **kwargs)

    setattr(init_speculator, ORIGINAL_ATTR, original)
    return init_speculator


def install() -> bool:
    """Wrap V2's ``init_speculator``; cheap and idempotent (no CUDA, no sockets).

    Raises :class:`MissingSymbol` when the installed vLLM has no V2
    ``spec_decode`` package, no ``init_speculator`` or no ``BaseSpeculator``
    module (then the hook stays off and V2 speculation is stock).
    """
    package = require(SPEC_DECODE)
    current = require(SPEC_DECODE, "init_speculator")
    if importlib.util.find_spec(SPECULATOR_MODULE) is None:
        raise MissingSymbol(f"{SPECULATOR_MODULE}.BaseSpeculator")
    if is_wrapped(current):
        wrapped, original = current, getattr(current, ORIGINAL_ATTR)
    else:
        original, wrapped = current, _wrap(current)
        package.init_speculator = wrapped
    _patch_runner(original, wrapped)
    return True


def _patch_runner(original: Callable, wrapped: Callable) -> None:
    runner = sys.modules.get(MODEL_RUNNER)
    if runner is None:   # imported later: ``from ... import init_speculator`` then finds the wrapper
        return
    name = getattr(runner, "init_speculator", None)
    if name is original:
        runner.init_speculator = wrapped
    elif name is not wrapped:
        log.warning("k3-accel: %s.init_speculator is not vLLM's (another plugin?); left alone, so the V2 "
                    "runner may not use remote drafting", MODEL_RUNNER)


def uninstall() -> None:
    """Put vLLM's own ``init_speculator`` back (tests)."""
    package = sys.modules.get(SPEC_DECODE)
    current = getattr(package, "init_speculator", None) if package else None
    if not is_wrapped(current):
        return
    original = getattr(current, ORIGINAL_ATTR)
    package.init_speculator = original
    runner = sys.modules.get(MODEL_RUNNER)
    if runner is not None and getattr(runner, "init_speculator", None) is current:
        runner.init_speculator = original


# ============================================================= the speculator
def _close_session(session: Any) -> None:
    try:
        session.close()
    except Exception:  # noqa: BLE001 - shutdown must not raise
        log.debug("k3-accel: closing the draft session failed", exc_info=True)


class RemoteSpeculatorMixin:
    """Everything of :class:`RemoteSpeculatorV2` except the ``BaseSpeculator`` base."""

    # what the V2 runner reads off its speculator
    supports_mm_inputs = False
    num_query_per_req = 1
    num_extra_query_per_req = 0
    enable_adaptive_verification = False
    draft_token_confidence_probs = None
    # None: the rejection sampler treats drafts as point masses, which is exact
    # for the server's greedy drafts whatever the target's temperature.
    draft_logits = None
    # -1 ("no draft") must not reach the runner: see _fill_missing
    fill_missing_drafts = True

    def __init__(self, vllm_config: Any, device: torch.device | str, req_states: Any = None, *,
                 session: Any = None):
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
        self.counters: collections.Counter = collections.Counter()
        self._known: set[str] = set()
        if session is None:
            from k3_accel.vllm.remote import RemoteDraftSession
            session = RemoteDraftSession(vllm_config, self.device)
        self.session = session
        self._finalizer = weakref.finalize(self, _close_session, session)
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

        Where the server gave no draft (no match, request disabled, failure,
        dummy run) the column holds the request's last sampled token instead
        of -1 (see :meth:`_fill_missing`); columns past this step's K are -1
        (the runner overwrites them with -1 itself and never schedules them).
        Dummy/profile runs return -1 throughout (the runner discards them).
        """
        r = int(input_batch.num_reqs)
        out = self.drafts[:r]
        out.fill_(-1)
        if dummy_run or is_profile:          # warm-up, profiling, graph capture: never the network
            self.counters["dummy_runs"] += 1
            return out
        k = self.num_speculative_steps if num_speculative_tokens is None else \
            max(0, min(int(num_speculative_tokens), self.num_speculative_steps))
        self._finish_departed()
        if r == 0:
            return out
        # host-side data only, so every TP rank takes the same decision
        skip = _finishes_after_prefill(input_batch, self.req_states)
        keep = np.flatnonzero(~skip)
        if skip.any():
            self.counters["skipped_requests"] += int(skip.sum())
        if keep.size == 0:
            self.counters["skipped_steps"] += 1
        else:
            self.counters["steps"] += 1
            drafts = self._step(input_batch, aux_hidden_states, num_sampled, num_rejected, last_sampled,
                                next_prefill_tokens, keep, k)
            self._known.update(input_batch.req_ids[i] for i in keep.tolist())
            if k > 0:
                if keep.size == r:
                    out[:, :k].copy_(drafts)
                else:
                    out[torch.from_numpy(keep).to(self.device), :k] = drafts
        if k > 0 and self.fill_missing_drafts:
            self._fill_missing(out[:, :k], input_batch, last_sampled, self.vocab_size)
        return out

    # ------------------------------------------------------------ helpers
    @staticmethod
    def _fill_missing(cols: torch.Tensor, input_batch, last_sampled: torch.Tensor, vocab_size: int = 0) -> None:
        """Replace -1 (no draft), and any id outside the target's vocabulary, by the request's
        last sampled token, like vLLM's ``NgramGPUSpeculator``.

        The V2 runner copies these drafts into the next step's ``input_ids``
        unchecked (``_combine_sampled_and_draft_tokens_kernel``; with async
        scheduling every decode request gets K draft slots whatever we
        return), and an id of -1 trips CUDA's index assert in the embedding
        (seen on an H200). A real id there is verified like any draft, so
        the output is unchanged; the slots are computed either way.
        """
        slots = input_batch.idx_mapping[: cols.shape[0]]
        flat = last_sampled.reshape(-1) if last_sampled.dim() > 1 and last_sampled.shape[-1] == 1 else last_sampled
        filler = flat.index_select(0, slots).to(torch.int64).clamp_min_(0).unsqueeze(1)
        missing = (cols < 0) | (cols >= vocab_size) if vocab_size > 0 else cols < 0
        cols.copy_(torch.where(missing, filler, cols))

    def _step(self, input_batch, aux_hidden_states, num_sampled, num_rejected, last_sampled,
              next_prefill_tokens, keep: np.ndarray, k: int) -> torch.Tensor:
        """Every TP rank calls ``session.step`` once (it broadcasts); only the driver builds the input."""
        from k3_accel.vllm import v2_inputs

        session, n = self.session, int(keep.size)
        inp = None
        if _is_driver(session):
            try:
                counts = v2_inputs.batch_counts(input_batch, num_sampled, num_rejected)
                inp = v2_inputs.build_step_input(
                    input_batch, aux_hidden_states, counts, keep, last_sampled, next_prefill_tokens, k,
                    ship_hidden=bool(getattr(session, "ships_hidden", True)),
                    prompt_of=self._prompt_of(input_batch), first_seen=lambda rid: rid not in self._known)
            except Exception:  # noqa: BLE001 - fail closed: None = no drafts, still broadcast
                self._failed("building the step input")
                inp = None
        if session.group.world_size > 1:
            # never raises on the driver for a client error; an exception here is a broken
            # collective, which no local fallback could put back in lockstep
            return session.step(inp, n, k)
        try:
            return session.step(inp, n, k)
        except Exception:  # noqa: BLE001
            self._failed("the remote step")
            return torch.full((n, k), -1, dtype=torch.int64, device=self.device)

    def _failed(self, what: str) -> None:
        self.counters["failures"] += 1
        if self.counters["failures"] <= _MAX_LOGGED_FAILURES:
            log.exception("k3-accel: %s failed; this step gets no drafts", what)
        else:
            log.debug("k3-accel: %s failed; this step gets no drafts", what, exc_info=True)

    def _prompt_of(self, input_batch) -> Callable[[int], torch.Tensor | None] | None:
        states = self.req_states
        if states is None or not hasattr(states, "all_token_ids"):
            return None

        def prompt(i: int) -> torch.Tensor:
            slot = int(input_batch.idx_mapping_np[i])
            n = int(states.prefill_len.np[slot])
            return states.all_token_ids.gpu[slot, :n].to("cpu", torch.int64)
        return prompt

    def _finish_departed(self) -> None:
        """Free requests vLLM dropped (finished or preempted) since the last step."""
        if self.req_states is None or not self._known:
            return
        live = self.req_states.req_id_to_index
        gone = sorted(rid for rid in self._known if rid not in live)
        if gone:
            self.finish(gone)

    # ------------------------------------------------------------- public
    def finish(self, req_ids) -> None:
        ids = list(req_ids)
        self._known.difference_update(ids)
        try:
            self.session.finish(ids)
        except Exception:  # noqa: BLE001
            self._failed("freeing finished requests")

    def stats(self) -> dict[str, Any]:
        transport = self.session.stats() if hasattr(self.session, "stats") else {}
        return {"speculator": dict(self.counters), "session_errors": getattr(self.session, "errors", 0),
                "known_requests": len(self._known), "transport": transport}

    def close(self) -> None:
        self._finalizer()


def _is_driver(session: Any) -> bool:
    """This rank owns the client (TP rank 0 with an open session)."""
    driver = getattr(session, "is_driver", None)
    return bool(driver) if driver is not None else getattr(session, "client", None) is not None


def _finishes_after_prefill(input_batch, req_states) -> np.ndarray:
    from k3_accel.vllm.v2_inputs import finishes_after_prefill
    return finishes_after_prefill(input_batch, req_states)


@functools.lru_cache(maxsize=1)
def speculator_class() -> type:
    """``RemoteSpeculatorV2``: the mixin on vLLM's ``BaseSpeculator`` (imported on first use)."""
    base = require(SPECULATOR_MODULE, "BaseSpeculator")
    cls = type("RemoteSpeculatorV2", (RemoteSpeculatorMixin, base),
               {"__module__": __name__, "__doc__": RemoteSpeculatorMixin.__doc__})
    cls.__qualname__ = "RemoteSpeculatorV2"
    return cls


def create_speculator(vllm_config: Any, device: torch.device | str, req_states: Any = None, *,
                      session: Any = None):
    """Build the V2 remote speculator (what the wrapped ``init_speculator`` returns)."""
    spec = vllm_config.speculative_config
    log.info("k3-accel: V2 runner drafts remotely (method=%s, num_speculative_tokens=%s)",
             spec.method, spec.num_speculative_tokens)
    return speculator_class()(vllm_config, device, req_states, session=session)


def __getattr__(name: str) -> Any:
    if name == "RemoteSpeculatorV2":
        return speculator_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RemoteSpeculatorMixin", "create_speculator", "install", "is_wrapped", "speculator_class",
           "uninstall", "wants_remote"]
