"""NumPy's bundled OpenBLAS on one thread while the engine runs (thread-safe).

The engine's host matmuls are small; with NumPy's BLAS thread pool running beside MLX's they
stalled decoding for up to seconds per token on a 2-core machine (measured). The setting is
process-wide, so concurrent users are counted: the first to enter saves the caller's setting
and sets one thread, the last to leave restores it.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from pathlib import Path

import numpy as np


def _find_controls():
    for lib in (Path(np.__file__).parent.parent / "numpy.libs").glob("libscipy_openblas*"):
        try:
            handle = ctypes.CDLL(str(lib))
            get = handle.scipy_openblas_get_num_threads64_
            return get, handle.scipy_openblas_set_num_threads64_
        except (OSError, AttributeError):
            continue
    return None, None


_get, _set = _find_controls()
_lock = threading.Lock()
_users = 0
_saved = None


@contextlib.contextmanager
def one_blas_thread():
    """Context in which NumPy's OpenBLAS uses one thread; restores the setting afterwards."""
    global _users, _saved
    if _set is None:
        yield
        return
    with _lock:
        if _users == 0:
            _saved = _get()
            _set(1)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                _set(_saved)


def blas_threads() -> int | None:
    """NumPy's current OpenBLAS thread count (None when it cannot be read)."""
    return None if _get is None else int(_get())
