"""The server's boundary for context rows: check a row message, admit its requests, apply them.

Checks come in two layers, both before any state changes:

1. :func:`check_message` — the message as a whole (field ranges, row
   counts, hidden width and dtype, K, logits mode). A failure rejects the
   message with one typed error.
2. :func:`admit` — each request on its own (a request the server took back,
   context gap, non-finite rows, anchor outside the vocabulary, request
   limits, pool room). A failure is that request's alone: the others go on,
   and its stored context is left exactly as it was. Making room may take
   back what other sessions borrowed beyond their fair share (``state.py``).

:func:`apply` then stores the admitted requests' rows with one engine call.
Engines trust what reaches them.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from k3_accel import protocol as p
from k3_accel.protocol import ErrorCode, ProtocolError
from k3_accel.server.engines.base import EngineCaps, IngestBatch
from k3_accel.server.state import RequestError, RequestState, RequestStore, Session


@dataclass
class RowMessage:
    """A checked ingest or propose: per-request columns and the rows they own."""
    handles: np.ndarray          # [n] int64
    starts: np.ndarray           # [n]
    counts: np.ndarray           # [n]
    offsets: np.ndarray          # [n + 1]: request i owns rows offsets[i]..offsets[i+1]-1
    tokens: np.ndarray           # [rows]
    hidden: torch.Tensor | None  # [rows, width]
    anchors: np.ndarray | None   # [n] (propose)
    k: int = 0
    logits: str = "none"
    topk: int = 0
    temperature: np.ndarray | None = None   # [n] float32 (propose with sampling)
    seeds: np.ndarray | None = None         # [n] int64
    nonfinite: np.ndarray | None = None   # [rows] device-plane rows: checked on the device when read

    @property
    def n(self) -> int:
        return len(self.handles)


def check_message(req: p.Request, caps: EngineCaps) -> RowMessage:
    """Message-level checks; :class:`ProtocolError` rejects the whole message."""
    msg, meta = req.msg, req.meta
    handles, starts, counts = meta[:, 0], meta[:, 1], meta[:, 2]
    if len(meta) and int(meta[:, :3].min()) < 0:
        raise ProtocolError(ErrorCode.BAD_FIELD, "handles, starts and counts must be >= 0")
    if (counts > msg.rows).any():                 # a count past rows could overflow the sum below
        raise ProtocolError(ErrorCode.FRAME_MISMATCH, f"a request claims more than the message's {msg.rows} rows")
    offsets = np.zeros(len(meta) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    if int(offsets[-1]) != msg.rows:
        raise ProtocolError(ErrorCode.FRAME_MISMATCH, f"counts add up to {int(offsets[-1])}, rows={msg.rows}")
    if len(set(handles.tolist())) != len(handles):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a request handle appears twice in one message")
    _check_hidden(msg, caps)
    out = RowMessage(handles, starts, counts, offsets, req.tokens, req.hidden, None,
                     nonfinite=req.fetch.nonfinite if req.fetch is not None else None)
    if isinstance(msg, p.Propose):
        _check_propose(msg, caps)
        out.anchors, out.k, out.logits, out.topk = meta[:, 3], msg.k, msg.logits, msg.topk
        out.temperature, out.seeds = req.temperature, req.seeds
    return out


def _check_hidden(msg, caps: EngineCaps) -> None:
    if not msg.hidden:
        if caps.needs_hidden_states and msg.rows:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"engine {caps.kind} needs hidden rows with every row")
        return
    if not caps.needs_hidden_states:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"engine {caps.kind} takes no hidden rows")
    if msg.width != caps.context_width:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"hidden rows are {msg.width} wide, the engine "
                                                   f"expects {caps.context_width}")
    if msg.hidden not in caps.hidden_dtypes:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"hidden dtype {msg.hidden} not in {list(caps.hidden_dtypes)}")


def _check_propose(msg: p.Propose, caps: EngineCaps) -> None:
    if not 0 <= msg.k <= caps.max_spec_tokens:
        raise ProtocolError(ErrorCode.K_TOO_LARGE, f"k={msg.k}, the server allows 0..{caps.max_spec_tokens}")
    if msg.logits not in ("none", "full", "topk"):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"logits={msg.logits!r}: allowed none, full, topk")
    if msg.logits == "full" and not caps.supports_logits:
        raise ProtocolError(ErrorCode.UNSUPPORTED, f"engine {caps.kind} returns no logits")
    if msg.logits == "topk" and not (caps.supports_topk and msg.topk > 0):
        raise ProtocolError(ErrorCode.UNSUPPORTED, f"engine {caps.kind}: top-k needs supports_topk and topk > 0")
    if msg.sampling and not caps.sampling:
        raise ProtocolError(ErrorCode.UNSUPPORTED, f"engine {caps.kind} drafts greedily (no sampling)")
    if msg.logits == "topk" and caps.vocab_size and msg.topk > caps.vocab_size:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"topk={msg.topk} exceeds the vocabulary ({caps.vocab_size})")


# float dtype -> (same-width unsigned integer view, magnitude mask, smallest non-finite magnitude)
_NONFINITE_BITS = {
    torch.bfloat16: (np.uint16, 0x7FFF, 0x7F80),
    torch.float16: (np.uint16, 0x7FFF, 0x7C00),
    torch.float32: (np.uint32, 0x7FFF_FFFF, 0x7F80_0000),
}
_CHECK_CHUNK_BYTES = 1 << 20           # rows are checked a cache-sized slab at a time


def bad_rows(hidden: torch.Tensor | None, offsets: np.ndarray, flags: np.ndarray | None = None) -> np.ndarray:
    """Per request: how many of its hidden rows hold NaN or Inf (zeros without hidden rows);
    ``flags``: which rows do, when already known (rows read over the device plane)."""
    if hidden is None or hidden.shape[0] == 0:
        return np.zeros(len(offsets) - 1, dtype=np.int64)
    if flags is None:
        flags = _nonfinite_rows(hidden)
    return _per_request(flags.astype(np.int64), offsets)


def word_dtype(dtype: torch.dtype) -> torch.dtype:
    """The signed integer type of a hidden dtype's width: what :func:`top_bits` returns."""
    return torch.int16 if dtype.itemsize == 2 else torch.int32


def top_bits(hidden: torch.Tensor) -> torch.Tensor:
    """Each row's largest magnitude bits (the sign cleared), on the tensor's device: ``[rows]`` of
    the same-width integer type. Two kernels on a GPU (the device plane's reads); which rows hold
    NaN or Inf follows on the host (:func:`nonfinite_top_bits`)."""
    _, mask, _ = _NONFINITE_BITS[hidden.dtype]
    return torch.bitwise_and(hidden.view(word_dtype(hidden.dtype)), mask).amax(dim=1)


def nonfinite_top_bits(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Which rows hold NaN or Inf, from their :func:`top_bits` (the same bit test as below)."""
    return bits >= _NONFINITE_BITS[dtype][2]


def _nonfinite_rows(hidden: torch.Tensor) -> np.ndarray:
    """Which rows of a ``[rows, width]`` frame tensor (a dtype of ``protocol.HIDDEN_DTYPES``) hold
    NaN or Inf, from the bits: a value is NaN or Inf exactly when its magnitude bits are at least the
    all-ones exponent's. numpy, not torch's CPU ops on bf16: on the H200 host those made the store
    phase of a B = 32 DFlash propose 5.6-6.3 ms, this 1.3-1.8 ms (draft-rpc-rowcheck-h200.json)."""
    utype, mask, first_bad = _NONFINITE_BITS[hidden.dtype]
    words = hidden.view(torch.int16 if utype is np.uint16 else torch.int32).numpy().view(utype)
    rows = words.shape[0]
    step = max(1, _CHECK_CHUNK_BYTES // max(1, words.strides[0]))
    out = np.empty(rows, dtype=bool)
    scratch = np.empty((min(step, rows), words.shape[1]), dtype=utype)
    for lo in range(0, rows, step):
        part = words[lo:lo + step]
        mags = np.bitwise_and(part, mask, out=scratch[:len(part)])
        np.greater_equal(mags.max(axis=1, initial=0), first_bad, out=out[lo:lo + len(part)])
    return out


def token_tensor(ids: np.ndarray) -> torch.Tensor:
    """Token ids for an engine, zero-copy: they may view a read-only frame (engines never write them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # torch warns about read-only arrays
        return torch.from_numpy(np.ascontiguousarray(ids))


def outside_vocab(ids: np.ndarray, vocab: int) -> np.ndarray:
    """Which token ids no engine can hold: negative ones, and ``>= vocab`` when it is known."""
    return (ids < 0) | (ids >= vocab) if vocab else ids < 0


def vocab_text(vocab: int) -> str:
    return f"the vocabulary 0..{vocab - 1}" if vocab else "0..2**63-1"


def _per_request(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    running = np.concatenate(([0], np.cumsum(flags, dtype=np.int64)))
    return running[offsets[1:]] - running[offsets[:-1]]


@dataclass
class Admitted:
    """What :func:`admit` let through: request indexes and their states, and the failures."""
    index: list[int] = field(default_factory=list)
    states: list[RequestState] = field(default_factory=list)
    failures: dict[int, tuple[str, str]] = field(default_factory=dict)

    def fail(self, i: int, exc: RequestError) -> None:
        self.failures[i] = (exc.code.value, exc.message)


def admit(store: RequestStore, session: Session, rows: RowMessage) -> Admitted:
    """Per-request checks, request limits and pool room, in message order; changes nothing but
    what making room evicts (never a context the message names)."""
    out, engine = Admitted(), store.engine
    vocab = engine.caps.vocab_size
    bad = bad_rows(rows.hidden, rows.offsets, rows.nonfinite) if rows.hidden is not None else None
    bad_ids = _per_request(outside_vocab(rows.tokens, vocab), rows.offsets)
    bad_anchors = outside_vocab(rows.anchors, vocab) if rows.anchors is not None else None
    pool = engine.pool
    # every request needs at most ceil(count / block) + 1 new blocks (+1: a shared partial block's
    # copy): with that much free, nobody needs counting (the common case, and a cheap one)
    precise = int((rows.counts // pool.block_rows + 2).sum()) > pool.free_blocks
    handles, active = rows.handles.tolist(), session.active
    named = [s for s in (store.lookup(session, h) for h in handles) if s is not None] if precise else []
    flagged = bad_ids > 0                     # requests that fail a row check below (one list, not B look-ups)
    if bad is not None:
        flagged |= bad > 0
    if bad_anchors is not None:
        flagged |= bad_anchors
    fresh = total = blocks = 0                # requests this message activates, pool blocks it takes
    for i, (handle, start, flag) in enumerate(zip(handles, rows.starts.tolist(), flagged.tolist())):
        state = active.get(handle)
        if state is not None and not flag and not precise and start <= state.length:
            out.index.append(i)               # active, its rows clean and the pool roomy: nothing to decide
            out.states.append(state)
            continue
        count = int(rows.counts[i])
        state = state or store.lookup(session, handle)
        try:
            if state is None and session.evicted:
                store.check_evicted(session, handle, start)
            length = state.length if state is not None else 0
            if start > length:
                raise RequestError(ErrorCode.CONTEXT_GAP, f"request {handle}: rows start at {start}, "
                                                          f"its context ends at {length}")
            if bad is not None and bad[i]:
                raise RequestError(ErrorCode.NON_FINITE, f"request {handle}: {bad[i]} hidden row(s) hold NaN or Inf")
            if bad_ids[i]:
                raise RequestError(ErrorCode.BAD_REQUEST, f"request {handle}: {bad_ids[i]} token id(s) outside "
                                                          f"{vocab_text(vocab)}")
            if bad_anchors is not None and bad_anchors[i]:
                raise RequestError(ErrorCode.BAD_REQUEST, f"request {handle}: anchor token "
                                                          f"{int(rows.anchors[i])} outside {vocab_text(vocab)}")
            new = state is None or active.get(handle) is not state
            if new:
                store.check_room(session, fresh + 1)
            if state is None:
                state = store.new_state(session, handle)
            if precise:
                blocks = engine.blocks_needed(state.engine_state, start, count) if count else 0
                store.make_room(session, total + blocks, keep=named)
        except RequestError as exc:
            out.fail(i, exc)
            continue
        fresh += new
        total += blocks
        out.index.append(i)
        out.states.append(state)
    return out


def _keep_rows(hidden: torch.Tensor, keep: np.ndarray, stream) -> torch.Tensor:
    """The kept rows; on a device (rows read over the device plane) on the engine's stream,
    whose work reads them (the buffer's memory then belongs to it)."""
    if hidden.device.type != "cuda":
        return hidden[torch.from_numpy(keep)]
    with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream(hidden.device)):
        return hidden[torch.from_numpy(keep).to(hidden.device)]


def apply(store: RequestStore, rows: RowMessage, admitted: Admitted) -> int:
    """Store the admitted requests' rows (one engine call); returns the rows stored."""
    states = admitted.states
    for state in states:
        store.activate(state)
    if not states:
        return 0
    starts, counts, tokens, hidden = rows.starts, rows.counts, rows.tokens, rows.hidden
    if len(states) < rows.n:                      # some failed: keep only the admitted rows
        idx = np.asarray(admitted.index, dtype=np.int64)
        starts, counts = starts[idx], counts[idx]
        keep = np.repeat(np.isin(np.arange(rows.n), idx), rows.counts)
        tokens = tokens[keep]
        hidden = _keep_rows(hidden, keep, getattr(store.engine, "stream", None)) if hidden is not None else None
    offsets = np.zeros(len(states) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    total = int(offsets[-1])
    starts_l, counts_l, offsets_l = starts.tolist(), counts.tolist(), offsets.tolist()
    changed = [j for j, (s, c) in enumerate(zip(starts_l, counts_l)) if c or s < states[j].length]   # rows, or a rewind
    if changed:
        positions = np.repeat(starts - offsets[:-1], counts) + np.arange(total)
        if len(changed) < len(states):            # only requests without rows are left out
            starts, counts = starts[changed], counts[changed]
        store.engine.ingest(IngestBatch(
            [states[j].engine_state for j in changed], starts.tolist(), counts.tolist(),
            torch.from_numpy(positions), token_tensor(tokens), hidden,
            # rows on a device here are always this server's own read of a target's slot (device_plane)
            owned=hidden is not None and hidden.device.type != "cpu"))
    for state, start, a, b in zip(states, starts_l, offsets_l, offsets_l[1:]):
        state.write_tokens(start, tokens[a:b])
    return total
