"""Who may talk to the draft server: loopback, CURVE keys, or an explicit opt-out."""
from __future__ import annotations

import ipaddress
import logging
import socket
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("k3_accel.server")


class SecurityError(ValueError):
    """The requested bind would expose the server without authentication."""


def is_loopback(host: str) -> bool:
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as exc:
        raise SecurityError(f"--host {host!r} does not resolve: {exc}") from None
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)   # none: not known loopback


def check_bind(host: str, curve: bool, allow_insecure: bool) -> None:
    """Refuse a non-loopback bind without CURVE keys unless explicitly allowed."""
    if is_loopback(host) or curve:
        return
    if not allow_insecure:
        raise SecurityError(f"--host {host} is not a loopback address: give --curve-secret-key and "
                            "--curve-authorized-keys, or --allow-insecure-remote to accept anyone")
    log.warning("binding %s without authentication or encryption (--allow-insecure-remote)", host)


def load_keys(secret_key_file: str, authorized_dir: str) -> tuple[bytes, bytes]:
    """The server's (public, secret) CURVE key; SecurityError naming the fault when the key file or
    the authorized-keys directory cannot serve (also the CLI's check, before anything starts)."""
    try:
        public, secret = zmq.auth.load_certificate(secret_key_file)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"--curve-secret-key {secret_key_file}: {exc}") from None
    if secret is None:
        raise SecurityError(f"{secret_key_file} holds no secret key")
    if not Path(authorized_dir).is_dir():
        raise SecurityError(f"--curve-authorized-keys {authorized_dir} is not a directory")
    return public, secret


class CurveGuard:
    """CURVE server keys on a socket plus a ZAP authenticator for the authorized keys."""

    def __init__(self, ctx: zmq.Context, secret_key_file: str, authorized_dir: str):
        self.public, self.secret = load_keys(secret_key_file, authorized_dir)
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=str(authorized_dir))

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def close(self) -> None:
        self.auth.stop()
