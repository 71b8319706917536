"""Rules of the settings reader and the server's metrics that the mutants of
``scripts/mutant_rules_s22b.py`` showed no test checked: an address names a real port,
an empty setting means unset, and the stats op counts every error it returned."""
from __future__ import annotations

import pytest

from k3_accel.config import ConfigError, check_address, load_config
from k3_accel.server.metrics import ServerMetrics

ADDRESS_ENV = "VLLM_K3_DRAFT_REMOTE_ADDRESS"


@pytest.mark.parametrize("section, env, needle", [
    ({"draft_address": "tcp://127.0.0.1:0"}, {}, "additional_config.k3_accel.draft_address='tcp://127.0.0.1:0'"),
    ({}, {ADDRESS_ENV: "tcp://10.0.0.2:0"}, f"{ADDRESS_ENV}='tcp://10.0.0.2:0'"),
    ({}, {ADDRESS_ENV: "tcp://10.0.0.2:65536"}, f"{ADDRESS_ENV}='tcp://10.0.0.2:65536'"),
])
def test_an_address_whose_port_is_not_1_to_65535_is_refused_naming_its_key(section, env, needle):
    with pytest.raises(ConfigError) as info:
        load_config({"k3_accel": section}, environ=env)
    assert needle in str(info.value) and "expected tcp://HOST:PORT or ipc://PATH" in str(info.value)


@pytest.mark.parametrize("address", ["tcp://10.0.0.2:1", "tcp://10.0.0.2:65535", "ipc:///tmp/k3.sock"])
def test_the_first_and_last_ports_and_an_ipc_path_are_accepted(address):
    assert check_address(address, "draft_address") == address
    assert load_config(None, environ={ADDRESS_ENV: address}).draft_address == address


def test_an_empty_or_blank_setting_means_unset():
    """An exported but empty variable (``VLLM_K3_DRAFT_REMOTE_ADDRESS=``) leaves vLLM stock, it is
    not a bad address; a blank path is no path."""
    cfg = load_config(None, environ={ADDRESS_ENV: "", "VLLM_K3_DRAFT_CAPTURE_DIR": "   ",
                                     "VLLM_K3_DRAFT_CURVE_SERVER_KEY": "", "K3_ACCEL_CACHE_DIR": " "})
    assert cfg.draft_address is None and cfg.capture_dir is None
    assert cfg.curve_server_key is None and cfg.dma_cache_dir is None
    cfg = load_config({"k3_accel": {"draft_address": "  ", "capture_dir": ""}}, environ={})
    assert cfg.draft_address is None and cfg.capture_dir is None
    cfg = load_config({"k3_accel": {"capture_dir": " /tmp/cap "}}, environ={})
    assert cfg.capture_dir == "/tmp/cap"


def test_the_stats_errors_count_every_error_returned_per_code():
    metrics = ServerMetrics()
    for code in ("BAD_FIELD", "UNKNOWN_REQUEST", "BAD_FIELD", "BAD_FIELD"):
        metrics.error(code)
    assert metrics.snapshot()["errors"] == {"BAD_FIELD": 3, "UNKNOWN_REQUEST": 1}
    metrics.flush()
    assert metrics.registry.get_sample_value("k3_draft_errors_total", {"code": "BAD_FIELD"}) == 3
    assert metrics.registry.get_sample_value("k3_draft_errors_total", {"code": "UNKNOWN_REQUEST"}) == 1
