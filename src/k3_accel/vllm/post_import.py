"""Run a function right after a module is imported (at once if it already is).

``register()`` must stay cheap, but the V1 runner module costs ~1.5 s to
import and only the worker process needs it; so the proposer hook waits for
the first import of ``vllm.v1.worker.gpu_model_runner`` instead of forcing it.
"""
from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from types import ModuleType
from typing import Any, Callable

log = logging.getLogger("k3_accel")

Callback = Callable[[ModuleType], None]
_lock = threading.Lock()
_pending: dict[str, list[Callback]] = {}


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` is imported; now if it already is."""
    module = sys.modules.get(name)
    if module is not None:
        _run(name, module, [callback])
        return
    with _lock:
        _pending.setdefault(name, []).append(callback)
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())


def _run(name: str, module: ModuleType, callbacks: list[Callback]) -> None:
    for callback in callbacks:
        try:
            callback(module)
        except Exception:  # a hook must never break the import it watches
            log.exception("k3-accel: post-import hook for %s failed", name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds watched modules with the other finders and wraps their loader."""

    def find_spec(self, name: str, path: Any, target: Any = None):
        if name not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, name)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, name: str):
        self._inner, self._name = inner, name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        with _lock:
            callbacks = _pending.pop(self._name, [])
        _run(self._name, module, callbacks)

    def __getattr__(self, attr: str) -> Any:   # get_source, is_package, ... of the real loader
        return getattr(self._inner, attr)
