"""The plugin's settings: the only place that reads env vars and additional_config.

Precedence: ``--additional-config '{"k3_accel": {...}}'`` wins over the
environment, which wins over the defaults below. Every value remembers where it
came from (:meth:`K3Config.source`), so a message can name the key the user set.
An environment variable that is set but blank counts as unset, for every setting.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from k3_accel.comm.threshold import DmaThreshold, parse_dma_min_bytes


class ConfigError(ValueError):
    """A setting has a bad value; the message names the key and what is allowed."""


def _positive_int(key: str, allow_zero: bool = False) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        try:
            number = int(str(value).strip())
        except ValueError:
            number = None
        if number is None or number < 0 or (number == 0 and not allow_zero):
            allowed = "an integer >= 0" if allow_zero else "an integer > 0"
            raise ConfigError(f"{key}={value!r}: expected {allowed}")
        return number
    return parse


def _switch(key: str) -> Callable[[Any], bool]:
    def parse(value: Any) -> bool:
        text = str(value).strip().lower()
        if isinstance(value, bool) or text in ("1", "0", "true", "false", "on", "off", "yes", "no"):
            return value if isinstance(value, bool) else text in ("1", "true", "on", "yes")
        raise ConfigError(f"{key}={value!r}: expected on/off (true/false, 1/0)")
    return parse


def _auto_switch(key: str) -> Callable[[Any], str]:
    """``auto``, or a switch's on/off (true/false, 1/0) as ``"on"`` / ``"off"``."""
    def parse(value: Any) -> str:
        if str(value).strip().lower() == "auto":
            return "auto"
        try:
            return "on" if _switch(key)(value) else "off"
        except ConfigError:
            raise ConfigError(f"{key}={value!r}: expected auto, on or off") from None
    return parse


def _choice(*allowed: str) -> Callable[[str], Callable[[Any], str]]:
    def make(key: str) -> Callable[[Any], str]:
        def parse(value: Any) -> str:
            text = str(value).strip().lower()
            if text not in allowed:
                raise ConfigError(f"{key}={value!r}: allowed {list(allowed)}")
            return text
        return parse
    return make


def _optional_str(key: str) -> Callable[[Any], str | None]:
    def parse(value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return value.strip() or None
    return parse


MAX_IPC_PATH = 107        # a unix socket's name: sun_path holds 108 bytes with the terminating NUL


def check_address(text: str, key: str = "address") -> str:
    """The one rule for a draft server address: ``tcp://HOST:PORT`` (port 1..65535) or
    ``ipc://PATH``; :class:`ConfigError` naming ``key`` otherwise."""
    ok = False
    if isinstance(text, str) and text.startswith("tcp://"):
        host, _, port = text[len("tcp://"):].rpartition(":")
        # a host to connect to: not a bind wildcard ("*"), no blanks (ZMQ refuses either at connect)
        ok = bool(host) and "*" not in host and not any(ch.isspace() for ch in host) \
            and port.isdigit() and 0 < int(port) < 65536
    elif isinstance(text, str) and text.startswith("ipc://"):
        ok = 0 < len(text[len("ipc://"):].encode()) <= MAX_IPC_PATH     # as the server's --ipc-path
    if not ok:
        raise ConfigError(f"{key}={text!r}: expected tcp://HOST:PORT or ipc://PATH "
                          f"(PATH at most {MAX_IPC_PATH} bytes)")
    return text


def _address(key: str) -> Callable[[Any], str | None]:
    def parse(value: Any) -> str | None:
        text = _optional_str(key)(value)
        return None if text is None else check_address(text, key)
    return parse


def _dma(key: str) -> Callable[[Any], DmaThreshold]:
    def parse(value: Any) -> DmaThreshold:
        try:
            return parse_dma_min_bytes(None if value is None else str(value), source=key)
        except ValueError as exc:  # the message already starts with ``key=value``
            raise ConfigError(str(exc)) from exc
    return parse


@dataclass(frozen=True)
class K3Config:
    """Typed plugin settings (see README "Configuration")."""

    draft_address: str | None = None          # no address: vLLM behaves as stock
    draft_timeout_ms: int = 30000             # hello, ingests, frees: generous
    draft_propose_timeout_ms: int = 50        # a propose's reply: step-sized (the GPU waits for it)
    ingest_ring_depth: int = 2                # pinned staging slots; 0 = every ingest waits for its reply
    device_plane: str = "auto"                # auto: hidden rows GPU to GPU when the server is on this host; off
    adaptive: bool = True                     # per-step K from measured acceptance and costs; off = fixed K
    adaptive_min_k: int = 0                   # fewest drafts for a sampling request (0: speculation may stop)
    adaptive_probe_interval: int = 32         # while speculation is off, a probe every this many steps
    adaptive_gate: str = "auto"               # V2: while speculation is off the scheduler schedules plain
                                              # decodes; auto: with vLLM's adaptive verification only
    draft_priority: bool = True               # V2: vLLM's step thread waits for the previous step's drafts
                                              # before it prepares the next step (the GIL goes to the draft thread)
    capture_dir: str | None = None
    timing_log_interval: int = 0              # 0 = no periodic timing log
    dma_min_bytes: DmaThreshold = dataclasses.field(default_factory=lambda: parse_dma_min_bytes(None))
    dma_cache_dir: str | None = None          # measured DMA crossovers (default ~/.cache/k3_accel)
    curve_server_key: str | None = None       # server public key file (client side)
    curve_client_key: str | None = None       # client certificate (secret) file
    # field -> where its value came from; filled by load_config (not compared)
    _sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def source(self, field: str) -> str:
        """Where ``field``'s value came from: ``additional_config.k3_accel.<field>``,
        the environment variable's name, or ``default``."""
        if field not in ALLOWED_KEYS:
            raise KeyError(f"unknown setting {field!r}; known: {list(ALLOWED_KEYS)}")
        return self._sources.get(field, "default")


@dataclass(frozen=True)
class _Setting:
    field: str
    env: str | None
    parse: Callable[[str], Callable[[Any], Any]]


_SETTINGS = (
    _Setting("draft_address", "VLLM_K3_DRAFT_REMOTE_ADDRESS", _address),
    _Setting("draft_timeout_ms", "VLLM_K3_DRAFT_REMOTE_TIMEOUT_MS", _positive_int),
    _Setting("draft_propose_timeout_ms", "VLLM_K3_DRAFT_PROPOSE_TIMEOUT_MS", _positive_int),
    _Setting("ingest_ring_depth", "VLLM_K3_DRAFT_ASYNC_PREFILL_INGEST",
             lambda key: _positive_int(key, allow_zero=True)),
    _Setting("device_plane", "VLLM_K3_DRAFT_DEVICE_PLANE", _choice("auto", "off")),
    _Setting("adaptive", "VLLM_K3_DRAFT_ADAPTIVE", _switch),
    _Setting("adaptive_min_k", "VLLM_K3_DRAFT_ADAPTIVE_MIN_K", lambda key: _positive_int(key, allow_zero=True)),
    _Setting("adaptive_probe_interval", "VLLM_K3_DRAFT_ADAPTIVE_PROBE_INTERVAL", _positive_int),
    _Setting("adaptive_gate", "VLLM_K3_DRAFT_ADAPTIVE_GATE", _auto_switch),
    _Setting("draft_priority", "VLLM_K3_DRAFT_PRIORITY", _switch),
    _Setting("capture_dir", "VLLM_K3_DRAFT_CAPTURE_DIR", _optional_str),
    _Setting("timing_log_interval", "VLLM_K3_DRAFT_TIMING_LOG_INTERVAL",
             lambda key: _positive_int(key, allow_zero=True)),
    _Setting("dma_min_bytes", "VLLM_PCIE_DMA_MIN_BYTES", _dma),
    _Setting("dma_cache_dir", "K3_ACCEL_CACHE_DIR", _optional_str),
    _Setting("curve_server_key", "VLLM_K3_DRAFT_CURVE_SERVER_KEY", _optional_str),
    _Setting("curve_client_key", "VLLM_K3_DRAFT_CURVE_CLIENT_KEY", _optional_str),
)
ALLOWED_KEYS = tuple(s.field for s in _SETTINGS)


def _plugin_section(additional_config: Mapping[str, Any] | None) -> Mapping[str, Any]:
    section = (additional_config or {}).get("k3_accel", {})
    if not isinstance(section, Mapping):
        raise ConfigError(f"additional_config.k3_accel: expected an object, got {type(section).__name__}")
    unknown = sorted(set(section) - set(ALLOWED_KEYS))
    if unknown:
        raise ConfigError(f"additional_config.k3_accel: unknown key(s) {unknown}; "
                          f"allowed: {list(ALLOWED_KEYS)}")
    return section


def load_config(additional_config: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> K3Config:
    """Build the validated config; raises :class:`ConfigError` on a bad value."""
    env = os.environ if environ is None else environ
    section = _plugin_section(additional_config)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in _SETTINGS:
        if setting.field in section:
            key, raw = f"additional_config.k3_accel.{setting.field}", section[setting.field]
        elif setting.env and env.get(setting.env, "").strip():      # exported but blank: unset
            key, raw = setting.env, env[setting.env]
        else:
            continue
        values[setting.field] = setting.parse(key)(raw)
        sources[setting.field] = key
    return K3Config(**values, _sources=sources)


def from_vllm(vllm_config: Any, environ: Mapping[str, str] | None = None) -> K3Config:
    """The plugin's config for one engine: ``vllm_config.additional_config`` + environment.

    The one loader for every hook (speculator, communicator). ``vllm_config`` may be
    None (no engine config in this process): then only the environment counts.
    """
    additional = getattr(vllm_config, "additional_config", None) if vllm_config is not None else None
    return load_config(additional if isinstance(additional, Mapping) else None, environ)
