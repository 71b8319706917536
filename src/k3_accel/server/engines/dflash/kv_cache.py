"""The engine's one K/V pool: sized once from a byte budget, paged in blocks.

``kv[0]`` holds keys and ``kv[1]`` values, each
``[layers, num_blocks + 1, block_rows, kv_heads, head_dim]``; block ``b`` of the
:class:`~..pool.BlockPool` is ``kv[:, :, b]``. The last block is the trash, workspace outside
the pool's budget (like the graphs' buffers): the pool never hands it out, and a graph's
padding rows are stored there. Zero-filled at start, so every
slot always holds finite values (the PyTorch attention path multiplies masked
slots by zero).
"""
from __future__ import annotations

import numpy as np
import torch

from ..pool import BlockPool
from .config import DFlashConfig


def bytes_per_row(cfg: DFlashConfig, dtype: torch.dtype) -> int:
    """K and V of one context row in every layer."""
    return 2 * cfg.num_layers * cfg.kv_size * torch.empty((), dtype=dtype).element_size()


def blocks_in_budget(budget_bytes: int, block_rows: int, row_bytes: int) -> int:
    """Whole blocks that fit in ``budget_bytes`` (at least one is required)."""
    blocks = budget_bytes // (block_rows * row_bytes)
    if blocks < 1:
        raise ValueError(f"a K/V budget of {budget_bytes} bytes holds no block of {block_rows} rows "
                         f"({block_rows * row_bytes} bytes)")
    return blocks


def cuda_budget(device: torch.device, fraction: float, reserve_bytes: int) -> int:
    """``fraction`` of the device's free memory, less ``reserve_bytes`` for activations."""
    if not 0 < fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {fraction}")
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * fraction) - reserve_bytes


class KVCache:
    def __init__(self, cfg: DFlashConfig, num_blocks: int, block_rows: int, dtype: torch.dtype,
                 device: torch.device):
        self.pool = BlockPool(num_blocks, block_rows)
        self.kv = torch.zeros(2, cfg.num_layers, num_blocks + 1, block_rows, cfg.num_kv_heads,
                              cfg.head_dim, dtype=dtype, device=device)
        self.trash_slot = num_blocks * block_rows      # the first row of the trash block

    @property
    def nbytes(self) -> int:
        """The pool's bytes (what the budget bounds; the trash block is not counted)."""
        return self.pool.num_blocks * self.kv[:, :, 0].numel() * self.kv.element_size()

    def copy_block(self, src: int, dst: int, rows: int) -> None:
        """Copy on write: the first ``rows`` rows of block ``src`` into block ``dst``."""
        self.kv[:, :, dst, :rows] = self.kv[:, :, src, :rows]

    def slots(self, blocks: list[int], start: int, count: int) -> np.ndarray | list[int]:
        """Flat slots (block * block_rows + row) of rows ``start .. start+count-1``
        (a plain list for a few rows: the decode case, where numpy costs more than it saves)."""
        r = self.pool.block_rows
        if count <= 8:
            return [blocks[row // r] * r + row % r for row in range(start, start + count)]
        rows = np.arange(start, start + count)
        return np.asarray(blocks, dtype=np.int64)[rows // r] * r + rows % r
