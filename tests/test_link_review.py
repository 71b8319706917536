"""Review (s30) of the client's link: a draft server address that the settings accept but ZMQ
cannot connect to (an ipc path longer than a Unix socket name allows) leaves drafting off with
the link down and an error logged, like any unreachable server; start() never raises, and
service() raises only the TransportError the step turns into "fail closed"."""
from __future__ import annotations

import pytest

from helpers.steps import settings
from k3_accel.transport.failures import TransportError
from k3_accel.transport.link import Link, State
from k3_accel.transport.timing import Telemetry

TOO_LONG = "ipc:///tmp/" + "k3" * 100          # a Unix socket name holds at most 107 bytes


def test_an_address_zmq_cannot_connect_to_leaves_the_link_down_without_raising():
    link = Link(settings(TOO_LONG, timeout_ms=1000), Telemetry(), on_ready=lambda caps: None,
                on_state_lost=lambda why: None)
    try:
        link.start(0)                               # "never raises on failure"
        assert link.state is State.DISCONNECTED
        assert link.down                            # the speculator skips the step: no server to talk to
        try:
            link.service()                          # a later attempt fails the same way, typed
        except TransportError as exc:
            link.lose(exc)
        assert link.state is State.DISCONNECTED and link.down
        assert not link.conn.is_open
    finally:
        link.close()
