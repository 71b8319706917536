"""The server's HTTP endpoints (a real :class:`HealthServer` on a free loopback port): /metrics
shows what was recorded up to the scrape (``on_scrape`` runs before the registry is read), a
probe's query string does not change which endpoint answers, /readyz follows readiness and an
unknown path is 404."""
from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from k3_accel.server.http import HealthServer


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture()
def health():
    registry = CollectorRegistry()
    flushed = Counter("k3_test_flushed", "what on_scrape moved into the registry", registry=registry)
    state = {"ready": False, "pending": 0}

    def on_scrape():                      # like ServerMetrics.flush: pending counts land in Prometheus
        flushed.inc(state["pending"])
        state["pending"] = 0
    server = HealthServer("127.0.0.1", 0, registry, ready=lambda: state["ready"], on_scrape=on_scrape).start()
    yield server, state
    server.close()


def test_a_scrape_shows_what_was_recorded_before_it(health):
    server, state = health
    state["pending"] = 3
    code, body = _get(server.port, "/metrics")
    assert code == 200 and "k3_test_flushed_total 3.0" in body
    state["pending"] = 2
    assert "k3_test_flushed_total 5.0" in _get(server.port, "/metrics")[1]


def test_a_query_string_does_not_change_the_endpoint(health):
    server, state = health
    state["pending"] = 1
    assert _get(server.port, "/healthz?probe=liveness") == (200, "ok\n")
    assert _get(server.port, "/readyz?verbose=1") == (503, "not ready\n")
    state["ready"] = True
    assert _get(server.port, "/readyz?verbose=1") == (200, "ready\n")
    code, body = _get(server.port, "/metrics?name[]=k3_test_flushed_total")
    assert code == 200 and "k3_test_flushed_total 1.0" in body


def test_unknown_paths_are_not_found(health):
    server, _ = health
    assert _get(server.port, "/nope")[0] == 404
    assert _get(server.port, "/healthzz")[0] == 404
