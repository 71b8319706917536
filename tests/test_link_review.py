"""Review (s30) of the client's link: a draft server address that the settings accept but ZMQ
cannot connect to (a host name with a slash) leaves drafting off with the link down and an error
logged, like any unreachable server; start() never raises, and service() raises only the
TransportError the step turns into "fail closed". Hellos refused while the server stops, and a
hello again that cannot be sent."""
from __future__ import annotations

import pytest

from helpers.steps import settings
from k3_accel.transport.failures import TransportError
from k3_accel.transport.link import Link, State
from k3_accel.transport.timing import Telemetry

REFUSED = "tcp://draft/server:5557"              # well-formed for the settings, refused by ZMQ's connect


def test_an_address_zmq_cannot_connect_to_leaves_the_link_down_without_raising():
    link = Link(settings(REFUSED, timeout_ms=1000), Telemetry(), on_ready=lambda caps: None,
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


class _Router:
    """A stand-in server socket the test thread answers by hand (no timing: each reply is sent
    only once the hello is there)."""

    def __init__(self) -> None:
        import zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"

    def answer_hello(self, link: Link, reply_for) -> None:
        import zmq
        from helpers.steps import wait_until
        from k3_accel import protocol as p
        got: list = []

        def hello_here() -> bool:
            link.service()
            if self.sock.poll(10, zmq.POLLIN):
                got.append(self.sock.recv_multipart())
            return bool(got)
        assert wait_until(hello_here, timeout=60)
        ident, *frames = got[0]
        req = p.decode_request(frames)
        assert req.op == "hello"
        self.sock.send_multipart([ident, *p.encode_reply(reply_for(req.seq))])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _caps() -> dict:
    import msgspec
    from k3_accel import protocol as p
    return msgspec.to_builtins(p.Caps(engine="ngram", needs_hidden_states=False, context_width=0,
                                      hidden_dtypes=[], supports_logits=False, supports_topk=False,
                                      max_spec_tokens=8, block_size=16, vocab_size=0))


@pytest.mark.parametrize("code", ["SHUTTING_DOWN", "INTERNAL"])
def test_a_hello_refused_because_the_server_is_stopping_is_retried_not_incompatible_for_good(code):
    """A hello that reaches a server while it stops (a restart) is answered SHUTTING_DOWN, one that
    meets a fault inside the server INTERNAL: neither says anything about whether the server fits
    this target, so the link reconnects (with backoff) and drafts once the server answers, instead
    of turning drafting off for good."""
    from helpers.steps import wait_until
    from k3_accel import protocol as p
    from k3_accel.protocol import ErrorCode, Reply
    router = _Router()
    ready: list = []
    link = Link(settings(router.address, timeout_ms=60_000, backoff_initial_ms=1, backoff_max_ms=1),
                Telemetry(), on_ready=ready.append, on_state_lost=lambda why: None)
    try:
        link.start(0)
        router.answer_hello(link, lambda seq: p.error_reply(seq, "srv-old", ErrorCode(code), "not now"))
        assert wait_until(lambda: (link.service(), link.state is not State.CONNECTING)[1], timeout=60)
        assert link.state is not State.INCOMPATIBLE, link.problem
        router.answer_hello(link, lambda seq: Reply(seq, True, "srv-new", result=_caps()))
        assert wait_until(lambda: (link.service(), link.ready)[1], timeout=60)
        assert ready and ready[0].engine == "ngram"
    finally:
        link.close()
        router.close()


def test_a_new_hello_that_cannot_be_sent_never_revives_the_old_one():
    """The server forgot this client's session (NO_SESSION): the link says hello again. When that
    hello cannot even be queued (the server went away meanwhile), the link must not take the
    previous, answered hello for the new one's answer and call itself ready on a session the server
    no longer holds."""
    from helpers.steps import wait_until
    from k3_accel.protocol import Reply
    router = _Router()
    ready: list = []
    link = Link(settings(router.address, timeout_ms=60_000), Telemetry(), on_ready=ready.append,
                on_state_lost=lambda why: None)
    try:
        link.start(0)
        router.answer_hello(link, lambda seq: Reply(seq, True, "srv", result=_caps()))
        assert wait_until(lambda: (link.service(), link.ready)[1], timeout=60)
        router.close()                                  # the server goes away
        assert wait_until(lambda: not link.conn.writable(0), timeout=60)   # ZMQ has seen the peer leave
        try:
            link.rehello("the server reclaimed this client's session")
        except TransportError as exc:                   # nothing can be queued: no peer
            assert "not connected" in str(exc)
        link.service()
        assert not link.ready and len(ready) == 1, "the old hello's answer was taken for the new one"
    finally:
        link.close()
