"""Helpers for the DFlash engine tests: a request mirror and the two oracles.

:class:`Mirror` drives a :class:`DFlashEngine` through the contract's batched
calls and keeps, per request, the context rows the engine should hold (what the
server would have accepted), so any oracle can recompute from scratch.
"""
from __future__ import annotations

from pathlib import Path

import torch

from k3_accel.server.engines.base import IngestBatch, Proposal, ProposeBatch
from k3_accel.server.engines.dflash import DFlashEngine
from k3_accel.testing.dflash_eager import reference_propose
from k3_accel.testing.dflash_reference import DFlashReference
from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target

WIDTH = 256          # tiny draft: 2 aux layers x hidden 128


def checkpoint(root: Path, target: Path | None = None, name: str = "draft", **kw) -> tuple[Path, Path]:
    target = target or write_tiny_target(root / "target")
    return write_tiny_dflash(root / name, target, **kw), target


def random_rows(gen: torch.Generator, n: int, width: int = WIDTH) -> torch.Tensor:
    """Aux hidden rows as a target sends them (bf16 values)."""
    return torch.randn(n, width, generator=gen).to(torch.bfloat16)


class Mirror:
    def __init__(self, engine: DFlashEngine):
        self.engine = engine
        self.rows: dict[object, torch.Tensor] = {}

    def new(self):
        state = self.engine.new_state()
        self.rows[state] = torch.empty(0, self.engine.caps.context_width, dtype=torch.bfloat16)
        return state

    def ingest(self, items: list[tuple[object, int, torch.Tensor]]) -> None:
        """One batched ingest: each item rewinds ``state`` to ``start`` and appends ``rows``."""
        batch = IngestBatch(
            states=[s for s, _, _ in items], starts=[start for _, start, _ in items],
            counts=[len(r) for _, _, r in items],
            positions=torch.cat([torch.arange(start, start + len(r)) for _, start, r in items]),
            token_ids=torch.zeros(sum(len(r) for _, _, r in items), dtype=torch.long),
            hidden=torch.cat([r for _, _, r in items]))
        self.engine.ingest(batch)
        for state, start, rows in items:
            self.rows[state] = torch.cat([self.rows[state][:start], rows])

    def fork(self, state, length: int):
        new = self.engine.fork(state, length)
        self.rows[new] = self.rows[state][:length]
        return new

    def release(self, state) -> None:
        self.engine.release(state)
        del self.rows[state]

    def propose(self, states: list, anchors: list[int], k: int, logits: str = "full",
                topk: int = 0, temperature=None, seeds=None) -> Proposal:
        return self.engine.propose(ProposeBatch(
            states=states, histories=[[0] * self.engine.length(s) for s in states],
            anchors=torch.tensor(anchors, dtype=torch.long), k=k, logits=logits, topk=topk,
            temperature=None if temperature is None else torch.tensor(temperature, dtype=torch.float32),
            seeds=None if seeds is None else torch.tensor(seeds, dtype=torch.int64))).wait()

    def check_lengths(self) -> None:
        for state, rows in self.rows.items():
            assert self.engine.length(state) == len(rows)


def reference(ref: DFlashReference, rows: torch.Tensor, anchor: int, k: int) -> torch.Tensor:
    """Independent float64 logits ``[k, V]``."""
    return ref.logits(rows.double(), anchor, k)


def eager(engine_weights, rows: torch.Tensor, anchor: int, k: int) -> torch.Tensor:
    """The old engine's logits ``[k, V]`` (fp32) over the same rows."""
    return reference_propose(engine_weights, rows, torch.arange(len(rows)), anchor, k)[1]


def random_ops(engine, m: Mirror, live: list, ops, gen: torch.Generator, on_propose) -> None:
    """Apply a hypothesis sequence of batched chunked ingests (with rewinds), forks, releases and
    proposals to ``live`` states; capacity failures must change nothing; ``on_propose(states,
    anchors, k)`` checks each proposal; lengths and block reference counts are checked after
    every operation."""
    from collections import Counter

    import pytest

    from k3_accel.server.engines.base import EngineError, EngineFault

    def snapshot() -> tuple:
        return ([(list(s.blocks), s.length) for s in live], engine.pool.free_blocks,
                [engine.pool.refcount(b) for b in range(engine.pool.num_blocks)])

    for op in ops:
        if op[0] == "ingest":
            items, seen = [], set()
            for idx, back, n in op[1]:
                state = live[idx % len(live)] if live else None
                if state is None or id(state) in seen:
                    continue
                seen.add(id(state))
                items.append((state, max(0, engine.length(state) - back), random_rows(gen, n)))
            if not items:
                continue
            need = sum(engine.blocks_needed(s, start, len(r)) for s, start, r in items)
            snap = snapshot()
            if need > engine.pool.free_blocks:
                with pytest.raises(EngineError) as err:
                    m.ingest(items)
                assert err.value.fault is EngineFault.CAPACITY and snapshot() == snap
            else:
                m.ingest(items)
        elif op[0] == "fork" and live:
            src = live[op[1] % len(live)]
            length = int(op[2] * engine.length(src))
            if engine.pool.fork_needed(length) > engine.pool.free_blocks:
                with pytest.raises(EngineError):
                    engine.fork(src, length)
            else:
                live.append(m.fork(src, length))
        elif op[0] == "release" and live:
            m.release(live.pop(op[1] % len(live)))
        elif op[0] == "propose" and live:
            states = list({id(s): s for s in (live[i % len(live)] for i in op[1])}.values())
            on_propose(states, [(op[3] + 31 * i) % 512 for i in range(len(states))], op[2])
        m.check_lengths()
        held = Counter(b for s in live for b in s.blocks)
        for block in range(engine.pool.num_blocks):
            assert engine.pool.refcount(block) == held.get(block, 0)
        assert engine.pool.used_blocks == len(held)
        for s in live:
            assert len(s.blocks) == engine.pool.blocks_for(s.length)


def check_proposal(prop: Proposal, rows: list[torch.Tensor], anchors, k: int, want, dtype) -> int:
    """Every request's logits and drafts against ``want(rows, anchor, k)`` under ``dtype``'s
    precision rule; returns the clear draft positions."""
    from k3_accel.testing.precision import check_drafts, check_logits
    clear = 0
    for i, (r, a) in enumerate(zip(rows, anchors)):
        expected = want(r, a, k)
        check_logits(prop.logits[i], expected, dtype)
        clear += check_drafts(prop.tokens[i], expected, dtype)
    return clear


def random_ops_strategy():
    """Hypothesis operation sequences for :func:`random_ops`."""
    from hypothesis import strategies as st
    return st.lists(st.one_of(
        st.tuples(st.just("ingest"), st.lists(st.tuples(st.integers(0, 5), st.integers(0, 9),
                                                        st.integers(0, 40)), min_size=1, max_size=3)),
        st.tuples(st.just("fork"), st.integers(0, 5), st.floats(0, 1)),
        st.tuples(st.just("release"), st.integers(0, 5)),
        st.tuples(st.just("propose"), st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True),
                  st.integers(1, 7), st.integers(0, 511)),
    ), min_size=4, max_size=14)
