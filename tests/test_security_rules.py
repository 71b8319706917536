"""The server's CURVE guard refuses a setup that could not authenticate anyone, with a typed
:class:`SecurityError` naming the fault (the CLI turns it into a usage error), before it starts
an authenticator: a key file holding only a public key, an authorized-keys path that is not a
directory. Real pyzmq certificates and a real ZMQ context."""
from __future__ import annotations

import pytest
import zmq
import zmq.auth

from k3_accel.server.security import CurveGuard, SecurityError


@pytest.fixture()
def certs(tmp_path):
    keys, authorized = tmp_path / "certs", tmp_path / "authorized"
    keys.mkdir(), authorized.mkdir()
    zmq.auth.create_certificates(str(keys), "server")
    zmq.auth.create_certificates(str(keys), "client")
    (authorized / "client.key").write_bytes((keys / "client.key").read_bytes())
    return keys, authorized


def _refusal(ctx: zmq.Context, secret_file, authorized) -> str:
    try:
        guard = CurveGuard(ctx, str(secret_file), str(authorized))
    except SecurityError as exc:
        return str(exc)
    guard.close()
    pytest.fail(f"CurveGuard accepted {secret_file} / {authorized}")


def test_a_valid_secret_key_and_directory_give_a_curve_server_socket(certs):
    keys, authorized = certs
    ctx = zmq.Context()
    guard = CurveGuard(ctx, str(keys / "server.key_secret"), str(authorized))
    try:
        public, secret = zmq.auth.load_certificate(str(keys / "server.key_secret"))
        assert (guard.public, guard.secret) == (public, secret)
        sock = ctx.socket(zmq.ROUTER)
        guard.apply(sock)
        assert sock.curve_server == 1
        sock.close(0)
    finally:
        guard.close()
        ctx.term()


def test_a_key_file_without_a_secret_key_is_refused(certs):
    keys, authorized = certs
    ctx = zmq.Context()
    try:
        msg = _refusal(ctx, keys / "server.key", authorized)        # the public half only
        assert "holds no secret key" in msg and "server.key" in msg
    finally:
        ctx.term()


@pytest.mark.parametrize("where", ["missing", "a_file"])
def test_authorized_keys_that_are_not_a_directory_are_refused(certs, where):
    keys, authorized = certs
    path = authorized / "client.key" if where == "a_file" else authorized / "nowhere"
    ctx = zmq.Context()
    try:
        msg = _refusal(ctx, keys / "server.key_secret", path)
        assert "--curve-authorized-keys" in msg and "not a directory" in msg and str(path) in msg
    finally:
        ctx.term()


def test_a_host_that_resolves_to_no_address_is_not_taken_for_loopback(monkeypatch):
    """Binding is refused without CURVE unless every address the host resolves to is loopback:
    a resolver that returns nothing proves nothing, so it counts as not loopback."""
    import socket

    from k3_accel.server import security
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [])
    assert security.is_loopback("somewhere") is False
    with pytest.raises(security.SecurityError, match="not a loopback address"):
        security.check_bind("somewhere", curve=False, allow_insecure=False)


@pytest.mark.parametrize("secret, where, needle", [
    ("server.key", "authorized", "holds no secret key"),                 # the public half only
    ("nowhere.key_secret", "authorized", "nowhere.key_secret"),          # no such file
    ("server.key_secret", "nowhere", "not a directory"),
])
def test_the_cli_refuses_curve_keys_that_cannot_serve_with_a_usage_error(certs, secret, where, needle, capsys):
    """A key file or authorized-keys directory CurveGuard refuses is a usage error naming the fault
    (exit 2), not a traceback from the server's start."""
    from k3_accel.server.cli import build_parser, validate
    keys, authorized = certs
    ap = build_parser()
    args = ap.parse_args(["--curve-secret-key", str(keys / secret),
                          "--curve-authorized-keys", str(authorized.parent / where)])
    with pytest.raises(SystemExit) as info:
        validate(args, ap)
    err = capsys.readouterr().err
    assert info.value.code == 2 and needle in err and "Traceback" not in err, err
