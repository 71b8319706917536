"""CURVE authentication: authorized clients are answered, others get nothing."""
from __future__ import annotations

import shutil

import pytest
import zmq
import zmq.auth

from k3_accel import protocol as p
from k3_accel.server.security import SecurityError, check_bind, is_loopback
from conftest import ServerProcess, Wire


@pytest.fixture
def keys(tmp_path):
    certs, authorized = tmp_path / "certs", tmp_path / "authorized"
    certs.mkdir(), authorized.mkdir()
    for name in ("server", "client", "rogue"):
        zmq.auth.create_certificates(str(certs), name)
    shutil.copy(certs / "client.key", authorized / "client.key")
    return certs, authorized


def _client(server, certs, name, timeout_ms=10000):
    public, secret = zmq.auth.load_certificate(str(certs / f"{name}.key_secret"))
    server_public, _ = zmq.auth.load_certificate(str(certs / "server.key"))
    return Wire(server.address, timeout_ms=timeout_ms, curve_secretkey=secret, curve_publickey=public,
                curve_serverkey=server_public)


def test_authorized_client_works_and_unauthorized_gets_nothing(keys):
    certs, authorized = keys
    server = ServerProcess("--curve-secret-key", str(certs / "server.key_secret"),
                           "--curve-authorized-keys", str(authorized))
    try:
        good = _client(server, certs, "client")
        assert good.call(p.Hello()).ok
        rogue = _client(server, certs, "rogue", timeout_ms=1500)
        with pytest.raises(TimeoutError):
            rogue.call(p.Hello())
        plain = Wire(server.address, timeout_ms=1500)      # no CURVE at all
        with pytest.raises(TimeoutError):
            plain.call(p.Hello())
        assert good.call(p.Stats()).ok                      # the good one is still served
        for w in (good, rogue, plain):
            w.close()
    finally:
        assert server.stop() == 0


def test_bind_rules():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("10.1.2.3")
    with pytest.raises(SecurityError, match="--allow-insecure-remote"):
        check_bind("10.1.2.3", curve=False, allow_insecure=False)
    check_bind("10.1.2.3", curve=True, allow_insecure=False)
    check_bind("10.1.2.3", curve=False, allow_insecure=True)   # explicit opt-out: allowed, logged
