"""A step's reply holds only that step's drafts, -1 everywhere else.

The draft thread writes each proposing step's drafts into one of two pinned reply slots
(``seq % 2``), so step ``s + 2`` reuses step ``s``'s slot. A request that has no drafts this
step (not kept: vLLM skipped it, its drafting is off, it has just joined the batch and sits
out, ...) must read -1 in its row, never what another request (or itself) got two steps
earlier in that row.

Real pieces, on CPU: the launch of a V2 step (:func:`~k3_accel.vllm.spec_decode.v2_launch.launch`
with its device rows and launch slots), the :class:`DraftPipeline` on a :class:`HostFence`, a
:class:`DraftClient` and a ``k3-draft-server --engine ngram`` process. Simulated: the batch
(vLLM's ``InputBatch`` field names) and the sampler (the test picks the sampled tokens).
"""
from __future__ import annotations

import random
import types

import numpy as np
import torch

from helpers.server import ServerProcess
from helpers.steps import settings
from helpers.v2_sim import expected

K = 4
MAX_REQS = 8
CAPACITY = 512


class Sim:
    """The batch and the requests' histories as the server must see them."""

    def __init__(self):
        self.hist: dict[str, list[int]] = {}     # tokens shipped so far (the server's context)
        self.anchor: dict[str, int] = {}         # the last sampled token (not shipped yet)
        self.prompt: dict[str, list[int]] = {}
        self.slot: dict[str, int] = {}           # the request's persistent slot (vLLM's idx_mapping)
        self.last = torch.zeros(MAX_REQS, 1, dtype=torch.int64)     # last sampled token by slot
        self.nxt = torch.zeros(1, MAX_REQS, dtype=torch.int32)      # next prefill token by slot

    def add(self, rid: str, prompt: list[int], anchor: int) -> None:
        free = sorted(set(range(MAX_REQS)) - set(self.slot.values()))
        self.slot[rid] = free[0]
        self.prompt[rid] = prompt
        self.hist[rid] = []
        self.anchor[rid] = anchor

    def drop(self, rid: str) -> None:
        for d in (self.slot, self.prompt, self.hist, self.anchor):
            d.pop(rid)

    def batch(self, order: list[str], kept: set[str], sampled: dict[str, int]):
        """A step of the requests in ``order``: a kept request ships what the server has not seen
        (its prompt the first time, then its last sampled token) and anchors on ``sampled[rid]``;
        a request not kept has one row this step that the launch leaves out."""
        chunks, positions = [], []
        for rid in order:
            if rid in kept:
                chunk = self.prompt[rid] if not self.hist[rid] else [self.anchor[rid]]
                start = len(self.hist[rid])
            else:
                chunk, start = [7], 0
            chunks.append(chunk)
            positions.append(torch.arange(start, start + len(chunk)))
        counts = np.array([len(c) for c in chunks], dtype=np.int32)
        qsl = np.zeros(len(order) + 1, dtype=np.int32)
        np.cumsum(counts, out=qsl[1:])
        slots = np.array([self.slot[rid] for rid in order], dtype=np.int64)
        for rid in kept:
            self.last[self.slot[rid], 0] = sampled[rid]
        return types.SimpleNamespace(
            req_ids=list(order), num_reqs=len(order), idx_mapping=torch.from_numpy(slots), idx_mapping_np=slots,
            query_start_loc=torch.from_numpy(qsl), query_start_loc_np=qsl,
            input_ids=torch.tensor([t for c in chunks for t in c], dtype=torch.int32),
            positions=torch.cat(positions), num_scheduled_tokens=counts), chunks

    def shipped(self, order: list[str], kept: set[str], chunks, sampled: dict[str, int]) -> None:
        for rid, chunk in zip(order, chunks):
            if rid in kept:
                self.hist[rid] += chunk
                self.anchor[rid] = sampled[rid]


def _pattern(rng: random.Random) -> list[int]:
    """A prompt that repeats a short phrase: the n-gram lookup finds drafts in it."""
    phrase = [rng.randrange(10, 400) for _ in range(rng.randrange(3, 6))]
    return (phrase * 4)[: rng.randrange(8, 4 * len(phrase) + 1)]


class Harness:
    def __init__(self, server: ServerProcess):
        from k3_accel.transport.client import DraftClient
        from k3_accel.vllm.spec_decode.fence import HostFence
        from k3_accel.vllm.spec_decode.pipeline import DraftPipeline
        from k3_accel.vllm.spec_decode.v2_launch import DeviceRows, LaunchSlots

        self.failures: list[str] = []
        self.pipe = DraftPipeline(DraftClient(settings(server.address, num_speculative_tokens=K)), HostFence(),
                                  MAX_REQS, K, lambda kind, what: self.failures.append(f"{kind}: {what}"))
        self.rows = DeviceRows(CAPACITY, 0, torch.bfloat16, MAX_REQS, torch.device("cpu"))
        self.slots = LaunchSlots(2, CAPACITY, 0, torch.bfloat16, MAX_REQS, pin=False)
        self.sim = Sim()
        assert self.pipe.call(lambda c: c.server_stats(), timeout=60) is not None    # connected

    def step(self, order: list[str], kept: set[str], k: int, sampled: dict[str, int]):
        """One step; for a proposing step (``k > 0``) its fence value, the reply read as the V2
        speculator reads it (``[len(order), k]``) and what each row must hold."""
        from k3_accel.vllm.spec_decode.v2_launch import launch

        sim = self.sim
        batch, chunks = sim.batch(order, kept, sampled)
        keep = np.array(sorted(order.index(rid) for rid in kept), dtype=np.int64)
        r = len(order)
        num_sampled = torch.tensor([1 if rid in kept else 0 for rid in order], dtype=torch.int32)
        step = launch(self.rows, self.slots, batch, None, num_sampled, torch.zeros(r, dtype=torch.int32),
                      sim.last, sim.nxt, keep, k, {}, None, 30.0)
        seq = self.pipe.submit(step, propose=k > 0)
        sim.shipped(order, kept, chunks, sampled)
        if k == 0:
            assert seq is None
            return None
        assert self.pipe.fence.wait(seq, 60)
        got = self.pipe.reply_rows(seq, r, k).clone()
        conf = self.pipe.confidence_rows(seq, r, k).clone()
        want = [expected(sim.hist[rid], sim.anchor[rid], k) if rid in kept else [-1] * k for rid in order]
        return seq, got, conf, want

    def close(self):
        self.pipe.close(10)


def test_a_request_without_drafts_two_steps_later_reads_none_of_the_old_ones():
    """The rule at its smallest: four requests draft in steps 1 and 2; in step 3 (step 1's slot)
    two of them are not kept, and a fifth joins at a row that had drafts and sits out."""
    server = ServerProcess("--engine", "ngram")
    h = Harness(server)
    try:
        rng = random.Random(1)
        ids = ["a", "b", "c", "d"]
        for rid in ids:
            prompt = _pattern(rng)
            h.sim.add(rid, prompt, prompt[1])          # anchored inside the phrase: the lookup finds drafts
        seq1, got1, _, want1 = h.step(ids, set(ids), K, {rid: h.sim.prompt[rid][2] for rid in ids})
        assert got1.tolist() == want1
        assert all(t >= 0 for row in want1 for t in row[:1])     # every row had drafts in slot seq1 % 2
        seq2, got2, _, want2 = h.step(ids, set(ids), K, {rid: h.sim.prompt[rid][3] for rid in ids})
        assert got2.tolist() == want2
        h.sim.drop("d")
        h.sim.add("e", _pattern(rng), 1)
        order = ["a", "b", "c", "e"]                    # e joins at d's row
        seq3, got3, conf3, want3 = h.step(order, {"a", "c"}, K, {"a": h.sim.prompt["a"][4], "c": 5})
        assert seq3 % 2 == seq1 % 2                     # the slot of step 1, reused
        assert got3[1].tolist() == [-1] * K and got3[3].tolist() == [-1] * K
        assert got3.tolist() == want3
        assert (conf3 == -1).all()                      # the n-gram server sends no confidence
        assert h.failures == []
    finally:
        h.close()
        server.stop()


def test_replies_over_many_steps_of_mixed_batches_hold_only_their_own_step():
    """Many steps at every batch size up to ``MAX_REQS``: requests join, leave, are kept or not,
    the order changes, the draft length changes and ingest-only steps come between proposing
    ones. After every proposing step each row holds exactly that step's drafts for the request
    now in it (the n-gram lookup over what it shipped), and -1 for a request not kept."""
    server = ServerProcess("--engine", "ngram")
    h = Harness(server)
    rng = random.Random(25)
    live: list[str] = []
    made = 0
    exercised = 0                    # rows not kept that held drafts in their slot two steps earlier
    previous: dict[int, torch.Tensor] = {}    # slot -> the reply last read from it (full k)
    try:
        for _ in range(60):
            while len(live) < MAX_REQS and (not live or rng.random() < 0.4):
                made += 1
                rid = f"r{made}"
                prompt = _pattern(rng)
                h.sim.add(rid, prompt, rng.choice(prompt))
                live.append(rid)
            order = rng.sample(live, rng.randrange(1, len(live) + 1))
            rng.shuffle(order)
            kept = {rid for rid in order if rng.random() < 0.5} or {order[0]}
            sampled = {rid: rng.choice(h.sim.prompt[rid] + [rng.randrange(10, 400)]) for rid in kept}
            k = 0 if rng.random() < 0.15 else rng.randrange(1, K + 1)
            out = h.step(order, kept, k, sampled)
            if out is not None:
                seq, got, conf, want = out
                assert got.tolist() == want, f"step {seq}: order {order}, kept {sorted(kept)}, k {k}"
                assert (conf == -1).all()
                old = previous.get(seq % 2)
                if old is not None:
                    exercised += sum(1 for i, rid in enumerate(order)
                                     if rid not in kept and i < old.shape[0] and (old[i, :k] >= 0).any())
                previous[seq % 2] = got
            if len(live) > 2 and rng.random() < 0.2:
                gone = rng.choice(live)
                live.remove(gone)
                h.sim.drop(gone)
                h.pipe.call(lambda c, gone=gone: c.finish([gone]), timeout=60)
        assert exercised >= 10           # the mix did reuse slots under requests without drafts
        assert h.failures == []
    finally:
        h.close()
        server.stop()
