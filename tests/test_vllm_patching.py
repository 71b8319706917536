"""The one patch helper (``k3_accel.vllm.patching``): records, refuses twice, undoes, logs once."""
from __future__ import annotations

import logging
import types

import pytest

from k3_accel.vllm import patching


class Target:
    def greet(self) -> str:
        return "stock"

    @classmethod
    def kind(cls) -> str:
        return "stock"


class Child(Target):
    pass


@pytest.fixture
def hook():
    yield "test-hook"
    patching.undo("test-hook")


def test_patch_records_refuses_twice_and_undo_restores(hook, caplog):
    stock = Target.__dict__["greet"]
    with caplog.at_level(logging.INFO, logger="k3_accel"):
        done = patching.patch(Target, "greet", lambda self: "patched", hook=hook)
    assert Target().greet() == "patched"
    assert done.original is stock and patching.patched(Target, "greet") is done
    assert done.site == f"{__name__}.Target.greet" and patching.applied(hook) == [done]
    with pytest.raises(patching.PatchError, match=r"Target\.greet is already patched by hook 'test-hook'"):
        patching.patch(Target, "greet", lambda self: "again", hook="other")
    assert Target().greet() == "patched"                      # the refused patch changed nothing
    assert [r.getMessage() for r in caplog.records] == [f"k3-accel: hook test-hook patched {done.site}"]
    assert patching.undo(hook) == [done]
    assert Target.__dict__["greet"] is stock and patching.patched(Target, "greet") is None
    with caplog.at_level(logging.INFO, logger="k3_accel"):    # patched again: not logged again
        patching.patch(Target, "greet", lambda self: "patched", hook=hook)
    assert len(caplog.records) == 1


def test_inherited_and_class_attributes_come_back_exactly(hook):
    patching.patch(Child, "greet", lambda self: "child", hook=hook)
    patching.patch(Target, "kind", classmethod(lambda cls: f"patched {cls.__name__}"), hook=hook)
    assert Child().greet() == "child" and Target().greet() == "stock" and Child.kind() == "patched Child"
    patching.undo(hook)
    assert "greet" not in Child.__dict__                       # it was inherited: deleted, not copied
    assert Child().greet() == "stock" and Child.kind() == "stock"


def test_module_attributes_and_restore_value(hook):
    module = types.ModuleType("k3_fake_module")
    module.fn = lambda: "stock"
    stock = module.fn
    wrapped = patching.patch(module, "fn", lambda: "wrapped", hook=hook).replacement
    other = types.ModuleType("k3_fake_importer")
    other.fn = wrapped                                          # imported the name after it was wrapped
    patching.patch(other, "fn", wrapped, hook=hook, restore=stock)
    assert patching.patched(other, "fn").original is stock
    patching.undo(hook)
    assert module.fn is stock and other.fn is stock


def test_undo_leaves_a_site_someone_else_changed(hook, caplog):
    stock = Target.__dict__["greet"]
    patching.patch(Target, "greet", lambda self: "ours", hook=hook)
    theirs = lambda self: "theirs"  # noqa: E731
    Target.greet = theirs
    try:
        with caplog.at_level(logging.WARNING, logger="k3_accel"):
            patching.undo(hook)
        assert Target.__dict__["greet"] is theirs and patching.patched(Target, "greet") is None
        assert "was changed after hook test-hook patched it" in caplog.text
    finally:
        Target.greet = stock


def test_swapped_holds_only_inside_the_block(hook):
    module = types.ModuleType("k3_swap_module")
    module.Proposer = "stock"
    with patching.swapped(module, "Proposer", "remote", hook=hook) as done:
        assert module.Proposer == "remote" and patching.patched(module, "Proposer") is done
        with pytest.raises(patching.PatchError):
            with patching.swapped(module, "Proposer", "nested", hook=hook):
                pass
        assert module.Proposer == "remote"
    assert module.Proposer == "stock" and patching.patched(module, "Proposer") is None
    with pytest.raises(RuntimeError, match="init failed"):
        with patching.swapped(module, "Proposer", "remote", hook=hook):
            raise RuntimeError("init failed")
    assert module.Proposer == "stock" and patching.applied(hook) == []


def test_when_imported_runs_after_the_import(tmp_path, monkeypatch, hook):
    (tmp_path / "k3_watched_mod.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    patching.when_imported("k3_watched_mod", lambda m: seen.append(m.VALUE + 1), hook=hook)
    assert seen == []
    import k3_watched_mod  # noqa: F401
    assert seen == [42]
    patching.when_imported("k3_watched_mod", lambda m: seen.append("now"), hook=hook)   # already imported
    assert seen == [42, "now"]


def test_when_imported_failure_does_not_break_the_import(tmp_path, monkeypatch, caplog, hook):
    (tmp_path / "k3_watched_bad.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def boom(module):
        raise RuntimeError("hook bug")

    patching.when_imported("k3_watched_bad", boom, hook=hook)
    with caplog.at_level(logging.ERROR, logger="k3_accel"):
        import k3_watched_bad
    assert k3_watched_bad.VALUE == 1
    assert any("hook test-hook failed to patch k3_watched_bad after its import" in r.getMessage()
               for r in caplog.records)


def test_undo_drops_pending_import_watches(tmp_path, monkeypatch, hook):
    (tmp_path / "k3_watched_never.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    patching.when_imported("k3_watched_never", seen.append, hook=hook)
    patching.undo(hook)
    import k3_watched_never  # noqa: F401
    assert seen == []
