"""End to end: vLLM's OpenAI server with remote drafting, started by examples/two_process.sh.

The example script starts ``k3-draft-server`` and then ``python -m
vllm.entrypoints.openai.api_server`` with ``--speculative-config`` and
``--additional-config`` (the plugin loads by itself in every vLLM process).
An HTTP client sends completions and compares them with a second OpenAI
server started without drafting.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from k3_accel.demo.child import child_env
from k3_accel.demo.main import build_tiny
from k3_accel.demo.probe import probe
from k3_accel.demo.server import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "two_process.sh"
VLLM_ARGS = "--enforce-eager --max-model-len 512 --max-num-seqs 8 --dtype float32"
PROMPTS = ["The quick brown fox jumps over the lazy dog", "one two three one two three one two",
           "Water boils at one hundred degrees", "Bread, cheese, apples, milk, honey"]


def _env() -> dict[str, str]:
    env = child_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")       # the server as users run it: engine core in its own process
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "wb") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _wait_http(port: int, proc: subprocess.Popen, log: Path, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise TimeoutError(f"no OpenAI server on {port}:\n{log.read_text()[-4000:]}")


def _complete(port: int, model: str, prompt: str) -> tuple[str, list[int]]:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        choice = json.loads(r.read())["choices"][0]
    return choice["text"], choice.get("token_ids")


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    work = tmp_path_factory.mktemp("e2e-openai")
    target, draft = build_tiny(work)
    env, out = _env(), {}
    api, draft_port, draft_http = free_port(), free_port(), free_port()
    script_env = {**env, "TARGET": target, "DRAFT": draft, "K": "3", "API_PORT": str(api),
                  "DRAFT_PORT": str(draft_port), "DRAFT_HTTP_PORT": str(draft_http), "PYTHON": sys.executable,
                  "VLLM_ARGS": VLLM_ARGS}
    proc = _start(["bash", str(SCRIPT)], work / "two_process.log", script_env)
    try:
        _wait_http(api, proc, work / "two_process.log")
        out["remote"] = [_complete(api, target, p) for p in PROMPTS]
        out["draft_tokens"] = _metric(api, "vllm:spec_decode_num_draft_tokens")
        out["server"] = probe(f"tcp://127.0.0.1:{draft_port}")["stats"]
    finally:
        _stop(proc)
    base_port = free_port()
    base = _start([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target,
                   "--port", str(base_port), *VLLM_ARGS.split()], work / "baseline.log", env)
    try:
        _wait_http(base_port, base, work / "baseline.log")
        out["baseline"] = [_complete(base_port, target, p) for p in PROMPTS]
    finally:
        _stop(base)
    return out


def test_completions_identical_with_and_without_remote_drafting(served):
    assert served["remote"] == served["baseline"]
    assert all(ids and len(ids) == 16 for _, ids in served["remote"])


def test_the_server_drafted_remotely(served):
    assert served["draft_tokens"] > 0
    stats = served["server"]
    assert stats["ops"].get("propose", 0) > 0 and stats["ingested_rows"] > 0, stats
