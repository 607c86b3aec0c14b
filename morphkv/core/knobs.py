"""The knobs' one name each: what a rule's field, a flag and an arm option are called.

Every ``KVCacheConfig`` field has one short name, listed here once. The flag is ``--name`` (``_``
written ``-``: ``--kv-bits``), the arm option is ``name=value`` (``morphkv:block=16``), a rule's
dataclass field of that knob has that name (``WindowAttention.fusion``), and the config keeps it
in the field beside it (``KVCacheConfig.morphkv_block``: the Python API and saved caches).
``OLD`` keeps the spellings users already type working.
"""

from __future__ import annotations

FIELDS = {  # a knob's name -> the KVCacheConfig field that holds it
    "method": "method",
    "head_dim": "head_dim",
    "budget": "morphkv_budget",
    "sinks": "morphkv_n_sink",
    "window": "morphkv_window",
    "fusion": "morphkv_fusion",
    "recent": "morphkv_recent",
    "value": "morphkv_value",
    "peak": "morphkv_peak",
    "decay": "morphkv_decay",
    "pool": "morphkv_pool",
    "scoring": "scoring",
    "seed": "seed",
    "kv_bits": "kv_bits",
    "kv_group_size": "kv_group_size",
    "kv_smooth": "kv_smooth",
    "block": "morphkv_block",
    "kv_memory": "kv_memory",
    "recent_share": "morphkv_recent_share",
    "engine": "engine",
    "pin": "pin",
    "pin_rank": "pin_rank",
    "pin_replies": "pin_replies",
    "pin_fit": "pin_fit",
    "pin_repeats": "pin_repeats",
}
OLD = {"n_sink": "sinks", "bits": "kv_bits", "memory": "kv_memory"}  # older spellings
NAMES = {field: name for name, field in FIELDS.items()}


def field_of(key: str) -> str:
    """The config field a knob's name, old spelling or field name means (``ValueError`` naming
    it when none)."""
    name = OLD.get(key, key)
    if name in FIELDS:
        return FIELDS[name]
    if key in NAMES:
        return key
    raise ValueError(f"{key!r} names no KVCacheConfig field; knobs: {sorted(FIELDS)}")


def flag(key: str) -> str:
    """The command-line flag of a knob (by name, old spelling or field): ``--kv-bits``."""
    return "--" + NAMES[field_of(key)].replace("_", "-")
