"""Which mlx_lm model modules have morphkv's attention hook installed (see ``attach``)."""

from __future__ import annotations

_ATTACHED: dict[str, object] = {}  # module name -> the original scaled_dot_product_attention


def hooks_attached() -> bool:
    """True when at least one model module routes attention through morphkv caches."""
    return bool(_ATTACHED)
