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
   one GPU per rank, every peer's GPU visible here and peer-accessible from
   this rank's GPU, agreed by all ranks.

Every rank's report is gathered and combined first (:func:`combine_reports`), so
no rank acts on its local answer alone. No report and no passing probe → no DMA.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .consensus import agree, describe_error, gather

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


def combine_reports(reports: Sequence[Optional[bool]]) -> Optional[bool]:
    """One all-peer report for the group from every rank's own report.

    Any explicit ``False`` forbids; ``True`` only when every rank says ``True``;
    anything else (a rank without a report) is no report.
    """
    if any(r is False for r in reports):
        return False
    if reports and all(r is True for r in reports):
        return True
    return None


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    reason: str
    # identical on every rank: (node count, ((GPU name, GPU id), ...) in rank order,
    # (driver, ...) in rank order); empty when the ranks could not be identified
    signature: tuple = ()


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


def default_driver() -> str:
    """The kernel driver's version (``/sys/module/nvidia/version``), else the CUDA driver API's."""
    try:
        with open("/sys/module/nvidia/version", encoding="ascii") as fh:
            return f"nvidia {fh.read().strip()}"
    except OSError:
        pass
    try:
        return f"cuda-driver-api {torch._C._cuda_getDriverVersion()}"
    except Exception:  # noqa: BLE001 - no driver: the probe fails elsewhere
        return "unknown"


def default_own_index(device: torch.device) -> int:
    if device.type != "cuda":
        raise RuntimeError(f"device {device} is not a CUDA device")
    return device.index if device.index is not None else torch.cuda.current_device()


@dataclass(frozen=True)
class GpuView:
    """What the probe asks this machine. Injectable, so the rule runs in CPU tests."""

    node_id: Callable[[], str] = default_node_id
    device_id: Callable[[int], str] = default_device_id
    device_name: Callable[[int], str] = default_device_name
    visible_devices: Callable[[], Sequence[int]] = default_visible_devices
    can_access: Callable[[int, int], bool] = default_can_access
    driver: Callable[[], str] = default_driver
    own_index: Callable[[torch.device], int] = default_own_index


def _check_peers(view: GpuView, infos: Sequence[tuple], rank: int) -> None:
    """Raise unless this rank sees every peer's GPU (distinct from its own) and can access it."""
    nodes = {item[0] for item in infos}
    if len(nodes) != 1:
        raise RuntimeError(f"ranks span {len(nodes)} nodes")
    ids = [item[1] for item in infos]
    if len(set(ids)) != len(ids):
        raise RuntimeError("two ranks share one GPU")
    visible = {view.device_id(i): i for i in view.visible_devices()}
    mine = visible.get(infos[rank][1])
    if mine is None:
        raise RuntimeError("own GPU is not among the visible devices")
    for peer, item in enumerate(infos):
        if peer == rank:
            continue
        other = visible.get(item[1])
        if other is None:
            raise RuntimeError(f"GPU of rank {peer} is not visible from rank {rank}")
        if not view.can_access(mine, other):
            raise RuntimeError(f"no peer access from rank {rank} to rank {peer}")


def probe_all_peer(group, device: torch.device, view: Optional[GpuView] = None) -> ProbeResult:
    """Collective over ``group`` (gloo): one node, distinct GPUs, P2P between every pair.

    Each rank publishes its node id, GPU id and name and driver; each rank then
    checks that it sees every peer's GPU and can access it. Any local error
    fails the probe on every rank (agreed), so this never leaves ranks apart.
    The signature (GPU names and ids in rank order, drivers) identifies the
    topology for the crossover cache; it is set whenever every rank identified
    its GPU, even if the peer check failed.
    """
    view = view or GpuView()
    info = None
    local_error: Optional[str] = None
    try:
        index = view.own_index(device)
        info = (view.node_id(), view.device_id(index), view.device_name(index), view.driver())
    except Exception as exc:  # noqa: BLE001
        local_error = describe_error(exc)
    infos = gather(group, info)
    # a rank that could not identify its GPU reports its own error; the others wait for it
    if local_error is None and all(item is not None for item in infos):
        try:
            _check_peers(view, infos, dist.get_rank(group))
        except Exception as exc:  # noqa: BLE001
            local_error = describe_error(exc)
    signature: tuple = ()
    if all(item is not None for item in infos):
        signature = (
            len({item[0] for item in infos}),
            tuple((item[2], item[1]) for item in infos),
            tuple(item[3] for item in infos),
        )
    reason = agree(group, local_error)
    if reason is not None:
        return ProbeResult(False, reason, signature)
    return ProbeResult(True, f"one node, peer access between all {len(infos)} ranks", signature)


__all__ = [
    "ALL_PEER_ATTRIBUTE", "Capability", "GpuView", "ProbeResult", "SUPPORTED_DTYPES",
    "SUPPORTED_WORLD_SIZES", "combine_reports", "decide_capability", "probe_all_peer",
    "runtime_report", "shard_multiple", "tensor_fits_ring", "world_size_supported",
]
