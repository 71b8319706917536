"""Does this server fit this target? The one place of the compatibility rules.

The checks run on the ``hello`` reply (by the client, and by ``k3-accel
doctor``). Every value of the target side comes from the target's own
configuration, never from the server's word.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3_accel import protocol as p
from k3_accel.protocol import Caps, ProtocolError, Reply
from k3_accel.transport.failures import IncompatibleServer


@dataclass(frozen=True)
class TargetNeeds:
    """What the target is and will ask of the server."""
    context_width: int            # aux layers x hidden size of the rows it ships (0 = none)
    hidden_dtype: torch.dtype
    num_speculative_tokens: int   # the largest k it will ask for
    logits: str = "none"          # "none" | "full" | "topk"
    topk: int = 0
    vocab_size: int = 0           # the target's vocabulary (0 = unknown: not checked)
    hidden_size: int = 0          # the target's hidden size (0 = unknown: not checked)
    aux_layer_ids: tuple[int, ...] = ()
    max_requests: int = 0         # the target's max_num_seqs (0 = unknown)
    draft: dict = field(default_factory=dict)   # {"engine": ..., DSpark facts} the server must match ({} = any)

    @classmethod
    def from_settings(cls, s) -> "TargetNeeds":
        return cls(s.context_width, s.hidden_dtype, s.num_speculative_tokens, s.logits, s.topk,
                   s.target_vocab_size, s.hidden_size, tuple(s.aux_layer_ids), s.max_requests,
                   dict(getattr(s, "draft", {}) or {}))


def caps_from_hello(reply: Reply) -> Caps:
    """The server's capabilities; :class:`IncompatibleServer` if the reply is not a usable hello."""
    if not reply.ok:
        code, message = reply.error or ("?", "")
        raise IncompatibleServer(f"hello refused: {code}: {message}")
    try:
        return p.caps_from_result(reply.result)
    except ProtocolError as exc:
        raise IncompatibleServer(f"hello reply carries no valid caps: {exc.message}") from None


def problems(caps: Caps, needs: TargetNeeds) -> list[str]:
    """Every reason the server cannot serve this target (empty = compatible); each names both values."""
    out = []
    if caps.protocol != p.PROTOCOL_VERSION:
        out.append(f"protocol: server {caps.protocol}, client {p.PROTOCOL_VERSION}")
    if caps.vocab_size and needs.vocab_size and caps.vocab_size != needs.vocab_size:
        out.append(f"vocabulary: server drafts ids 0..{caps.vocab_size - 1}, target vocabulary is "
                   f"{needs.vocab_size}")
    if caps.needs_hidden_states:
        out.extend(_hidden_problems(caps, needs))
    out.extend(_draft_problems(caps, needs))
    if needs.num_speculative_tokens > caps.max_spec_tokens:
        out.append(f"K: target asks for {needs.num_speculative_tokens}, server allows "
                   f"{caps.max_spec_tokens}")
    if needs.logits == "full" and not caps.supports_logits:
        out.append(f"logits: target needs draft logits, engine {caps.engine} returns none")
    if needs.logits == "topk" and not caps.supports_topk:
        out.append(f"logits: target needs top-k draft logits, engine {caps.engine} has none")
    return out


# draft facts a server may differ in and still draft usefully (n-gram sizes): warned of, not refused
ADVISORY_DRAFT_KEYS = ("prompt_lookup_min", "prompt_lookup_max")


def _draft_problems(caps: Caps, needs: TargetNeeds) -> list[str]:
    """The draft model the target's speculative config names (DSpark: layout, vocabulary, heads)."""
    want = {key: value for key, value in needs.draft.items() if key not in ADVISORY_DRAFT_KEYS}
    engine = want.pop("engine", None)
    if engine and caps.engine != engine:
        return [f"draft engine: the target's method needs a {engine} server, the server runs {caps.engine}"]
    return [f"draft {key}: server {caps.draft.get(key)!r}, target's draft config {value!r}"
            for key, value in want.items() if caps.draft.get(key) != value]


def _hidden_problems(caps: Caps, needs: TargetNeeds) -> list[str]:
    if needs.context_width <= 0:
        return [f"hidden rows: engine {caps.engine} needs them, the target ships none"]
    out = []
    if needs.hidden_size and caps.hidden_size and needs.hidden_size != caps.hidden_size:
        out.append(f"hidden size: server {caps.hidden_size}, target {needs.hidden_size}")
    if needs.aux_layer_ids and tuple(caps.aux_layer_ids) != tuple(needs.aux_layer_ids):
        out.append(f"aux layer ids: server {list(caps.aux_layer_ids)}, target captures "
                   f"{list(needs.aux_layer_ids)}")
    if caps.context_width != needs.context_width:
        out.append(f"context width: server {caps.context_width}, target ships {needs.context_width} "
                   f"(aux layers x hidden size)")
    dtype = str(needs.hidden_dtype).replace("torch.", "")
    if dtype not in caps.hidden_dtypes:
        out.append(f"hidden dtype: target {dtype}, server takes {caps.hidden_dtypes}")
    return out


def warnings(caps: Caps, needs: TargetNeeds) -> list[str]:
    """Fit but not fully: what the target should know (capacity, n-gram sizes)."""
    out = []
    if needs.max_requests and caps.max_requests and needs.max_requests > caps.max_requests:
        out.append(f"capacity: target runs up to {needs.max_requests} requests (max_num_seqs), the server "
                   f"admits {caps.max_requests} per client: the excess is not drafted")
    if any(key in needs.draft and caps.draft.get(key) != needs.draft[key] for key in ADVISORY_DRAFT_KEYS):
        (s_lo, s_hi), (t_lo, t_hi) = ([d.get(key, "?") for key in ADVISORY_DRAFT_KEYS]
                                      for d in (caps.draft, needs.draft))
        out.append(f"n-gram sizes: the server matches grams of {s_lo}..{s_hi} tokens, the target's "
                   f"prompt_lookup_min/max are {t_lo}..{t_hi}: its drafts differ from vLLM's own ngram "
                   f"(start the server with --ngram-min {t_lo} --ngram-max {t_hi})")
    return out


def check(reply: Reply, needs: TargetNeeds) -> Caps:
    """The caps when compatible; else :class:`IncompatibleServer` naming every problem."""
    caps = caps_from_hello(reply)
    found = problems(caps, needs)
    if found:
        raise IncompatibleServer("; ".join(found))
    return caps
