"""Target-side transport to the remote draft server (vLLM-independent).

Public API::

    from k3_accel.transport import ClientSettings, DraftClient, StepInput, StepOutput

Modules: ``api`` (settings, step input/output), ``client`` (the per-step
driver), ``link`` (connect, hello, backoff, restarts), ``connection`` (the
DEALER socket, seq numbers, pending replies), ``book`` (request handles,
admission, failures, frees), ``layout`` (rows -> slot, copies, message
splitting), ``staging`` (pinned ring), ``outbox`` (messages out, replies
settled), ``sender`` (the sender thread: deferred ingests, heartbeats),
``handshake`` (the compatibility rules), ``failures`` (typed errors, failure
queue), ``capture`` (feature capture), ``timing`` (phases, counters).
"""
from __future__ import annotations

import importlib

# Exported names -> the module that defines them; imported on first use so that
# importing k3_accel.transport.api (e.g. at plugin registration) does not load zmq.
_EXPORTS = {
    "ClientSettings": "api", "SettingsError": "api", "StepInput": "api", "StepOutput": "api",
    "DraftClient": "client", "State": "client",
    "FailureKind": "failures", "IncompatibleServer": "failures", "StepInputError": "failures",
    "TransportError": "failures", "TransportTimeout": "failures",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'k3_accel.transport' has no attribute {name!r}")
    return getattr(importlib.import_module(f"k3_accel.transport.{_EXPORTS[name]}"), name)
