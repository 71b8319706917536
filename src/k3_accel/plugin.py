"""vLLM general-plugin entry point: installs k3-accel's hooks, nothing else.

``register()`` runs in every vLLM process (API server, engine core, each
worker). It is idempotent and cheap: no sockets, no CUDA. A hook whose vLLM
symbols are missing is left off with one log line; a bad setting raises
:class:`k3_accel.config.ConfigError` so the user sees it at start.
"""
from __future__ import annotations

import importlib
import logging

from k3_accel.config import load_config
from k3_accel.vllm.compat import MissingSymbol, vllm_version

log = logging.getLogger("k3_accel")

# (hook name, "module:function" that installs it), in installation order; every patch goes
# through k3_accel.vllm.patching (``patching.applied()`` lists them)
HOOKS: tuple[tuple[str, str], ...] = (
    ("communicator", "k3_accel.vllm.tp.communicator:install"),
    ("custom_op", "k3_accel.vllm.tp.custom_op:install"),
    ("speculator_v2", "k3_accel.vllm.spec_decode.hooks:install_v2"),
    ("draft_tp", "k3_accel.vllm.spec_decode.hooks:install_draft_tp"),
    ("scheduler_gate", "k3_accel.vllm.spec_decode.hooks:install_gate"),
    ("proposer_v1", "k3_accel.vllm.spec_decode.hooks:install_v1"),
)

_installed: dict[str, bool] | None = None


def register() -> dict[str, bool]:
    """Install every hook once per process; returns which hooks are on."""
    global _installed
    if _installed is not None:
        return _installed
    load_config()  # validate the environment now: a bad value fails at start
    _installed = {name: _install(name, module) for name, module in HOOKS}
    return _installed


def _install(name: str, target: str) -> bool:
    module, function = target.split(":")
    try:
        # the installer may return False: not applicable here (e.g. not a CUDA platform)
        return getattr(importlib.import_module(module), function)() is not False
    except MissingSymbol as exc:
        log.warning("k3-accel: hook %s off: vLLM %s lacks %s", name, vllm_version(), exc.symbol)
    except Exception:  # a hook must never take vLLM down
        log.exception("k3-accel: hook %s off: installing it failed", name)
    return False
