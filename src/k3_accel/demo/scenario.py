"""What a demo/e2e child process runs: engines, rounds of prompts, faults, records.

A :class:`Scenario` is plain JSON-able data. :func:`run` executes it in the
current process (vLLM in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
it owns the draft server (if any run drafts remotely), builds each run's
engine in turn, feeds rounds of prompts step by step (firing server faults
at given steps), and returns outputs, vLLM's spec-decode counters, the
client's and the server's stats and timings.
"""
from __future__ import annotations

import gc
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from k3_accel.demo import recorder
from k3_accel.demo.probe import ProbeError, probe
from k3_accel.demo.server import DraftServer

ACTIONS = ("kill", "stop", "cont", "restart", "sleep", "touch", "wait_file", "crash")
SERVER_ACTIONS = ("kill", "stop", "cont", "restart")
_partial: dict[str, Any] = {"out": None, "runs": [], "current": None}   # what a ``crash`` leaves behind
SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted", "vllm:num_preemptions": "preemptions"}
READY_WAIT_S = 120.0         # longest a ``wait_ready`` round keeps stepping for the client to reconnect
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"     # a vector: accepted at draft position i


class ScenarioError(ValueError):
    """A scenario field is invalid; the message names it."""


@dataclass
class Round:
    prompts: list[Any]                       # strings or lists of token ids
    max_tokens: int | list[int] = 16
    # {"step": N, "do": kill|stop|cont|restart} (the scenario's server), {"step": N, "do": "sleep",
    # "seconds": S}, {"step": N, "do": "touch"|"wait_file", "path": P} (meet another process; wait_file
    # has a deadline) or {"step": N, "do": "crash"} (this process dies at once: no goodbye on the wire)
    actions: list[dict] = field(default_factory=list)
    probe_server: bool = True                # read the server's stats after the round
    label: str = ""                          # what the round is for (reports)
    wait_ready: bool = False                 # afterwards, step short requests until the client is ready


@dataclass
class Run:
    name: str
    rounds: list[Round]
    speculative: dict | None = None          # vLLM speculative_config
    remote: bool = False                     # draft through the scenario's server
    plugin: dict = field(default_factory=dict)   # more additional_config["k3_accel"] keys
    record_drafts: bool = False


@dataclass
class Scenario:
    target: str
    runs: list[Run]
    engine: dict = field(default_factory=dict)      # LLM(...) keyword arguments
    server_args: list[str] | None = None            # k3-draft-server flags (None: no server)
    server_address: str | None = None               # or a draft server someone else runs
    workdir: str = "."

    @classmethod
    def from_dict(cls, data: dict) -> "Scenario":
        runs = [Run(**{**r, "rounds": [Round(**x) for x in r["rounds"]]}) for r in data["runs"]]
        return cls(**{**data, "runs": runs})

    def to_dict(self) -> dict:
        return asdict(self)

    def validate(self) -> None:
        for run in self.runs:
            if run.remote and self.server_args is None and self.server_address is None:
                raise ScenarioError(f"run {run.name!r} drafts remotely but the scenario has no server")
            for rnd in run.rounds:
                for action in rnd.actions:
                    if action.get("do") not in ACTIONS or not isinstance(action.get("step"), int) or (
                        action["do"] in ("touch", "wait_file") and not action.get("path")):
                        raise ScenarioError(f"run {run.name!r}: bad action {action!r}; allowed {ACTIONS}")


def run(scenario: Scenario) -> dict:
    """Execute ``scenario`` here; returns the result dict (see the module docstring)."""
    scenario.validate()
    server = None
    if scenario.server_args is not None:
        server = DraftServer(scenario.server_args, Path(scenario.workdir) / "draft-server.log")
        t0 = time.perf_counter()
        server.start()
        server_start = time.perf_counter() - t0
    address = scenario.server_address or (server.address if server else None)
    runs = _partial["runs"] = []
    try:
        for r in scenario.runs:
            runs.append(_run_engine(scenario, r, server, address))
    finally:
        code = server.close() if server else None
    out: dict[str, Any] = {"runs": runs}
    if server:
        out["server"] = {"address": server.address, "metrics_url": server.metrics_url, "starts": server.starts,
                         "start_s": server_start, "exit_code": code, "log": str(server.log_path)}
    return out


# a run that drafts a fixed K every step (the per-step controller off): tests that compare drafts or counts
FIXED_K = {"adaptive": False}
# the plugin's step-sized propose deadline (50 ms) is for a GPU target; on this CPU engine the
# draft server shares the target's cores and a propose takes tens of ms on its own
CPU_PROPOSE_TIMEOUT_MS = 5000


def _engine_kwargs(scenario: Scenario, r: Run, address: str | None) -> dict:
    kwargs = {"model": scenario.target, "enforce_eager": True, "disable_log_stats": False,
              **scenario.engine}
    if r.speculative is not None:
        kwargs["speculative_config"] = dict(r.speculative)
    if r.remote:
        kwargs["additional_config"] = {"k3_accel": {"draft_address": address,
                                                    "draft_propose_timeout_ms": CPU_PROPOSE_TIMEOUT_MS, **r.plugin}}
    return kwargs


def _run_engine(scenario: Scenario, r: Run, server: DraftServer | None, address: str | None) -> dict:
    from vllm import LLM

    if r.record_drafts:
        recorder.start(r.name)
    t0 = time.perf_counter()
    llm = LLM(**_engine_kwargs(scenario, r, address))
    result: dict[str, Any] = {"name": r.name, "start_s": time.perf_counter() - t0, "rounds": []}
    try:
        _partial["current"] = result                        # what a crash in a later round saves
        for i, rnd in enumerate(r.rounds):
            result["rounds"].append(_run_round(llm, f"{r.name}-{i}", rnd, server if r.remote else None))
        _partial["current"] = None
        result["drafter"] = _drafter_stats(llm)
    finally:
        if r.record_drafts:
            result["drafts"], result["draft_calls"] = recorder.stop()
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return result


def _run_round(llm: Any, tag: str, rnd: Round, server: DraftServer | None) -> dict:
    from vllm import SamplingParams

    engine = llm.llm_engine
    lengths = rnd.max_tokens if isinstance(rnd.max_tokens, list) else [rnd.max_tokens] * len(rnd.prompts)
    before = _spec_counters(llm)
    ids = [f"{tag}-{j}" for j in range(len(rnd.prompts))]
    t0 = time.perf_counter()
    for rid, prompt, n in zip(ids, rnd.prompts, lengths):
        engine.add_request(rid, _prompt(prompt), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    outputs, step, acting = {}, 0, 0.0
    while engine.has_unfinished_requests():
        for action in rnd.actions:
            if action["step"] == step:
                t_act = time.perf_counter()
                _act(server, action)
                acting += time.perf_counter() - t_act
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        step += 1
    elapsed = time.perf_counter() - t0 - acting      # the harness's own actions (a kill, a sleep) are not generation
    after = _spec_counters(llm)
    if rnd.wait_ready:
        _step_until_ready(llm, tag)
    return {"label": rnd.label, "outputs": [list(outputs[i].outputs[0].token_ids) for i in ids],
            "prompt_token_ids": [list(outputs[i].prompt_token_ids) for i in ids],
            "texts": [outputs[i].outputs[0].text for i in ids], "steps": step, "generate_s": elapsed,
            "actions_s": acting,
            "spec": {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS.values()},
            "accepted_per_pos": _per_position(before, after),
            "client": _drafter_stats(llm),
            "server": _server_stats(server) if server and rnd.probe_server else None}


def _client_state(llm: Any) -> str | None:
    stats = _drafter_stats(llm)
    return stats.get("state") or (stats.get("transport") or {}).get("state")


def _step_until_ready(llm: Any, tag: str) -> None:
    """Step short requests until the remote drafter's client is connected again (the client
    only reconnects inside steps); a deadline, never a fixed sleep."""
    from vllm import SamplingParams

    engine, deadline, n = llm.llm_engine, time.monotonic() + READY_WAIT_S, 0
    while _client_state(llm) not in (None, "ready") and time.monotonic() < deadline:
        engine.add_request(f"{tag}-ready-{n}", {"prompt_token_ids": [1, 2, 3, 4]},
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        n += 1
        time.sleep(0.05)


def _prompt(prompt: Any) -> Any:
    if isinstance(prompt, list):
        return {"prompt_token_ids": [int(t) for t in prompt]}
    return prompt


def _act(server: DraftServer | None, action: dict) -> None:
    what = action["do"]
    if what == "sleep":
        time.sleep(float(action.get("seconds", 1.0)))
        return
    if what == "touch":
        Path(action["path"]).touch()
        return
    if what == "wait_file":
        deadline = time.monotonic() + float(action.get("timeout", 600))
        while not Path(action["path"]).exists():
            if time.monotonic() > deadline:
                raise ScenarioError(f"{action['path']} did not appear in time")
            time.sleep(0.05)
        return
    if what == "crash":
        import json
        import os
        if _partial["out"]:
            runs = _partial["runs"] + ([_partial["current"]] if _partial["current"] else [])
            Path(_partial["out"]).write_text(json.dumps({"runs": runs, "crashed": True}))
        if action.get("path"):
            Path(action["path"]).touch()
        os._exit(70)
    if server is None:
        raise ScenarioError(f"action {what!r} needs a remote run")
    if what == "kill":
        server.kill()
    elif what == "stop":
        server.signal(signal.SIGSTOP)
    elif what == "cont":
        server.signal(signal.SIGCONT)
    else:
        server.restart()


def _spec_counters(llm: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for metric in llm.get_metrics():
        name = SPEC_COUNTERS.get(metric.name)
        if name is not None and hasattr(metric, "value"):
            found[name] = int(metric.value or 0)
        elif metric.name == PER_POSITION and hasattr(metric, "values"):
            found["accepted_per_pos"] = [int(v) for v in metric.values]
    return found


def _per_position(before: dict, after: dict) -> list[int]:
    """This round's accepted draft tokens at draft position 1..K (empty without speculation)."""
    pos_after, pos_before = after.get("accepted_per_pos", []), before.get("accepted_per_pos", [])
    pos_before = pos_before + [0] * (len(pos_after) - len(pos_before))
    return [a - b for a, b in zip(pos_after, pos_before)]


def _drafter_of(worker: Any) -> dict:
    runner = getattr(worker, "model_runner", None) or worker.worker.model_runner
    drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)   # V1 / V2 runner
    stats = getattr(drafter, "stats", None)
    return {"class": type(drafter).__name__, **(stats() if callable(stats) else {})}


def _drafter_stats(llm: Any) -> dict:
    return llm.collective_rpc(_drafter_of)[0]


def _server_stats(server: DraftServer) -> dict | None:
    try:
        return probe(server.address, timeout_ms=5000)["stats"]
    except ProbeError as exc:
        return {"error": str(exc)}
