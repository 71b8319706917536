"""DFlash block-drafting engines (DFlash and DSpark): batched, over one paged K/V pool (see engine.py)."""
from .config import CheckpointError, DFlashConfig, read_dflash_config
from .dspark_config import DSparkConfig, read_dspark_config
from .dspark_engine import DSparkEngine
from .engine import DFlashEngine
from .weights import DFlashWeights, draft_tensor_shapes, load_dflash

__all__ = ["CheckpointError", "DFlashConfig", "DFlashEngine", "DFlashWeights", "DSparkConfig", "DSparkEngine",
           "draft_tensor_shapes", "load_dflash", "read_dflash_config", "read_dspark_config"]
