"""Rank consensus: every rank of a group takes the same decision, or none does.

All helpers are collective over a CPU (gloo) process group; every rank must call
them in the same order. The rule that keeps ranks in step: **a rank never
decides on its own local answer whether to enter a collective.** Local work
that may fail runs inside :func:`run_agreed`, which turns any exception into a
reason and agrees on it, so every rank leaves with the same outcome and goes
on to the same next collective.

A failure is agreed by a MAX all-reduce of a flag; only when some rank failed
are the reasons exchanged, so the happy path costs one tiny all-reduce.

Collectives that may wait on a peer that never comes (a rank that failed
before an exchange, a dead or hung peer at teardown) run on a dedicated group
from :func:`bounded_group`, whose every operation gives up after a timeout;
vLLM's own CPU group is never left in the middle of a collective.
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Callable, Generic, List, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
log = logging.getLogger(__name__)

StageHook = Callable[[str], None]


class AgreedError(RuntimeError):
    """Raised with the same ``reason`` on every rank of a group (already agreed)."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


def _flag_device(group) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank_failed(group, failed: bool) -> bool:
    """Collective: True on every rank when ``failed`` is True on any rank."""
    flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=_flag_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(int(flag.item()))


def agree(group, error: Optional[str]) -> Optional[str]:
    """Collective. ``error`` is this rank's failure (None = fine).

    Returns None when every rank passed None; otherwise the same text on every
    rank: each failing rank's reason, ranks with the same reason grouped
    (``"rank 1: X"``, ``"ranks 0,2: Y; rank 3: Z"``), so the root cause shows
    next to the peers that merely timed out waiting for it.
    """
    if not any_rank_failed(group, error is not None):
        return None
    return describe_failures(gather(group, error))


def describe_failures(errors: Sequence[Optional[str]], limit: int = 3) -> str:
    """``errors`` in rank order (None = fine) → one line, identical reasons grouped."""
    by_text: dict = {}
    for rank, text in enumerate(errors):
        if text is not None:
            by_text.setdefault(text, []).append(rank)
    parts = []
    for text, ranks in list(by_text.items())[:limit]:
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))
        parts.append(f"{who}: {text}")
    if len(by_text) > limit:
        parts.append(f"{len(by_text) - limit} more reason(s)")
    return "; ".join(parts)


def gather(group, value) -> List:
    """Collective: every rank's ``value`` (picklable), in group-rank order, on every rank."""
    values: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def broadcast_from_first(group, obj):
    """Collective: the group's first rank's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class Outcome(Generic[T]):
    """Result of :func:`run_agreed`: ``value`` when every rank succeeded, else the agreed ``failure``."""

    value: Optional[T]
    failure: Optional[str]

    @property
    def ok(self) -> bool:
        return self.failure is None


def run_agreed(
    group,
    work: Callable[[], T],
    *,
    stage: str = "",
    hook: Optional[StageHook] = None,
) -> Outcome[T]:
    """Collective: run ``work`` on every rank, then agree whether it succeeded everywhere.

    ``work`` may itself contain collectives only if it cannot fail *between*
    them on one rank alone (it agrees internally, or uses a bounded group). An
    :class:`AgreedError` from ``work`` is already the same on every rank and is
    returned without a second round. ``hook(f"{stage}:start")`` and
    ``hook(f"{stage}:end")`` run around ``work``, inside the guard: tests raise
    from them to inject a failure before and after the stage's exchanges.
    """
    value: Optional[T] = None
    error: Optional[str] = None
    try:
        if hook is not None:
            hook(f"{stage}:start")
        value = work()
        if hook is not None:
            hook(f"{stage}:end")
    except AgreedError as exc:
        return Outcome(None, exc.reason)
    except Exception as exc:  # noqa: BLE001 - any local failure becomes an agreed reason
        error = describe_error(exc)
    failure = agree(group, error)
    return Outcome(value if failure is None else None, failure)


def create_on_all_ranks(
    group,
    factory: Callable[[], T],
    *,
    abandon: Optional[Callable[[T], None]] = None,
    stage: str = "create",
    hook: Optional[StageHook] = None,
) -> Outcome[T]:
    """Collective: run ``factory`` on every rank; keep the results only if all succeeded.

    A rank whose factory raised (or returned None) contributes its reason. When
    any rank failed, the ranks that did build a value cannot run its collective
    teardown (the failed ranks hold nothing to tear down), so they call
    ``abandon(value)`` — a local, non-collective release — and drop it.
    """
    def build() -> T:
        value = factory()
        if value is None:
            raise RuntimeError("factory returned None")
        built.append(value)
        return value

    built: list = []
    outcome = run_agreed(group, build, stage=stage, hook=hook)
    if not outcome.ok and built and abandon is not None:
        try:
            abandon(built[0])
        except Exception as exc:  # noqa: BLE001
            log.warning("k3-accel: local release after failed consensus raised %s", describe_error(exc))
    return outcome


def bounded_group(group, timeout_s: float):
    """Collective over ``group``'s ranks: a new gloo group whose every operation times out.

    Only the members take part (``use_local_synchronization``), so it works for
    a TP group inside a larger world. A member that never arrives makes the
    others' operations fail after ``timeout_s`` instead of blocking: use it for
    exchanges a peer may miss, and drop it after any failure on it.
    """
    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(
        ranks,
        backend="gloo",
        timeout=datetime.timedelta(seconds=float(timeout_s)),
        use_local_synchronization=True,
    )


__all__ = [
    "AgreedError", "Outcome", "StageHook", "agree", "any_rank_failed", "bounded_group",
    "broadcast_from_first", "create_on_all_ranks", "describe_error", "describe_failures", "gather",
    "run_agreed",
]
