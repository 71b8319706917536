"""The benchmark-only oracle engine (benchmarks/oracle_engine.py, issue 27 P6): it runs the DFlash
engine's step unchanged, and its proposals follow vLLM's acceptance schedule (counted over many
steps, fixed seed)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from dflash_support import Mirror, checkpoint, random_rows
from k3_accel.server.engines.dflash import DFlashEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from oracle_engine import KEY, Oracle, OracleDFlashEngine, acceptance_rates, write_control  # noqa: E402

BUDGET = 1 << 20
K = 7


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("oracle"))


def _record(tmp_path: Path, n: int, length: int, vocab: int, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, vocab - 1, (n, length), generator=gen).tolist()
    (tmp_path / "record.json").write_text(json.dumps({"sequences": seqs}))
    return seqs


def _control(tmp_path: Path, length: float, seed: int = 0) -> str:
    path = tmp_path / "control.json"
    write_control(path, {"length": length, "record": str(tmp_path / "record.json"), "seed": seed})
    return str(path)


def test_a_control_write_never_shows_a_reader_a_partial_file(tmp_path):
    """The server reads the control file while the harness rewrites it (a P6 run once read it
    empty: JSONDecodeError, a failed propose): a reader that opened it before the write still
    reads the whole old setting, one that opens it after reads the whole new one."""
    path = tmp_path / "control.json"
    write_control(path, {"length": 1.0, "record": None})
    with open(path) as old:
        write_control(path, {"length": 4.0, "record": "r.json", "tag": "x" * 10000})
        assert json.loads(old.read()) == {"length": 1.0, "record": None}
    assert json.loads(path.read_text())["length"] == 4.0
    assert [p.name for p in tmp_path.iterdir()] == ["control.json"]


@pytest.mark.parametrize("length,want", [
    (1.0, [0.0] * 7), (4.0, [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]),
    (6.5, [1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0]), (8.0, [1.0] * 7)])
def test_rates_are_the_minimum_variance_schedule(length, want):
    assert acceptance_rates(length, K) == pytest.approx(want)
    with pytest.raises(ValueError):
        acceptance_rates(K + 1.5, K)


@pytest.mark.vllm033
def test_rates_match_vllm():
    from vllm.config.speculative import SpeculativeConfig
    for length in (1.0, 1.3, 2.0, 4.0, 5.25, 6.5, 8.0):
        assert acceptance_rates(length, K) == pytest.approx(
            SpeculativeConfig._acceptance_length_to_rates(length, K))


def _prefix(drafts: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(truth) and drafts[n] == truth[n]:
        n += 1
    return n


@pytest.mark.parametrize("length", [1.0, 2.3, 4.0, 6.5])
def test_proposals_follow_the_schedule(length):
    """Over 4,000 request-steps: position i is right (and so accepted by a greedy target) in
    the fraction ``rates[i]`` of them; after the first wrong draft every draft is wrong."""
    vocab, steps = 512, 4000
    gen = torch.Generator().manual_seed(5)
    seqs = torch.randint(0, vocab, (50, 200), generator=gen).tolist()
    oracle = Oracle(length, seqs, vocab, seed=11)
    rates = acceptance_rates(length, K)
    counts = [0] * K
    for step in range(steps):
        seq = seqs[step % 50]
        pos = KEY + step % 150
        truth = seq[pos + 1:pos + 1 + K]
        drafts = oracle.drafts(seq[:pos], seq[pos], K)
        n = _prefix(drafts, truth)
        assert all(d != t for d, t in zip(drafts[n:], truth[n:]))
        for i in range(n):
            counts[i] += 1
    for i, rate in enumerate(rates):
        sigma = (steps * rate * (1 - rate)) ** 0.5
        assert abs(counts[i] - steps * rate) <= 4 * sigma + 1e-9, (i, counts, rates)
    assert oracle.counts == {"requests": steps, "found": steps, "scheduled_accepts": sum(counts)}
    assert sum(counts) / steps == pytest.approx(length - 1, abs=0.05)


def test_unknown_request_or_wrong_anchor_gets_no_oracle_drafts():
    oracle = Oracle(8.0, [list(range(40))], 512)
    assert oracle.drafts(list(range(20)), 20, K) == list(range(21, 28))
    assert oracle.drafts(list(range(20)), 99, K) is None            # not the recorded token
    assert oracle.drafts([5] * 20, 20, K) is None                     # not in the record
    assert oracle.drafts(list(range(36)), 36, K)[:3] == [37, 38, 39]  # past the record: padded


def _fill(mirror: Mirror, gen: torch.Generator, seqs: list[list[int]], lengths: list[int]) -> list:
    states = []
    for n in lengths:
        s = mirror.new()
        mirror.ingest([(s, 0, random_rows(gen, n))])
        states.append(s)
    return states


def test_compute_is_the_dflash_step_and_drafts_are_the_record(ckpt, tmp_path):
    """Same weights, same rows: the oracle's own DFlash compute gives exactly the plain
    engine's drafts and logits; what it returns is the recorded continuation (length 8:
    every draft right)."""
    vocab = 512
    seqs = _record(tmp_path, 4, 120, vocab)
    plain = DFlashEngine(str(ckpt[0]), str(ckpt[1]), budget_bytes=BUDGET)
    oracle = OracleDFlashEngine(str(ckpt[0]), str(ckpt[1]), budget_bytes=BUDGET,
                                control=_control(tmp_path, 8.0))
    lengths = [17, 40, 9, 64]
    m_plain, m_oracle = Mirror(plain), Mirror(oracle)
    s_plain = _fill(m_plain, torch.Generator().manual_seed(2), seqs, lengths)
    s_oracle = _fill(m_oracle, torch.Generator().manual_seed(2), seqs, lengths)
    for step in range(3):
        anchors = [seqs[i][n + step] for i, n in enumerate(lengths)]
        hist = [seqs[i][:n + step] for i, n in enumerate(lengths)]
        from k3_accel.server.engines.base import ProposeBatch
        want = plain.propose(ProposeBatch(s_plain, hist, torch.tensor(anchors), K, logits="full")).wait()
        got = oracle.propose(ProposeBatch(s_oracle, hist, torch.tensor(anchors), K, logits="full")).wait()
        assert torch.equal(oracle.last_compute.tokens, want.tokens)
        assert torch.equal(got.logits, want.logits)
        for i, n in enumerate(lengths):
            assert got.tokens[i].tolist() == seqs[i][n + step + 1:n + step + 1 + K]
        rows = torch.Generator().manual_seed(10 + step)
        grow = [(s, plain.length(s), random_rows(rows, 1)) for s in s_plain]
        m_plain.ingest(grow)
        m_oracle.ingest([(s, oracle.length(s), r) for s, (_, _, r) in zip(s_oracle, grow)])
    assert oracle.oracle_counts()["found"] == 12


def test_control_file_switches_length_and_unknown_requests_keep_dflash_drafts(ckpt, tmp_path):
    vocab = 512
    seqs = _record(tmp_path, 2, 100, vocab)
    ctl = _control(tmp_path, 1.0)
    oracle = OracleDFlashEngine(str(ckpt[0]), str(ckpt[1]), budget_bytes=BUDGET, control=ctl)
    mirror = Mirror(oracle)
    states = _fill(mirror, torch.Generator().manual_seed(4), seqs, [30, 30])
    from k3_accel.server.engines.base import ProposeBatch
    hist = [seqs[0][:30], [7] * 30]                       # the second is not in the record
    batch = ProposeBatch(states, hist, torch.tensor([seqs[0][30], 3]), K)
    got = oracle.propose(batch).wait()
    truth = seqs[0][31:31 + K]
    assert _prefix(got.tokens[0].tolist(), truth) == 0     # length 1: nothing right
    assert torch.equal(got.tokens[1], oracle.last_compute.tokens[1])
    import os
    import time
    write_control(ctl, {"length": 8.0, "record": str(tmp_path / "record.json")})
    os.utime(ctl, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert oracle.propose(batch).wait().tokens[0].tolist() == truth


@pytest.mark.gpu
def test_cuda_graph_step_is_the_dflash_step(ckpt, tmp_path):
    """On CUDA (bf16, Triton kernels, CUDA graphs): the oracle's own compute is the plain
    engine's graph replay, and it returns the record (length 8)."""
    from k3_accel.server.engines.base import ProposeBatch
    seqs = _record(tmp_path, 3, 100, 512)
    kw = dict(device="cuda", dtype="bfloat16", budget_bytes=BUDGET, max_spec_tokens=K)
    plain = DFlashEngine(str(ckpt[0]), str(ckpt[1]), **kw)
    oracle = OracleDFlashEngine(str(ckpt[0]), str(ckpt[1]), control=_control(tmp_path, 8.0), **kw)
    lengths = [20, 33, 48]
    s_plain = _fill(Mirror(plain), torch.Generator().manual_seed(6), seqs, lengths)
    s_oracle = _fill(Mirror(oracle), torch.Generator().manual_seed(6), seqs, lengths)
    anchors, hist = [seqs[i][n] for i, n in enumerate(lengths)], [seqs[i][:n] for i, n in enumerate(lengths)]
    want = plain.propose(ProposeBatch(s_plain, hist, torch.tensor(anchors), K)).wait()
    got = oracle.propose(ProposeBatch(s_oracle, hist, torch.tensor(anchors), K)).wait()
    assert oracle.graphs is not None
    assert torch.equal(oracle.last_compute.wait().tokens, want.tokens)
    for i, n in enumerate(lengths):
        assert got.tokens[i].tolist() == seqs[i][n + 1:n + 1 + K]
