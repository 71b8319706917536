"""A ROUTER (client side) <-> DEALER (server side) forwarder that can be paused.

While paused it reads nothing from the client, so large zero-copy frames stay
queued inside the client's libzmq. :meth:`pause` returns only once no forward
is under way: a message sent after it is never forwarded before :meth:`resume`
(checking a flag before a 5 ms poll would let one that arrives during the poll
through). Every forwarded request is recorded in
``seen`` as ``(seq, op, [blake2b of each frame after the header])``.
"""
from __future__ import annotations

import collections
import hashlib
import threading
import time

import msgpack
import torch
import zmq

from .ports import free_port


def digest(data) -> str:
    """blake2b of a tensor's or buffer's bytes."""
    raw = data.contiguous().view(torch.uint8).numpy().tobytes() if isinstance(data, torch.Tensor) else bytes(data)
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


class Relay:
    def __init__(self, server_address: str):
        self.port = free_port()
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.RCVHWM, 1)
        self.front.setsockopt(zmq.RCVBUF, 64 * 1024)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.bind(f"tcp://127.0.0.1:{self.port}")
        self.back = self.ctx.socket(zmq.DEALER)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.connect(server_address)
        self._paused = threading.Event()
        self._front_lock = threading.Lock()          # held from the pause check to the forward
        self.stop_flag = threading.Event()
        self.seen: list[tuple[int, str, list[str]]] = []
        self._idents: collections.deque[bytes] = collections.deque()   # one per forwarded request
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def ops(self, op: str) -> list[list[str]]:
        """Frame digests of every forwarded message of ``op``, in order."""
        return [d for _, o, d in self.seen if o == op]

    def _run(self) -> None:
        while not self.stop_flag.is_set():
            with self._front_lock:
                if not self._paused.is_set() and self.front.poll(5):
                    frames = self.front.recv_multipart()
                    self._idents.append(frames[0])
                    _, seq, msg = msgpack.unpackb(frames[1], raw=False)
                    self.seen.append((seq, msg[0], [digest(f) for f in frames[2:]]))
                    self.back.send_multipart(frames[1:])
            while self.back.poll(0 if not self._paused.is_set() else 5):
                self.front.send_multipart([self._idents.popleft(), *self.back.recv_multipart()])
            if self._paused.is_set():
                time.sleep(0.005)

    def pause(self) -> None:
        with self._front_lock:
            self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def close(self) -> None:
        self.stop_flag.set()
        self.thread.join(5)
        self.front.close()
        self.back.close()
        self.ctx.term()
