"""Method ``dspark`` on vLLM 0.33's V2 runner goes remote like ``dflash``: the real
``VllmConfig`` (tiny Qwen3 target + tiny DSpark draft in vLLM's layout, K=4), the wrapped
``init_speculator``, vLLM's own ``InputBatch`` / ``RequestState`` on CPU (``helpers.v2_sim``)
and a real ``k3-draft-server --engine dspark``. The drafts equal the DSpark engine's over the
rows the step shipped; with ``enable_adaptive_verification`` the server's per-draft confidence
lands in ``draft_token_confidence_probs`` (what the runner hands adaptive verification); a
server whose draft does not fit the target's (engine, layout, vocabulary, Markov rank) is
refused at hello and the target runs without drafts."""
from __future__ import annotations

import os

import pytest
import torch

from dflash_support import Mirror
from helpers.server import ServerProcess
from helpers.v2_sim import AUX_LAYERS, HIDDEN, K, MAX_MODEL_LEN, MAX_REQS, MAX_TOKENS, VOCAB, Sched, Sim
from helpers.v2_sim import client_stats, vllm_world
from k3_accel.server.engines.dflash import DSparkEngine
from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target
from k3_accel.testing.tiny_dspark import write_tiny_dspark

pytestmark = [pytest.mark.vllm, pytest.mark.vllm033]
spec_decode = pytest.importorskip("vllm.v1.worker.gpu.spec_decode")


def _config(target, draft, adaptive: bool):
    from vllm.engine.arg_utils import EngineArgs
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"          # DSpark exists on the V2 runner only
    spec = {"method": "dspark", "model": str(draft), "num_speculative_tokens": K}
    config = EngineArgs(model=str(target), max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_TOKENS,
                        max_num_seqs=MAX_REQS, enforce_eager=True, speculative_config=spec).create_engine_config()
    # vLLM refuses adaptive verification without full CUDA graphs (none on this CPU box): set the
    # flag the speculator reads after validation, as a GPU config would carry it
    config.speculative_config.enable_adaptive_verification = adaptive
    return config


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("v2_dspark")
    target = write_tiny_target(root / "target", vocab_size=VOCAB, hidden_size=HIDDEN, dtype="bfloat16")
    kw = dict(target_layer_ids=AUX_LAYERS, dtype="bfloat16")
    return {"target": target,
            "dspark": write_tiny_dspark(root / "dspark", target, **kw),
            "no_head": write_tiny_dspark(root / "no_head", target, confidence=False, **kw),
            "fill_in": write_tiny_dspark(root / "fill_in", target, sample_from_anchor=False, **kw),
            "dflash": write_tiny_dflash(root / "dflash", target, **kw)}


@pytest.fixture(scope="module")
def config(models):
    return _config(models["target"], models["dspark"], adaptive=True)


@pytest.fixture(scope="module")
def world(config):
    with vllm_world(config) as group:
        yield group


def _server(models, name: str, engine: str = "dspark") -> ServerProcess:
    return ServerProcess("--engine", engine, "--draft-model", str(models[name]), "--target-model",
                         str(models["target"]), "--block-size", "4", "--memory-budget-mb", "2",
                         "--num-speculative-tokens", str(K))


def _speculator(config, address, sim, monkeypatch):
    from k3_accel.vllm.spec_decode import hooks
    hooks.install_v2()
    monkeypatch.setenv("VLLM_K3_DRAFT_REMOTE_ADDRESS", address)
    monkeypatch.setenv("VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS", "60000")   # a CPU engine's propose, not a GPU's
    monkeypatch.setenv("VLLM_K3_DRAFT_ADAPTIVE", "0")                 # every step asks for K drafts
    return spec_decode.init_speculator(config, torch.device("cpu"), sim.req_states)


def _aux(positions) -> torch.Tensor:
    """The rows the step ships for ``positions``: the fake target's aux layers, concatenated."""
    return torch.cat([torch.stack([Sim.aux_row(p, j) for p in positions]) for j in range(len(AUX_LAYERS))],
                     dim=1).to(torch.bfloat16)


def _two_steps(spec, sim, **sampling):
    """A prefill that samples, then a verify step accepting 1 of 4: what the engine must have seen."""
    a, b = [5, 6, 7, 8, 9, 10, 11], [40, 41, 42]
    sim.add("a", a)
    sim.add("b", b)
    first = sim.propose(spec, [Sched("a", 0, a, sampled=12), Sched("b", 0, b, sampled=43)], **sampling).clone()
    conf1 = spec.draft_token_confidence_probs[:2].clone()
    second = sim.propose(spec, [Sched("a", 7, [12, 1, 2, 3, 4], sampled=9, rejected=3, drafts=4),
                                Sched("b", 3, [43], sampled=44)], **sampling).clone()
    conf2 = spec.draft_token_confidence_probs[:2].clone()
    return [(first, conf1, [(0, 7, 12), (0, 3, 43)]), (second, conf2, [(7, 2, 9), (3, 1, 44)])]


def _engine_says(models, name, steps, temperature=None, seeds=None):
    """The DSpark engine in process over the same rows: (drafts, confidence) per step."""
    m = Mirror(DSparkEngine(str(models[name]), str(models["target"]), block_size=4, budget_bytes=1 << 20))
    states = [m.new(), m.new()]
    out = []
    for spans in steps:
        m.ingest([(s, start, _aux(range(start, start + n))) for s, (start, n, _) in zip(states, spans)])
        p = m.propose(states, [anchor for *_, anchor in spans], K, logits="none", temperature=temperature,
                      seeds=seeds)
        out.append((p.tokens, p.confidence))
    return out


def test_v2_dspark_goes_remote(models, config, world, monkeypatch):
    from k3_accel.vllm.spec_decode.methods import draft_signature, unserved_reason
    assert config.speculative_config.method == "dspark" and unserved_reason(config.speculative_config) is None
    assert draft_signature(config.speculative_config)["engine"] == "dspark"
    server, sim = _server(models, "dspark"), Sim()
    try:
        spec = _speculator(config, server.address, sim, monkeypatch)
        try:
            assert type(spec).__name__ == "RemoteSpeculatorV2"
            stats = client_stats(spec)
            assert stats["state"] == "ready" and stats["engine"] == "dspark"
            assert spec.core.session.ships_hidden and spec.core.session.facts.aux_layer_ids == AUX_LAYERS
            got = _two_steps(spec, sim)
            want = _engine_says(models, "dspark", [spans for *_, spans in got])
            for (drafts, _, _), (tokens, _) in zip(got, want):
                assert drafts.tolist() == tokens.tolist()
            assert len(set(got[0][0].reshape(-1).tolist())) > 1          # not degenerate
        finally:
            spec.close()
    finally:
        assert server.stop() == 0


def test_v2_rows_compacted_into_a_ring_slot_draft_what_the_host_path_drafts(models, config, world, monkeypatch):
    """The speculator with the device plane's ring on (a host-memory ring stands in for the CUDA one
    this machine lacks; the transport then reads the slot like any rows): a step that fits a slot is
    launched into it, a longer one through pinned memory (counted), and the drafts are the engine's."""
    from helpers.standin import host_ring
    server, sim = _server(models, "dspark"), Sim()
    try:
        spec = _speculator(config, server.address, sim, monkeypatch)
        try:
            ring = host_ring(2, 8, HIDDEN * len(AUX_LAYERS))      # the prefill's 10 rows do not fit, 6 do
            monkeypatch.setattr(spec.core.session, "plane_ring", lambda: ring)
            taken = []
            take = ring.take
            monkeypatch.setattr(ring, "take", lambda: taken.append(take()) or taken[-1])
            got = _two_steps(spec, sim)
            want = _engine_says(models, "dspark", [spans for *_, spans in got])
            for (drafts, _, _), (tokens, _) in zip(got, want):
                assert drafts.tolist() == tokens.tolist()
            spec.flush()
            assert taken == [0] and ring.holds == [0, 0]           # only the second step fitted a slot
            assert spec.stats()["adapter"]["ring_host_steps"] == 1
        finally:
            spec.close()
    finally:
        assert server.stop() == 0


def test_v2_dspark_samples_with_the_requests_seeds(models, world, monkeypatch):
    """``draft_sample_method: probabilistic``: each request's temperature and seed (the runner's
    sampling state, by slot) reach the server, whose drafts are the engine's sampled ones for them."""
    cfg = _config(models["target"], models["dspark"], adaptive=False)
    cfg.speculative_config.draft_sample_method = "probabilistic"
    server, sim = _server(models, "dspark"), Sim()
    temperature = torch.tensor([1.3, 0.0, 0.7, 2.0] * (sim.max_num_reqs // 4 + 1))[:sim.max_num_reqs]
    seeds = torch.arange(sim.max_num_reqs, dtype=torch.int64) * 7_919_000_013 - 2**40
    try:
        spec = _speculator(cfg, server.address, sim, monkeypatch)
        try:
            assert spec.sample_drafts and client_stats(spec)["state"] == "ready"
            got = _two_steps(spec, sim, temperature=temperature, seeds=seeds)
            slots = [sim.req_states.req_id_to_index[r] for r in ("a", "b")]
            per_request = dict(temperature=temperature[slots].tolist(), seeds=seeds[slots].tolist())
            assert per_request["temperature"][0] > 0
            spans = [spans for *_, spans in got]
            want = _engine_says(models, "dspark", spans, **per_request)
            greedy = _engine_says(models, "dspark", spans)
            for (drafts, _, _), (tokens, _) in zip(got, want):
                assert drafts.tolist() == tokens.tolist()
            assert any(d.tolist() != g.tolist() for (d, _, _), (g, _) in zip(got, greedy))   # it sampled
        finally:
            spec.close()
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("server_model,adaptive", [("dspark", True), ("no_head", True), ("dspark", False)])
def test_dspark_confidence_reaches_vllm(models, config, world, monkeypatch, server_model, adaptive):
    """With adaptive verification and a confidence head: the server's sigmoid(confidence) per draft,
    in batch order, where the in-tree speculator writes it; without either: 1 per draft."""
    cfg = config if adaptive else _config(models["target"], models["dspark"], adaptive=False)
    server, sim = _server(models, server_model), Sim()
    try:
        spec = _speculator(cfg, server.address, sim, monkeypatch)
        try:
            assert client_stats(spec)["state"] == "ready"
            got = _two_steps(spec, sim)
            want = _engine_says(models, server_model, [spans for *_, spans in got])
            for (drafts, conf, _), (tokens, confidence) in zip(got, want):
                assert drafts.tolist() == tokens.tolist()
                if adaptive and confidence is not None:
                    torch.testing.assert_close(conf, confidence.float(), atol=1e-6, rtol=0)
                    assert ((conf > 0) & (conf < 1)).all() and not torch.equal(conf, torch.ones_like(conf))
                else:
                    assert torch.equal(conf, torch.ones_like(conf))
            # a request without drafts this step gets confidence 0 (no verification budget)
            sim.add("c", [70, 71, 72, 73] * 3)
            sim.propose(spec, [Sched("c", 0, [70, 71, 72, 73] * 2, next_prompt=70)])
            assert torch.equal(spec.draft_token_confidence_probs[:1], torch.zeros(1, K))
        finally:
            spec.close()
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("server_model,engine,why", [
    ("fill_in", "dspark", "draft sample_from_anchor: server False, target's draft config True"),
    ("dflash", "dflash", "draft engine: the target's method needs a dspark server, the server runs dflash")])
def test_dspark_handshake_mismatch_fails_closed(models, config, world, monkeypatch, server_model, engine, why):
    server, sim = _server(models, server_model, engine), Sim()
    try:
        spec = _speculator(config, server.address, sim, monkeypatch)
        try:
            stats = client_stats(spec, ready=False)
            import time
            deadline = time.monotonic() + 30
            while not stats.get("incompatible") and time.monotonic() < deadline:
                time.sleep(0.05)
                stats = client_stats(spec, ready=False)
            assert why in (stats.get("incompatible") or ""), stats.get("incompatible")
            a = [5, 6, 7, 8, 9, 10, 11]
            sim.add("a", a)
            d = sim.propose(spec, [Sched("a", 0, a, sampled=12)])
            assert d.tolist() == [[12] * K]                          # no drafts: the last sampled token
            assert torch.equal(spec.draft_token_confidence_probs[:1], torch.zeros(1, K))
        finally:
            spec.close()
    finally:
        assert server.stop() == 0
