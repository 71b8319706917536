"""The vLLM-independent step API: settings, one step's input, one step's output."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from k3_accel.config import ConfigError, check_address
from k3_accel.transport.failures import StepInputError

LOGITS_MODES = ("none", "full", "topk")


class SettingsError(ValueError):
    """A :class:`ClientSettings` value is out of range; the message names it."""


@dataclass(frozen=True)
class ClientSettings:
    """Everything the transport needs; :meth:`from_config` fills it from :class:`K3Config`."""
    address: str                              # tcp://HOST:PORT or ipc://PATH
    timeout_ms: int = 30000                   # per message (VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS)
    propose_timeout_ms: int = 50              # a propose's reply: past it the step has no drafts
    ring_depth: int = 2                       # staging slots; 0 = no deferral (one slot, synchronous)
    max_rows: int = 8192                      # most context rows in one step (max batched tokens)
    context_width: int = 0                    # aux layers x hidden size shipped per row (0 = none)
    hidden_dtype: torch.dtype = torch.bfloat16
    num_speculative_tokens: int = 0           # largest k the target asks for (checked at hello)
    target_vocab_size: int = 0                # the target's vocabulary: drafts outside it are dropped
    hidden_size: int = 0                      # the target's hidden size (checked at hello)
    aux_layer_ids: tuple[int, ...] = ()       # target layers whose outputs are shipped (checked at hello)
    max_requests: int = 0                     # the target's max_num_seqs (capacity check; 0 = unknown)
    draft: dict = field(default_factory=dict)  # the draft the server must run (engine + DSpark facts; checked at hello)
    logits: str = "none"                      # draft logits wanted: none | full | topk
    topk: int = 0
    capture_dir: str | None = None            # feature capture (VLLM_K3_DRAFT_CAPTURE_DIR)
    timing_log_interval: int = 0              # log phase means every N steps (0 = never)
    curve_server_key: str | None = None       # server public key file
    curve_client_key: str | None = None       # this client's certificate (secret) file
    client_name: str = "k3-target"
    session: str = field(default_factory=lambda: uuid.uuid4().hex)   # namespace key, secret, per instance
    backoff_initial_ms: int = 200             # first retry delay after a failed reconnect
    backoff_max_ms: int = 10000
    heartbeat_ms: int = 2000                  # a ping after this long without a message (keeps the lease)
    zero_copy_min_bytes: int = 64 * 1024      # smaller frames are copied (cheaper than zero-copy)
    device_plane: str = "auto"                # hidden rows GPU to GPU when the server is on this host (auto | off)
    device: str | None = None                 # the target's CUDA device for the device ring (None: the current one)

    def __post_init__(self) -> None:
        try:
            check_address(self.address)
        except ConfigError as exc:
            raise SettingsError(str(exc)) from None
        for name, low in (("timeout_ms", 1), ("propose_timeout_ms", 1), ("ring_depth", 0), ("max_rows", 1), ("context_width", 0),
                          ("num_speculative_tokens", 0), ("topk", 0), ("timing_log_interval", 0),
                          ("backoff_initial_ms", 1), ("backoff_max_ms", 1), ("heartbeat_ms", 1),
                          ("zero_copy_min_bytes", 0), ("target_vocab_size", 0), ("hidden_size", 0),
                          ("max_requests", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise SettingsError(f"{name}={value!r}: expected an integer >= {low}")
        if self.device_plane not in ("auto", "off"):
            raise SettingsError(f"device_plane={self.device_plane!r}: allowed ['auto', 'off']")
        if self.logits not in LOGITS_MODES:
            raise SettingsError(f"logits={self.logits!r}: allowed {list(LOGITS_MODES)}")
        if self.logits == "topk" and self.topk < 1:
            raise SettingsError("logits='topk' needs topk >= 1")
        if not isinstance(self.hidden_dtype, torch.dtype) or not self.hidden_dtype.is_floating_point:
            raise SettingsError(f"hidden_dtype={self.hidden_dtype!r}: expected a floating torch dtype")
        if bool(self.curve_server_key) != bool(self.curve_client_key):
            raise SettingsError("curve_server_key and curve_client_key go together")
        if not isinstance(self.session, str) or not 16 <= len(self.session) <= 128:
            raise SettingsError("session: expected a secret string of 16..128 characters")
        if any(not isinstance(i, int) or i < 0 for i in self.aux_layer_ids):
            raise SettingsError(f"aux_layer_ids={self.aux_layer_ids!r}: expected integers >= 0")

    @property
    def timeout_s(self) -> float:
        return self.timeout_ms / 1000.0

    @property
    def propose_timeout_s(self) -> float:
        return min(self.propose_timeout_ms, self.timeout_ms) / 1000.0

    @classmethod
    def from_config(cls, config: Any, **target: Any) -> "ClientSettings":
        """Settings from a ``K3Config`` plus target facts (max_rows, context_width, ...)."""
        if not getattr(config, "draft_address", None):
            raise SettingsError("no draft server address (VLLM_K3_DRAFT_REMOTE_ADDRESS)")
        base = dict(address=config.draft_address, timeout_ms=config.draft_timeout_ms,
                    propose_timeout_ms=config.draft_propose_timeout_ms,
                    ring_depth=config.ingest_ring_depth, capture_dir=config.capture_dir,
                    device_plane=getattr(config, "device_plane", "auto"),
                    timing_log_interval=config.timing_log_interval,
                    curve_server_key=config.curve_server_key, curve_client_key=config.curve_client_key)
        return cls(**{**base, **target})


IntSeq = Sequence[int] | torch.Tensor


@dataclass
class StepInput:
    """One target step, as the adapter sees it (rank 0 only).

    ``counts[i]`` new context rows of ``req_ids[i]`` are rows
    ``sum(counts[:i]) ..`` of ``positions`` / ``token_ids`` / ``hidden``
    (device tensors, any device). ``sampled[i]``: the request sampled a token
    this step; ``anchor_tokens[i]`` / ``anchor_positions[i]``: the token at
    the position right after its context (just sampled, or the next prompt
    token) and that position, so the request's rows start at
    ``anchor_positions[i] - counts[i]`` (checked; lists or tensors on any
    device). ``k``: drafts wanted (0 = ship context only).
    ``prompt_token_ids``: for requests seen for the first time, their prompt
    (lets a prefix-cache hit reconnect to a retained request).
    ``num_accepted``: drafts the target accepted per request last step, if known.
    ``num_verified``: drafts the target verified per request last step, if known (vLLM's adaptive
    verification may verify fewer than it was handed: the rest were neither accepted nor rejected).
    ``temperature`` / ``seeds``: per request, to sample its drafts as vLLM seeds them (sent only
    to a server whose hello offers ``sampling``; otherwise the drafts are greedy).
    """
    req_ids: Sequence[str]
    counts: Sequence[int]
    positions: torch.Tensor
    token_ids: torch.Tensor
    sampled: Sequence[bool]
    anchor_tokens: IntSeq
    anchor_positions: IntSeq
    k: int = 0
    hidden: torch.Tensor | None = None
    prompt_token_ids: Mapping[str, IntSeq] | None = None
    num_accepted: Sequence[int] | None = None
    num_verified: Sequence[int] | None = None
    temperature: Sequence[float] | torch.Tensor | None = None   # [R] >= 0 (0: greedy)
    seeds: IntSeq | None = None                                 # [R] int64

    @property
    def num_requests(self) -> int:
        return len(self.req_ids)

    def batch_ids(self) -> list[str]:
        """The requests this step is about: rows to send or a token sampled."""
        return [rid for rid, c, s in zip(self.req_ids, self.counts, self.sampled) if c > 0 or s]

    def anchors(self) -> tuple[np.ndarray, np.ndarray]:
        """Anchor tokens and positions as int64 arrays (device tensors come over first)."""
        values = [self.anchor_tokens, self.anchor_positions]
        on_device = [v for v in values if isinstance(v, torch.Tensor) and v.device.type != "cpu"]
        if on_device:
            values = [v.to("cpu", non_blocking=True) if isinstance(v, torch.Tensor) else v for v in values]
            torch.cuda.current_stream(on_device[0].device).synchronize()
        return tuple(v.numpy().astype(np.int64, copy=False) if isinstance(v, torch.Tensor)
                     else np.fromiter(v, dtype=np.int64, count=len(v)) for v in values)

    def validate(self, settings: ClientSettings) -> None:
        """Raise :class:`StepInputError` unless every field is consistent."""
        r = len(self.req_ids)
        if len(set(self.req_ids)) != r:
            raise StepInputError("req_ids holds duplicates")
        for name in ("counts", "sampled", "anchor_tokens", "anchor_positions"):
            if len(getattr(self, name)) != r:
                raise StepInputError(f"{name} has {len(getattr(self, name))} entries for {r} requests")
        if (self.temperature is None) != (self.seeds is None) or (
                self.temperature is not None and not len(self.temperature) == len(self.seeds) == r):
            raise StepInputError(f"temperature and seeds: both or neither, {r} entries each")
        for name in ("num_accepted", "num_verified"):
            value = getattr(self, name)
            if value is not None and len(value) != r:
                raise StepInputError(f"{name} has {len(value)} entries for {r} requests")
        if any((not isinstance(c, int)) or c < 0 for c in self.counts):
            raise StepInputError("counts must be integers >= 0")
        if not isinstance(self.k, int) or self.k < 0:
            raise StepInputError(f"k={self.k!r}: expected an integer >= 0")
        n = sum(self.counts)
        _check_rows("positions", self.positions, n)
        _check_rows("token_ids", self.token_ids, n)
        if n > settings.max_rows:
            raise StepInputError(f"{n} rows exceed max_rows={settings.max_rows}")
        if self.hidden is not None:
            if self.hidden.dim() != 2 or self.hidden.shape[0] != n:
                raise StepInputError(f"hidden has shape {list(self.hidden.shape)}, expected [{n}, W]")
            if self.hidden.shape[1] != settings.context_width:
                raise StepInputError(f"hidden width {self.hidden.shape[1]} != context_width "
                                     f"{settings.context_width}")
            if self.hidden.dtype != settings.hidden_dtype:
                raise StepInputError(f"hidden dtype {self.hidden.dtype} != {settings.hidden_dtype}")


def _check_rows(name: str, t: torch.Tensor, n: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != n:
        shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise StepInputError(f"{name}: expected a 1-D tensor of {n} rows, got {shape}")
    if t.dtype not in (torch.int64, torch.int32):
        raise StepInputError(f"{name}: expected int64 or int32, got {t.dtype}")


@dataclass
class StepOutput:
    """Drafts for every request of the step, in input order.

    ``drafts`` is ``[R, k]`` int64 on the CPU, -1 where there is no draft
    (disabled request, no match, fail-closed). ``logits`` ([R, k, V]) or
    ``extra`` (``topk_values`` / ``topk_indices``) when asked for; they may
    be read-only views of the reply buffer. ``deferred``: the step's context
    went out without waiting for the server.
    """
    drafts: torch.Tensor
    logits: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    deferred: bool = False

    @classmethod
    def empty(cls, num_requests: int, k: int) -> "StepOutput":
        return cls(torch.full((num_requests, k), -1, dtype=torch.int64))
