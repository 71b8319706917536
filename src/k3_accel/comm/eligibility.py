"""When the DMA ring may run at all: the fail-closed capability rule and per-tensor checks.

The ring opens every peer's memory over CUDA IPC and drives copy engines between
every pair of neighbours, so it is safe only when all ranks sit on one node and
every pair of GPUs has peer access. Nothing here assumes that: DMA is allowed
only on an explicit, true all-peer report —

1. the one-shot runtime's ``supports_all_peer_auxiliary`` attribute (FlashInfer /
   b12x IPC workspaces set it once every peer is mapped). ``True`` allows,
   an explicit ``False`` forbids (the runtime knows the topology better than we
   do), and a missing or non-boolean attribute counts as *no report*;
2. else this module's own probe: one node (same host and boot id on every rank),
   every peer's GPU visible here and peer-accessible from this rank's GPU,
   agreed by all ranks.

No report and no passing probe → no DMA.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .consensus import agree, describe_error

SUPPORTED_WORLD_SIZES = (2, 4, 6, 8, 10)  # b12x DmaAllReduce
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ALL_PEER_ATTRIBUTE = "supports_all_peer_auxiliary"


def world_size_supported(world_size: int) -> bool:
    return int(world_size) in SUPPORTED_WORLD_SIZES


def shard_multiple(world_size: int) -> int:
    """Element count every DMA tensor must be a multiple of."""
    return int(world_size) * 8


def tensor_fits_ring(t: torch.Tensor, world_size: int) -> bool:
    """dtype bf16/fp16/fp32, contiguous, non-empty, ``numel % (world·8) == 0``."""
    numel = t.numel()
    return (
        numel > 0
        and numel % shard_multiple(world_size) == 0
        and t.dtype in SUPPORTED_DTYPES
        and t.is_contiguous()
    )


def runtime_report(runtime: object) -> Optional[bool]:
    """The runtime's all-peer report: True/False when it states one, else None."""
    if runtime is None:
        return None
    value = getattr(runtime, ALL_PEER_ATTRIBUTE, None)
    if isinstance(value, bool):
        return value
    return None


@dataclass(frozen=True)
class Capability:
    capable: bool
    reason: str


def decide_capability(report: Optional[bool], probe: Optional["ProbeResult"]) -> Capability:
    """Combine the runtime's report and the probe, failing closed."""
    if report is True:
        return Capability(True, "one-shot runtime reports all-peer connectivity")
    if report is False:
        return Capability(False, "one-shot runtime reports no all-peer connectivity")
    if probe is None:
        return Capability(False, "no all-peer report and no P2P probe")
    if probe.ok:
        return Capability(True, f"P2P probe: {probe.reason}")
    return Capability(False, f"P2P probe failed: {probe.reason}")


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    reason: str
    signature: tuple = ()  # (node count, per-rank device names): identical on every rank


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def default_node_id() -> str:
    return f"{socket.gethostname()}/{_boot_id()}"


def default_device_id(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is None:
        raise RuntimeError("this torch build does not expose device UUIDs")
    return str(uuid)


def default_device_name(index: int) -> str:
    return str(torch.cuda.get_device_name(index))


def default_visible_devices() -> Sequence[int]:
    return range(torch.cuda.device_count())


def default_can_access(a: int, b: int) -> bool:
    return bool(torch.cuda.can_device_access_peer(a, b))


def probe_all_peer(
    group,
    device: torch.device,
    *,
    node_id: Callable[[], str] = default_node_id,
    device_id: Callable[[int], str] = default_device_id,
    device_name: Callable[[int], str] = default_device_name,
    visible_devices: Callable[[], Sequence[int]] = default_visible_devices,
    can_access: Callable[[int, int], bool] = default_can_access,
) -> ProbeResult:
    """Collective over ``group`` (gloo): one node, and P2P between every pair of ranks.

    Each rank publishes its node id and its GPU's id; each rank then checks that it
    sees every peer's GPU and can access it. Any local error fails the probe on
    every rank. The device helpers are injectable so the rule runs on CPU tests.
    """
    info = None
    local_error: Optional[str] = None
    try:
        if device.type != "cuda" and device_id is default_device_id:
            raise RuntimeError(f"device {device} is not a CUDA device")
        index = device.index if device.index is not None else 0
        info = (node_id(), device_id(index), device_name(index))
    except Exception as exc:  # noqa: BLE001
        local_error = describe_error(exc)
    world = dist.get_world_size(group)
    infos: list = [None] * world
    dist.all_gather_object(infos, info, group=group)
    rank = dist.get_rank(group)
    if local_error is None:
        if any(item is None for item in infos):
            local_error = "a peer could not identify its GPU"
        elif len({item[0] for item in infos}) != 1:
            local_error = f"ranks span {len({item[0] for item in infos})} nodes"
        else:
            try:
                visible = {device_id(i): i for i in visible_devices()}
                mine = visible.get(infos[rank][1])
                if mine is None:
                    raise RuntimeError("own GPU is not among the visible devices")
                for peer, item in enumerate(infos):
                    if peer == rank:
                        continue
                    other = visible.get(item[1])
                    if other is None:
                        raise RuntimeError(f"GPU of rank {peer} is not visible from rank {rank}")
                    if not can_access(mine, other):
                        raise RuntimeError(f"no peer access from rank {rank} to rank {peer}")
            except Exception as exc:  # noqa: BLE001
                local_error = describe_error(exc)
    reason = agree(group, local_error)
    if reason is not None:
        return ProbeResult(False, reason)
    names = tuple(item[2] for item in infos)
    return ProbeResult(
        True,
        f"one node, peer access between all {world} ranks",
        signature=(1, names),
    )


__all__ = [
    "ALL_PEER_ATTRIBUTE", "Capability", "ProbeResult", "SUPPORTED_DTYPES",
    "SUPPORTED_WORLD_SIZES", "decide_capability", "probe_all_peer", "runtime_report",
    "shard_multiple", "tensor_fits_ring", "world_size_supported",
]
