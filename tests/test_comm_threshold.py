"""Parsing the dma_min_bytes setting (its sources live in k3_accel.config)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3_accel.comm.threshold import (
    SETTING,
    DmaThreshold,
    DmaThresholdError,
    format_bytes,
    parse_byte_size,
    parse_dma_min_bytes,
)


@pytest.mark.parametrize("text", [None, "", "  ", "auto", "AUTO", " Auto "])
def test_unset_and_auto_mean_auto(text):
    t = parse_dma_min_bytes(text)
    assert t == DmaThreshold.auto() and t.is_auto and t.min_bytes is None


@pytest.mark.parametrize("text", ["off", "OFF", "none", "None", "disabled", " disabled "])
def test_off_words(text):
    t = parse_dma_min_bytes(text)
    assert t.is_off and t.min_bytes is None and not t.is_auto


@pytest.mark.parametrize(
    "text,expected",
    [
        ("0", 0),
        ("1048576", 1 << 20),
        ("6M", 6 << 20),
        ("6m", 6 << 20),
        ("24MiB", 24 << 20),
        ("24 MB", 24 << 20),
        ("512k", 512 << 10),
        ("512KiB", 512 << 10),
        ("2G", 2 << 30),
        ("1t", 1 << 40),
        ("+8M", 8 << 20),
        ("100b", 100),
    ],
)
def test_sizes(text, expected):
    t = parse_dma_min_bytes(text)
    assert t.mode == "bytes" and t.min_bytes == expected


@pytest.mark.parametrize("text", ["-1", "-6M", "1.5M", "abc", "6X", "M", "6 M B", "0x10", "1e6", "six"])
def test_bad_values_raise_a_clear_typed_error(text):
    with pytest.raises(DmaThresholdError) as info:
        parse_dma_min_bytes(text)
    err = info.value
    assert isinstance(err, ValueError)
    assert SETTING in str(err) and "auto" in str(err) and "off" in str(err)
    assert repr(text) in str(err)


def test_negative_says_negative():
    with pytest.raises(DmaThresholdError, match="negative"):
        parse_dma_min_bytes("-1")


def test_integers_are_accepted_and_bools_rejected():
    assert parse_dma_min_bytes(4096) == DmaThreshold.at(4096)
    with pytest.raises(DmaThresholdError):
        parse_dma_min_bytes(-3)
    with pytest.raises(DmaThresholdError):
        parse_dma_min_bytes(True)


def test_source_name_appears_in_error():
    with pytest.raises(DmaThresholdError, match="dma_min_bytes"):
        parse_dma_min_bytes("junk", source="additional_config.dma_min_bytes")


def test_threshold_invariants():
    with pytest.raises(ValueError):
        DmaThreshold("bytes")
    with pytest.raises(ValueError):
        DmaThreshold("auto", 5)
    with pytest.raises(ValueError):
        DmaThreshold("sometimes")
    with pytest.raises(ValueError):
        DmaThreshold("bytes", -1)
    assert str(DmaThreshold.at(24 << 20)) == "24 MiB"
    assert str(DmaThreshold.auto()) == "auto" and str(DmaThreshold.off()) == "off"


@given(st.integers(min_value=0, max_value=1 << 20), st.sampled_from(["", "k", "M", "g", "KiB", "mb"]))
def test_size_round_trip(amount, suffix):
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "kib": 1 << 10, "mb": 1 << 20}[suffix.lower()]
    assert parse_byte_size(f"{amount}{suffix}") == amount * scale


def test_format_bytes():
    assert format_bytes(6 << 20) == "6 MiB"
    assert format_bytes(512 << 10) == "512 KiB"
    assert format_bytes(100) == "100 B"
