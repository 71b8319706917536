"""The vLLM adapter against a real vLLM import (``VLLM_TARGET_DEVICE=cpu``).

``K3CudaCommunicator`` is a real ``CudaCommunicator`` subclass; on CPU its stock
parts run over gloo (PyNCCL and custom all-reduce disable themselves) and the
ring is :class:`LoopbackDmaRuntime` — the same router code as on GPUs.
"""
from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from helpers.comm import loopback_hooks  # noqa: E402
from helpers.ranks import run_ranks  # noqa: E402

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

# No GPU here: PyNCCL stays off (the CUDA wheel would otherwise try to start NCCL).
ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_DISABLE_PYNCCL": "1"}
MiB = 1 << 20


# ------------------------------------------------------------ registration
def test_communicator_install_is_a_noop_off_cuda():
    from vllm.platforms import current_platform

    from k3_accel.vllm.tp import communicator

    before = current_platform.get_device_communicator_cls()
    assert not current_platform.is_cuda()
    assert communicator.install() is False
    assert communicator.install() is False
    assert current_platform.get_device_communicator_cls() == before


def _cuda_like_platform():
    from vllm.platforms.interface import Platform, PlatformEnum

    class CudaLikePlatform(Platform):
        _enum = PlatformEnum.CUDA

        @classmethod
        def get_device_communicator_cls(cls) -> str:
            return "vllm.distributed.device_communicators.cuda_communicator.CudaCommunicator"

    return CudaLikePlatform


def test_platform_hook_returns_the_subclass():
    from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from k3_accel.vllm import patching
    from k3_accel.vllm.tp.communicator import HOOK, STOCK_QUALNAME, K3CudaCommunicator, patch_platform

    platform = _cuda_like_platform()
    stock = platform.__dict__["get_device_communicator_cls"]
    assert patch_platform(platform) is True
    assert patch_platform(platform) is True                 # idempotent
    assert patching.patched(platform, "get_device_communicator_cls").hook == HOOK
    cls = resolve_obj_by_qualname(platform.get_device_communicator_cls())
    assert cls is K3CudaCommunicator and issubclass(cls, CudaCommunicator)
    patching.undo(HOOK)                                      # through the one patch helper
    assert platform.__dict__["get_device_communicator_cls"] is stock
    assert platform.get_device_communicator_cls() == STOCK_QUALNAME


def test_patch_refuses_a_hook_owned_by_someone_else():
    from k3_accel.vllm.tp.communicator import patch_platform

    platform = _cuda_like_platform()
    platform.get_device_communicator_cls = classmethod(lambda cls: "other.plugin.Comm")
    assert patch_platform(platform) is False
    assert platform.get_device_communicator_cls() == "other.plugin.Comm"


@pytest.mark.gpu  # vllm.platforms.cuda loads vLLM's CUDA extension: only on a GPU host with vLLM
def test_cuda_platform_module_when_importable():
    from vllm.platforms.cuda import CudaPlatformBase
    from k3_accel.vllm.tp.communicator import QUALNAME, install

    assert install(CudaPlatformBase) is True
    assert CudaPlatformBase.get_device_communicator_cls() == QUALNAME


def test_missing_symbol_is_typed():
    from k3_accel.vllm.compat import MissingSymbol
    from k3_accel.vllm.tp.communicator import patch_platform

    with pytest.raises(MissingSymbol):
        patch_platform(type("NoHook", (), {}))


def test_custom_op_registered_idempotently_with_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from k3_accel.vllm.tp import custom_op

    assert custom_op.install() is True
    assert custom_op.install() is True
    op = torch.ops.vllm.k3_all_reduce
    schema = str(op.default._schema)
    assert schema.startswith("vllm::k3_all_reduce(Tensor tensor, str group_name) -> Tensor")
    with FakeTensorMode():
        x = torch.empty(4, 8, dtype=torch.bfloat16)
        y = op(x, "tp:0")
        assert y.shape == (4, 8) and y.dtype == torch.bfloat16


# -------------------------------------------------------------- behaviour
def _setup_overrides(threshold_text, max_bytes=4 * MiB, rank=0, world=2, **hook_kw):
    from k3_accel.comm.threshold import parse_dma_min_bytes
    from k3_accel.vllm.tp.communicator import K3CudaCommunicator, Overrides, Sizing

    hooks = loopback_hooks(rank, world, **hook_kw)
    K3CudaCommunicator.overrides = Overrides(
        hooks=hooks,
        sizing=Sizing(max_bytes, ((64 * 2048, torch.float32),), torch.float32),
        threshold=None if threshold_text is None else parse_dma_min_bytes(threshold_text),
    )
    return K3CudaCommunicator


def _comm(rank, world):
    cls = _setup_overrides("256K", rank=rank, world=world)
    group = dist.new_group(backend="gloo")
    comm = cls(cpu_group=group, device=torch.device("cpu"), device_group=group, unique_name="tp:0")
    res = {"backend": comm.k3_decision.backend, "min": comm.k3_router.dma.min_bytes}
    ring = comm.k3_router.dma.runtime
    calls0 = ring.calls                                    # capture size prepared at start
    small = torch.full((4, 64), float(rank + 1))
    big = torch.full((256, 1024), float(rank + 1))         # 1 MiB fp32
    res["small"] = comm.all_reduce(small)[0, 0].item()
    res["big"] = comm.all_reduce(big)[0, 0].item()
    res["ring_calls"] = ring.calls - calls0
    # in-place entry: NCCL-class path reduces in place and returns the same tensor
    t = torch.full((4, 64), float(rank + 1))
    out = comm.all_reduce_in_place(t)
    res["inplace_small_same"] = out is t
    res["inplace_small_value"] = t[0, 0].item()
    # ring path returns a different tensor; the input is dead
    t = torch.full((256, 1024), float(rank + 1))
    out = comm.all_reduce_in_place(t)
    res["inplace_big_same"] = out is t
    res["inplace_big_value"] = out[0, 0].item()
    res["ring_calls_after"] = ring.calls - calls0
    comm.destroy()
    res["closed"] = ring.closed
    res["router_after_destroy"] = comm.k3_router
    return res


def test_tp_communicator_routes_and_tears_down(group):
    for r in [g["comm"] for g in group]:
        assert r["backend"] == "B12X_DMA" and r["min"] == 256 * 1024
        assert r["small"] == 3.0 and r["big"] == 3.0 and r["ring_calls"] == 1
        assert r["inplace_small_same"] is True and r["inplace_small_value"] == 3.0
        assert r["inplace_big_same"] is False and r["inplace_big_value"] == 3.0
        assert r["ring_calls_after"] == 2
        assert r["closed"] is True and r["router_after_destroy"] is None


def _other_groups(rank, world):
    cls = _setup_overrides("256K", rank=rank, world=world)
    group = dist.new_group(backend="gloo")
    singles = [dist.new_group([r], backend="gloo") for r in range(world)]
    pp = cls(cpu_group=group, device=torch.device("cpu"), device_group=group, unique_name="pp:0")
    one = cls(cpu_group=singles[rank], device=torch.device("cpu"), device_group=singles[rank], unique_name="tp:1")
    t = torch.full((8,), float(rank + 1))
    same = one.all_reduce_in_place(t)
    res = (pp.k3_router, pp.k3_decision, one.k3_router, same is t, t.tolist(),
           pp.all_reduce(torch.ones(8)).tolist())
    pp.destroy()
    one.destroy()
    return res


def test_only_multi_rank_tp_groups_get_a_router(group):
    out = [g["other"] for g in group]
    for rank, (pp_router, pp_decision, one_router, same, values, pp_sum) in enumerate(out):
        assert pp_router is None and pp_decision is None and one_router is None
        assert same is True and values == [float(rank + 1)] * 8     # world size 1: untouched
        assert pp_sum == [2.0] * 8


def _off(rank, world, text):
    cls = _setup_overrides(text, rank=rank, world=world)
    group = dist.new_group(backend="gloo")
    comm = cls(cpu_group=group, device=torch.device("cpu"), device_group=group, unique_name="tp:0")
    out = comm.all_reduce(torch.full((256, 1024), float(rank + 1)))
    res = (comm.k3_router, comm.k3_decision.backend, comm.k3_decision.reason, out[0, 0].item())
    comm.destroy()
    return res


def test_dma_off_leaves_stock_path_only(group):
    for router, backend, reason, value in [g["off"] for g in group]:
        assert router is None and backend == "VLLM_STOCK" and "disabled" in reason and value == 3.0


def _bad_env(rank, world):
    cls = _setup_overrides(None, rank=rank, world=world)
    group = dist.new_group(backend="gloo")
    os.environ["VLLM_PCIE_DMA_MIN_BYTES"] = "-4M"
    try:
        cls(cpu_group=group, device=torch.device("cpu"), device_group=group, unique_name="tp:0")
    except ValueError as exc:  # the plugin's ConfigError / DmaThresholdError, both ValueErrors
        return str(exc)
    finally:
        del os.environ["VLLM_PCIE_DMA_MIN_BYTES"]
    return None


def test_bad_setting_fails_at_start_with_a_clear_error(group):
    out = [g["bad-env"] for g in group]
    assert all(msg is not None and "VLLM_PCIE_DMA_MIN_BYTES" in msg for msg in out)


def _op(rank, world):
    from vllm.distributed.parallel_state import GroupCoordinator
    from vllm.platforms import current_platform

    from k3_accel.vllm.tp import custom_op
    from k3_accel.vllm.tp.communicator import QUALNAME

    cls = _setup_overrides("256K", rank=rank, world=world)
    type(current_platform).get_device_communicator_cls = classmethod(lambda c: QUALNAME)
    custom_op.install()
    coord = GroupCoordinator(
        group_ranks=[list(range(world))], local_rank=rank, torch_distributed_backend="gloo",
        use_device_communicator=True, group_name="tp",
    )
    comm = coord.device_communicator
    ring = comm.k3_router.dma.runtime
    before = ring.calls
    small = torch.full((4, 64), float(rank + 1))
    big = torch.full((256, 1024), float(rank + 1))
    s = torch.ops.vllm.k3_all_reduce(small, coord.unique_name)
    b = torch.ops.vllm.k3_all_reduce(big, coord.unique_name)
    res = (type(comm) is cls, s[0, 0].item(), b[0, 0].item(), ring.calls - before,
           s.data_ptr() != small.data_ptr(), b.data_ptr() != big.data_ptr())
    coord.destroy()
    return res


def test_custom_op_goes_through_the_router(group):
    for is_k3, small, big, ring_calls, new_small, new_big in [g["op"] for g in group]:
        assert is_k3 and small == 3.0 and big == 3.0 and ring_calls == 1
        assert new_small and new_big                       # out-of-place


def test_install_is_cheap_and_defers_the_class():
    """register() runs in the API server too: install must not import cuda_communicator."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "import k3_accel.vllm.tp.communicator as c, k3_accel.vllm.tp.custom_op as o\n"
        "c.install(); o.install(); c.install()\n"
        "mod = 'vllm.distributed.device_communicators.cuda_communicator'\n"
        "print('LOADED' if mod in sys.modules else 'DEFERRED')\n"
        "print('SUB' if issubclass(c.K3CudaCommunicator, sys.modules[mod].CudaCommunicator) else 'NOT')\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, **ENV, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split()
    assert lines[-2:] == ["DEFERRED", "SUB"]


def test_sizing_from_a_vllm_shaped_config():
    from types import SimpleNamespace as NS

    from k3_accel.vllm.tp.communicator import sizing_from_vllm_config

    model = NS(get_hidden_size=lambda: 7168, dtype=torch.bfloat16)
    draft = NS(get_hidden_size=lambda: 8192)
    cfg = NS(
        model_config=model,
        speculative_config=NS(draft_model_config=draft),
        scheduler_config=NS(max_num_batched_tokens=8192),
        compilation_config=NS(cudagraph_capture_sizes=[1, 2, 512], cudagraph_mode=NS(name="PIECEWISE")),
        parallel_config=NS(use_ubatching=False),
    )
    s = sizing_from_vllm_config(cfg)
    assert s.max_bytes == 8192 * 8192 * 4            # largest hidden, fp32 counts
    assert s.capture_sizes == ((7168, torch.bfloat16), (2 * 7168, torch.bfloat16), (512 * 7168, torch.bfloat16))
    cfg.compilation_config.cudagraph_mode = NS(name="NONE")
    assert sizing_from_vllm_config(cfg).capture_sizes == ()
    cfg.parallel_config.use_ubatching = True
    assert sizing_from_vllm_config(cfg).max_bytes is None
    assert sizing_from_vllm_config(None).max_bytes is None


def test_ring_sizes_include_v2s_speculative_decode_graphs():
    """V2 captures uniform-decode graphs at token counts rounded up to 1 + K: the ring is
    prepared for those too (an unprepared size is declined inside a graph)."""
    from types import SimpleNamespace as NS

    from k3_accel.vllm.tp.communicator import sizing_from_vllm_config

    cfg = NS(model_config=NS(get_hidden_size=lambda: 1024, dtype=torch.bfloat16),
             speculative_config=NS(draft_model_config=None, num_speculative_tokens=3),
             scheduler_config=NS(max_num_batched_tokens=8192),
             compilation_config=NS(cudagraph_capture_sizes=[1, 2, 6, 512], cudagraph_mode=NS(name="FULL")),
             parallel_config=NS(use_ubatching=False))
    tokens = [n // 1024 for n, _ in sizing_from_vllm_config(cfg).capture_sizes]
    assert tokens == [1, 2, 4, 6, 8, 512]             # 1, 2 -> 4; 6 -> 8; 512 is a multiple of 4
    cfg.speculative_config = None
    assert [n // 1024 for n, _ in sizing_from_vllm_config(cfg).capture_sizes] == [1, 2, 6, 512]


def _all(rank, world):
    """Every gloo case in one spawned group (importing vLLM in a child costs seconds); the
    custom-op case re-points the platform's hook, so it runs last."""
    return {"comm": _comm(rank, world), "other": _other_groups(rank, world), "off": _off(rank, world, "off"),
            "bad-env": _bad_env(rank, world), "op": _op(rank, world)}


@pytest.fixture(scope="module")
def group():
    return run_ranks(_all, 2, env=ENV, timeout=600)


def _op_alone(rank, world):
    """The op on a TP group of one rank (TP=1, or a pipeline-parallel stage alone)."""
    from vllm.distributed.parallel_state import GroupCoordinator

    from k3_accel.vllm.tp import custom_op

    custom_op.install()
    coord = GroupCoordinator(group_ranks=[[0]], local_rank=0, torch_distributed_backend="gloo",
                             use_device_communicator=False, group_name="tp")
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    y = torch.ops.vllm.k3_all_reduce(x, coord.unique_name)
    res = {"same_values": torch.equal(y, x), "shares_memory": y.untyped_storage().data_ptr()
           == x.untyped_storage().data_ptr(), "world": coord.world_size}
    y.add_(100.0)                                  # the caller owns the result: the input is untouched
    res["input_after"] = x.flatten().tolist()
    coord.destroy()
    return res


def test_custom_op_at_world_size_one_returns_a_new_tensor():
    """A custom op may not return an alias of its input (Inductor and CUDA graphs reuse buffers on
    that promise): alone in its group, k3_all_reduce returns a copy, never the input itself."""
    (res,) = run_ranks(_op_alone, 1, env=ENV, timeout=300)
    assert res["world"] == 1
    assert res["same_values"] and not res["shares_memory"]
    assert res["input_after"] == [float(i) for i in range(12)]
