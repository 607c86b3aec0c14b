"""morphkv: constant-size KV caches (MorphKV and its eviction family) for mlx_lm."""

from .runtime import program as _program

_program.start()  # only for the `morphkv` command: quiet Ctrl-C, OpenBLAS re-exec (Linux)

from .runtime import blas as _blas  # noqa: E402

_blas.load_in_process()  # a script that imports morphkv before MLX gets OpenBLAS's matmuls

from .core.cache import MorphKVCache  # noqa: E402
from .core.config import KVCacheConfig  # noqa: E402
from .core.pins import pin  # noqa: E402
from .core.presets import PRESETS, recommended  # noqa: E402
from .core.rules import METHODS  # noqa: E402
from .mlxlm.attach import attach, detach  # noqa: E402
from .mlxlm.builder import KVCacheBuilder, patch_model, unpatch_model  # noqa: E402

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
    "pin",
    "unpatch_model",
]
__version__ = _program.VERSION

if not _program.invoked_as_program():
    from .runtime.blas import warn_if_slow

    warn_if_slow()  # MLX was imported before morphkv: say once how to get OpenBLAS
