"""The ``dma_min_bytes`` setting: when large all-reduces may ride the DMA ring.

This module parses the value only; :mod:`k3_accel.config` knows where it is set
(its key and environment variable) and passes that as ``source``, so an error
names what the user actually wrote. Accepted text (case-insensitive, surrounding blanks ignored):

* unset or empty, or ``auto`` — measure the crossover on this group at start-up
  (the default);
* ``off``, ``none``, ``disabled`` — never use the DMA ring;
* a non-negative integer byte count, optionally with a binary suffix
  ``K``/``M``/``G``/``T`` (``KB``/``KiB``, ... accepted; all mean powers of 1024),
  e.g. ``6M``, ``24MiB``, ``1048576``, ``0`` (every eligible size).

Anything else — a negative number, a fraction, an unknown suffix — raises
:class:`DmaThresholdError` naming the source and the allowed values.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Optional

SETTING = "dma_min_bytes"  # the setting's name when the caller names no source
ALLOWED = "'auto' (default), 'off'/'none'/'disabled', or a byte count >= 0 with an optional K/M/G/T suffix (e.g. 24M)"

_OFF_WORDS = frozenset({"off", "none", "disabled"})
_SUFFIXES = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"([+-]?\d+)\s*([a-z]*)")

Mode = Literal["auto", "off", "bytes"]


class DmaThresholdError(ValueError):
    """The DMA threshold setting holds an invalid value; ``source`` names where it was set."""

    def __init__(self, value: object, why: str, *, source: str = SETTING):
        self.value = value
        self.source = source
        super().__init__(f"{source}={value!r} is invalid: {why}; allowed: {ALLOWED}")


@dataclass(frozen=True)
class DmaThreshold:
    """The parsed setting. ``min_bytes`` is set only in ``bytes`` mode."""

    mode: Mode
    min_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "off", "bytes"):
            raise ValueError(f"unknown DMA threshold mode {self.mode!r}")
        if (self.mode == "bytes") != (self.min_bytes is not None):
            raise ValueError("min_bytes is required in 'bytes' mode and only there")
        if self.min_bytes is not None and self.min_bytes < 0:
            raise ValueError("min_bytes must be >= 0")

    @classmethod
    def auto(cls) -> "DmaThreshold":
        return cls("auto")

    @classmethod
    def off(cls) -> "DmaThreshold":
        return cls("off")

    @classmethod
    def at(cls, min_bytes: int) -> "DmaThreshold":
        return cls("bytes", int(min_bytes))

    @property
    def is_auto(self) -> bool:
        return self.mode == "auto"

    @property
    def is_off(self) -> bool:
        return self.mode == "off"

    def __str__(self) -> str:
        return self.mode if self.min_bytes is None else format_bytes(self.min_bytes)


def parse_byte_size(text: str, *, source: str = SETTING) -> int:
    """``"24M"`` → 25165824. Raises :class:`DmaThresholdError` on bad input."""
    raw = text.strip().lower()
    match = _SIZE_RE.fullmatch(raw)
    if match is None:
        raise DmaThresholdError(text, "not an integer byte count", source=source)
    amount, suffix = int(match.group(1)), match.group(2)
    if suffix not in _SUFFIXES:
        raise DmaThresholdError(text, f"unknown size suffix {suffix!r}", source=source)
    if amount < 0:
        raise DmaThresholdError(text, "negative sizes are not allowed", source=source)
    return amount * _SUFFIXES[suffix]


def parse_dma_min_bytes(text: Optional[str], *, source: str = SETTING) -> DmaThreshold:
    """Parse the setting's text (``None`` = unset) into a :class:`DmaThreshold`."""
    if text is None:
        return DmaThreshold.auto()
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise DmaThresholdError(text, f"expected text, got {type(text).__name__}", source=source)
    if isinstance(text, int):
        if text < 0:
            raise DmaThresholdError(text, "negative sizes are not allowed", source=source)
        return DmaThreshold.at(text)
    word = text.strip().lower()
    if word in ("", "auto"):
        return DmaThreshold.auto()
    if word in _OFF_WORDS:
        return DmaThreshold.off()
    return DmaThreshold.at(parse_byte_size(text, source=source))


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n} B"


__all__ = [
    "ALLOWED", "SETTING", "DmaThreshold", "DmaThresholdError",
    "format_bytes", "parse_byte_size", "parse_dma_min_bytes",
]
