"""DFlash block-drafting engine (pure PyTorch)."""
from .checkpoint import CheckpointError, DFlashConfig, DFlashWeights, load_dflash
from .engine import DFlashEngine, DFlashState

__all__ = ["CheckpointError", "DFlashConfig", "DFlashEngine", "DFlashState", "DFlashWeights",
           "load_dflash"]
