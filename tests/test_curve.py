"""CURVE: authorized clients are answered, others get nothing; sessions are bound to client keys;
the real DraftClient applies its keys (issue 14)."""
from __future__ import annotations

import shutil

import pytest
import zmq
import zmq.auth

from helpers.oracles import ngram_lookup
from helpers.server import ServerProcess
from helpers.steps import settings, step
from helpers.wire import Wire
from k3_accel import protocol as p
from k3_accel.server.security import SecurityError, check_bind, is_loopback
from k3_accel.transport.client import DraftClient
from k3_accel.transport.link import State

HISTORY = [5, 6, 7, 5, 6, 7, 5]


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("curve")
    certs, authorized = root / "certs", root / "authorized"
    certs.mkdir(), authorized.mkdir()
    for name in ("server", "client", "other", "rogue"):
        zmq.auth.create_certificates(str(certs), name)
    for name in ("client", "other"):
        shutil.copy(certs / f"{name}.key", authorized / f"{name}.key")
    return certs, authorized


@pytest.fixture(scope="module")
def server(keys):
    certs, authorized = keys
    s = ServerProcess("--engine", "ngram", "--curve-secret-key", str(certs / "server.key_secret"),
                      "--curve-authorized-keys", str(authorized), "--lease-s", "0")
    yield s
    assert s.stop() == 0


def _wire(server, certs, name, timeout_ms=20000, **kw) -> Wire:
    public, secret = zmq.auth.load_certificate(str(certs / f"{name}.key_secret"))
    server_public, _ = zmq.auth.load_certificate(str(certs / "server.key"))
    return Wire(server.address, timeout_ms=timeout_ms, curve_secretkey=secret, curve_publickey=public,
                curve_serverkey=server_public, **kw)


def test_authorized_client_works_and_unauthorized_gets_nothing(server, keys):
    certs, _ = keys
    good = _wire(server, certs, "client")
    rogue = _wire(server, certs, "rogue", timeout_ms=1500, hello=False)
    plain = Wire(server.address, timeout_ms=1500, hello=False)            # no CURVE at all
    try:
        for w in (rogue, plain):
            with pytest.raises(TimeoutError):
                w.call(p.Hello(w.session))
        assert good.call(p.Stats()).ok                                     # the good one is still served
    finally:
        for w in (good, rogue, plain):
            w.close()


def test_a_session_belongs_to_the_client_key_that_opened_it(server, keys):
    certs, _ = keys
    owner = _wire(server, certs, "client")
    owner.ingest([(0, 0, HISTORY)]).raise_for_error()
    thief = _wire(server, certs, "other", hello=False)                    # authorized, but another key
    again = None
    try:
        reply = thief.call(p.Hello(owner.session, "thief"))
        assert not reply.ok and reply.error[0] == "NOT_OWNER"
        for msg in (p.Clear(), p.Bye(), p.Free([0], retain=False)):         # and it is bound to nothing
            assert thief.call(msg).error[0] == "NO_SESSION"
        assert thief.call(p.Hello(thief.session)).ok                       # its own session is fine
        again = _wire(server, certs, "client", session=owner.session)      # the owner's key reclaims it
        got = again.propose(4, [(0, len(HISTORY), [], 6)]).raise_for_error().tensors["drafts"].tolist()
        want = ngram_lookup(HISTORY + [6], 4)
        assert got == [want + [-1] * (4 - len(want))]
    finally:
        for w in (owner, thief, again):
            if w is not None:
                w.close()


def _client(server, certs, client_key, server_key="server", **kw) -> DraftClient:
    extra = {} if client_key is None else {"curve_server_key": str(certs / f"{server_key}.key"),
                                           "curve_client_key": str(certs / f"{client_key}.key_secret")}
    return DraftClient(settings(server.address, **extra, **kw))


def test_draft_client_with_the_right_keys_drafts(server, keys):
    certs, _ = keys
    with _client(server, certs, "client") as client:
        assert client.state is State.READY
        out = client.step(step(["a"], [(0, HISTORY)], anchors=[6], k=4))
        want = ngram_lookup(HISTORY + [6], 4)
        assert out.drafts.tolist() == [want + [-1] * (4 - len(want))]


@pytest.mark.parametrize("client_key, server_key", [("rogue", "server"), (None, "server"), ("client", "other")],
                         ids=["unauthorized key", "no keys", "wrong server key"])
def test_draft_client_without_the_right_keys_fails_closed(server, keys, client_key, server_key):
    certs, _ = keys
    with _client(server, certs, client_key, server_key, timeout_ms=1500) as client:
        assert client.state is not State.READY
        for _ in range(2):
            out = client.step(step(["a"], [(0, HISTORY)], anchors=[6], k=4))
            assert out.drafts.tolist() == [[-1] * 4]
        assert client.state is not State.READY


def test_bind_rules():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("10.1.2.3")
    with pytest.raises(SecurityError, match="--allow-insecure-remote"):
        check_bind("10.1.2.3", curve=False, allow_insecure=False)
    check_bind("10.1.2.3", curve=True, allow_insecure=False)
    check_bind("10.1.2.3", curve=False, allow_insecure=True)   # explicit opt-out: allowed, logged


def test_a_name_that_resolves_to_loopback_and_a_routable_address_is_not_loopback(monkeypatch):
    """Binding such a name listens on the routable address too: it needs CURVE (or the opt-out)."""
    import socket

    real = socket.getaddrinfo
    answers = {"both.k3.test": ["127.0.0.1", "10.1.2.3"], "both6.k3.test": ["::1", "2001:db8::7"],
               "lo.k3.test": ["127.0.0.1", "::1"]}

    def getaddrinfo(host, *args, **kw):
        if host in answers:
            return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0))
                    for a in answers[host]]
        return real(host, *args, **kw)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    assert is_loopback("lo.k3.test")
    for host in ("both.k3.test", "both6.k3.test"):
        assert not is_loopback(host)
        with pytest.raises(SecurityError, match="not a loopback address"):
            check_bind(host, curve=False, allow_insecure=False)
        check_bind(host, curve=True, allow_insecure=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_the_server_refuses_a_non_loopback_bind_without_curve(host):
    """The rule at the command line, not only in ``check_bind``: ``k3-draft-server`` asked to listen
    beyond loopback with no CURVE keys and no ``--allow-insecure-remote`` exits 2 naming the flag,
    before it binds anything."""
    import socket
    import subprocess
    import sys

    from helpers.ports import free_port
    from helpers.server import src_env

    port, http_port = free_port(), free_port()
    out = subprocess.run([sys.executable, "-m", "k3_accel.server.cli", "--engine", "ngram", "--host", host,
                          "--port", str(port), "--http-port", str(http_port)],
                         env=src_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--allow-insecure-remote" in out.stderr and "loopback" in out.stderr
    for p_ in (port, http_port):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", p_)) != 0        # nothing listens: it never bound
