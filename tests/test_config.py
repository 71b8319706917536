"""Settings: env vars, additional_config precedence, and clear errors."""
from __future__ import annotations

import pytest

from k3_accel.config import ALLOWED_KEYS, ConfigError, K3Config, load_config


def test_defaults():
    cfg = load_config({}, environ={})
    assert cfg == K3Config()
    assert cfg.draft_address is None and cfg.draft_timeout_ms == 30000 and cfg.ingest_ring_depth == 2
    assert cfg.dma_min_bytes.mode == "auto"


def test_reference_env_names():
    cfg = load_config(None, environ={
        "VLLM_K3_DRAFT_REMOTE_ADDRESS": "tcp://10.0.0.2:5557", "VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS": "1500",
        "VLLM_K3_DRAFT_ASYNC_PREFILL_INGEST": "0", "VLLM_K3_DRAFT_CAPTURE_DIR": "/tmp/cap",
        "VLLM_K3_DRAFT_TIMING_LOG_INTERVAL": "50", "VLLM_PCIE_DMA_MIN_BYTES": "24M"})
    assert cfg.draft_address == "tcp://10.0.0.2:5557" and cfg.draft_timeout_ms == 1500
    assert cfg.ingest_ring_depth == 0 and cfg.capture_dir == "/tmp/cap" and cfg.timing_log_interval == 50
    assert cfg.dma_min_bytes.mode == "bytes" and cfg.dma_min_bytes.min_bytes == 24 << 20


def test_additional_config_wins_over_env():
    cfg = load_config({"k3_accel": {"draft_address": "tcp://127.0.0.1:9", "ingest_ring_depth": 4}},
                      environ={"VLLM_K3_DRAFT_REMOTE_ADDRESS": "tcp://127.0.0.1:1",
                               "VLLM_K3_DRAFT_ASYNC_PREFILL_INGEST": "1"})
    assert cfg.draft_address == "tcp://127.0.0.1:9" and cfg.ingest_ring_depth == 4


@pytest.mark.parametrize("section, env, needle", [
    ({"draft_adress": "tcp://x:1"}, {}, "unknown key(s) ['draft_adress']"),
    ({}, {"VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS": "soon"}, "VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS='soon': expected an integer > 0"),
    ({}, {"VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS": "0"}, "expected an integer > 0"),
    ({"ingest_ring_depth": -1}, {}, "additional_config.k3_accel.ingest_ring_depth=-1: expected an integer >= 0"),
    ({"draft_address": "localhost:5557"}, {}, "expected tcp://HOST:PORT"),
    ({}, {"VLLM_PCIE_DMA_MIN_BYTES": "-5"}, "VLLM_PCIE_DMA_MIN_BYTES"),
    ({}, {"VLLM_PCIE_DMA_MIN_BYTES": "lots"}, "allowed"),
    ({"adaptive_gate": "sometimes"}, {}, "additional_config.k3_accel.adaptive_gate='sometimes': expected auto, on or off"),
])
def test_bad_values_name_the_key(section, env, needle):
    with pytest.raises(ConfigError) as info:
        load_config({"k3_accel": section}, environ=env)
    assert needle in str(info.value)


@pytest.mark.parametrize("raw, want", [("auto", "auto"), ("AUTO", "auto"), (True, "on"), ("1", "on"),
                                       ("on", "on"), (False, "off"), ("0", "off"), ("false", "off")])
def test_the_scheduler_gate_is_auto_unless_switched(raw, want):
    assert K3Config().adaptive_gate == "auto"
    assert load_config({"k3_accel": {"adaptive_gate": raw}}, environ={}).adaptive_gate == want
    assert load_config(None, environ={"VLLM_K3_DRAFT_ADAPTIVE_GATE": str(raw)}).adaptive_gate == want


def test_section_must_be_an_object():
    with pytest.raises(ConfigError, match="expected an object"):
        load_config({"k3_accel": ["draft_address"]}, environ={})


def test_unknown_key_error_lists_allowed_keys():
    with pytest.raises(ConfigError) as info:
        load_config({"k3_accel": {"nope": 1}}, environ={})
    assert all(k in str(info.value) for k in ALLOWED_KEYS)


@pytest.mark.parametrize("address", ["tcp://*:5557", "tcp://10.0.0.2 :5557", "tcp://my host:5557"])
def test_an_address_zmq_cannot_connect_to_is_refused_when_read(address):
    """The server side's bind idiom ``tcp://*:PORT`` (or a host with a blank) is no address a
    client can connect to: ZMQ refuses it at connect, so it is refused here, naming the key,
    instead of leaving drafting off at the first step."""
    with pytest.raises(ConfigError) as info:
        load_config(None, environ={"VLLM_K3_DRAFT_REMOTE_ADDRESS": address})
    assert "VLLM_K3_DRAFT_REMOTE_ADDRESS" in str(info.value) and "expected tcp://HOST:PORT" in str(info.value)
    for ok in ("tcp://[::1]:5557", "tcp://localhost:5557", "tcp://0.0.0.0:5557"):
        assert load_config(None, environ={"VLLM_K3_DRAFT_REMOTE_ADDRESS": ok}).draft_address == ok


def test_an_ipc_path_longer_than_a_unix_socket_name_is_refused_when_read():
    """The server refuses such an --ipc-path (107 bytes at most); the client's address obeys the
    same limit instead of failing at connect, leaving drafting off."""
    fits = "ipc:///tmp/" + "k" * (107 - len("/tmp/"))
    assert load_config(None, environ={"VLLM_K3_DRAFT_REMOTE_ADDRESS": fits}).draft_address == fits
    with pytest.raises(ConfigError) as info:
        load_config(None, environ={"VLLM_K3_DRAFT_REMOTE_ADDRESS": fits + "k"})
    assert "VLLM_K3_DRAFT_REMOTE_ADDRESS" in str(info.value) and "at most 107 bytes" in str(info.value)


@pytest.mark.parametrize("blank", ["", "  "])
def test_an_exported_but_blank_variable_is_unset_for_every_setting(blank):
    # `export VAR=` (or an env file's `VAR=`) is how deployments clear a setting: every
    # setting falls back to its default and says so, whatever its type
    cfg = load_config(None, environ={name: blank for name in _env_names()})
    assert cfg == K3Config()
    assert all(cfg.source(key) == "default" for key in ALLOWED_KEYS)
    # a blank variable never hides a value given in additional_config
    cfg = load_config({"k3_accel": {"adaptive": False}}, environ={"VLLM_K3_DRAFT_ADAPTIVE": blank})
    assert cfg.adaptive is False


def _env_names() -> list[str]:
    from k3_accel import config
    return [s.env for s in config._SETTINGS if s.env]
