"""Small one-shot all-reduce (FlashInfer PCIe IPC workspace) as a router backend.

k3-accel does not build its own one-shot workspace: when stock vLLM has enabled
its FlashInfer PCIe IPC wrapper (``VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=1``),
the router reuses that instance, so decode-size tensors keep exactly the path
stock vLLM gives them. The wrapper is set up lazily by vLLM (at kernel warm-up),
so :meth:`should_use` asks it at call time.

Accepted implementations:

* vLLM's ``FlashInferPcieIpcAllReduce`` (``should_use``, ``all_reduce``,
  ``disabled``, ``workspace``);
* a FlashInfer ``PcieIpcAllReduceWorkspace`` itself (``supports``,
  ``all_reduce``, ``destroy``), optionally owned (then :meth:`close` destroys it).

``run`` overrides who executes an accepted tensor: the vLLM adapter passes the
stock ``CudaCommunicator.all_reduce`` so that whatever stock vLLM would do with a
one-shot-size tensor is exactly what happens.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .eligibility import runtime_report


class OneShotBackend:
    name = "FLASHINFER_PCIE_IPC"

    def __init__(
        self,
        impl: object,
        *,
        owned: bool = False,
        max_bytes: Optional[int] = None,
        run: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> None:
        self.impl = impl
        self.owned = owned
        self.max_bytes = max_bytes
        self._run = run
        check = getattr(impl, "should_use", None)
        if check is None:
            check = getattr(impl, "supports")
        self._check = check
        self._closed = False

    @classmethod
    def from_vllm(
        cls, wrapper: object, *, run: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    ) -> Optional["OneShotBackend"]:
        """Reuse vLLM's wrapper when it exists and is not disabled; else None."""
        if wrapper is None or getattr(wrapper, "disabled", True):
            return None
        return cls(wrapper, owned=False, run=run)

    @property
    def workspace(self) -> object:
        return getattr(self.impl, "workspace", self.impl)

    def all_peer_report(self) -> Optional[bool]:
        """The workspace's all-peer report (None while unmapped or absent)."""
        return runtime_report(self.workspace)

    def should_use(self, t: torch.Tensor) -> bool:
        if self._closed:
            return False
        if self.max_bytes is not None and t.numel() * t.element_size() > self.max_bytes:
            return False
        return bool(self._check(t))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self._run is not None:
            return self._run(t)
        return self.impl.all_reduce(t)

    def close(self) -> None:
        """Collective for an owned workspace; a borrowed wrapper is left to its owner."""
        if self._closed:
            return
        self._closed = True
        if self.owned:
            destroy = getattr(self.impl, "destroy", None)
            if destroy is not None:
                destroy()


__all__ = ["OneShotBackend"]
