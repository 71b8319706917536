"""/healthz, /readyz and /metrics on a small threaded HTTP server."""
from __future__ import annotations

from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from k3_accel import threads


def _handler(registry: CollectorRegistry, ready: Callable[[], bool], on_scrape: Callable[[], None]) -> type:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._send(200, b"ok\n", "text/plain")
            elif path == "/readyz":
                ok = ready()
                self._send(200 if ok else 503, b"ready\n" if ok else b"not ready\n", "text/plain")
            elif path == "/metrics":
                on_scrape()
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            else:
                self._send(404, b"not found\n", "text/plain")

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # keep probes out of the log
            pass

    return Handler


class HealthServer:
    def __init__(self, host: str, port: int, registry: CollectorRegistry, ready: Callable[[], bool],
                 on_scrape: Callable[[], None] = lambda: None):
        self.httpd = ThreadingHTTPServer((host, port), _handler(registry, ready, on_scrape))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]

    def start(self) -> "HealthServer":
        threads.start(self.httpd.serve_forever, "k3-http")
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
