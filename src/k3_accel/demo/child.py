"""Run a :class:`~k3_accel.demo.scenario.Scenario` in a fresh Python process.

Parent side: :func:`run_in_child`. Child side: ``python -m k3_accel.demo.child
SPEC.json OUT.json``. A fresh process per scenario keeps vLLM's process-wide
state (and numba's import side effects) out of the caller; the engine runs
in-process inside the child (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so one
child start covers several engines.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import k3_accel
from k3_accel.demo.scenario import Scenario

_counter = itertools.count()


class ChildError(RuntimeError):
    """The scenario process failed or timed out; the message holds its log tail."""


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    src = str(Path(k3_accel.__file__).resolve().parents[1])
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra or {})
    return env


def run_in_child(scenario: Scenario, timeout: float = 600, env: dict[str, str] | None = None,
                 crash_ok: bool = False) -> dict:
    """Run ``scenario`` in a child process; returns its result dict. ``crash_ok``: the scenario
    ends with a ``crash`` action; return what it saved instead of failing."""
    work = Path(scenario.workdir)
    work.mkdir(parents=True, exist_ok=True)
    n = next(_counter)
    spec, out, log = (work / f"scenario-{n}.json", work / f"result-{n}.json", work / f"scenario-{n}.log")
    spec.write_text(json.dumps(scenario.to_dict(), indent=1))
    with open(log, "wb") as fh:
        try:
            proc = subprocess.run([sys.executable, "-m", "k3_accel.demo.child", str(spec), str(out)],
                                  stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=child_env(env), timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ChildError(f"scenario timed out after {timeout:.0f} s; log {log}:\n{_tail(log)}") from None
    if crash_ok and proc.returncode == 70 and out.exists():
        return {**json.loads(out.read_text()), "log": str(log)}
    if proc.returncode != 0 or not out.exists():
        raise ChildError(f"scenario failed (exit {proc.returncode}); log {log}:\n{_tail(log)}")
    result = json.loads(out.read_text())
    result["log"] = str(log)
    return result


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def main(argv: list[str] | None = None) -> int:
    spec_path, out_path = argv if argv is not None else sys.argv[1:]
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1)   # `kill -USR1 PID` dumps every thread's stack
    from k3_accel.demo import scenario as sc
    sc._partial["out"] = out_path
    scenario = Scenario.from_dict(json.loads(Path(spec_path).read_text()))
    run = sc.run
    result = run(scenario)
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
