"""The communicator's settings: one loader (``from_vllm``), and messages that name the real source."""
from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from k3_accel.comm.router import RouterDecision
from k3_accel.config import ALLOWED_KEYS, ConfigError, K3Config, from_vllm, load_config

ENV_NAME = "VLLM_PCIE_DMA_MIN_BYTES"
KEY = "additional_config.k3_accel.dma_min_bytes"


def test_each_value_remembers_its_source():
    cfg = load_config({"k3_accel": {"dma_min_bytes": "6M"}}, environ={"K3_ACCEL_CACHE_DIR": "/tmp/x",
                                                                     ENV_NAME: "1M"})
    assert cfg.dma_min_bytes.min_bytes == 6 << 20                 # additional_config wins
    assert cfg.source("dma_min_bytes") == KEY
    assert cfg.source("dma_cache_dir") == "K3_ACCEL_CACHE_DIR"
    assert cfg.source("draft_address") == "default"
    assert load_config({}, environ={ENV_NAME: "1M"}).source("dma_min_bytes") == ENV_NAME
    assert cfg == K3Config(dma_min_bytes=cfg.dma_min_bytes, dma_cache_dir="/tmp/x")   # sources don't compare
    with pytest.raises(KeyError):
        cfg.source("dma_min_byte")
    assert set(ALLOWED_KEYS) >= {"dma_min_bytes", "dma_cache_dir"}


def test_a_bad_threshold_names_where_it_was_set():
    with pytest.raises(ConfigError) as info:
        load_config({"k3_accel": {"dma_min_bytes": "-6M"}}, environ={ENV_NAME: "auto"})
    assert str(info.value).startswith(f"{KEY}='-6M' is invalid") and ENV_NAME not in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config({}, environ={ENV_NAME: "lots"})
    assert str(info.value).startswith(f"{ENV_NAME}='lots' is invalid") and "additional_config" not in str(info.value)


def test_from_vllm_reads_additional_config_and_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_NAME, "2M")
    cfg = from_vllm(NS(additional_config={"k3_accel": {"dma_cache_dir": "/c"}}))
    assert cfg.dma_cache_dir == "/c" and cfg.source("dma_cache_dir") == "additional_config.k3_accel.dma_cache_dir"
    assert cfg.dma_min_bytes.min_bytes == 2 << 20 and cfg.source("dma_min_bytes") == ENV_NAME
    assert from_vllm(None).dma_min_bytes.min_bytes == 2 << 20              # no engine config: env only
    assert from_vllm(NS(additional_config=None)).source("dma_cache_dir") == "default"
    assert from_vllm(NS()).source("dma_cache_dir") == "default"
    with pytest.raises(ConfigError, match="unknown key"):
        from_vllm(NS(additional_config={"k3_accel": {"dma_min": 1}}))


def test_the_start_up_line_names_the_source_not_a_fixed_variable():
    line = RouterDecision("VLLM_STOCK", None, "DMA disabled by setting", "off", threshold_source=KEY).summary
    assert f"threshold off ({KEY})" in line and ENV_NAME not in line
    line = RouterDecision("VLLM_STOCK", None, "x", "auto", threshold_source="default").summary
    assert "threshold auto (default)" in line


def test_comm_package_knows_no_environment_variable_names():
    """Issue 11: only config.py knows setting names; comm/ takes values and a source label."""
    from pathlib import Path

    import k3_accel.comm as comm

    for path in Path(comm.__file__).parent.glob("*.py"):
        text = path.read_text()
        assert "os.environ" not in text and "getenv" not in text, path.name
        assert "VLLM_PCIE_DMA_MIN_BYTES" not in text and "K3_ACCEL_CACHE_DIR" not in text, path.name
