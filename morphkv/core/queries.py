"""Whether queries reach morphkv caches: the registry the attention hook fills.

``morphkv.mlxlm.hooks`` rebinds mlx_lm's attention function in model modules and records each
module here; a cache scoring by real queries checks ``hooks_attached()`` before it relies on
them. Code that hands caches their queries itself uses ``queries_by_hand()``.
"""

from __future__ import annotations

import contextlib

_BY_HAND = "<queries by hand>"
_ATTACHED: dict[str, object] = {}  # module name -> the original scaled_dot_product_attention


@contextlib.contextmanager
def queries_by_hand():
    """Attention scoring without a model hook, for code that hands each cache its queries
    itself with ``cache.prepare_attention(queries, scale, mask)`` (benchmarks, tests)."""
    _ATTACHED[_BY_HAND] = None
    try:
        yield
    finally:
        _ATTACHED.pop(_BY_HAND, None)


def hooks_attached() -> bool:
    """True when at least one model module routes attention through morphkv caches."""
    return bool(_ATTACHED)
