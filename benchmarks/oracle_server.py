"""``k3-draft-server`` with the benchmark-only oracle engine (:mod:`oracle_engine`).

    python benchmarks/oracle_server.py --oracle-control CTL.json [--random-draft qwen3-8b] \
        --engine dflash --draft-model DIR --target-model DIR --device cuda ...

Every other flag is the server's own (``k3-draft-server --help``). The server is the product's
(``k3_accel.server.cli``); only its engine loader is swapped, in this process. ``--random-draft
qwen3-8b``: the draft's weights are random at the Qwen3-8B DFlash shape, made on the device
(``benchmarks/draft_step.py``: nothing written to disk); ``--draft-model`` then only needs a
``config.json`` of that shape (the server's flag checks), ``--target-model`` is not read.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE), str(HERE.parent / "src")):
    if path not in sys.path:
        sys.path.insert(0, path)

from k3_accel.server import cli  # noqa: E402
from oracle_engine import OracleDFlashEngine  # noqa: E402


def oracle_loader(control: str, random_draft: str | None):
    def load(args: argparse.Namespace) -> OracleDFlashEngine:
        budget = None if args.memory_budget_mb is None else args.memory_budget_mb * cli.MIB
        pool = {"budget_bytes": budget} if budget is not None else (
            {"memory_fraction": args.gpu_memory_fraction} if args.device.startswith("cuda") else {})
        options = dict(control=control, max_spec_tokens=args.num_speculative_tokens,
                       block_size=args.block_size, graph_k=(args.num_speculative_tokens,),
                       coalesce_rows=args.ingest_coalesce_rows, **pool)
        if random_draft:
            import torch
            from draft_step import config, random_weights
            dtype = torch.float32 if args.dtype in ("float32", "fp32") else torch.bfloat16
            weights = random_weights(config(quick=random_draft == "tiny"), args.device, dtype)
            return OracleDFlashEngine.from_weights(weights, **options)
        return OracleDFlashEngine(args.draft_model, args.target_model, device=args.device,
                                  dtype=args.dtype, **options)
    return load


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--oracle-control", required=True)
    ap.add_argument("--random-draft", choices=["qwen3-8b", "tiny"], default=None)
    ours, rest = ap.parse_known_args(argv)
    if "--engine" not in rest:
        rest = ["--engine", "dflash", *rest]
    cli._load_engine = oracle_loader(ours.oracle_control, ours.random_draft)
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main())
