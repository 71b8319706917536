"""A fixture factory of started :class:`DraftClient` objects, closed at the end of the test."""
from __future__ import annotations

import pytest

from k3_accel.transport.client import DraftClient

from .server import ServerProcess
from .steps import settings


@pytest.fixture
def server():
    srv = ServerProcess("--engine", "ngram")
    yield srv
    srv.stop()


@pytest.fixture
def client_factory():
    made: list[DraftClient] = []

    def make(address: str, **kw) -> DraftClient:
        client = DraftClient(settings(address, **kw)).start()
        made.append(client)
        return client
    yield make
    for client in made:
        client.close()
