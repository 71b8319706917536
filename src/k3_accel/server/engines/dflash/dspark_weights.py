"""DSpark weights: the DFlash backbone (:func:`.weights.load_dflash`) plus the Markov head
and the optional confidence head, named as ``Qwen3DSparkForCausalLM.load_weights`` loads them
(unprefixed in the checkpoint): ``markov_head.markov_w1.weight [V, r]`` (rows: the previous
*target* token), ``markov_head.markov_w2.weight [draft_V, r]``, and
``confidence_head.proj.weight [1, H (+ r)]`` / ``.bias [1]`` (kept in float32, as vLLM keeps
them). As in vLLM, the confidence head exists when the config enables it *and* the
checkpoint has its tensors; ``t2d`` and ``mask_embedding`` are not read.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import CheckpointError
from .dspark_config import DSparkConfig, read_dspark_config
from .tensors import read_tensors, tensor_files
from .weights import DFlashWeights, _check_shape, load_dflash

MARKOV_W1, MARKOV_W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
CONFIDENCE_W, CONFIDENCE_B = "confidence_head.proj.weight", "confidence_head.proj.bias"


@dataclass
class DSparkHeads:
    markov_w1: torch.Tensor                      # [V, r], model dtype
    markov_w2: torch.Tensor                      # [draft_V, r], model dtype
    confidence_w: torch.Tensor | None = None     # [1, H (+ r)], float32
    confidence_b: torch.Tensor | None = None     # [1], float32
    target_ids: torch.Tensor | None = None       # [draft_V] int64: each draft id's target id (set by the engine)


def head_shapes(cfg: DSparkConfig) -> dict[str, tuple[int, ...]]:
    """Every DSpark head tensor name and its shape (confidence ones when the config enables it)."""
    shapes = {MARKOV_W1: (cfg.vocab_size, cfg.markov_rank), MARKOV_W2: (cfg.draft_vocab_size, cfg.markov_rank)}
    if cfg.confidence_head:
        width = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_with_markov else 0)
        shapes.update({CONFIDENCE_W: (1, width), CONFIDENCE_B: (1,)})
    return shapes


def load_dspark(draft_dir: str | os.PathLike, target_dir: str | os.PathLike,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                ) -> tuple[DFlashWeights, DSparkHeads]:
    """Load and validate a DSpark draft: the backbone (with the target's shared tensors) and its heads."""
    root = Path(draft_dir)
    cfg = read_dspark_config(str(root))
    weights = load_dflash(root, target_dir, dtype, device, config=cfg)
    files = tensor_files(root)
    shapes = head_shapes(cfg)
    for name in (MARKOV_W1, MARKOV_W2):
        if name not in files:
            raise CheckpointError(f"missing tensor {name} in DSpark checkpoint {root}")
    present = [n for n in shapes if n in files]
    if cfg.confidence_head and len(present) == 3:
        raise CheckpointError(f"DSpark checkpoint {root} has only one of {CONFIDENCE_W}, {CONFIDENCE_B}")
    tensors = read_tensors(files, present)
    for name in present:
        _check_shape(name, tensors[name], shapes[name])

    def get(name: str, as_dtype: torch.dtype) -> torch.Tensor | None:
        t = tensors.get(name)
        return None if t is None else t.to(device=device, dtype=as_dtype).contiguous()

    return weights, DSparkHeads(get(MARKOV_W1, dtype), get(MARKOV_W2, dtype),
                                get(CONFIDENCE_W, torch.float32), get(CONFIDENCE_B, torch.float32))
