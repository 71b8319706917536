"""Where a step's rows start against what the server holds: attach, or sit the step out.

A request whose rows start past its remote context is a prefix-cache hit (or a request drafting
again after the link came back): it is attached first with a ``reconnect`` carrying its token
history up to that start, when the step brings that history. One that cannot be attached, or
whose anchor lies before its own rows (no context at all), sits the step out, disabled and named.
One drafting again whose rows start at its first row needs no history from then on.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from k3_accel import protocol as p
from k3_accel.transport import layout
from k3_accel.transport.api import StepInput
from k3_accel.transport.book import Record, RequestBook
from k3_accel.transport.failures import FailureKind
from k3_accel.transport.timing import Telemetry


def starts(inp: StepInput, recs: list[Record], plan: layout.RowPlan, book: RequestBook,
           send: Callable[..., None], telemetry: Telemetry) -> layout.RowPlan:
    """``plan`` less the requests that sit this step out; reconnects sent for those attached
    (``send(msg, ids, kind, *frames)``: behind what is queued to go before them)."""
    order = plan.order
    if book.history_wanted:                # rows from the first one bring the whole context along
        for i in order[plan.starts[order] == 0].tolist():
            book.attached(recs[i])
    lengths = np.fromiter((recs[i].length for i in order.tolist()), dtype=np.int64, count=len(order))
    ahead, before = order[plan.starts[order] > lengths], order[plan.starts[order] < 0]
    if ahead.size == 0 and before.size == 0:
        return plan
    drop = before.tolist()
    for i in drop:
        why = f"anchor position {int(plan.starts[i] + plan.counts[i])} before its {int(plan.counts[i])} rows"
        book.failures.push(FailureKind.REQUEST, [inp.req_ids[i]], why)
        recs[i].disabled = why
    for i in ahead.tolist():
        rec, rid, start = recs[i], inp.req_ids[i], int(plan.starts[i])
        prompt = (inp.prompt_token_ids or {}).get(rid)
        if rec.resync and (prompt is None or len(prompt) < start):
            drop.append(i)                 # drafting again, its history comes with a later step
            continue
        why = (f"rows start at {start}, the server holds {rec.length}" if rec.sent and not rec.resync else
               None if prompt is not None and len(prompt) >= start else
               f"prefix-cache hit at {start} but no prompt tokens to attach it")
        if why is not None:
            book.failures.push(FailureKind.CLIENT_GAP if rec.sent else FailureKind.COLD_START, [rid], why)
            rec.disabled = why
            drop.append(i)
            continue
        tokens = torch.as_tensor(prompt[:start] if not isinstance(prompt, torch.Tensor) else prompt[:start],
                                 dtype=torch.int64).cpu().contiguous()
        send(p.Reconnect(rec.handle, start), [rid], FailureKind.RECONNECT, p.tensor_frame(tokens))
        telemetry.count("reconnects")
        rec.length, rec.sent = start, True
        book.attached(rec)
    return plan.without(drop) if drop else plan
