"""``torch.ops.vllm.k3_all_reduce(tensor, group_name) -> Tensor``.

An out-of-place all-reduce op in the ``vllm`` library namespace (Inductor's
fast fallback covers only ``vllm::``), with an ``empty_like`` fake, so compiled
and captured code can call the router explicitly. It resolves the group like
stock ``vllm::all_reduce`` and goes through the group's device communicator —
for the TP group that is :class:`~k3_accel.vllm.tp.communicator.K3CudaCommunicator`,
i.e. the same router. Capture-safe as long as the chosen backend is (the ring's
captured sizes are prepared at start-up; an unprepared size falls through to
the stock backends during capture).

The result never aliases the input (a custom op may not return an alias): at
world size 1 the input is cloned.
"""
from __future__ import annotations

import torch

from k3_accel.vllm.compat import require

OP_NAME = "k3_all_reduce"


def k3_all_reduce(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    from vllm.distributed.parallel_state import _groups

    ref = _groups.get(group_name)
    group = ref() if ref is not None else None
    if group is None:
        raise ValueError(f"k3_all_reduce: group {group_name!r} is not found or destroyed")
    if group.world_size == 1:
        return tensor.clone()
    return group._all_reduce_out_place(tensor)


def k3_all_reduce_fake(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(tensor)


def is_installed() -> bool:
    return hasattr(torch.ops.vllm, OP_NAME)


def install() -> bool:
    """Register ``vllm::k3_all_reduce`` once; cheap and idempotent (no CUDA, no sockets).

    Raises :class:`~k3_accel.vllm.compat.MissingSymbol` if vLLM lacks
    ``direct_register_custom_op`` or the group registry the op resolves.
    """
    register = require("vllm.utils.torch_utils", "direct_register_custom_op")
    require("vllm.distributed.parallel_state", "_groups")
    if is_installed():
        return True
    register(op_name=OP_NAME, op_func=k3_all_reduce, fake_impl=k3_all_reduce_fake)
    return True


__all__ = ["OP_NAME", "install", "is_installed", "k3_all_reduce", "k3_all_reduce_fake"]
