"""``dma_min_bytes = auto``: measure where the DMA ring beats the next backend.

At start-up every rank times the next backend (what stock vLLM would use) and
the DMA ring at a ladder of sizes, the tables are merged across ranks (the
slowest rank's time per cell: an all-reduce finishes with its slowest rank), and
every rank derives the same decision from the same table:

    the crossover is the smallest ladder size S at which the ring beats the next
    backend by at least ``margin`` **and keeps winning at every larger size
    measured**; no such S → no crossover (DMA off).

Between ladder points the next backend keeps the sizes below S, so the rule
errs towards stock behaviour. A decision is cached per world size, topology (which
GPUs, in rank order), driver and software versions (``~/.cache/k3_accel/``, or
the config's ``dma_cache_dir``); the first rank loads it and broadcasts it, so
all ranks agree even when their file systems differ.

The measurement is an injected function ``measure(nbytes) -> (next_s, dma_s)``;
:func:`make_event_measure` is the real one (CUDA events, median). It allocates
its input buffer when it is made (an agreed stage), so a rank is unlikely to
fail alone half-way through the ring's collectives for want of memory.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .consensus import AgreedError, agree, broadcast_from_first, describe_error

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_LADDER: Tuple[int, ...] = tuple(MiB << k for k in range(0, 9))  # 1 MiB .. 256 MiB
DEFAULT_MARGIN = 0.03
CACHE_FORMAT = 1

Measure = Callable[[int], Tuple[float, float]]


@dataclass(frozen=True)
class Sample:
    nbytes: int
    next_s: float
    dma_s: float

    @property
    def dma_wins_by(self) -> float:
        """Fraction of the next backend's time the ring saves (negative: ring slower)."""
        return 1.0 - self.dma_s / self.next_s if self.next_s > 0 else float("-inf")


@dataclass(frozen=True)
class CrossoverDecision:
    min_bytes: Optional[int]
    reason: str
    samples: Tuple[Sample, ...] = ()
    source: str = "measured"  # or "cache"
    key: str = ""

    def to_json(self) -> dict:
        return {
            "format": CACHE_FORMAT,
            "min_bytes": self.min_bytes,
            "reason": self.reason,
            "samples": [[s.nbytes, s.next_s, s.dma_s] for s in self.samples],
            "key": self.key,
        }

    @classmethod
    def from_json(cls, data: Mapping, *, source: str = "cache") -> "CrossoverDecision":
        if data.get("format") != CACHE_FORMAT:
            raise ValueError("unknown crossover cache format")
        min_bytes = data["min_bytes"]
        samples = tuple(Sample(int(n), float(a), float(b)) for n, a, b in data["samples"])
        return cls(
            None if min_bytes is None else int(min_bytes),
            str(data["reason"]), samples, source, str(data.get("key", "")),
        )


def ladder_sizes(
    max_bytes: int,
    world_size: int,
    itemsize: int,
    base: Sequence[int] = DEFAULT_LADDER,
) -> Tuple[int, ...]:
    """Ladder sizes the ring can take: ≤ ``max_bytes``, whole multiples of world·8 elements.

    ``max_bytes`` itself (rounded down) closes the ladder, so the rule also sees
    the largest size that will ever be routed.
    """
    quantum = int(world_size) * 8 * int(itemsize)
    sizes = []
    for nbytes in (*base, int(max_bytes)):
        nbytes = (int(nbytes) // quantum) * quantum
        if 0 < nbytes <= max_bytes and nbytes not in sizes:
            sizes.append(nbytes)
    return tuple(sorted(sizes))


def select_crossover(samples: Iterable[Sample], *, margin: float = DEFAULT_MARGIN) -> Tuple[Optional[int], str]:
    """The decision rule (see module doc). Returns ``(min_bytes or None, reason)``."""
    table = sorted(samples, key=lambda s: s.nbytes)
    if not table:
        return None, "no sizes measured"
    wins = [s.dma_s <= s.next_s * (1.0 - margin) for s in table]
    if not wins[-1]:
        best = max(table, key=lambda s: s.dma_wins_by)
        return None, (
            f"DMA never wins by >= {margin:.0%} up to {_mib(table[-1].nbytes)} "
            f"(closest at {_mib(best.nbytes)}: DMA {best.dma_s * 1e3:.3f} ms vs "
            f"next {best.next_s * 1e3:.3f} ms)"
        )
    first = len(table) - 1
    while first > 0 and wins[first - 1]:
        first -= 1
    s = table[first]
    return s.nbytes, (
        f"DMA wins from {_mib(s.nbytes)} up ({s.dma_s * 1e3:.3f} ms vs next "
        f"{s.next_s * 1e3:.3f} ms there)"
    )


def _mib(n: int) -> str:
    return f"{n / MiB:g} MiB"


def merge_across_ranks(group, samples: Sequence[Sample]) -> Tuple[Sample, ...]:
    """Collective: per cell, the slowest rank's time; identical on every rank."""
    if group is None or dist.get_world_size(group) == 1:
        return tuple(samples)
    flat = torch.tensor(
        [v for s in samples for v in (float(s.nbytes), s.next_s, s.dma_s)], dtype=torch.float64
    )
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    values = flat.tolist()
    return tuple(
        Sample(int(values[3 * i]), values[3 * i + 1], values[3 * i + 2]) for i in range(len(samples))
    )


# --------------------------------------------------------------------------- cache
def default_cache_dir() -> Path:
    """``~/.cache/k3_accel`` (the config's ``dma_cache_dir`` overrides it)."""
    return Path.home() / ".cache" / "k3_accel"


def cache_key(fields: Mapping) -> str:
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


@dataclass
class CrossoverCache:
    directory: Path = field(default_factory=default_cache_dir)

    def path(self, key: str) -> Path:
        return Path(self.directory) / f"dma-crossover-{key}.json"

    def load(self, key: str) -> Optional[CrossoverDecision]:
        try:
            data = json.loads(self.path(key).read_text())
            decision = CrossoverDecision.from_json(data)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return decision if decision.key == key else None

    def store(self, key: str, decision: CrossoverDecision, fields: Mapping) -> Optional[Path]:
        path = self.path(key)
        data = decision.to_json()
        data["key"] = key
        data["fields"] = {k: fields[k] for k in sorted(fields)}
        data["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as fh:
                tmp = fh.name
                json.dump(data, fh, indent=1, default=str)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("k3-accel: could not write DMA crossover cache %s: %s", path, exc)
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            return None
        return path


def environment_fields(world_size: int, topology: object, driver: object, **extra) -> dict:
    """What a cached crossover depends on: world size, topology, driver, software versions.

    ``topology`` names the GPUs in rank order (so another subset of a host's GPUs,
    with other links between them, gets its own entry); ``driver`` is every rank's
    driver version.
    """
    from importlib import metadata

    def version(dist_name: str) -> str:
        try:
            return metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            return "absent"

    nccl = "absent"
    try:
        if torch.cuda.is_available():
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001
        pass
    fields = {
        "world_size": int(world_size),
        "topology": topology,
        "driver": driver,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "nccl": nccl,
        "b12x": version("b12x"),
        "k3_accel": version("k3-accel"),
    }
    fields.update(extra)
    return fields


# --------------------------------------------------------------------------- run
def load_agreed(group, key: str, *, cache: Optional[CrossoverCache]) -> Optional[CrossoverDecision]:
    """Collective: the first rank's cached decision for ``key``, on every rank (or None)."""
    if cache is None:
        return None
    first = group is None or dist.get_rank(group) == 0
    payload = None
    if first:
        try:
            cached = cache.load(key)
            payload = None if cached is None else cached.to_json()
        except Exception as exc:  # noqa: BLE001 - an unreadable cache is no cache
            log.warning("k3-accel: DMA crossover cache unreadable: %s", exc)
    if group is not None:
        payload = broadcast_from_first(group, payload)
    if payload is None:
        return None
    cached = CrossoverDecision.from_json(payload)
    return CrossoverDecision(cached.min_bytes, cached.reason, cached.samples, "cache", key)


def run_auto(
    group,
    measure: Measure,
    sizes: Sequence[int],
    *,
    margin: float = DEFAULT_MARGIN,
    cache: Optional[CrossoverCache] = None,
    key: str = "",
    fields: Optional[Mapping] = None,
) -> CrossoverDecision:
    """Collective over ``group`` (gloo): measure → merge → decide → store under ``key``.

    A rank whose measurement fails does not skip the merge alone: the failure is
    agreed first and raised as :class:`AgreedError` on every rank.
    """
    if not sizes:
        return CrossoverDecision(None, "no ladder size fits the ring", (), "measured", key)
    local: list = []
    error: Optional[str] = None
    try:
        local = [Sample(n, *measure(n)) for n in sizes]
    except Exception as exc:  # noqa: BLE001
        error = describe_error(exc)
    failure = agree(group, error) if group is not None else error
    if failure is not None:
        raise AgreedError(failure)
    merged = merge_across_ranks(group, local)
    min_bytes, reason = select_crossover(merged, margin=margin)
    decision = CrossoverDecision(min_bytes, reason, merged, "measured", key)
    first = group is None or dist.get_rank(group) == 0
    if cache is not None and first:
        cache.store(key, decision, dict(fields or {}))
    return decision


def _median_event_time(fn: Callable[[], object], *, iters: int) -> float:
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def make_event_measure(
    next_fn: Callable[[torch.Tensor], torch.Tensor],
    dma_fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    device: torch.device,
    max_bytes: int,
    dtype: torch.dtype = torch.bfloat16,
    warmup: int = 3,
    iters: int = 15,
) -> Measure:
    """The real measurement: CUDA-event medians of each backend at each size (random data).

    One buffer of ``max_bytes`` is filled here; each size times a prefix of it.
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    data = torch.empty(int(max_bytes) // itemsize, device=device, dtype=dtype).uniform_(-1.0, 1.0)

    def measure(nbytes: int) -> Tuple[float, float]:
        x = data[: nbytes // itemsize].uniform_(-1.0, 1.0)  # fresh values: an in-place backend grows them
        for _ in range(warmup):
            next_fn(x)
            dma_fn(x)
        torch.cuda.synchronize(device)
        t_next = _median_event_time(lambda: next_fn(x), iters=iters)
        t_dma = _median_event_time(lambda: dma_fn(x), iters=iters)
        return t_next, t_dma

    return measure


__all__ = [
    "CrossoverCache", "CrossoverDecision", "DEFAULT_LADDER", "DEFAULT_MARGIN", "Sample",
    "cache_key", "default_cache_dir", "environment_fields", "ladder_sizes",
    "load_agreed", "make_event_measure", "merge_across_ranks", "run_auto", "select_crossover",
]
