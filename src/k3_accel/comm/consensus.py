"""Rank consensus: every rank of a group takes the same decision, or none does.

All helpers are collective over a CPU (gloo) process group; every rank must call
them in the same order. A failure is agreed by a MAX all-reduce of a flag; only
when some rank failed are the reasons exchanged, so the happy path costs one
tiny all-reduce.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Generic, Optional, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
log = logging.getLogger(__name__)


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
    rank: the lowest failing rank's reason, prefixed with that rank.
    """
    if not any_rank_failed(group, error is not None):
        return None
    errors: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    failing = [(rank, text) for rank, text in enumerate(errors) if text is not None]
    rank, text = failing[0]
    more = f" (and {len(failing) - 1} more rank(s))" if len(failing) > 1 else ""
    return f"rank {rank}: {text}{more}"


def broadcast_from_first(group, obj):
    """Collective: the group's first rank's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass
class Created(Generic[T]):
    """Result of :func:`create_on_all_ranks`: ``value`` on every rank, or None on every rank."""

    value: Optional[T]
    reason: Optional[str]

    @property
    def ok(self) -> bool:
        return self.value is not None


def create_on_all_ranks(
    group,
    factory: Callable[[], T],
    *,
    abandon: Optional[Callable[[T], None]] = None,
) -> Created[T]:
    """Collective: run ``factory`` on every rank; keep the results only if all succeeded.

    A rank whose factory raised contributes its reason. When any rank failed, the
    ranks that did build a value cannot run its collective teardown (the failed
    ranks hold nothing to tear down), so they call ``abandon(value)`` — a local,
    non-collective release — and drop it.
    """
    value: Optional[T] = None
    error: Optional[str] = None
    try:
        value = factory()
        if value is None:
            error = "factory returned None"
    except Exception as exc:  # noqa: BLE001 - any failure keeps NCCL
        error = describe_error(exc)
    reason = agree(group, error)
    if reason is None:
        return Created(value, None)
    if value is not None and abandon is not None:
        try:
            abandon(value)
        except Exception as exc:  # noqa: BLE001
            log.warning("k3-accel: local release after failed consensus raised %s", describe_error(exc))
    return Created(None, reason)


__all__ = [
    "Created", "agree", "any_rank_failed", "broadcast_from_first",
    "create_on_all_ranks", "describe_error",
]
