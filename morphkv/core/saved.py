"""Saving and loading a cache, checked before it is trusted.

A saved cache is untrusted input: the header (config and pinned ranges) and the storage are
checked here, the engine's arrays by ``morphkv.core.device_saved.restore``; anything wrong
raises one ``ValueError`` naming it before anything is built. Caches saved by the float64 host
engine (removed in issue 43) are refused with a message that says so.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

from . import device_saved, quant
from .config import KVCacheConfig
from .pins import Pins, check_ranges
from .repeats import check_heard

HOST_FORMAT = ("saved cache: written by the float64 host engine, which was removed (issue 43); "
               "its state cannot be loaded: rebuild the cache from its tokens")

def header(config: KVCacheConfig, pins: Pins) -> str:
    """A saved cache's first entry: the config's fields as JSON, plus ``"pinned"``: the pinned
    [start, end) ranges, and ``"heard"``: ``pin_repeats``' hashes, when there are any (a file
    without them has none)."""
    if not (len(pins.starts) or pins.heard.size):
        return config.to_json()
    extra = {"pinned": pins.ranges()} if len(pins.starts) else {}
    if pins.heard.size:
        extra["heard"] = pins.heard.tolist()
    return json.dumps({**json.loads(config.to_json()), **extra}, sort_keys=True)


def read_header(text) -> tuple[KVCacheConfig, Pins]:
    """``header``'s (config, pins), checked (``ValueError`` naming what is wrong)."""
    try:
        fields = json.loads(text)
    except (TypeError, ValueError) as e:
        raise ValueError(f"saved cache config is malformed: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError("saved cache config is malformed: not a JSON object")
    if fields.get("engine") == "host":
        raise ValueError(HOST_FORMAT)
    pins = Pins()
    ranges = check_ranges(fields.pop("pinned", []))
    if ranges:
        pins.starts, pins.ends = (np.array(x, np.int64) for x in zip(*ranges, strict=True))
    pins.heard = check_heard(fields.pop("heard", []))
    return KVCacheConfig.from_json(json.dumps(fields)).validate(), pins


class SavedState:
    """``state`` for mlx_lm's save_prompt_cache / load_prompt_cache and copy.deepcopy, checked
    on load (for ``MorphKVCache``)."""

    @property
    def state(self) -> list:
        """[config JSON] when empty, else [config JSON, keys, values, array spec, arrays...]
        (the engine's state, see ``morphkv.core.saved``); quantized keys and values are three
        arrays each (packed, scales, biases)."""
        self._flush()
        if self.engine is None:
            return [header(self.config, self.pins)]
        keys, values = self.keys, self.values  # MLX arrays as they are: no host read
        self.engine.fill_norms(self._float_values)
        spec, arrays = device_saved.snapshot(self.engine)
        storage = [keys, values] if self.config.kv_bits is None else [*keys, *values]
        return [header(self.config, self.pins), *storage, spec, *arrays]

    @state.setter
    def state(self, state: list) -> None:
        """Restore from ``state``; an inconsistent or edited state raises ``ValueError`` and
        leaves this cache as it was."""
        config, pins = read_header(state[0])
        n = 1 if config.kv_bits is None else 3  # arrays per stored keys (values)
        if len(state) == 1:
            engine = keys = values = None
        elif len(state) < 2 + 2 * n or not isinstance(state[1 + 2 * n], str):
            raise ValueError("saved cache: expected [config, keys, values, spec, arrays...]")
        else:
            keys, values = state[1 : 1 + n], state[1 + n : 1 + 2 * n]
            spec, arrays = state[1 + 2 * n], state[2 + 2 * n :]
            keys, values = (tuple(x) if n == 3 else x[0] for x in (keys, values))
            self._check_saved_storage(config, keys, values)
            B, H, N = quant.dims(keys)
            D = quant.head_dim(keys, config.kv_group_size)
            if not spec.startswith(device_saved.PREFIX):
                raise ValueError(HOST_FORMAT)
            if N > config.budget + 1 and config.rule.evicts:
                raise ValueError(f"saved cache: {N} stored rows for budget {config.budget}")
            engine = device_saved.restore(config, B, H, D, N, spec, arrays)
        self.pins = pins  # checked: now the cache changes
        self.adopt(engine, keys, values, config)

    @staticmethod
    def _check_saved_storage(config: KVCacheConfig, keys, values) -> None:
        bits, group_size = config.kv_bits, config.kv_group_size
        for name, a in (("keys", keys), ("values", values)):
            if bits is not None:
                quant.check_triplet(name, a, bits, group_size)
                continue
            floating = isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating)
            if not floating or a.ndim != 4:
                raise ValueError(f"saved cache: {name} must be a 4-d floating MLX array")
        shapes = [(quant.dims(x), quant.dtype(x)) for x in (keys, values)]
        if shapes[0][0] != shapes[1][0] or shapes[0][1] != shapes[1][1] or 0 in shapes[0][0]:
            raise ValueError(f"saved cache: keys and values {shapes} do not match")
        dim = quant.head_dim(keys, group_size)
        if bits is None and 0 in keys.shape:
            raise ValueError("saved cache: keys have an empty head_dim")
        if config.head_dim is not None and dim != config.head_dim:
            raise ValueError(f"saved cache: head_dim {dim} != config {config.head_dim}")

    # ---- mlx_lm's kv_bits= / --kv-bits ---------------------------------------------------
