"""Feature capture: per request a binary file of context rows and a JSON index.

Layout, per request (``stem`` from :func:`request_file_stem`)::

    <stem>.bin   records back to back; a record is positions (int64 x rows),
                 token ids (int64 x rows), then hidden rows (dtype x rows x width)
    <stem>.json  {"request_id": ..., "bin": "<stem>.bin", "layout": {...},
                  "records": [
                  {"offset": 0, "rows": 12, "first_position": 0, "nbytes": ...},
                  ...
                  ]}

The index is appended in O(1): one ``pwrite`` replaces the constant tail
``]}`` + newline with ``,<record>]}`` + newline, so the file is valid JSON
after every append, and a killed writer leaves it valid (binary bytes are
written before the index record that points at them). A torn tail (power
loss) is repaired by :func:`recover_index` when the file is opened again.
Writing happens on a background thread, off the target's critical path.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from k3_accel import threads

log = logging.getLogger("k3_accel.transport")

TAIL = b"]}\n"
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-")
_MAX_STEM = 120


class CaptureError(Exception):
    """A capture file could not be written or recovered."""


def request_file_stem(req_id: str) -> str:
    """An injective, case-insensitively distinct file stem for a request id.

    Lower-case letters, digits, ``_`` and ``-`` stay; every other character
    becomes ``%XX`` (upper-case hex of its UTF-8 bytes). Stems that would
    exceed 120 characters keep an 80-character readable head plus ``~`` and
    a SHA-256 of the id (``~`` never appears in a short stem).
    """
    if not isinstance(req_id, str):
        raise TypeError(f"request id must be a str, got {type(req_id).__name__}")
    encoded = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode("utf-8"))
                      for c in req_id)
    stem = "r-" + encoded
    if len(stem) <= _MAX_STEM:
        return stem
    digest = hashlib.sha256(req_id.encode("utf-8")).hexdigest()
    return f"{stem[:80]}~{digest}"


# ------------------------------------------------------------------ index
def _prefix(header: dict[str, Any]) -> bytes:
    text = json.dumps({**header, "records": []})
    assert text.endswith("[]}")
    return (text[:-2] + "\n").encode("utf-8")


def _record_of(line: bytes) -> bytes | None:
    """The complete record JSON at the start of an index line, or None.

    A line is ``{..},`` or ``{..}]}``, or, after a torn append, a complete
    record followed by debris; a cut-off record never parses as an object.
    """
    try:
        value, end = json.JSONDecoder().raw_decode(line.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    return line.decode("utf-8")[:end].encode("utf-8") if isinstance(value, dict) else None


def recover_index(path: str | os.PathLike) -> int:
    """Make an index file valid JSON again; returns how many records it keeps.

    A file cut or torn anywhere inside an append loses only the record being
    appended; the repaired file replaces the old one atomically.
    """
    path = Path(path)
    data = path.read_bytes()
    try:
        return len(json.loads(data)["records"])
    except (ValueError, KeyError, TypeError):
        pass
    head, sep, body = data.partition(b"[\n")
    if not sep:
        raise CaptureError(f"{path}: no record list found; cannot recover")
    keep = []
    for line in body.split(b"\n"):
        record = _record_of(line)
        if record is None:
            break
        keep.append(record)
    fixed = head + b"[\n" + b",\n".join(keep) + TAIL
    try:
        json.loads(fixed)
    except ValueError as exc:
        raise CaptureError(f"{path}: header is damaged; cannot recover ({exc})") from None
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(fixed)
    os.replace(tmp, path)
    return len(keep)


class CaptureIndex:
    """An append-only JSON index file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, header: dict[str, Any]):
        self.path = Path(path)
        if self.path.exists():
            self.count = recover_index(self.path)
        else:
            self.path.write_bytes(_prefix(header) + TAIL)
            self.count = 0
        self._fd = os.open(self.path, os.O_RDWR)
        self._end = os.fstat(self._fd).st_size

    def append(self, record: dict[str, Any]) -> None:
        """Add one record with a single write over the tail."""
        text = (b",\n" if self.count else b"") + json.dumps(record).encode("utf-8") + TAIL
        at = self._end - len(TAIL)
        written = os.pwrite(self._fd, text, at)
        while written < len(text):  # regular files rarely write short; finish it
            written += os.pwrite(self._fd, text[written:], at + written)
        self._end = at + len(text)
        self.count += 1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# ----------------------------------------------------------------- writer
@dataclass
class CaptureJob:
    req_id: str
    positions: torch.Tensor        # CPU views into a staging slot
    token_ids: torch.Tensor
    hidden: torch.Tensor | None
    release: Callable[[], None]    # called once written (frees the slot hold)
    ready: Any = None              # a CUDA event to wait for before reading the views (async copy)


class _RequestFiles:
    def __init__(self, directory: Path, req_id: str, hidden: torch.Tensor | None):
        stem = request_file_stem(req_id)
        layout = {"positions": "int64", "token_ids": "int64",
                  "hidden": None if hidden is None else str(hidden.dtype).replace("torch.", ""),
                  "width": 0 if hidden is None else int(hidden.shape[1])}
        self.index = CaptureIndex(directory / f"{stem}.json",
                                  {"request_id": req_id, "bin": f"{stem}.bin", "layout": layout})
        self.bin = open(directory / f"{stem}.bin", "ab")

    def write(self, job: CaptureJob) -> None:
        offset = self.bin.seek(0, os.SEEK_END)
        parts = [job.positions, job.token_ids] + ([job.hidden] if job.hidden is not None else [])
        nbytes = 0
        for t in parts:
            raw = memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()) if t.numel() else b""
            nbytes += self.bin.write(raw)
        self.bin.flush()
        first = int(job.positions[0]) if job.positions.numel() else -1
        self.index.append({"offset": offset, "rows": int(job.positions.numel()),
                           "first_position": first, "nbytes": nbytes})

    def close(self) -> None:
        self.bin.close()
        self.index.close()


class CaptureWriter:
    """Writes capture jobs on a background thread; at most ``max_open`` requests' files open."""

    def __init__(self, directory: str | os.PathLike, on_error: Callable[[str], None] | None = None,
                 max_open: int = 64):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.on_error = on_error or (lambda detail: None)
        self.max_open = max_open
        self.records = 0
        self.errors = 0
        self._files: OrderedDict[str, _RequestFiles] = OrderedDict()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threads.start(self._run, "k3-capture")

    def submit(self, job: CaptureJob) -> None:
        self._queue.put(("write", job))

    def finish(self, req_id: str) -> None:
        """Close the request's files (after its queued records)."""
        self._queue.put(("finish", req_id))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is on disk."""
        done = threading.Event()
        self._queue.put(("flush", done))
        return done.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        if self._thread.is_alive():
            self._queue.put(("stop", None))
            self._thread.join(timeout)

    # ------------------------------------------------------------- thread
    def _run(self) -> None:
        while True:
            op, arg = self._queue.get()
            if op == "stop":
                break
            if op == "flush":
                arg.set()
            elif op == "finish":
                self._close_files(arg)
            else:
                self._write(arg)
        for req_id in list(self._files):
            self._close_files(req_id)

    def _write(self, job: CaptureJob) -> None:
        try:
            if job.ready is not None:
                job.ready.synchronize()
            self._files_for(job).write(job)
            self.records += 1
        except Exception as exc:  # disk full, permissions: report, never crash the target
            self.errors += 1
            log.warning("capture of request %r failed: %s", job.req_id, exc)
            self.on_error(f"{job.req_id}: {type(exc).__name__}: {exc}")
        finally:
            job.release()

    def _files_for(self, job: CaptureJob) -> _RequestFiles:
        files = self._files.get(job.req_id)
        if files is None:
            files = self._files[job.req_id] = _RequestFiles(self.directory, job.req_id, job.hidden)
            while len(self._files) > self.max_open:
                self._close_files(next(iter(self._files)))
        self._files.move_to_end(job.req_id)
        return files

    def _close_files(self, req_id: str) -> None:
        files = self._files.pop(req_id, None)
        if files is not None:
            files.close()


def submit_step(writer: "CaptureWriter", ring: Any, inp: Any, plan: Any, slot: Any, ready: Any, hidden: bool,
                telemetry: Any) -> None:
    """Queue one capture record per request with rows in this step's staging ``slot``
    (each holds the slot until it is written)."""
    for i, d in zip(plan.order.tolist(), plan.dst.tolist()):
        n = int(plan.counts[i])
        if n == 0:
            continue
        start = int(plan.starts[i])
        ring.hold(slot)
        writer.submit(CaptureJob(
            inp.req_ids[i], torch.arange(start, start + n), slot.token_ids[d:d + n],
            slot.hidden[d:d + n] if hidden else None, release=lambda: ring.release(slot), ready=ready))
        telemetry.count("capture_records")


def read_capture(index_path: str | os.PathLike) -> list[dict[str, np.ndarray]]:
    """Load every record of one request's capture (for tests and offline tools)."""
    index_path = Path(index_path)
    index = json.loads(index_path.read_bytes())
    layout, data = index["layout"], (index_path.parent / index["bin"]).read_bytes()
    width = layout["width"]
    out = []
    for rec in index["records"]:
        rows, at = rec["rows"], rec["offset"]
        pos = np.frombuffer(data, np.int64, rows, at)
        tok = np.frombuffer(data, np.int64, rows, at + 8 * rows)
        item = {"positions": pos, "token_ids": tok}
        if layout["hidden"]:
            dtype = getattr(torch, layout["hidden"])
            raw = data[at + 16 * rows: at + rec["nbytes"]]
            item["hidden"] = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(rows, width) if rows else \
                torch.empty(0, width, dtype=dtype)
        out.append(item)
    return out
