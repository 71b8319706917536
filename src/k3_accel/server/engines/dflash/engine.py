"""DFlashEngine: per-request context K/V cache + batched block drafting."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import DraftEngine, EngineCaps, EngineError, Proposal
from .checkpoint import DFlashWeights, load_dflash
from .model import Rope, block_forward, compute_logits, context_kv, query_block

_DTYPES = {"float32": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MIN_CAPACITY = 16


@dataclass
class DFlashState:
    """Context K/V of one request: rows ``0..length-1`` of ``k``/``v``
    (``[layers, capacity, nkv, head_dim]``) are valid; rows past ``length``
    are scratch (the transient query block is written there by ``propose``)."""
    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


class _StateKV:
    """KVSource that writes each request's block K/V into its state's spare
    rows and returns views (no copy of the context)."""

    def __init__(self, states: list[DFlashState], block: int):
        self.states, self.block = states, block

    def keys_values(self, layer, req, k_block, v_block):
        s = self.states[req]
        end = s.length + self.block
        s.k[layer, s.length:end] = k_block
        s.v[layer, s.length:end] = v_block
        return s.k[layer, :end], s.v[layer, :end], s.length


class DFlashEngine(DraftEngine):
    """DFlash block drafter over a draft checkpoint and its target's embed/lm_head."""

    def __init__(self, draft_dir: str, target_dir: str, device: str = "cpu",
                 dtype: str = "float32", max_spec_tokens: int | None = None,
                 block_size: int = 16):
        if max_spec_tokens is not None and max_spec_tokens < 0:
            raise ValueError(f"max_spec_tokens must be >= 0, got {max_spec_tokens}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} not supported; use one of {sorted(_DTYPES)}")
        self.dtype = _DTYPES[dtype]
        self.device = torch.device(device)
        self.weights: DFlashWeights = load_dflash(draft_dir, target_dir, self.dtype, self.device)
        cfg = self.weights.config
        self.config = cfg
        self.rope = Rope(cfg, self.dtype, self.device)
        limit = cfg.block_size - 1
        self.caps = EngineCaps(
            kind="dflash", needs_hidden_states=True, context_width=cfg.context_width,
            supports_logits=True, supports_topk=True,
            max_spec_tokens=limit if max_spec_tokens is None else min(max_spec_tokens, limit),
            block_size=block_size, vocab_size=cfg.vocab_size, mask_token_id=cfg.mask_token_id,
            aux_layer_ids=tuple(cfg.target_layer_ids))

    # ------------------------------------------------------------ state ---

    @property
    def bytes_per_row(self) -> int:
        cfg = self.config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * cfg.kv_size * elem

    def _alloc(self, capacity: int) -> DFlashState:
        cfg = self.config
        shape = (cfg.num_layers, capacity, cfg.num_kv_heads, cfg.head_dim)
        return DFlashState(torch.empty(shape, dtype=self.dtype, device=self.device),
                           torch.empty(shape, dtype=self.dtype, device=self.device))

    def new_state(self) -> DFlashState:
        return self._alloc(0)

    def _reserve(self, state: DFlashState, rows: int) -> None:
        """Make room for ``rows`` rows, growing geometrically (amortised O(1))."""
        if rows <= state.capacity:
            return
        grown = self._alloc(max(rows, 2 * state.capacity, _MIN_CAPACITY))
        n = state.length
        grown.k[:, :n] = state.k[:, :n]
        grown.v[:, :n] = state.v[:, :n]
        state.k, state.v = grown.k, grown.v

    def _check_rows(self, state: DFlashState, positions: torch.Tensor,
                    hidden: torch.Tensor | None) -> int:
        """Validate an append without touching state; returns the row count."""
        width = self.caps.context_width
        if not isinstance(hidden, torch.Tensor):
            raise EngineError("BAD_REQUEST", "dflash needs hidden rows with every context row")
        if hidden.dim() != 2 or hidden.shape[1] != width:
            raise EngineError("BAD_REQUEST",
                              f"hidden rows have shape {list(hidden.shape)}, expected [n, {width}]")
        if hidden.dtype not in _HIDDEN_DTYPES:
            raise EngineError("BAD_REQUEST", f"hidden rows have dtype {hidden.dtype}")
        n = hidden.shape[0]
        pos = torch.as_tensor(positions).reshape(-1)
        expected = torch.arange(state.length, state.length + n)
        if pos.numel() != n or not torch.equal(pos.long().cpu(), expected):
            raise EngineError("BAD_REQUEST",
                              f"positions must be {state.length}..{state.length + n - 1}")
        if not bool(torch.isfinite(hidden).all()):
            raise EngineError("NON_FINITE", "hidden rows contain NaN or Inf")
        return n

    @torch.inference_mode()
    def append(self, state: DFlashState, positions: torch.Tensor, token_ids: torch.Tensor,
               hidden: torch.Tensor | None) -> None:
        """Compute and store K/V for the new context rows. A rejected append
        (bad shape/dtype/positions, non-finite values) leaves ``state`` unchanged."""
        n = self._check_rows(state, positions, hidden)
        if n == 0:
            return
        pos = torch.arange(state.length, state.length + n, device=self.device)
        k, v = context_kv(self.weights, self.rope,
                          hidden.to(device=self.device, dtype=self.dtype), pos)
        self._reserve(state, state.length + n)
        state.k[:, state.length:state.length + n] = k
        state.v[:, state.length:state.length + n] = v
        state.length += n

    def truncate(self, state: DFlashState, length: int) -> None:
        if not 0 <= length <= state.length:
            raise EngineError("BAD_REQUEST", f"cannot truncate {state.length} rows to {length}")
        state.length = length

    def fork(self, state: DFlashState, length: int) -> DFlashState:
        if not 0 <= length <= state.length:
            raise EngineError("BAD_REQUEST", f"cannot fork {length} of {state.length} rows")
        new = self._alloc(max(length, _MIN_CAPACITY))
        new.k[:, :length] = state.k[:, :length]
        new.v[:, :length] = state.v[:, :length]
        new.length = length
        return new

    # ---------------------------------------------------------- propose ---

    def _check_propose(self, states, histories, anchors, k) -> None:
        if not len(states) == len(histories) == len(anchors):
            raise EngineError("BAD_REQUEST", "states, histories and anchors differ in length")
        if k > self.caps.max_spec_tokens:
            raise EngineError("K_TOO_LARGE", f"k={k} > max_spec_tokens={self.caps.max_spec_tokens}")
        if k < 0:
            raise EngineError("BAD_REQUEST", f"k={k} < 0")
        for s, hist, a in zip(states, histories, anchors):
            if not 0 <= int(a) < self.config.vocab_size:
                raise EngineError("BAD_REQUEST", f"anchor token {a} outside the vocab")
            if len(hist) != s.length:
                raise EngineError("BAD_REQUEST",
                                  f"history has {len(hist)} tokens but state has {s.length} rows")

    @torch.inference_mode()
    def propose(self, states: list[DFlashState], histories: list[torch.Tensor],
                anchors: list[int], k: int, want_logits: bool = False) -> Proposal:
        """Greedy block drafts: request i's block ``[anchor_i, mask*k]`` sits at
        positions ``L_i..L_i+k`` and attends to its ``L_i`` context rows. All
        requests run batched through the projections/MLP; attention is per
        request. Block K/V only touch rows past each state's length."""
        self._check_propose(states, histories, anchors, k)
        n_req, vocab = len(states), self.config.vocab_size
        if n_req == 0 or k == 0:
            logits = torch.zeros(n_req, k, vocab) if want_logits else None
            return Proposal(torch.full((n_req, k), -1, dtype=torch.long), logits)
        for s in states:
            self._reserve(s, s.length + k + 1)
        ids = torch.tensor([query_block(self.config, int(a), k) for a in anchors],
                           device=self.device)
        starts = torch.tensor([s.length for s in states], device=self.device)
        positions = starts[:, None] + torch.arange(k + 1, device=self.device)[None]
        h = block_forward(self.weights, self.rope, ids, positions, _StateKV(states, k + 1))
        logits = compute_logits(self.weights, h[:, 1:]).cpu()
        return Proposal(logits.argmax(dim=-1), logits if want_logits else None)
