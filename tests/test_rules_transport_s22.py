"""Rules of the client's transport plumbing that the suite did not check (twenty-second session):
the link's reconnect backoff is bounded, and a server that forgot this client's session
(NO_SESSION) disables every request it held, not only those of the message that learned it. Real objects (a real ZMQ socket, a real server
process where one is needed); the link's clock is a fake one, so nothing here depends on speed."""
from __future__ import annotations

from helpers.ports import free_port
from helpers.steps import drafts_again, settings, step
from helpers.wire import Wire
from k3_accel import protocol as p
from k3_accel.transport import link as link_module
from k3_accel.transport.failures import TransportError
from k3_accel.transport.link import Link, State
from k3_accel.transport.timing import Telemetry


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_reconnect_backoff_doubles_but_never_waits_longer_than_backoff_max(monkeypatch):
    """A server that stays away: each failed attempt doubles the wait before the next one, but
    never past backoff_max_ms, so a server that comes back after a long outage is found again
    within backoff_max_ms (the link's clock is faked: no real waiting)."""
    clock = _Clock()
    monkeypatch.setattr(link_module.time, "monotonic", clock)
    lost: list[str] = []
    s = settings(f"tcp://127.0.0.1:{free_port()}", timeout_ms=60_000,
                 backoff_initial_ms=1000, backoff_max_ms=4000)
    link = Link(s, Telemetry(), on_ready=lambda caps: None, on_state_lost=lost.append)
    try:
        link.start(0)                       # nobody listens: the hello waits for service()
        assert link.state is State.CONNECTING
        for _ in range(12):                 # twelve failed attempts in a row (1, 2, 4, 4, 4, ... s)
            link.lose(TransportError("connection refused"))
            assert link.state is State.DISCONNECTED
            clock.now += 4.0                # backoff_max later: the next attempt is due
            link.service()
            assert link.state is State.CONNECTING, "no reconnect attempt within backoff_max_ms"
        link.lose(TransportError("connection refused"))
        clock.now += 3.5                    # before backoff_max has passed: no attempt yet
        link.service()
        assert link.state is State.DISCONNECTED
    finally:
        link.close()


def test_a_session_the_server_forgot_disables_every_request_it_held(server, client_factory):
    """The server closes the client's session behind its back (here a Bye under the same session
    key): the next reply is NO_SESSION, and every request the session held is disabled at once
    (their context is gone on the server), not only those of that message; drafting comes back
    for new requests on the new session."""
    client = client_factory(server.address, timeout_ms=5000)
    client.step(step(["a", "b"], [(0, [1, 2, 1]), (0, [3, 4, 3])], anchors=[2, 4]))
    assert not client.is_disabled("a") and not client.is_disabled("b")
    other = Wire(server.address, session=client.settings.session)
    try:
        assert other.call(p.Bye()).ok                     # the session is gone on the server
    finally:
        other.close()
    out = client.step(step(["a"], [(3, [2])], anchors=[1]))
    assert out.drafts.tolist() == [[-1] * 4]
    assert client.is_disabled("a")
    assert client.is_disabled("b"), "a request of the forgotten session stays attached"
    out = client.step(step(["b"], [(3, [4])], anchors=[3]))
    assert out.drafts.tolist() == [[-1] * 4]              # fail closed: no drafts from a lost context
    assert drafts_again(client)
