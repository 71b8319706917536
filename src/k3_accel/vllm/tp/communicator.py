"""vLLM adapter: ``K3CudaCommunicator`` routes large TP all-reduces to the DMA ring.

Installed by :func:`install` (called from the plugin's ``register()``), which
points the CUDA platform's ``get_device_communicator_cls`` hook at this class.
It stays a subclass of ``CudaCommunicator`` with the same constructor, so
``GroupCoordinator.graph_capture`` and every stock backend keep working.

Only the TP group (``unique_name`` ``tp:*``) with more than one rank builds a
router; every other group, and the TP group whenever the ring is off, runs the
stock code behind one ``is None`` branch. Everything the router does not send
to the ring goes to the stock ``CudaCommunicator.all_reduce``.

Faults never reach the engine: set-up failures (sizing, allocation, a peer's
failure) leave stock behaviour on every rank with one log line saying why;
``destroy()`` and sleep mode's ``suspend()``/``resume()`` never raise, and
teardown is bounded in time whatever the peers do. Only an invalid setting
raises (:class:`~k3_accel.config.ConfigError`, on every rank alike).

Settings come from :func:`k3_accel.config.from_vllm` → ``K3Config.dma_min_bytes``
and ``dma_cache_dir``; the log line names where the threshold was set.

Importing this module is cheap: the class itself is built on first attribute
access (``resolve_obj_by_qualname`` in a worker), because that imports vLLM's
``cuda_communicator`` (~1 s), which the API-server process never needs.
"""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, List, Optional, Tuple

import torch

from k3_accel.comm.build import RouterHooks, build_router
from k3_accel.comm.consensus import agree, describe_error, run_agreed
from k3_accel.comm.crossover import CrossoverCache
from k3_accel.comm.oneshot import OneShotBackend
from k3_accel.comm.router import AllReduceRouter, RouterDecision
from k3_accel.comm.threshold import DmaThreshold
from k3_accel.config import ConfigError, K3Config, from_vllm
from k3_accel.vllm import patching
from k3_accel.vllm.compat import MissingSymbol, require, vllm_version

_CUDA_COMM_MODULE = "vllm.distributed.device_communicators.cuda_communicator"
STOCK_QUALNAME = f"{_CUDA_COMM_MODULE}.CudaCommunicator"
QUALNAME = "k3_accel.vllm.tp.communicator.K3CudaCommunicator"

# A child of vLLM's logger, so vLLM's handler prints it.
log = logging.getLogger("vllm.k3_accel.communicator")


@dataclass(frozen=True)
class Sizing:
    """What the ring must hold, from the vLLM config."""

    max_bytes: Optional[int]
    capture_sizes: Tuple[Tuple[int, torch.dtype], ...] = ()
    model_dtype: torch.dtype = torch.bfloat16
    note: str = ""
    ring_in_graphs: bool = True  # False when sleep mode may free communicator memory


def sizing_from_vllm_config(vllm_config) -> Sizing:
    """``max_bytes`` = max batched tokens × largest hidden size × 4 (fp32 reductions count).

    Capture sizes = each CUDA-graph capture batch × hidden size, in the model dtype, plus,
    with speculative decoding, each batch rounded up to a multiple of 1 + K (the sizes V2
    captures its uniform-decode graphs at).
    With ``enable_nccl_comm_suspend`` (sleep mode frees communicator memory) the
    ring stays out of CUDA graphs, so freeing and rebuilding it cannot leave a
    graph pointing at freed memory.
    """
    if vllm_config is None or getattr(vllm_config, "model_config", None) is None:
        return Sizing(None, note="no vLLM model config at communicator construction")
    parallel = getattr(vllm_config, "parallel_config", None)
    if bool(getattr(parallel, "use_ubatching", False)):
        return Sizing(None, note="micro-batching (DBO) reduces on two streams; the ring has one channel")
    model = vllm_config.model_config
    hidden = int(model.get_hidden_size())
    hiddens = [hidden]
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    if draft is not None:
        try:
            hiddens.append(int(draft.get_hidden_size()))
        except Exception:  # noqa: BLE001 - a draft without a hidden size reduces nothing here
            pass
    tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
    dtype = model.dtype if isinstance(model.dtype, torch.dtype) else torch.bfloat16
    itemsize = max(torch.empty(0, dtype=dtype).element_size(), 4)
    max_bytes = tokens * max(hiddens) * itemsize
    captures: List[Tuple[int, torch.dtype]] = []
    compilation = getattr(vllm_config, "compilation_config", None)
    sizes = getattr(compilation, "cudagraph_capture_sizes", None) or []
    mode = getattr(compilation, "cudagraph_mode", None)
    if mode is None or str(getattr(mode, "name", mode)).upper() != "NONE":
        captures = [(int(b) * hidden, dtype) for b in _graph_token_counts(sizes, spec, tokens)]
    in_graphs = not bool(getattr(model, "enable_nccl_comm_suspend", False))
    return Sizing(max_bytes, tuple(captures) if in_graphs else (), dtype, ring_in_graphs=in_graphs)


def _graph_token_counts(sizes, spec, max_tokens: int) -> List[int]:
    """The token counts vLLM captures graphs at: each capture size and, with speculation, each
    rounded up to a multiple of 1 + K (V2's uniform-decode graphs, ``cudagraph_utils``)."""
    counts = {int(b) for b in sizes if int(b) > 0}
    k = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    if k > 0:
        q = k + 1
        counts |= {-(-b // q) * q for b in counts if -(-b // q) * q <= max(max_tokens, max(counts, default=0))}
    return sorted(counts)


def _hooks(overrides: "Overrides", cfg: K3Config) -> RouterHooks:
    if overrides.hooks is not None:
        return overrides.hooks
    return RouterHooks(cache=CrossoverCache(Path(cfg.dma_cache_dir))) if cfg.dma_cache_dir else RouterHooks()


def _current_vllm_config():
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    return get_current_vllm_config_or_none()


@dataclass
class Overrides:
    """Test/benchmark injection: hooks for the router and a fixed sizing."""

    hooks: Optional[RouterHooks] = None
    sizing: Optional[Sizing] = None
    threshold: Optional[DmaThreshold] = None


STOCK = "VLLM_STOCK"


def setup_router(comm, stock: Callable[[torch.Tensor], torch.Tensor], overrides: Overrides):
    """Collective over ``comm.cpu_group``: ``(router or None, decision)``, the same on every rank.

    Raises :class:`ConfigError` (on every rank) for an invalid setting; every
    other failure is agreed and returns stock behaviour with its reason.
    """
    group = comm.cpu_group
    vllm_config = cfg = None
    invalid = early = None  # an invalid setting; any other failure before the first exchange
    try:
        vllm_config = _current_vllm_config()
        cfg = from_vllm(vllm_config)
    except ConfigError as exc:
        invalid = str(exc)
    except Exception as exc:  # noqa: BLE001 - reported through the agreed stage below
        early = exc
    invalid = agree(group, invalid)
    if invalid is not None:
        raise ConfigError(invalid)

    def local():
        if early is not None or cfg is None:
            raise early or RuntimeError("no settings")
        threshold = overrides.threshold or cfg.dma_min_bytes
        sizing = overrides.sizing or sizing_from_vllm_config(vllm_config)
        oneshot = OneShotBackend.from_vllm(getattr(comm, "fi_pcie_ipc_ar_comm", None), run=stock)
        return threshold, sizing, oneshot, _hooks(overrides, cfg)

    hooks = overrides.hooks
    inputs = run_agreed(group, local, stage="adapter", hook=hooks.on_stage if hooks else None)
    if not inputs.ok:
        threshold = overrides.threshold or (cfg.dma_min_bytes if cfg is not None else "?")
        return None, _stock_decision(str(threshold), cfg, f"k3-accel set-up failed ({inputs.failure})")
    assert cfg is not None
    threshold, sizing, oneshot, hooks = inputs.value
    router = build_router(
        group=group, device=comm.device, threshold=threshold, max_bytes=sizing.max_bytes,
        fallback=stock, oneshot=oneshot, next_name=STOCK, capture_sizes=sizing.capture_sizes,
        measure_dtype=sizing.model_dtype, hooks=hooks, cache_fields={"vllm": vllm_version()},
        threshold_source="override" if overrides.threshold else cfg.source("dma_min_bytes"),
        capturable=sizing.ring_in_graphs,
    )
    decision = router.decision
    assert decision is not None
    if sizing.note and router.dma is None:
        decision = decision.with_reason(f"{decision.reason} ({sizing.note})")
    # Without the ring the router adds nothing over stock: drop it (one branch per call).
    return (router if router.dma is not None else None), decision


def _stock_decision(threshold: str, cfg: Optional[K3Config], reason: str) -> RouterDecision:
    source = cfg.source("dma_min_bytes") if cfg is not None else "dma_min_bytes"
    return RouterDecision(STOCK, None, reason, threshold, threshold_source=source, failed=True)


def _define() -> type:
    """Build the subclass. Importing vLLM's ``cuda_communicator`` costs ~1 s, so it is
    deferred until a process resolves the class (workers do; the API server never does)."""
    CudaCommunicator = require(_CUDA_COMM_MODULE, "CudaCommunicator")

    class K3CudaCommunicator(CudaCommunicator):  # type: ignore[misc, valid-type]
        """``CudaCommunicator`` whose TP all-reduce goes through the k3-accel router."""

        overrides: ClassVar[Optional[Overrides]] = None

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.k3_router: Optional[AllReduceRouter] = None
            self.k3_decision: Optional[RouterDecision] = None
            if (
                self.world_size > 1
                and self.unique_name.split(":")[0] == "tp"
                and isinstance(self.cpu_group, torch.distributed.ProcessGroup)
            ):
                self._k3_setup()

        # ------------------------------------------------------------- set-up
        def _k3_stock_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
            return CudaCommunicator.all_reduce(self, t)

        def _k3_setup(self) -> None:
            """Never raises except for an invalid setting; logs the decision once (TP rank 0)."""
            try:
                self.k3_router, self.k3_decision = setup_router(
                    self, self._k3_stock_all_reduce, type(self).overrides or Overrides()
                )
            except ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. a peer died mid set-up: stay stock
                self.k3_router = None
                why = f"k3-accel set-up failed ({describe_error(exc)})"
                self.k3_decision = _stock_decision("?", None, why)
            decision = self.k3_decision
            if int(getattr(self, "rank_in_group", 0)) == 0:
                level = logging.WARNING if decision.failed else logging.INFO
                log.log(level, "k3-accel TP group %s: %s", self.unique_name, decision.summary)

        # ------------------------------------------------------------ hot path
        def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
            router = self.k3_router
            if router is None:
                return CudaCommunicator.all_reduce(self, input_)
            return router.all_reduce(input_)

        def all_reduce_in_place(self, tensor: torch.Tensor) -> torch.Tensor:
            """Sum ``tensor`` over the group; **use the returned tensor**.

            The result is either ``tensor`` itself (reduced in place by NCCL) or a
            new tensor (one-shot, DMA ring or another stock custom backend, all
            out-of-place) — after the call the caller must treat ``tensor`` as
            dead: its contents are unspecified when a new tensor is returned.
            World size 1 returns ``tensor`` unchanged.
            """
            if self.world_size == 1:
                return tensor
            router = self.k3_router
            if router is not None and router.choose(tensor) != "next":
                return router.all_reduce(tensor)
            if self._k3_stock_custom_accepts(tensor):
                return CudaCommunicator.all_reduce(self, tensor)
            pynccl = getattr(self, "pynccl_comm", None)
            if pynccl is not None and not getattr(pynccl, "disabled", True):
                if pynccl.all_reduce(tensor, out_tensor=tensor) is not None:
                    return tensor
            torch.distributed.all_reduce(tensor, group=self.device_group)
            return tensor

        def _k3_stock_custom_accepts(self, t: torch.Tensor) -> bool:
            """Would stock vLLM use one of its out-of-place custom backends for ``t``?"""
            checks: List[Tuple[str, str]] = [
                ("qr_comm", "should_quick_allreduce"),
                ("fi_pcie_ipc_ar_comm", "should_use"),
                ("fi_ar_comm", "should_use_fi_ar"),
                ("aiter_ar_comm", "should_custom_ar"),
                ("ca_comm", "should_custom_ar"),
                ("symm_mem_comm", "should_use_symm_mem"),
            ]
            for attr, method in checks:
                backend = getattr(self, attr, None)
                if backend is None or getattr(backend, "disabled", False):
                    continue
                if attr == "aiter_ar_comm" and not getattr(self, "use_aiter_allreduce", False):
                    continue
                check: Optional[Callable] = getattr(backend, method, None)
                if check is not None and check(t):
                    return True
            return False

        # ------------------------------------------------------- sleep mode
        def suspend(self) -> None:
            """Collective: release the ring's memory (kept if a CUDA graph holds it), then stock."""
            router = self.k3_router
            if router is not None:
                self._k3_lifecycle("suspend", router.suspend)
            stock = getattr(super(), "suspend", None)
            if stock is not None:
                stock()

        def resume(self) -> None:
            """Collective: stock first, then rebuild the ring on every rank or none."""
            stock = getattr(super(), "resume", None)
            if stock is not None:
                stock()
            router = self.k3_router
            if router is not None:
                self._k3_lifecycle("resume", router.resume)
                if router.dma is None:
                    self.k3_router = None  # not restored: stock from here on, on every rank

        def _k3_lifecycle(self, what: str, step: Callable[[], str]) -> None:
            try:
                outcome = step()
            except Exception as exc:  # noqa: BLE001 - sleep mode must not fail on the ring
                outcome = f"failed ({describe_error(exc)}); stock from here on"
                self.k3_router = None
            if int(getattr(self, "rank_in_group", 0)) == 0:
                log.info("k3-accel TP group %s %s: %s", self.unique_name, what, outcome)

        # ------------------------------------------------------------ teardown
        def destroy(self) -> None:
            """Closes the ring (bounded in time, never raises), then stock teardown."""
            router, self.k3_router = self.k3_router, None
            if router is not None:
                router.close()
            super().destroy()

    K3CudaCommunicator.__qualname__ = "K3CudaCommunicator"
    return K3CudaCommunicator


_CLASS: Optional[type] = None


def __getattr__(name: str):
    """``K3CudaCommunicator`` is built on first access (PEP 562)."""
    global _CLASS
    if name == "K3CudaCommunicator":
        if _CLASS is None:
            _CLASS = _define()
        return _CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


HOOK = "communicator"


def _patched_get_device_communicator_cls(cls) -> str:
    return QUALNAME


def patch_platform(platform_cls: type) -> bool:
    """Point ``platform_cls.get_device_communicator_cls`` at :data:`QUALNAME` (through
    :func:`k3_accel.vllm.patching.patch`, hook ``communicator``).

    Idempotent. Refuses (returns False) when the hook does not currently return
    stock ``CudaCommunicator`` — another plugin already owns it.
    """
    hook = getattr(platform_cls, "get_device_communicator_cls", None)
    if hook is None:
        raise MissingSymbol(f"{platform_cls.__module__}.{platform_cls.__qualname__}.get_device_communicator_cls")
    if patching.patched(platform_cls, "get_device_communicator_cls") is not None:
        return True
    current = hook()
    if current != STOCK_QUALNAME:
        log.warning(
            "k3-accel: %s's communicator is %s, not stock CudaCommunicator; DMA router not installed",
            platform_cls.__qualname__, current,
        )
        return False
    patching.patch(platform_cls, "get_device_communicator_cls",
                   classmethod(_patched_get_device_communicator_cls), hook=HOOK)
    return True


def install(platform_cls: Optional[type] = None) -> bool:
    """Install the communicator override; cheap and idempotent (no CUDA, no sockets).

    Returns True when installed, False when not applicable (not a CUDA platform,
    or another plugin owns the hook). Raises :class:`MissingSymbol` when the
    installed vLLM lacks what the override needs.
    """
    if importlib.util.find_spec(_CUDA_COMM_MODULE) is None:
        raise MissingSymbol(STOCK_QUALNAME)
    if platform_cls is None:
        platforms = require("vllm.platforms")
        current = getattr(platforms, "current_platform")
        is_cuda = getattr(current, "is_cuda", None)
        if is_cuda is None:
            raise MissingSymbol("vllm.platforms.current_platform.is_cuda")
        if not is_cuda():
            return False
        platform_cls = require("vllm.platforms.cuda", "CudaPlatformBase")
    return patch_platform(platform_cls)


# ``K3CudaCommunicator`` is also public; it is built lazily by ``__getattr__``.
__all__ = [
    "HOOK", "Overrides", "QUALNAME", "STOCK_QUALNAME", "Sizing",
    "install", "patch_platform", "setup_router", "sizing_from_vllm_config",
]
