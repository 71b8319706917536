"""Feature capture: collision-free file names, an index that is valid JSON after every
append and after a crash mid-append, and capture through a running client."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings as hsettings, strategies as st

from k3_accel.transport.capture import (TAIL, CaptureIndex, CaptureJob, CaptureWriter, read_capture,
                                        recover_index, request_file_stem)
from helpers.server import SRC
from helpers.steps import step as rows


# ------------------------------------------------------------------ names
@given(st.text(max_size=300), st.text(max_size=300))
@hsettings(max_examples=400)
def test_distinct_ids_get_distinct_stems_even_case_insensitively(a, b):
    sa, sb = request_file_stem(a), request_file_stem(b)
    assert (a == b) == (sa == sb)
    assert (a == b) == (sa.lower() == sb.lower())


@given(st.text(max_size=1000))
def test_stems_are_safe_file_names(req_id):
    stem = request_file_stem(req_id)
    assert len(stem) <= 160 and "/" not in stem and "\x00" not in stem and not stem.startswith(".")
    assert stem.isascii()


def test_similar_ids_do_not_collide():
    ids = ["a/b", "a_b", "a%2Fb", "A/b", "a.b", "a b", "x" * 500, "x" * 499 + "y", "", "."]
    assert len({request_file_stem(i) for i in ids}) == len(ids)


def test_non_str_id_is_a_type_error():
    with pytest.raises(TypeError):
        request_file_stem(123)


# ------------------------------------------------------------------ index
def test_index_is_valid_json_after_every_append(tmp_path):
    index = CaptureIndex(tmp_path / "i.json", {"request_id": "r", "bin": "r.bin", "layout": {}})
    assert json.loads((tmp_path / "i.json").read_text())["records"] == []
    for n in range(1, 60):
        index.append({"offset": n * 10, "rows": n, "first_position": n, "nbytes": 16 * n})
        doc = json.loads((tmp_path / "i.json").read_text())
        assert len(doc["records"]) == n and doc["records"][-1]["rows"] == n
        assert doc["request_id"] == "r"
    index.close()


def test_append_rewrites_only_the_tail(tmp_path):
    path = tmp_path / "i.json"
    index = CaptureIndex(path, {"request_id": "r", "bin": "r.bin", "layout": {}})
    for n in range(200):
        index.append({"n": n})
    before = path.read_bytes()
    index.append({"n": 200})
    after = path.read_bytes()
    assert after[:len(before) - len(TAIL)] == before[:-len(TAIL)]   # nothing before the tail changed
    index.close()


def test_reopened_index_continues(tmp_path):
    path = tmp_path / "i.json"
    index = CaptureIndex(path, {"request_id": "r", "bin": "r.bin", "layout": {}})
    index.append({"n": 0})
    index.close()
    index = CaptureIndex(path, {"request_id": "r", "bin": "r.bin", "layout": {}})
    index.append({"n": 1})
    index.close()
    assert [r["n"] for r in json.loads(path.read_text())["records"]] == [0, 1]


def torn_copies(path: Path, record: dict) -> list[bytes]:
    """Every state a torn append of ``record`` could leave behind (a prefix of the write)."""
    data = path.read_bytes()
    text = b",\n" + json.dumps(record).encode() + TAIL
    at = len(data) - len(TAIL)
    out = []
    for j in range(len(text)):
        torn = bytearray(data)
        torn[at:at + j] = text[:j]
        out.append(bytes(torn))
    return out


@pytest.mark.parametrize("existing", [0, 1, 3])
def test_recovery_from_any_torn_append(tmp_path, existing):
    path = tmp_path / "i.json"
    index = CaptureIndex(path, {"request_id": "r[\n", "bin": "r.bin", "layout": {"w": [1, 2]}})
    for n in range(existing):
        index.append({"n": n, "s": "x]}\n,"})
    index.close()
    for torn in torn_copies(path, {"n": existing, "s": "y"}):
        victim = tmp_path / "torn.json"
        victim.write_bytes(torn)
        kept = recover_index(victim)
        doc = json.loads(victim.read_bytes())
        assert kept == len(doc["records"]) and kept in (existing, existing + 1)
        assert [r["n"] for r in doc["records"]] == list(range(kept))
        assert doc["request_id"] == "r[\n"


WRITER = r"""
import sys, torch
from k3_accel.transport.capture import CaptureWriter, CaptureJob
w = CaptureWriter(sys.argv[1])
n = 0
print("ready", flush=True)
while True:
    pos = torch.arange(n * 7, n * 7 + 7)
    w.submit(CaptureJob("req/1", pos, pos + 1000, torch.full((7, 3), float(n)), release=lambda: None))
    n += 1
    if n % 50 == 0:
        w.flush()
"""


def test_index_survives_a_writer_killed_mid_append(tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC}
    for attempt in range(5):
        directory = tmp_path / f"run{attempt}"
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)], env=env,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2 + 0.1 * attempt)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        index = directory / f"{request_file_stem('req/1')}.json"
        doc = json.loads(index.read_bytes())           # valid JSON without any repair
        records = read_capture(index)
        assert len(records) == len(doc["records"]) > 0
        for n, rec in enumerate(records):              # every indexed record's bytes are complete
            assert rec["positions"].tolist() == list(range(n * 7, n * 7 + 7))
            assert rec["token_ids"].tolist() == [x + 1000 for x in range(n * 7, n * 7 + 7)]
            assert torch.equal(rec["hidden"], torch.full((7, 3), float(n)))


# ----------------------------------------------------------------- writer
def test_writer_writes_and_releases(tmp_path):
    released = []
    writer = CaptureWriter(tmp_path, max_open=2)
    for n in range(5):
        for rid in ("a", "B", "c/d"):
            pos = torch.arange(n * 3, n * 3 + 3)
            writer.submit(CaptureJob(rid, pos, pos * 2, torch.ones(3, 4, dtype=torch.bfloat16) * n,
                                     release=lambda: released.append(1)))
    writer.finish("a")
    assert writer.flush(10)
    writer.close()
    assert len(released) == 15 and writer.errors == 0
    for rid in ("a", "B", "c/d"):
        recs = read_capture(tmp_path / f"{request_file_stem(rid)}.json")
        assert [r["positions"].tolist() for r in recs] == [list(range(n * 3, n * 3 + 3)) for n in range(5)]
        index = json.loads((tmp_path / f"{request_file_stem(rid)}.json").read_text())
        assert [r["first_position"] for r in index["records"]] == [n * 3 for n in range(5)]
        assert recs[4]["hidden"].dtype == torch.bfloat16 and recs[4]["hidden"][0, 0].item() == 4


def test_writer_reports_errors_and_still_releases(tmp_path):
    errors, released = [], []
    writer = CaptureWriter(tmp_path, on_error=errors.append)
    (tmp_path / f"{request_file_stem('x')}.json").mkdir()        # the index path is a directory
    writer.submit(CaptureJob("x", torch.arange(2), torch.arange(2), None, release=lambda: released.append(1)))
    writer.flush(10)
    writer.close()
    assert released == [1] and len(errors) == 1 and writer.errors == 1


def test_client_capture_keeps_deferral_and_records_rows(server, client_factory, tmp_path):
    client = client_factory(server.address, capture_dir=str(tmp_path), ring_depth=2)
    out = client.step(rows(["r/1", "r2"], [(0, [1, 2, 3]), (0, [4, 5])], sampled=[False, False]))
    assert out.deferred
    client.step(rows(["r/1", "r2"], [(3, [4]), (2, [6, 7])], anchors=[5, 8]))
    client.flush()
    recs = read_capture(tmp_path / f"{request_file_stem('r/1')}.json")
    assert [r["positions"].tolist() for r in recs] == [[0, 1, 2], [3]]
    assert [r["token_ids"].tolist() for r in recs] == [[1, 2, 3], [4]]
    recs = read_capture(tmp_path / f"{request_file_stem('r2')}.json")
    assert [r["token_ids"].tolist() for r in recs] == [[4, 5], [6, 7]]
    assert client.stats()["capture"] == {"records": 4, "errors": 0}
    assert all(slot.holds == 0 for slot in client.ring.slots)
