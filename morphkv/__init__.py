"""morphkv: constant-size KV caches (MorphKV and its eviction family) for mlx_lm."""

from .attach import attach, detach
from .builder import KVCacheBuilder, patch_model, unpatch_model
from .cache import MorphKVCache
from .config import KVCacheConfig
from .presets import PRESETS, recommended
from .rules import METHODS

__all__ = [
    "attach",
    "detach",
    "KVCacheBuilder",
    "KVCacheConfig",
    "METHODS",
    "PRESETS",
    "recommended",
    "MorphKVCache",
    "patch_model",
    "unpatch_model",
]
__version__ = "0.1.0"
