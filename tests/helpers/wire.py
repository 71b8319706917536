"""A bare DEALER that speaks the wire protocol: one request, one reply (server tests)."""
from __future__ import annotations

import time
import uuid

import numpy as np
import torch
import zmq

from k3_accel import protocol as p


def meta(*cols: list[int]) -> memoryview:
    """An int64 ``[n, len(cols)]`` meta frame from per-request columns."""
    return np.ascontiguousarray(np.stack([np.asarray(c, dtype=np.int64) for c in cols], axis=1)
                                if cols and len(cols[0]) else np.zeros((0, len(cols)), np.int64)).data


def ints(values) -> memoryview:
    return np.ascontiguousarray(np.asarray(values, dtype=np.int64)).data


class Wire:
    def __init__(self, address: str, timeout_ms: int = 60000, session: str | None = None,
                 hello: bool = True, **sockopts):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for opt, value in sockopts.items():
            setattr(self.sock, opt, value)
        self.sock.connect(address)
        self.timeout_ms = timeout_ms
        self.seq = 0
        self.session = session or uuid.uuid4().hex
        self.caps = p.caps_from_result(self.call(p.Hello(self.session, "wire")).raise_for_error().result) \
            if hello else None

    def send_frames(self, frames: list) -> None:
        """Send, or TimeoutError when no peer takes the message in time (a DEALER without a
        connected peer, e.g. after a refused CURVE handshake, would block forever).  The peer
        can go between the poll and the send (a handshake refused in that gap): then poll again."""
        deadline = time.monotonic() + self.timeout_ms / 1000
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self.sock.poll(left_ms, zmq.POLLOUT):
                raise TimeoutError("cannot send: no connected peer")
            try:
                return self.sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                if time.monotonic() >= deadline:
                    raise TimeoutError("cannot send: the peer went away") from None

    def recv(self) -> p.Reply:
        if not self.sock.poll(self.timeout_ms):
            raise TimeoutError("no reply")
        return p.decode_reply(self.sock.recv_multipart())

    def send(self, msg, *frames) -> int:
        """Send without waiting for the reply; returns the bytes put on the wire (ZMTP framing included)."""
        self.seq += 1
        out = p.encode_request(self.seq, msg, *frames)
        self.send_frames(out)
        return sum(n + (2 if n < 256 else 9) for n in (memoryview(f).nbytes for f in out))

    def call(self, msg, *frames) -> p.Reply:
        self.send(msg, *frames)
        reply = self.recv()
        assert reply.seq == self.seq
        return reply

    # ------------------------------------------------------------ shortcuts
    def ingest(self, spans: list[tuple[int, int, list[int]]], hidden: torch.Tensor | None = None) -> p.Reply:
        """``spans``: (handle, start, tokens) per request."""
        return self.call(*_rows(p.Ingest, spans, hidden))

    def propose(self, k: int, spans: list[tuple[int, int, list[int], int]], hidden: torch.Tensor | None = None,
                **kw) -> p.Reply:
        """``spans``: (handle, start, tokens, anchor) per request."""
        return self.call(*_rows(p.Propose, spans, hidden, k=k, **kw))

    def send_propose(self, k: int, spans, hidden: torch.Tensor | None = None, **kw) -> int:
        """:meth:`propose` without waiting for the reply (read it with :meth:`recv`)."""
        return self.send(*_rows(p.Propose, spans, hidden, k=k, **kw))

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _rows(op, spans, hidden, **kw):
    handles = [s[0] for s in spans]
    starts = [s[1] for s in spans]
    counts = [len(s[2]) for s in spans]
    cols = [handles, starts, counts] + ([[s[3] for s in spans]] if op is p.Propose else [])
    tokens = [t for s in spans for t in s[2]]
    frames = [meta(*cols), ints(tokens)]
    if hidden is not None:
        frames.append(p.tensor_frame(hidden.contiguous()))
        kw.update(hidden=p.dtype_name(hidden.dtype), width=int(hidden.shape[1]))
    temperature, seeds = kw.pop("temperature", None), kw.pop("seeds", None)
    if temperature is not None:                       # a sampled propose: two more frames
        frames += [np.asarray(temperature, dtype=np.float32).data, ints(seeds)]
        kw["sampling"] = True
    args = (kw.pop("k"), len(spans), len(tokens)) if op is p.Propose else (len(spans), len(tokens))
    return (op(*args, **kw), *frames)
