"""DSpark test support: the checkpoint shapes, one scenario of steps run against the engine
(in process) or a draft server (over sockets), the peer oracle (vLLM 0.33's own module and
in-tree sampling, ``dspark_oracle.py``) and the comparisons.

The scenario covers chunked prefill (an ingest-only chunk, then the rest with a propose),
decode steps with partial acceptance (1 + accepted rows), a rewind (rows replaced from an
earlier position), and a reconnect (a retained context forked at a shorter length). It keeps
every request's accepted context rows itself, so the oracle recomputes each propose from scratch.
With ``sampled``, each propose gives every request a temperature (0 for some: greedy in the same
batch) and a seed (negative ones and ones past 32 bits too), and the oracle samples as vLLM's
``draft_sample_method: probabilistic`` does (its own ``gumbel_sample``, run by Triton's interpreter).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from k3_accel.testing.precision import clear_positions, logit_tolerance
from k3_accel.testing.tiny import write_tiny_target
from k3_accel.testing.tiny_dspark import write_tiny_dspark

K = 6
TEMPERATURES = (0.0, 0.6, 1.0, 1.7, 3.0)
WIDTH = 256                         # 2 aux layers x hidden 128
ORACLE = Path(__file__).with_name("dspark_oracle.py")
# name -> tiny_dspark_weights options: both layouts, with and without the confidence head
# (with and without its Markov input), a mapped (reduced) vocabulary, the top-k Markov path
SHAPES = {
    "anchor_confidence": dict(confidence=True, confidence_with_markov=True),
    "fill_in_mapped": dict(confidence=False, sample_from_anchor=False, draft_vocab_size=200, logit_scale=1.25,
                           layer_key="target_layer_ids"),
    "anchor_topk_scaled": dict(confidence=True, confidence_with_markov=False, draft_topk=3, draft_vocab_size=160,
                               layer_key="dflash_config", logit_scale=0.75),
}


def checkpoints(root: Path) -> dict[str, tuple[Path, Path]]:
    target = write_tiny_target(root / "target")
    return {name: (write_tiny_dspark(root / name, target, **opts), target) for name, opts in SHAPES.items()}


@dataclass
class Step:
    """One propose: each request's accepted context rows and anchor; what came back."""
    contexts: list[torch.Tensor]
    anchors: list[int]
    drafts: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    temperature: list[float] | None = None
    seeds: list[int] | None = None


@dataclass
class Scenario:
    driver: object
    seed: int = 0
    sampled: bool = False
    rows: dict = field(default_factory=dict)
    tokens: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)

    def _new_rows(self, name: str, start: int, n: int) -> tuple[torch.Tensor, list[int]]:
        gen = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}/{name}/{start}/{n}".encode()))
        rows = torch.randn(n, WIDTH, generator=gen).to(torch.bfloat16)
        toks = torch.randint(1, 500, (n,), generator=gen).tolist()
        self.rows[name] = torch.cat([self.rows.get(name, rows[:0])[:start], rows])
        self.tokens[name] = self.tokens.get(name, [])[:start] + toks
        return rows, toks

    def ingest(self, items: list[tuple[str, int, int]]) -> None:
        self.driver.ingest([(name, start, *self._new_rows(name, start, n)) for name, start, n in items])

    def propose(self, items: list[tuple[str, int, int, int]]) -> None:
        spans = [(name, start, *self._new_rows(name, start, n), anchor) for name, start, n, anchor in items]
        temps = seeds = None
        if self.sampled:
            keys = [zlib.crc32(f"{self.seed}/{name}/{start}/sample".encode()) for name, start, *_ in items]
            temps = [TEMPERATURES[key % len(TEMPERATURES)] for key in keys]
            seeds = [(key << 31) - (1 << 62) + s for s, key in enumerate(keys)]    # both signs, > 32 bits
        drafts, conf = self.driver.propose(spans, K, temps, seeds)
        self.steps.append(Step([self.rows[name].clone() for name, *_ in items], [a for *_, a in items],
                               drafts, conf, temps, seeds))

    def fork(self, src: str, dst: str, length: int) -> None:
        """``src`` leaves (its context retained); ``dst`` reconnects to its first ``length`` rows."""
        restored = self.driver.fork(src, dst, length, self.tokens[src][:length])
        self.rows[dst], self.tokens[dst] = self.rows[src][:restored], self.tokens[src][:restored]
        if restored < length:                 # the rest of the prefix is shipped again
            rows, toks = self.rows[src][restored:length], self.tokens[src][restored:length]
            self.driver.ingest([(dst, restored, rows, toks)])
            self.rows[dst], self.tokens[dst] = self.rows[src][:length], self.tokens[src][:length]

    def run(self) -> "Scenario":
        self.ingest([("A", 0, 11), ("B", 0, 5)])                          # prefill chunks, no propose
        self.propose([("A", 11, 19, 3), ("B", 5, 4, 40)])                 # the rest of the prompts
        self.propose([("A", 30, 3, 77), ("B", 9, 1, 12), ("C", 0, 14, 5)])  # 2 and 0 drafts accepted
        self.propose([("A", 26, 3, 9), ("B", 10, 2, 100), ("C", 14, K + 1, 6)])  # rewind; all accepted
        self.fork("A", "D", 20)                                           # reconnect
        self.propose([("D", 20, 4, 50), ("C", 21, 1, 6)])
        return self


class MirrorDriver:
    """The engine in process (tests/dflash_support.Mirror keeps the rows it must hold)."""

    def __init__(self, mirror):
        self.m, self.states = mirror, {}

    def _state(self, name):
        if name not in self.states:
            self.states[name] = self.m.new()
        return self.states[name]

    def ingest(self, items):
        self.m.ingest([(self._state(n), start, rows) for n, start, rows, _ in items])

    def propose(self, spans, k, temperature=None, seeds=None):
        self.ingest([s[:4] for s in spans])
        out = self.m.propose([self.states[s[0]] for s in spans], [s[4] for s in spans], k, logits="none",
                             temperature=temperature, seeds=seeds)
        return out.tokens.clone(), None if out.confidence is None else out.confidence.clone()

    def fork(self, src, dst, length, tokens):
        self.states[dst] = self.m.fork(self.states[src], length)
        self.m.release(self.states.pop(src))
        return length


def write_case(steps: list[Step], path: Path) -> None:
    case = {"steps": torch.tensor(len(steps))}
    for s, step in enumerate(steps):
        case[f"s{s}n"] = torch.tensor(len(step.contexts))
        case[f"s{s}anchors"] = torch.tensor(step.anchors)
        if step.temperature is not None:
            case[f"s{s}temperature"] = torch.tensor(step.temperature, dtype=torch.float32)
            case[f"s{s}seeds"] = torch.tensor(step.seeds, dtype=torch.int64)
        for i, rows in enumerate(step.contexts):
            case[f"s{s}r{i}"] = rows.float()
    save_file(case, str(path))


def run_oracle(jobs: list[dict]) -> list[dict[str, torch.Tensor]]:
    """Run ``dspark_oracle.py`` once for every job (``draft``, ``target``, ``steps``, ``name``,
    ``dir``); returns each job's outputs (``{dtype}/s{s}drafts|confidence|logits``)."""
    specs = []
    for job in jobs:
        case, out = Path(job["dir"]) / f"{job['name']}-case.safetensors", Path(job["dir"]) / f"{job['name']}-out.safetensors"
        write_case(job["steps"], case)
        specs.append({"draft": str(job["draft"]), "target": str(job["target"]), "case": str(case),
                      "out": str(out), "k": K, "dtypes": job.get("dtypes", ["float32", "bfloat16"])})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "VLLM_USE_V2_MODEL_RUNNER": "1",
           "VLLM_TARGET_DEVICE": "cpu"}
    res = subprocess.run([sys.executable, str(ORACLE), json.dumps(specs)], capture_output=True, text=True,
                         env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return [load_file(s["out"]) for s in specs]


def check_fp32(steps: list[Step], theirs: dict[str, torch.Tensor], has_confidence: bool) -> None:
    """float32: the same drafts at every position, the same confidence (to fp32 rounding)."""
    for s, step in enumerate(steps):
        assert torch.equal(step.drafts.long(), theirs[f"float32/s{s}drafts"]), (s, step.drafts, theirs[f"float32/s{s}drafts"])
        if has_confidence:
            assert step.confidence is not None
            torch.testing.assert_close(step.confidence.float(), theirs[f"float32/s{s}confidence"],
                                       atol=1e-5, rtol=0)
        else:
            assert step.confidence is None and f"float32/s{s}confidence" not in theirs


def check_low_precision(drafts: torch.Tensor, reference: dict[str, torch.Tensor], s: int,
                        dtype: torch.dtype) -> int:
    """Drafts in ``dtype`` against the float32 run (its Markov-biased logits and drafts), request
    by request while the drafted prefix agrees (a later position is conditioned on it): equal at
    every clear position (on the top-k path also the k-th and the next base logit must be apart by
    more than the rounding, or the candidate set itself may differ); returns how many were clear."""
    logits, want = reference[f"float32/s{s}logits"].double(), reference[f"float32/s{s}drafts"]
    clear = clear_positions(logits, logit_tolerance(dtype, logits))
    kept = int(torch.isfinite(logits[0, 0]).sum())
    if kept < logits.shape[-1]:         # the top-k path: its candidate set must be clear too
        base = reference[f"float32/s{s}base"].double()
        edge = base.topk(kept + 1, dim=-1).values
        clear &= (edge[..., kept - 1] - edge[..., kept]) > 2 * logit_tolerance(dtype, base)[..., 0]
    count = 0
    for i in range(want.shape[0]):
        for j in range(want.shape[1]):
            if int(drafts[i, j]) != int(want[i, j]):
                assert not bool(clear[i, j]), f"step {s} request {i}: draft {j} differs at a clear position"
                break
            count += int(clear[i, j])
    return count
