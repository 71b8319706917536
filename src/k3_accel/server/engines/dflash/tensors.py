"""Reading tensors from a checkpoint directory (one safetensors file or an index).

Every file is checked to lie inside the checkpoint directory; every error is a
:class:`~.config.CheckpointError` naming the file or tensor at fault.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Mapping

import torch
from safetensors import safe_open

from .config import CheckpointError, read_json

INDEX_FILE = "model.safetensors.index.json"


def _contained(root: Path, rel: str, what: str) -> Path:
    """``root/rel`` resolved, guaranteed to lie inside ``root`` (symlinks followed)."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel):
        raise CheckpointError(f"{what}: file path {rel!r} escapes checkpoint directory {root}")
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(root / rel))
    if real != real_root and real_root not in real.parents:
        raise CheckpointError(f"{what}: file path {rel!r} escapes checkpoint directory {root}")
    if not real.is_file():
        raise CheckpointError(f"{what}: missing weight file {root / rel}")
    return real


def tensor_files(root: str | os.PathLike) -> dict[str, Path]:
    """Map tensor name -> safetensors file for a checkpoint directory.

    Uses ``model.safetensors.index.json`` when present, else every
    ``*.safetensors`` file in the directory. Every file is checked to lie
    inside ``root``; a name stored in two files is an error.
    """
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    index = root / INDEX_FILE
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: missing or empty 'weight_map'")
        return {name: _contained(root, rel, str(index)) for name, rel in weight_map.items()}
    files = sorted(p.name for p in root.iterdir() if p.name.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files and no {INDEX_FILE}")
    out: dict[str, Path] = {}
    for rel in files:
        path = _contained(root, rel, str(root))
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in out:
                    raise CheckpointError(f"{root}: tensor {name} is stored in two files")
                out[name] = path
    return out


def read_tensors(files: Mapping[str, Path], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read only ``names`` (each must be in ``files``), grouped per file."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for path, group in by_file.items():
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                stored = set(f.keys())
                for name in group:
                    if name not in stored:
                        raise CheckpointError(f"missing tensor {name} (index names {path.name})")
                    out[name] = f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:  # corrupt file: safetensors raises its own types
            raise CheckpointError(f"{path}: cannot read safetensors ({exc})") from exc
    return out
