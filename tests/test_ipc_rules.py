"""Who may share CUDA memory (k3_accel/ipc.py): two processes are on one host only when they see
the same kernel boot *and* the same host name, so two containers on one kernel (each with its own
host name, no shared device memory) never take the device plane with each other."""
from __future__ import annotations

from k3_accel import ipc


def test_host_identity_is_the_boot_and_the_host_name(monkeypatch, tmp_path):
    boot = tmp_path / "boot_id"
    boot.write_text("2f1c-boot\n")
    monkeypatch.setattr(ipc, "BOOT_ID", boot)
    monkeypatch.setattr(ipc.socket, "gethostname", lambda: "node-a")
    a = ipc.host_identity()
    assert a == ipc.host_identity()                           # stable
    monkeypatch.setattr(ipc.socket, "gethostname", lambda: "container-b")
    assert ipc.host_identity() != a                           # same kernel, another container
    monkeypatch.setattr(ipc.socket, "gethostname", lambda: "node-a")
    boot.write_text("9e7d-boot\n")
    assert ipc.host_identity() != a                           # same name, another machine (or a reboot)
