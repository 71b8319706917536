"""ClientSettings validation, K3Config mapping, StepInput checks and the timing log."""
from __future__ import annotations

import logging

import pytest
import torch

from k3_accel.config import load_config
from k3_accel.transport.api import ClientSettings, SettingsError, StepInput
from k3_accel.transport.failures import StepInputError
from k3_accel.transport.timing import Telemetry


def test_from_config_maps_env_and_target_facts():
    cfg = load_config(environ={"VLLM_K3_DRAFT_REMOTE_ADDRESS": "tcp://127.0.0.1:5557",
                               "VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS": "1234",
                               "VLLM_K3_DRAFT_ASYNC_PREFILL_INGEST": "0",
                               "VLLM_K3_DRAFT_CAPTURE_DIR": "/tmp/cap",
                               "VLLM_K3_DRAFT_TIMING_LOG_INTERVAL": "50"})
    s = ClientSettings.from_config(cfg, max_rows=2048, context_width=3 * 7168, num_speculative_tokens=7)
    assert (s.address, s.timeout_ms, s.ring_depth, s.capture_dir, s.timing_log_interval) == \
        ("tcp://127.0.0.1:5557", 1234, 0, "/tmp/cap", 50)
    assert s.max_rows == 2048 and s.context_width == 21504 and s.timeout_s == pytest.approx(1.234)


@pytest.mark.parametrize("source", ["additional_config", "environment"])
def test_from_config_maps_each_curve_setting_to_its_own_field(source, tmp_path):
    """The server's public key and the client's certificate are two files: swapped, every
    CURVE handshake fails; each setting must reach its own field, from either source."""
    server_key, client_key = str(tmp_path / "server.key"), str(tmp_path / "client.key_secret")
    if source == "environment":
        cfg = load_config({}, {"VLLM_K3_DRAFT_REMOTE_ADDRESS": "tcp://h:1",
                               "VLLM_K3_DRAFT_CURVE_SERVER_KEY": server_key,
                               "VLLM_K3_DRAFT_CURVE_CLIENT_KEY": client_key})
    else:
        cfg = load_config({"k3_accel": {"draft_address": "tcp://h:1", "curve_server_key": server_key,
                                        "curve_client_key": client_key}}, {})
    s = ClientSettings.from_config(cfg)
    assert (s.curve_server_key, s.curve_client_key) == (server_key, client_key)
    plain = ClientSettings.from_config(load_config({"k3_accel": {"draft_address": "tcp://h:1"}}, {}))
    assert plain.curve_server_key is None and plain.curve_client_key is None


def test_from_config_without_address_is_a_settings_error():
    with pytest.raises(SettingsError, match="address"):
        ClientSettings.from_config(load_config(environ={}))


@pytest.mark.parametrize("kw, words", [
    ({"address": "localhost:5"}, "address"),
    ({"timeout_ms": 0}, "timeout_ms"),
    ({"ring_depth": -1}, "ring_depth"),
    ({"max_rows": 0}, "max_rows"),
    ({"logits": "some"}, "logits"),
    ({"logits": "topk"}, "topk"),
    ({"hidden_dtype": torch.int64}, "hidden_dtype"),
    ({"curve_server_key": "/k"}, "curve"),
    ({"ring_depth": True}, "ring_depth"),
])
def test_bad_settings_are_rejected_by_name(kw, words):
    with pytest.raises(SettingsError, match=words):
        ClientSettings(**{"address": "tcp://127.0.0.1:1", **kw})


def good_input(**kw) -> StepInput:
    base = dict(req_ids=["a", "b"], counts=[2, 1], positions=torch.arange(3), token_ids=torch.arange(3),
                sampled=[True, False], anchor_tokens=[1, 2], anchor_positions=[2, 1], k=3)
    base.update(kw)
    return StepInput(**base)


@pytest.mark.parametrize("kw, words", [
    ({"counts": [2]}, "counts"),
    ({"counts": [2, -1]}, "counts"),
    ({"positions": torch.arange(4)}, "positions"),
    ({"token_ids": torch.zeros(3)}, "token_ids"),
    ({"sampled": [True]}, "sampled"),
    ({"anchor_positions": [1]}, "anchor_positions"),
    ({"k": -1}, "k="),
    ({"hidden": torch.zeros(3, 5, dtype=torch.bfloat16)}, "width"),
    ({"hidden": torch.zeros(3, 8)}, "dtype"),
    ({"hidden": torch.zeros(2, 8, dtype=torch.bfloat16)}, "shape"),
    ({"req_ids": ["a", "a"]}, "duplicates"),
    ({"num_accepted": [1]}, "num_accepted"),
    ({"num_verified": [1]}, "num_verified"),
    ({"num_verified": [1, 1, 1]}, "num_verified"),
    ({"temperature": [0.5, 0.0], "seeds": [1]}, "seeds"),
    ({"temperature": [0.5], "seeds": [1, 2]}, "seeds"),
    ({"temperature": [0.5, 0.0]}, "seeds"),
])
def test_inconsistent_step_input_names_the_field(kw, words):
    settings = ClientSettings(address="tcp://127.0.0.1:1", max_rows=16, context_width=8)
    good_input().validate(settings)
    with pytest.raises(StepInputError, match=words):
        good_input(**kw).validate(settings)


def test_too_many_rows_for_the_ring():
    with pytest.raises(StepInputError, match="max_rows"):
        good_input().validate(ClientSettings(address="tcp://127.0.0.1:1", max_rows=2))


def test_a_step_of_exactly_max_rows_rows_is_accepted():
    """max_rows is the target's max batched tokens: a full step has exactly that many rows."""
    good_input().validate(ClientSettings(address="tcp://127.0.0.1:1", max_rows=3))     # 2 + 1 rows
    good_input(temperature=[0.5, 0.0], seeds=[1, 2], num_accepted=[0, 1], num_verified=[1, 1]).validate(
        ClientSettings(address="tcp://127.0.0.1:1", max_rows=3))


def test_timing_log_every_n_steps(caplog):
    tel = Telemetry(log_interval=2)
    with caplog.at_level(logging.INFO, logger="k3_accel.transport"):
        for _ in range(4):
            tel.add("stage", 0.001)
            tel.add_server_timing({"engine": 0.002, "bogus": "x"})
            tel.end_step()
    lines = [r.message for r in caplog.records if "timing over 2 steps" in r.message]
    assert len(lines) == 2 and "stage=1.000ms" in lines[0] and "server.engine=2.000ms" in lines[0]
    snap = tel.snapshot()
    assert snap["steps"] == 4 and snap["phases"]["stage"]["count"] == 4


def test_a_phase_reports_its_longest_time_and_server_timings_are_numbers_only():
    """``max_ms`` is the longest of a phase's times (not its first or last); a server timing that is
    not a number (a bool, a string) is ignored rather than counted as 1 s or 0 s."""
    tel = Telemetry()
    for seconds in (0.002, 0.005, 0.001):
        tel.add("stage", seconds)
    tel.add_server_timing({"engine": 0.004, "cached": True, "warm": False, "note": "x"})
    phases = tel.snapshot()["phases"]
    assert phases["stage"]["count"] == 3 and phases["stage"]["max_ms"] == pytest.approx(5.0)
    assert set(phases) == {"stage", "server.engine"}
    assert phases["server.engine"]["count"] == 1
