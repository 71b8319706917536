"""Typed transport errors and the lock-protected queue of asynchronous failures.

Anything that goes wrong away from the step that caused it (a deferred
ingest's reply, a reply that reveals a restarted server, a capture write)
is pushed here as a :class:`Failure`; the next step drains the queue in one
atomic swap and disables every affected request. Nothing here touches the
target's output: a failure only turns drafts into -1.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable


class TransportError(Exception):
    """The connection to the draft server is unusable (timeout, socket error)."""


class TransportTimeout(TransportError):
    """No reply within the per-message timeout."""


class RingTimeout(TransportError):
    """Every staging slot stayed busy past the timeout (back-pressure gave up)."""


class IncompatibleServer(Exception):
    """The server's hello does not fit this target (version, vocabulary, hidden size, aux
    layers, K, logits)."""


class StepInputError(ValueError):
    """A :class:`StepInput` is inconsistent (lengths, devices, shapes, dtypes)."""


class FailureKind(str, Enum):
    TRANSPORT = "transport"            # timeout / socket error: the batch in flight
    RING_TIMEOUT = "ring_timeout"      # no free staging slot in time
    MESSAGE = "message"                # the server rejected a whole message
    REQUEST = "request"                # a per-request error code in a reply
    SERVER_RESTART = "server_restart"  # a new server_id: all remote state is gone
    RECONNECT = "reconnect"            # retained-prefix attach failed
    COLD_START = "cold_start"          # prefix-cache hit that cannot be rebuilt remotely
    CLIENT_GAP = "client_gap"          # rows skip past what the client sent
    NOT_CONNECTED = "not_connected"    # rows arrived while the connection was down
    CAPACITY = "capacity"              # beyond the server's per-client request limit: not drafted
    OUT_OF_VOCAB = "out_of_vocab"      # the server sent a draft id outside the target's vocabulary
    SENDER = "sender"                  # the sender thread failed (treated like a socket failure)
    CAPTURE = "capture"                # a capture write failed (disables nothing)


@dataclass(frozen=True)
class Failure:
    """One failure and the request ids it disables (``all_requests`` = every one)."""
    kind: FailureKind
    ids: tuple[str, ...] = ()
    detail: str = ""
    all_requests: bool = False
    at: float = field(default_factory=time.monotonic)


class FailureQueue:
    """Thread-safe FIFO of failures; :meth:`drain` takes everything at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Failure] = []

    def push(self, kind: FailureKind, ids: Iterable[str] = (), detail: str = "",
             all_requests: bool = False) -> Failure:
        failure = Failure(FailureKind(kind), tuple(ids), detail, all_requests)
        with self._lock:
            self._items.append(failure)
        return failure

    def drain(self) -> list[Failure]:
        """Every queued failure, oldest first; the queue is empty afterwards."""
        with self._lock:
            items, self._items = self._items, []
        return items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
