"""Does this server fit this target? The checks run on the ``hello`` reply."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3_accel import protocol as p
from k3_accel.protocol import ProtocolError, Reply, ServerCaps
from k3_accel.transport.failures import IncompatibleServer


@dataclass(frozen=True)
class TargetNeeds:
    """What the target will ask of the server."""
    context_width: int            # aux layers x hidden size of the rows it can ship (0 = none)
    hidden_dtype: torch.dtype
    num_speculative_tokens: int   # the largest k it will ask for
    logits: str = "none"          # "none" | "full" | "topk"
    topk: int = 0


def caps_from_hello(reply: Reply) -> ServerCaps:
    """The server's capabilities; :class:`IncompatibleServer` if the reply is not a usable hello."""
    if not reply.ok:
        err = reply.error or {}
        raise IncompatibleServer(f"hello refused: {err.get('code')}: {err.get('message')}")
    try:
        return p.caps_from_body(reply.body.get("caps"))
    except ProtocolError as exc:
        raise IncompatibleServer(f"hello reply carries no valid caps: {exc}") from None


def problems(caps: ServerCaps, needs: TargetNeeds) -> list[str]:
    """Every reason the server cannot serve this target (empty = compatible)."""
    out = []
    if caps.protocol != p.PROTOCOL_VERSION:
        out.append(f"server speaks protocol {caps.protocol}, this client {p.PROTOCOL_VERSION}")
    if caps.needs_hidden_states:
        if needs.context_width <= 0:
            out.append(f"engine {caps.engine} needs hidden rows but the target ships none")
        elif caps.context_width != needs.context_width:
            out.append(f"context width: server expects {caps.context_width}, target ships "
                       f"{needs.context_width} (aux layers x hidden size)")
        dtype = str(needs.hidden_dtype).replace("torch.", "")
        if dtype not in caps.hidden_dtypes:
            out.append(f"hidden dtype {dtype} not in the server's {caps.hidden_dtypes}")
    if needs.num_speculative_tokens > caps.max_spec_tokens:
        out.append(f"k={needs.num_speculative_tokens} exceeds the server's max_spec_tokens={caps.max_spec_tokens}")
    if needs.logits == "full" and not caps.supports_logits:
        out.append(f"target needs draft logits; engine {caps.engine} returns none")
    if needs.logits == "topk" and not caps.supports_topk:
        out.append(f"target needs top-k draft logits; engine {caps.engine} does not support them")
    return out


def check(reply: Reply, needs: TargetNeeds) -> ServerCaps:
    """The caps when compatible; else :class:`IncompatibleServer` naming every problem."""
    caps = caps_from_hello(reply)
    found = problems(caps, needs)
    if found:
        raise IncompatibleServer("; ".join(found))
    return caps
