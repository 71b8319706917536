"""Looking up vLLM symbols a hook needs, with a typed failure when absent."""
from __future__ import annotations

import importlib
from typing import Any


class MissingSymbol(Exception):
    """The installed vLLM lacks a symbol a hook needs; the hook stays off."""

    def __init__(self, symbol: str):
        super().__init__(symbol)
        self.symbol = symbol


def require(module: str, attr: str | None = None) -> Any:
    """Import ``module`` (and get ``attr``) or raise :class:`MissingSymbol`."""
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise MissingSymbol(module) from exc
    if attr is None:
        return mod
    try:
        return getattr(mod, attr)
    except AttributeError as exc:
        raise MissingSymbol(f"{module}.{attr}") from exc


def vllm_version() -> str:
    try:
        import vllm
        return str(getattr(vllm, "__version__", "unknown"))
    except ImportError:
        return "not installed"
