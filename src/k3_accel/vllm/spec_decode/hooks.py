"""Where remote drafting enters vLLM: the V2 and V1 runner hooks.

Both are installed by ``register()`` (plugin hooks ``speculator_v2`` and
``proposer_v1``), cheaply: no sockets, no CUDA, no heavy vLLM import. Every
change goes through :mod:`k3_accel.vllm.patching`. Patch sites:

* V2 (``speculator_v2``): ``vllm.v1.worker.gpu.spec_decode.init_speculator``
  and the name ``init_speculator`` that ``vllm.v1.worker.gpu.model_runner``
  imports (patched now if that module is loaded, else right after its import).
  The wrapper returns ``RemoteSpeculatorV2`` (:mod:`.v2`) when
  :func:`~.methods.remote_enabled` says so, else calls vLLM's function.
* The scheduler gate (``scheduler_gate``), right after ``vllm.v1.core.sched.scheduler`` is
  imported: ``Scheduler._update_after_schedule`` caps the step's
  ``num_spec_tokens_to_schedule`` by the engine's :class:`~.gate.Gate` before vLLM (and
  ``AsyncScheduler``, which sizes its draft placeholders from it) reads it.
* V1 (``proposer_v1``), right after ``vllm.v1.worker.gpu_model_runner`` is
  imported (~1.5 s, workers only): ``GPUModelRunner.__init__``,
  ``take_draft_token_ids`` (drafts end at the first -1, so the scheduler
  schedules no placeholder for a missing draft) and ``shutdown``. While one remote runner's ``__init__`` runs,
  ``gpu_model_runner.DFlashProposer`` (or ``ngram_proposer.NgramProposer``) is
  swapped for :class:`~.v1.RemoteDFlashProposer` (or ``RemoteNgramProposer``),
  subclasses, so the runner's ``isinstance`` checks hold. Without an address
  every runner is built exactly as stock.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import sys
from types import ModuleType
from typing import Any, Callable

from k3_accel.vllm import patching
from k3_accel.vllm.compat import MissingSymbol, require, vllm_version
from k3_accel.config import ConfigError, load_config
from k3_accel.vllm.spec_decode.methods import HIDDEN_METHODS, remote_enabled, stays_local

log = logging.getLogger("k3_accel.vllm")

HOOK_V2 = "speculator_v2"
SPEC_DECODE = "vllm.v1.worker.gpu.spec_decode"
MODEL_RUNNER = "vllm.v1.worker.gpu.model_runner"

HOOK_GATE = "scheduler_gate"
SCHEDULER = "vllm.v1.core.sched.scheduler"

HOOK_V1 = "proposer_v1"
HOOK_DRAFT_TP = "draft_tp"
ARG_UTILS = "vllm.engine.arg_utils"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
NGRAM_MODULE = "vllm.v1.spec_decode.ngram_proposer"


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def _when_imported(module: str, apply: Callable[[ModuleType], None], hook: str) -> bool:
    """``apply`` once vLLM's ``module`` is imported; raises :class:`MissingSymbol` if vLLM has none."""
    require("vllm")
    if not _exists(module):
        raise MissingSymbol(module)
    patching.when_imported(module, apply, hook=hook)
    return True


# ==================================================================== V2
def install_v2() -> bool:
    """Wrap V2's ``init_speculator``; idempotent. Raises :class:`MissingSymbol` when vLLM has
    no V2 ``spec_decode`` package, no ``init_speculator`` or no ``BaseSpeculator`` module."""
    package = require(SPEC_DECODE)
    stock = require(SPEC_DECODE, "init_speculator")
    if not _exists(SPEC_DECODE + ".speculator"):
        raise MissingSymbol(f"{SPEC_DECODE}.speculator.BaseSpeculator")
    if patching.patched(package, "init_speculator") is None:
        patching.patch(package, "init_speculator", _wrap_init_speculator(stock), hook=HOOK_V2)
    patching.when_imported(MODEL_RUNNER, _patch_runner_name, hook=HOOK_V2)
    return True


def _wrap_init_speculator(stock: Callable) -> Callable:
    @functools.wraps(stock)
    def init_speculator(vllm_config, device, req_states, *args, **kwargs):
        if remote_enabled(vllm_config):
            from k3_accel.vllm.spec_decode.v2 import create_speculator
            return create_speculator(vllm_config, device, req_states)
        return stock(vllm_config, device, req_states, *args, **kwargs)
    return init_speculator


def _patch_runner_name(runner: ModuleType) -> None:
    """The runner's own ``init_speculator`` name: vLLM's (loaded before us) or already our
    wrapper (loaded after); either way recorded, so undo restores vLLM's."""
    ours = patching.patched(sys.modules[SPEC_DECODE], "init_speculator")
    if ours is None or patching.patched(runner, "init_speculator") is not None:
        return
    name = getattr(runner, "init_speculator", None)
    if name is ours.original:
        patching.patch(runner, "init_speculator", ours.replacement, hook=HOOK_V2)
    elif name is ours.replacement:
        patching.patch(runner, "init_speculator", ours.replacement, hook=HOOK_V2, restore=ours.original)
    else:
        log.warning("k3-accel: %s.init_speculator is not vLLM's (another plugin?); left alone, so the V2 "
                    "runner may not use remote drafting", MODEL_RUNNER)


# ======================================================= scheduler gate
def install_gate() -> bool:
    """Cap the scheduler's draft slots by the engine's gate (see :mod:`.gate`) once the
    scheduler module is imported; engines without a gate schedule exactly as stock."""
    return _when_imported(SCHEDULER, _patch_scheduler, HOOK_GATE)


def _patch_scheduler(module: ModuleType) -> None:
    cls = require(module.__name__, "Scheduler")
    if patching.patched(cls, "_update_after_schedule") is None:
        patching.patch(cls, "_update_after_schedule", _wrap_update_after_schedule(cls._update_after_schedule),
                       hook=HOOK_GATE)


_NO_GATE = object()


def _wrap_update_after_schedule(update: Callable) -> Callable:
    from k3_accel.vllm.spec_decode.gate import Gate, gated

    @functools.wraps(update)
    def _update_after_schedule(self, scheduler_output: Any) -> None:
        gate = self.__dict__.get("_k3_gate", _NO_GATE)
        if gate is _NO_GATE:
            gate = self._k3_gate = Gate.for_engine(self.vllm_config, writer=False)
        k = getattr(scheduler_output, "num_spec_tokens_to_schedule", None)
        if gate is not None and k:
            scheduler_output.num_spec_tokens_to_schedule = gated(k, gate)
        return update(self, scheduler_output)
    return _update_after_schedule


# ============================================================ draft TP
def install_draft_tp() -> bool:
    """Remote drafts never run on the target, so their TP size is moot: a remote method whose
    ``--speculative-config`` leaves ``draft_tensor_parallel_size`` unset gets 1 (vLLM would
    otherwise check the draft's head count against the target's TP and refuse to start)."""
    require("vllm")
    patching.when_imported(ARG_UTILS, _patch_engine_args, hook=HOOK_DRAFT_TP)
    return True


def _patch_engine_args(module: ModuleType) -> None:
    cls = require(module.__name__, "EngineArgs")
    if patching.patched(cls, "create_speculative_config") is None:
        patching.patch(cls, "create_speculative_config", _wrap_create_spec(cls.create_speculative_config),
                       hook=HOOK_DRAFT_TP)


def _wrap_create_spec(create: Callable) -> Callable:
    @functools.wraps(create)
    def create_speculative_config(self, *args: Any, **kwargs: Any) -> Any:
        spec = self.speculative_config
        if isinstance(spec, dict) and spec.get("method") in HIDDEN_METHODS \
                and spec.get("draft_tensor_parallel_size") is None and _has_address(self) and not stays_local(spec):
            self.speculative_config = {**spec, "draft_tensor_parallel_size": 1}
            log.info("k3-accel: remote %s drafting: draft_tensor_parallel_size=1 (the draft runs in the "
                     "draft server, not on the target's GPUs)", spec["method"])
        return create(self, *args, **kwargs)
    return create_speculative_config


def _has_address(engine_args: Any) -> bool:
    extra = getattr(engine_args, "additional_config", None)
    try:
        return bool(load_config(extra if isinstance(extra, dict) else None).draft_address)
    except ConfigError:
        return False                 # the speculator reports a bad setting with its own message


# ==================================================================== V1
def install_v1() -> bool:
    """Patch the V1 runner once it is imported; raises :class:`MissingSymbol` if vLLM has none."""
    return _when_imported(RUNNER_MODULE, _patch_runner_or_warn, HOOK_V1)


def _patch_runner_or_warn(module: ModuleType) -> None:
    try:
        patch_runner(module)
    except MissingSymbol as exc:
        log.warning("k3-accel: hook %s off: vLLM %s lacks %s", HOOK_V1, vllm_version(), exc.symbol)


def patch_runner(module: ModuleType) -> None:
    """Wrap ``GPUModelRunner.__init__`` and ``shutdown`` (idempotent)."""
    for name in ("GPUModelRunner", "DFlashProposer"):
        require(module.__name__, name)
    cls = module.GPUModelRunner
    if patching.patched(cls, "__init__") is not None:
        return
    patching.patch(cls, "__init__", _wrap_runner_init(cls.__init__), hook=HOOK_V1)
    if hasattr(cls, "take_draft_token_ids"):
        patching.patch(cls, "take_draft_token_ids", _wrap_take_drafts(cls.take_draft_token_ids), hook=HOOK_V1)
    if hasattr(cls, "shutdown"):
        patching.patch(cls, "shutdown", _wrap_shutdown(cls.shutdown), hook=HOOK_V1)


def _remote_proposer(method: str) -> tuple[ModuleType, str, type]:
    """(module, name, remote class) the runner's ``__init__`` must find for ``method``."""
    if method == "dflash":
        from k3_accel.vllm.spec_decode.v1 import RemoteDFlashProposer
        return require(RUNNER_MODULE), "DFlashProposer", RemoteDFlashProposer
    from k3_accel.vllm.spec_decode.v1_ngram import RemoteNgramProposer
    return require(NGRAM_MODULE), "NgramProposer", RemoteNgramProposer


def _wrap_runner_init(init: Callable) -> Callable:
    @functools.wraps(init)
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        if not remote_enabled(vllm_config):
            init(self, vllm_config, *args, **kwargs)
            return
        module, name, remote = _remote_proposer(vllm_config.speculative_config.method)
        with patching.swapped(module, name, remote, hook=HOOK_V1):
            init(self, vllm_config, *args, **kwargs)
        drafter = getattr(self, "drafter", None)
        if hasattr(drafter, "bind_runner"):
            drafter.bind_runner(self)
        log.info("k3-accel: V1 runner drafts remotely with %s", type(drafter).__name__)
    return __init__


def drafts_for_scheduler(draft_token_ids: list[list[int]]) -> list[list[int]]:
    """Each request's drafts up to its first "no draft" (-1): the scheduler then schedules only
    real drafts, so a request without any costs a plain decode step, not 1 + K verified tokens."""
    return [row[:row.index(-1)] if -1 in row else row for row in draft_token_ids]


def _wrap_take_drafts(take: Callable) -> Callable:
    @functools.wraps(take)
    def take_draft_token_ids(self, *args: Any, **kwargs: Any) -> Any:
        out = take(self, *args, **kwargs)
        if out is not None and getattr(getattr(self, "drafter", None), "is_remote_drafter", False):
            out.draft_token_ids = drafts_for_scheduler(out.draft_token_ids)
        return out
    return take_draft_token_ids


def _wrap_shutdown(shutdown: Callable) -> Callable:
    """Close a remote drafter's connection when the worker releases the runner."""
    @functools.wraps(shutdown)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        drafter = getattr(self, "drafter", None)
        if getattr(drafter, "is_remote_drafter", False):
            drafter.close()
        return shutdown(self, *args, **kwargs)
    return wrapper
