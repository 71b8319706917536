"""The demo's and the end-to-end tests' tiny checkpoints (built here, no downloads).

* untrained (what most end-to-end tests use, and ``k3-accel demo
  --untrained``): a random tiny Qwen3 target and a random DFlash draft. Every
  code path runs; almost no draft is accepted.
* trained (the demo's default): the target trained for a few seconds on its
  tokenizer's built-in text (:mod:`k3_accel.testing.tiny_lm`: a random network
  is unpredictable, a language model is not) and a DFlash draft distilled
  from it (:mod:`k3_accel.testing.distill`), so that drafts get accepted.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

from k3_accel.testing.distill import REPORT, DistillSettings, distill_tiny_dflash
from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target
from k3_accel.testing.tiny_lm import RECORD, write_tiny_lm_target

Log = Callable[[str], None]


def build_tiny(workdir: Path, with_draft: bool = True, trained: bool = False, k: int = 4,
               log: Log | None = None) -> tuple[str, str | None]:
    """A tiny target (and DFlash draft) under ``workdir``; returns their paths.

    ``trained``: the target is a tiny language model and the draft is
    distilled from it for ``k`` draft tokens per step (reused when
    ``workdir`` already holds one built the same way).
    """
    say = log or (lambda _msg: None)
    if not trained:
        target = write_tiny_target(workdir / "target")
        draft = write_tiny_dflash(workdir / "draft", target) if with_draft else None
        return str(target), None if draft is None else str(draft)
    t0 = time.perf_counter()
    target = write_tiny_lm_target(workdir / "target")
    record = json.loads((target / RECORD).read_text())
    say(f"trained the tiny target on the built-in text in {time.perf_counter() - t0:.1f} s "
        f"(loss {record['loss_first']:.2f} -> {record['loss_last']:.2f})")
    if not with_draft:
        return str(target), None
    say("distilling the tiny DFlash draft from it ...")
    report = distill_tiny_dflash(workdir / "draft", target, DistillSettings(k=k))
    say(f"distilled the draft in {report.total_s:.1f} s{' (cached)' if report.cached else ''}: held-out "
        f"acceptance at K={k} {report.acceptance_untrained:.1%} untrained -> {report.acceptance:.1%}")
    return str(target), report.path


def build_info(target: str, draft: str | None) -> dict:
    """What was trained and measured while building (``{}`` for random checkpoints)."""
    info = {}
    for key, path in (("target", Path(target) / RECORD), ("draft", Path(draft or "-") / REPORT)):
        if path.is_file():
            data = json.loads(path.read_text())
            data.pop("history", None)
            info[key] = data
    return info
