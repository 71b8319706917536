"""The one way k3-accel changes vLLM: every hook patches through this module.

* :func:`patch` replaces one attribute of a class or module, records what was
  there, refuses to patch the same attribute a second time and logs one line.
* :func:`swapped` does the same for the duration of a ``with`` block only (the
  V1 hook swaps the proposer class a runner's ``__init__`` looks up).
* :func:`when_imported` runs a hook's patch function right after a module is
  first imported (at once if it already is): ``register()`` stays cheap and
  never imports a heavy vLLM module itself. A :class:`importlib.abc.MetaPathFinder`
  wraps the watched module's loader.
* :func:`patched` / :func:`applied` say what is patched; :func:`undo` puts vLLM
  back (tests) and drops the hook's pending import watches.

A patch function reads the original from its :class:`Patch` (or wraps the value
it replaces in a closure); nothing is stored on vLLM's objects.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import logging
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterator

log = logging.getLogger("k3_accel")

_MISSING: Any = object()


class PatchError(RuntimeError):
    """An attribute is already patched (by k3-accel); the message names the site and the hook."""


@dataclass(frozen=True)
class Patch:
    """One replaced attribute: ``owner.name`` was ``original`` and is now ``replacement``."""
    hook: str
    owner: Any
    name: str
    original: Any          # what vLLM had there (the value a wrapper wraps)
    replacement: Any
    restore: Any           # what undo puts in ``owner.__dict__`` (_MISSING: delete, it was inherited)

    @property
    def site(self) -> str:
        owner = self.owner
        where = owner.__name__ if isinstance(owner, ModuleType) else \
            f"{owner.__module__}.{getattr(owner, '__qualname__', type(owner).__name__)}"
        return f"{where}.{self.name}"


_lock = threading.RLock()
_applied: dict[tuple[int, str], Patch] = {}     # (id(owner), name) -> patch; the Patch keeps owner alive
_announced: set[tuple[str, str]] = set()        # (hook, site) already logged
_pending: dict[str, list[tuple[str, Callable[[ModuleType], None]]]] = {}   # module -> [(hook, apply)]


def patch(owner: Any, name: str, replacement: Any, *, hook: str, restore: Any = _MISSING) -> Patch:
    """Set ``owner.name = replacement`` and record it; :class:`PatchError` if k3-accel already did.

    ``restore``: what :func:`undo` puts back when it is not the current value
    (a module that imported an already-wrapped name: vLLM's own function).
    """
    with _lock:
        key = (id(owner), name)
        if key in _applied:
            raise PatchError(f"{_applied[key].site} is already patched by hook {_applied[key].hook!r}")
        if restore is _MISSING:
            original, raw = getattr(owner, name), vars(owner).get(name, _MISSING)
        else:
            original = raw = restore
        setattr(owner, name, replacement)
        done = _applied[key] = Patch(hook, owner, name, original, replacement, raw)
        first = (hook, done.site) not in _announced
        _announced.add((hook, done.site))
    if first:
        log.info("k3-accel: hook %s patched %s", hook, done.site)
    return done


def patched(owner: Any, name: str) -> Patch | None:
    """The k3-accel patch of ``owner.name``, or None."""
    return _applied.get((id(owner), name))


def applied(hook: str | None = None) -> list[Patch]:
    """Every patch in place (of one hook), oldest first."""
    with _lock:
        return [p for p in _applied.values() if hook is None or p.hook == hook]


def undo(hook: str | None = None) -> list[Patch]:
    """Put back what the hook (every hook: None) patched, newest first; returns those patches.

    A site someone else re-patched since is left as it is (with a warning).
    Pending :func:`when_imported` watches of the hook are dropped too.
    """
    with _lock:
        mine = applied(hook)
        for p in reversed(mine):
            _restore(p)
        for module in list(_pending):
            _pending[module] = [(h, f) for h, f in _pending[module] if hook is not None and h != hook]
            if not _pending[module]:
                del _pending[module]
    return mine


def _restore(p: Patch) -> None:
    del _applied[(id(p.owner), p.name)]
    if vars(p.owner).get(p.name, _MISSING) is not p.replacement:
        log.warning("k3-accel: %s was changed after hook %s patched it; left as it is", p.site, p.hook)
    elif p.restore is _MISSING:
        delattr(p.owner, p.name)
    else:
        setattr(p.owner, p.name, p.restore)


@contextlib.contextmanager
def swapped(owner: Any, name: str, value: Any, *, hook: str) -> Iterator[Patch]:
    """``owner.name = value`` inside the block only (recorded like :func:`patch` meanwhile)."""
    done = patch(owner, name, value, hook=hook)
    try:
        yield done
    finally:
        with _lock:
            _restore(done)


# ------------------------------------------------------------- on import
def when_imported(module: str, apply: Callable[[ModuleType], None], *, hook: str) -> None:
    """Call ``apply(module)`` once ``module`` is imported; now if it already is.

    An exception in ``apply`` is logged and never breaks the import.
    """
    loaded = sys.modules.get(module)
    if loaded is not None:
        _run(module, loaded, [(hook, apply)])
        return
    with _lock:
        watchers = _pending.setdefault(module, [])
        if (hook, apply) not in watchers:
            watchers.append((hook, apply))
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())


def _run(name: str, module: ModuleType, watchers: list[tuple[str, Callable[[ModuleType], None]]]) -> None:
    for hook, apply in watchers:
        try:
            apply(module)
        except Exception:  # a hook must never break the import it watches
            log.exception("k3-accel: hook %s failed to patch %s after its import", hook, name)


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
            watchers = _pending.pop(self._name, [])
        _run(self._name, module, watchers)

    def __getattr__(self, attr: str) -> Any:   # get_source, is_package, ... of the real loader
        return getattr(self._inner, attr)


__all__ = ["Patch", "PatchError", "applied", "patch", "patched", "swapped", "undo", "when_imported"]
