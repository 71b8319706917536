"""CPU stand-ins for the DMA router's hardware: GPU identities and the loopback ring."""
from __future__ import annotations


def fake_gpus(rank: int, world: int, *, node: str = "n0", driver: str = "drv-1", gpu_ids=None,
              can_access=None, fail_identify: bool = False):
    """A :class:`~k3_accel.comm.eligibility.GpuView` for CPU ranks: rank r owns GPU r of ``world``."""
    from k3_accel.comm.eligibility import GpuView

    ids = list(gpu_ids or [f"GPU-{i}" for i in range(world)])

    def own_index(device):
        if fail_identify:
            raise RuntimeError(f"injected: rank {rank} cannot identify its GPU")
        return rank

    return GpuView(
        node_id=lambda: node, device_id=lambda i: ids[i], device_name=lambda i: "Fake GPU",
        visible_devices=lambda: range(world), can_access=can_access or (lambda a, b: True),
        driver=lambda: driver, own_index=own_index,
    )


def loopback_hooks(rank: int, world: int, *, runtime_cls=None, cache=None, timeout_s: float = 3.0, **kw):
    """Router hooks for CPU ranks: the loopback ring, a passing fake probe, a short exchange timeout."""
    from k3_accel.comm.build import RouterHooks
    from k3_accel.testing.loopback import LoopbackDmaRuntime, loopback_planner

    kw.setdefault("gpus", fake_gpus(rank, world))
    return RouterHooks(
        runtime_cls=runtime_cls or LoopbackDmaRuntime, planner=loopback_planner, cache=cache,
        exchange_timeout_s=timeout_s, **kw,
    )
