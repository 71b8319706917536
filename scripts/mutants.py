"""Plant bugs in the safety rules, one at a time, and see which the test suite catches.

For each mutant: copy the checkout (src, tests, pyproject) into a temporary
directory, replace one snippet of source with a broken version, run the tests
that guard that rule there, and report CAUGHT (some test failed) or MISSED
(all passed: the suite does not check that rule). A snippet that is no longer
in the source is reported STALE (update this list with the code). Two sets:
``planted`` (below, the first 17) and ``rules`` (``mutant_rules.py``: written
from the rules, at least one per area of ``src/k3_accel``); the report ends
with the kill rate per module.

For contributors, not run in CI (about 30 minutes on 2 cores for both sets):

    .venv/bin/python scripts/mutants.py                 # both sets
    .venv/bin/python scripts/mutants.py --set rules -j 2
    .venv/bin/python scripts/mutants.py vocab lease      # mutants whose name contains a word
    K3_MUTANT_PYTHON=python3 python3 scripts/mutants.py owned    # on the GPU machine (no venvs there)
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutant import Mutant  # noqa: E402
from mutant_rules import MODULE_MUTANTS, RULE_MUTANTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


MUTANTS = (
    Mutant("fail-open", "fail closed: a disabled request sits out until it leaves the batch", "transport/client.py",
           "live = np.fromiter((r.disabled is None for r in recs), dtype=bool, count=n)",
           "live = np.ones(n, dtype=bool)",
           ("tests/test_transport_client.py", "tests/test_transport_faults.py")),
    Mutant("vocab-range", "draft ids outside the target's vocabulary never reach vLLM", "transport/replies.py",
           "bad = ((d < -1) | (d >= vocab)).any(axis=1) if vocab else (d < -1).any(axis=1)",
           "bad = (d < -1).any(axis=1)",
           ("tests/test_transport_client.py::test_out_of_vocab_drafts_are_dropped",)),
    Mutant("per-request-errors", "one request's failure is its own", "server/rows.py",
           "        except RequestError as exc:\n            out.fail(i, exc)\n            continue\n        fresh += new",
           "        except RequestError as exc:\n            raise\n        fresh += new",
           ("tests/test_server.py", "tests/test_transport_client.py")),
    Mutant("gap-accepted", "rows past the stored context are refused", "server/rows.py",
           "            if start > length:", "            if start > length + 10 ** 9:",
           ("tests/test_server.py", "tests/test_store.py")),
    Mutant("no-rewind-ngram", "rows that start inside the context rewind it", "server/engines/ngram.py",
           "            state.rewind(start)\n", "",
           ("tests/test_ngram.py", "tests/test_server.py")),
    Mutant("no-rewind-pool", "a rewind returns the blocks past it", "server/engines/pool.py",
           "        self.truncate(table, start)\n        if count <= 0:",
           "        if count <= 0:",
           ("tests/test_dflash_pool.py", "tests/test_ngram.py")),
    Mutant("tenant-isolation", "a session only sees its own requests", "server/state.py",
           "        return session.active.get(handle) or self.retained.get((session.key, handle))",
           "        return session.active.get(handle) or next((s for (k, h), s in self.retained.items() "
           "if h == handle), None)",
           ("tests/test_server_sessions.py",)),
    Mutant("no-lease", "a silent session is reclaimed", "server/loop.py",
           "            for session in store.expired(self.lease_s, now):",
           "            for session in []:",
           ("tests/test_server_sessions.py",)),
    Mutant("frees-capped", "frees that could not be sent are all sent later", "transport/book.py",
           "        self._unsent_frees.append((handles, retain))",
           "        self._unsent_frees.append((handles, retain))\n        del self._unsent_frees[:-1]",
           ("tests/test_transport_faults.py",)),
    Mutant("late-timeout", "a reply's timeout is honoured", "transport/connection.py",
           "            left = min(item.deadline, give_up_at if give_up_at is not None else item.deadline) - now",
           "            left = min(item.deadline, give_up_at if give_up_at is not None else item.deadline) + 5.0 - now",
           ("tests/test_transport_faults.py",)),
    Mutant("propose-overtakes-ingest", "a propose never leaves before the ingests queued before it",
           "transport/client.py",
           "        if not deferred and not self.sender.wait_idle(self.settings.timeout_s):",
           "        if False:",
           ("tests/test_transport_client.py::test_deferred_ingests_then_propose_are_processed_in_order",
            "tests/test_transport_hidden.py")),
    Mutant("bottom-k", "top-k means the k largest", "server/engines/dflash/engine.py",
           ".topk(batch.topk, dim=-1)", ".topk(batch.topk, dim=-1, largest=False)",
           ("tests/test_transport_hidden.py",)),
    Mutant("attention-scale", "the draft's attention math (checked by an independent reference)",
           "server/engines/dflash/ops_torch.py",
           "* (hd ** -0.5)", "* (hd ** -0.5) * 1.25",
           ("tests/test_dflash_engine.py",)),
    Mutant("curve-unset", "the client applies its CURVE keys", "transport/connection.py",
           "        if self.curve is not None:", "        if False:",
           ("tests/test_curve.py",)),
    Mutant("no-drain", "messages queued at shutdown are answered", "server/loop.py",
           "            self._drain()\n", "",
           ("tests/test_server_batching.py",)),
    Mutant("heavy-register", "register() stays cheap: no zmq, no server in every vLLM process", "plugin.py",
           "    load_config()  # validate", "    import k3_accel.server.loop  # noqa: F401\n    load_config()  # validate",
           ("tests/test_plugin.py",)),
    Mutant("dma-fail-open", "a runtime that does not state its capability is not capable",
           "comm/eligibility.py",
           "    if isinstance(value, bool):\n        return value\n    return None",
           "    if isinstance(value, bool):\n        return value\n    return True",
           ("tests/test_comm_router.py", "tests/test_comm_consensus.py")),
)


SETS = {"planted": MUTANTS, "rules": RULE_MUTANTS, "modules": MODULE_MUTANTS, "all": MUTANTS + RULE_MUTANTS}


def run(mutant: Mutant, timeout: float) -> str:
    chosen = os.environ.get("K3_MUTANT_PYTHON")           # the GPU image, which has no venvs: python3
    python = Path(os.path.abspath(shutil.which(chosen) or chosen)) if chosen else ROOT / mutant.venv / "bin" / "python"
    if not python.exists():
        return f"NO {mutant.venv}"
    with tempfile.TemporaryDirectory(prefix="k3-mutant-") as tmp:
        root = Path(tmp)
        for part in ("src", "tests", "pyproject.toml"):
            src = ROOT / part
            (shutil.copytree if src.is_dir() else shutil.copy)(src, root / part,
                                                              **({"ignore": shutil.ignore_patterns("__pycache__")}
                                                                 if src.is_dir() else {}))
        path = root / "src" / "k3_accel" / mutant.file
        text = path.read_text()
        if mutant.old not in text:
            return "STALE"
        path.write_text(text.replace(mutant.old, mutant.new, 1))
        paths = [str(root / "src")]
        if chosen and os.environ.get("PYTHONPATH"):           # the GPU machine's packages (a --target folder)
            paths.append(os.environ["PYTHONPATH"])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "VLLM_TARGET_DEVICE": "cpu"}
        try:
            proc = subprocess.run([str(python), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutant.tests],
                                  cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "CAUGHT (timeout)"
        if "deselected" in proc.stdout and " passed" not in proc.stdout and proc.returncode == 5:
            return "NOT RUN"                    # every guarding test was deselected in that environment
        if proc.returncode in (3, 4):           # pytest's internal or usage error (a conftest that cannot
            return f"ERROR (exit {proc.returncode})"   # import: the environment, not the mutant)
        return "CAUGHT" if proc.returncode != 0 else "MISSED"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="plant bugs in the rules, one at a time; report which tests catch")
    ap.add_argument("words", nargs="*", help="only mutants whose name contains one of these")
    ap.add_argument("--set", choices=sorted(SETS), default="all")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="mutants run at once (each in its own copy)")
    ap.add_argument("--uncovered", action="store_true",
                    help="list the modules of src/k3_accel without a mutant in the set, run nothing")
    args = ap.parse_args(argv)
    if args.uncovered:
        have = {m.file for m in SETS[args.set]}
        package = ROOT / "src" / "k3_accel"
        missing = sorted(str(f.relative_to(package)) for f in package.rglob("*.py")
                         if f.name != "__init__.py" and str(f.relative_to(package)) not in have)
        print("\n".join(missing) or "every module has a mutant")
        return 1 if missing else 0
    chosen = [m for m in SETS[args.set] if not args.words or any(word in m.name for word in args.words)]

    def one(mutant: Mutant) -> tuple[Mutant, str]:
        t0 = time.monotonic()
        verdict = run(mutant, timeout=900)
        print(f"{verdict:16s} {mutant.name:26s} {time.monotonic() - t0:6.0f} s  {mutant.module}: {mutant.rule}",
              flush=True)
        return mutant, verdict
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(one, chosen))
    caught, total = Counter(), Counter()
    for mutant, verdict in results:
        total[mutant.module] += 1
        caught[mutant.module] += verdict.startswith("CAUGHT")
    print("\nkill rate per module:")
    for module in sorted(total):
        print(f"  {module:36s} {caught[module]} of {total[module]}")
    missed = sum(total.values()) - sum(caught.values())
    print(f"{sum(caught.values())} of {sum(total.values())} caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
