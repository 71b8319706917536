"""The target's facts, the TP-rank-0 draft thread and the broadcast that gives every rank the same drafts.

Rank 0 of the TP group owns the :class:`~.pipeline.DraftPipeline` (the one
thread that talks to the server); every rank calls the session in lockstep
and gets the same drafts. "No draft" comes from the transport (-1,
:meth:`StepOutput.empty` when a step fails); the runner adapters convert it
to what their runner needs.

The broadcast goes through a communicator vLLM has already set up: its
PyNCCL communicator on the current stream for device tensors, the group's
CPU (gloo) group for host tensors. A failure there fails the step closed.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch

from k3_accel.config import from_vllm
from k3_accel.transport.api import ClientSettings, StepInput, StepOutput
from k3_accel.vllm.spec_decode.methods import HIDDEN_METHODS, draft_signature

if TYPE_CHECKING:
    from k3_accel.vllm.spec_decode.core import FailureLog

log = logging.getLogger("k3_accel.vllm")


@dataclass(frozen=True)
class TargetFacts:
    """What the client must know about the target (from vLLM's config, never from the server)."""
    method: str
    num_speculative_tokens: int
    aux_layer_ids: tuple[int, ...]     # target layers whose outputs are shipped (empty: none)
    hidden_size: int
    hidden_dtype: torch.dtype
    max_rows: int
    vocab_size: int = 0
    max_num_seqs: int = 0
    adaptive_verification: bool = False     # vLLM's: it verifies a step's drafts by the step before's confidence

    @property
    def context_width(self) -> int:
        return len(self.aux_layer_ids) * self.hidden_size


def aux_layer_ids(spec: Any) -> tuple[int, ...]:
    """The target layers whose outputs vLLM captures for the draft, ascending, each once.

    vLLM decides (``get_eagle3_aux_layers_from_config``: capture indices, i.e. the
    layer id + 1, then ``sorted(set(...))`` when the model installs them); this
    turns its answer back into layer ids. A vLLM without that function (a draft
    host's doctor): the draft config's keys in vLLM's order
    (:func:`~k3_accel.server.engines.dflash.dspark_config.layer_ids`), sorted and
    deduplicated the same way.
    """
    if spec.method not in HIDDEN_METHODS:
        return ()
    try:
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    except ImportError:
        get_eagle3_aux_layers_from_config = None
    if get_eagle3_aux_layers_from_config is not None:
        captured = get_eagle3_aux_layers_from_config(spec)
        ids = [int(i) - 1 for i in captured or ()]
    else:
        from k3_accel.server.engines.dflash.dspark_config import layer_ids
        hf = spec.draft_model_config.hf_config
        ids = [int(i) for i in layer_ids(hf.to_dict() if hasattr(hf, "to_dict") else vars(hf)) or ()]
    if not ids or min(ids) < 0:
        raise ValueError(f"draft config of {spec.model} names no usable target layer ids "
                         f"(dflash_config.target_layer_ids)")
    return tuple(sorted(set(ids)))


def target_facts(vllm_config: Any) -> TargetFacts:
    spec = vllm_config.speculative_config
    model = vllm_config.model_config
    sched = vllm_config.scheduler_config
    return TargetFacts(method=spec.method, num_speculative_tokens=int(spec.num_speculative_tokens),
                       aux_layer_ids=aux_layer_ids(spec), hidden_size=int(model.get_hidden_size()),
                       hidden_dtype=model.dtype, max_rows=int(sched.max_num_batched_tokens),
                       vocab_size=int(model.get_vocab_size()), max_num_seqs=int(sched.max_num_seqs),
                       adaptive_verification=bool(getattr(spec, "enable_adaptive_verification", False)))


def client_settings(vllm_config: Any, facts: TargetFacts, rows_on: torch.device | None = None) -> ClientSettings:
    """The transport settings of this engine (the plugin config plus the target's facts).
    ``rows_on``: the CUDA device the steps' hidden rows are on, when they are handed to the
    transport there (V1), or compacted by the V2 launch into the session's ring: only then may the
    device plane carry them (its ring is allocated now, before vLLM profiles memory); else the plane
    is off and no device ring is made."""
    f = facts
    config = from_vllm(vllm_config)
    on_device = rows_on is not None and rows_on.type == "cuda"
    return ClientSettings.from_config(
        config, device_plane=config.device_plane if on_device else "off",
        device=str(rows_on) if on_device else None, max_rows=f.max_rows, context_width=f.context_width,
        hidden_dtype=f.hidden_dtype, num_speculative_tokens=f.num_speculative_tokens,
        target_vocab_size=f.vocab_size, hidden_size=f.hidden_size if f.aux_layer_ids else 0,
        aux_layer_ids=f.aux_layer_ids, max_requests=f.max_num_seqs, client_name=_client_name(vllm_config),
        draft=draft_signature(vllm_config.speculative_config))


# the V2 launch's device ring (device plane): slots of one whole decode step's rows each (a step with
# more rows, a long prefill chunk, takes the host path); enough slots for the draft thread's usual lag
V2_RING_DEPTH = 4


def launch_ring(settings: ClientSettings, facts: TargetFacts):
    """``(settings, ring)``: the :class:`~k3_accel.transport.device_plane.DeviceRing` the V2 launch
    compacts a step's hidden rows into, ``V2_RING_DEPTH`` slots of ``max_num_seqs x (1 + K)`` rows
    (at most ``max_rows``), allocated now, before vLLM profiles memory; ``(settings with the plane
    off, None)`` when it cannot be made (the reason is logged)."""
    if settings.device_plane == "off" or settings.device is None or not facts.context_width:
        return settings, None
    from k3_accel.transport.device_plane import DeviceRing
    rows = min(facts.max_rows, max(facts.max_num_seqs, 1) * (1 + facts.num_speculative_tokens))
    try:
        return settings, DeviceRing(V2_RING_DEPTH, rows, facts.context_width, facts.hidden_dtype, settings.device)
    except Exception as exc:  # noqa: BLE001 - the host path always works
        log.warning("k3-accel: no device ring for the V2 launch (%s: %s); hidden rows take the host path",
                    type(exc).__name__, exc)
        return dataclasses.replace(settings, device_plane="off"), None


def make_controller(config: Any, facts: TargetFacts):
    """The per-step K controller (None: ``adaptive`` off, a fixed K)."""
    from k3_accel.vllm.spec_decode.controller import Controller, ControllerSettings
    k = facts.num_speculative_tokens
    if not config.adaptive or k < 1:
        return None
    # a probe drafts fully for one step, two with vLLM's adaptive verification (it leaves the first
    # step's drafts unverified: it sizes a step from the confidences of the step before)
    return Controller(ControllerSettings(k_max=k, k_min=min(config.adaptive_min_k, k),
                                         probe_interval=config.adaptive_probe_interval,
                                         probe_steps=2 if facts.adaptive_verification else 1,
                                         confidence=facts.adaptive_verification))


def _client_name(vllm_config: Any) -> str:
    """``vllm-dp<rank>`` (a label for the server's logs and metrics; the session key is random)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    return f"vllm-dp{int(getattr(parallel, 'data_parallel_rank', 0) or 0)}"


def _tp_group():
    from vllm.distributed.parallel_state import get_tp_group
    return get_tp_group()


def broadcaster(group: Any, device: torch.device):
    """``send(tensor)``: rank 0's tensor to every rank of ``group`` in place, through a
    communicator vLLM set up already (see the module docstring); raises RuntimeError
    when there is none for ``device``."""
    if group.world_size == 1:
        return lambda t: None
    if device.type == "cuda":
        pynccl = getattr(getattr(group, "device_communicator", None), "pynccl_comm", None)
        if pynccl is None or getattr(pynccl, "disabled", True):
            raise RuntimeError("the TP group has no PyNCCL communicator to broadcast drafts with")
        return lambda t: pynccl.broadcast(t, src=0)
    import torch.distributed as dist
    src = group.ranks[0]
    return lambda t: dist.broadcast(t, src=src, group=group.cpu_group)


def every_rank(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank of the TP group (a MIN all-reduce over its CPU group, once, at
    construction): remote drafting is on on every rank or on none, or a rank with it off would never
    reach the drafts' broadcast the others wait in. ``ok`` where there is no TP group to ask."""
    try:
        group = _tp_group()
    except Exception:  # noqa: BLE001 - no distributed state: this rank alone
        return ok
    if group.world_size == 1:
        return ok
    import torch.distributed as dist
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return bool(flag.item())


# how much longer than the propose timeout the GPU may wait for a step's drafts (the device-to-host
# copy, the thread's wake-up, building and staging the message): see pipeline.py
DEADLINE_MARGIN_S = 0.05


class RemoteDraftSession:
    """The rank-0 draft thread plus the broadcast that gives every TP rank the same drafts."""

    def __init__(self, vllm_config: Any, device: torch.device, failures: FailureLog, device_rows: bool = False,
                 ring: bool = False):
        """``device_rows``: steps hand the transport hidden rows on ``device`` (V1); ``ring``: the V2
        launch compacts them into a device ring of the session's own (:func:`launch_ring`)."""
        self.facts = target_facts(vllm_config)
        self.device = device
        self.failures = failures
        self.group = _tp_group()
        self._broadcast = broadcaster(self.group, device)
        self.pipeline = None
        self.settings = None
        self.ring = None
        if self.group.rank_in_group == 0:
            from k3_accel.transport.client import DraftClient
            from k3_accel.vllm.spec_decode.fence import make_fence
            from k3_accel.vllm.spec_decode.gate import Gate
            from k3_accel.vllm.spec_decode.pipeline import DraftPipeline
            settings = client_settings(vllm_config, self.facts, device if device_rows or ring else None)
            if ring:
                settings, self.ring = launch_ring(settings, self.facts)
            self.settings = settings
            config = from_vllm(vllm_config)
            controller = make_controller(config, self.facts)
            self.pipeline = DraftPipeline(DraftClient(settings, self.ring), make_fence(device), self.facts.max_num_seqs,
                                          self.facts.num_speculative_tokens, self._thread_failure,
                                          controller=controller,
                                          gate=None if controller is None else Gate.for_engine(vllm_config, True),
                                          # past the longest a healthy step can take (its sender, ring and
                                          # device-slot waits, each up to the timeout); the GPU has the deadline
                                          stall_s=4 * settings.timeout_s + 5.0,
                                          deadline_s=settings.propose_timeout_s + DEADLINE_MARGIN_S,
                                          priority=config.draft_priority)
            log.info("k3-accel: remote drafting via %s (method=%s, K=%d, context width %d)",
                     settings.address, self.facts.method, self.facts.num_speculative_tokens,
                     self.facts.context_width)

    @property
    def ships_hidden(self) -> bool:
        return self.facts.context_width > 0

    def plane_ring(self):
        """The V2 launch's ring while the server has it (the device plane is on), else None."""
        client = self.client
        return self.ring if self.ring is not None and client is not None and client.plane.on else None

    @property
    def is_driver(self) -> bool:
        """This rank owns the client (TP rank 0) and must build the step input."""
        return self.pipeline is not None

    @property
    def client(self):
        return self.pipeline.client if self.pipeline is not None else None

    def _thread_failure(self, kind: str, what: str) -> None:
        self.failures.record(kind, what)

    def _wait_s(self) -> float:
        s = self.settings
        return s.timeout_s + s.propose_timeout_s if s is not None else 60.0

    # ------------------------------------------------------------ V1 (host input)
    def step(self, inp: StepInput | None, num_requests: int, k: int) -> torch.Tensor:
        """Drafts ``[num_requests, k]`` int64 on ``self.device``, identical on every rank.

        The driver passes the step's input (None: no drafts this step); other
        ranks pass None. Never raises for a client error: the step fails closed
        (no drafts), so every rank still reaches the broadcast.
        """
        drafts = None
        if self.pipeline is not None and inp is not None:
            drafts = self._drive(inp, num_requests, k)
        if drafts is None:
            drafts = torch.full((num_requests, k), -1, dtype=torch.int64, device=self.device)
        self.broadcast(drafts)
        return drafts

    def _drive(self, inp: StepInput, num_requests: int, k: int) -> torch.Tensor | None:
        try:
            out: StepOutput | None = self.pipeline.step_v1(inp, self._wait_s())
            if out is None:                 # an off step, handed over without waiting: no drafts
                return None
            if tuple(out.drafts.shape) != (num_requests, k):
                raise ValueError(f"drafts shape {list(out.drafts.shape)} != [{num_requests}, {k}]")
            return out.drafts.to(self.device)
        except Exception:  # noqa: BLE001 - fail closed; the transport disabled what it had to
            self.failures.record("step", "the remote draft step")
            return None

    def broadcast(self, drafts: torch.Tensor) -> None:
        """Rank 0's drafts to every rank (in place; nothing with one rank or ``k == 0``)."""
        if self.group.world_size == 1 or drafts.numel() == 0:
            return
        try:
            self._broadcast(drafts)
        except Exception:  # noqa: BLE001 - fail closed on this rank
            drafts.fill_(-1)
            self.failures.record("broadcast", "broadcasting the drafts to the TP group")

    # --------------------------------------------------------- the draft thread
    def link_down(self, req_ids: list[str]) -> bool:
        """Driver: True when the link to the server is not up; the step then gathers and sends
        nothing, and the draft thread only keeps the link moving and marks ``req_ids``."""
        client = self.client
        if client is None or not client.down:
            return False
        self.pipeline.call(lambda c: c.skip_step(req_ids), wait=False, after_held=True)
        return True

    def finish(self, req_ids: Iterable[str]) -> None:
        if self.pipeline is not None:
            self.pipeline.finish(list(req_ids))

    def wants_history(self) -> frozenset[str]:
        """Requests whose next rows must come with their token history (drafting again)."""
        client = self.client
        return client.wants_history() if client is not None else frozenset()

    def flush(self) -> None:
        """Wait until everything handed to the draft thread is on the server (tests, shutdown)."""
        if self.pipeline is not None:
            self.pipeline.flush(self._wait_s())

    def stats(self) -> dict:
        if self.pipeline is None:
            return {}
        controller, off_rows = self.pipeline.controller, self.pipeline.off_rows

        def stats(client):
            from k3_accel.vllm.spec_decode.gate import STATE
            return {**client.stats(), "controller": controller.snapshot() if controller is not None else None,
                    "off_rows": off_rows.stats(),
                    "gate": {role: dict(v) if v else None for role, v in STATE.items()}}
        return self.pipeline.call(stats, timeout=self._wait_s())

    def close(self) -> None:
        if self.pipeline is not None:
            pipeline, self.pipeline = self.pipeline, None
            pipeline.close(self._wait_s())
