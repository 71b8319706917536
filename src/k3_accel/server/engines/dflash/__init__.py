"""DFlash block-drafting engine: batched, over one paged K/V pool (see engine.py)."""
from .config import CheckpointError, DFlashConfig, read_dflash_config
from .engine import DFlashEngine
from .weights import DFlashWeights, draft_tensor_shapes, load_dflash

__all__ = ["CheckpointError", "DFlashConfig", "DFlashEngine", "DFlashWeights", "draft_tensor_shapes",
           "load_dflash", "read_dflash_config"]
