"""Saving and loading the selection engine's state, checked before it is trusted.

A saved cache is untrusted input: ``restore`` checks every array's dtype and shape against the
config and the storage, and every value against the others (slot counts, positions, ring
rows), and raises one ``ValueError`` naming what is wrong before anything is built.
Arrays travel as raw bytes with a spec string ``name:dtype:d0xd1;...`` (float64 has no
portable MLX dtype).
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

from . import device_saved, quant
from .config import KVCacheConfig
from .engine import Engine
from .pins import Pins, check_ranges

DTYPES = ("float64", "float32", "float16", "int32", "int64")


def pack(arrays: dict[str, np.ndarray]) -> tuple[str, list[mx.array]]:
    names = sorted(arrays)
    spec = ";".join(
        f"{k}:{arrays[k].dtype}:{'x'.join(map(str, arrays[k].shape))}" for k in names
    )
    data = [mx.array(np.ascontiguousarray(arrays[k]).reshape(-1).view(np.uint8)) for k in names]
    return spec, data


def unpack(spec: str, data: list) -> dict[str, np.ndarray]:
    entries = spec.split(";") if spec else []
    if len(entries) != len(data):
        raise ValueError(f"saved cache: {len(entries)} arrays named but {len(data)} stored")
    out = {}
    for entry, raw in zip(entries, data, strict=True):
        try:
            name, dtype, shape = entry.split(":")
            dims = tuple(int(d) for d in shape.split("x")) if shape else ()
        except ValueError:
            raise ValueError(f"saved cache: malformed array entry {entry!r}") from None
        if dtype not in DTYPES or any(d < 0 for d in dims):
            raise ValueError(f"saved cache: array {name!r} has bad dtype/shape {entry!r}")
        raw = np.array(raw)
        if raw.dtype != np.uint8 or raw.size != np.prod(dims, dtype=np.int64) * np.dtype(
            dtype
        ).itemsize:
            raise ValueError(f"saved cache: array {name!r} does not hold {entry!r}")
        out[name] = raw.view(dtype).reshape(dims)
    return out


def snapshot(engine: Engine) -> dict[str, np.ndarray]:
    """Host arrays describing the engine completely, pending queries (values) included."""
    out = {
        name: getattr(engine, name)
        for name in engine.ARRAYS
        if getattr(engine, name) is not None
    }
    out["scalars"] = np.array(
        [engine.seen, engine.slots, engine.finite, engine.capacity, engine.pending_count],
        np.int64,
    )
    if engine.pending and engine.real:
        out["pending_queries"] = engine.pending_queries()

    out["scale"] = np.array([engine.scale], np.float64)
    return out


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"saved cache is inconsistent: {what}")


def restore(config: KVCacheConfig, rows: int, head_dim: int, stored_rows: int, saved: dict):
    """An engine rebuilt from ``snapshot`` output, after checking it (see module doc)."""
    engine = Engine(config, rows, head_dim, config.scoring == "attention")
    expected = {"scalars", "scale"} | {
        n for n in engine.ARRAYS if getattr(engine, n) is not None
    }
    scalars, scale = saved["scalars"], saved["scale"]
    _need(scalars.shape == (5,) and scalars.dtype == np.int64, "scalars")
    seen, slots, finite, capacity, pending = (int(x) for x in scalars)
    _need(0 <= pending <= min(config.block, seen), f"{pending} pending tokens")
    held = int(engine.needed(seen - pending + np.arange(pending)).sum()) if engine.real else 0
    if held:
        expected.add("pending_queries")
    _need(set(saved) == expected, f"arrays {sorted(saved)} != {sorted(expected)}")
    queries = saved.get("pending_queries")
    if queries is not None:
        a = queries
        _need(a.ndim == 4 and a.shape[2] == held and a.dtype.kind == "f"
              and rows % a.shape[0] == 0 and a.shape[1] % (rows // a.shape[0]) == 0,
              f"pending_queries {a.dtype}{a.shape}")
    W, budget = config.window, config.budget
    _need(0 <= slots <= min(capacity, stored_rows, seen), f"slots={slots}")
    _need(finite in (0, 1), f"finite={finite}")
    _need(scale.shape == (1,) and np.isfinite(scale).all() and scale[0] > 0, "scale")
    if engine.rule.evicts:
        _need(slots <= budget and capacity <= budget + 1, f"{slots} slots for budget {budget}")
    else:
        _need(slots == seen, f"{slots} slots after {seen} tokens without eviction")
    positions = saved["positions"]
    _need(positions.shape == (rows, capacity) and positions.dtype == np.int32, "positions shape")
    kept = positions[:, :slots].astype(np.int64)
    _need(bool(((kept >= 0) & (kept < seen)).all()), "positions out of range")
    ordered = np.sort(kept, axis=1)
    _need(not (ordered[:, 1:] == ordered[:, :-1]).any(), "a position stored twice")
    _need(seen == 0 or bool((kept == seen - 1).any(axis=1).all()), "newest token missing")
    for name in ("accumulated", "value_norms"):
        dtype = None if getattr(engine, name) is None else getattr(engine, name).dtype
        if name in saved:
            a = saved[name]
            _need(a.shape == (rows, capacity) and a.dtype == dtype, f"{name} shape")
            _need(bool((a[:, :slots] >= 0).all()), f"{name} negative")
    if "ring" in saved:
        a = saved["ring"]
        _need(a.shape == (rows, W, capacity) and a.dtype == np.float16,
              f"ring is {a.dtype}{a.shape}")
        _need(bool(((a >= 0) & np.isfinite(a)).all()), "ring holds a negative or NaN")
    engine.seen, engine.slots, engine.finite = seen, slots, bool(finite)
    engine.pending_count, engine.norms_from = pending, slots
    engine.pending = [] if queries is None else [queries]
    engine.queries_held = 0 if queries is None else queries.shape[2]
    engine.capacity, engine.scale = capacity, float(scale[0])
    for name in engine.ARRAYS:
        if name in saved:
            setattr(engine, name, saved[name].copy())
    return engine


def header(config: KVCacheConfig, pins: Pins) -> str:
    """A saved cache's first entry: the config's fields as JSON, plus ``"pinned"``: the pinned
    [start, end) ranges, when there are any (a file without them has none)."""
    if not len(pins.starts):
        return config.to_json()
    return json.dumps({**json.loads(config.to_json()), "pinned": pins.ranges()}, sort_keys=True)


def read_header(text) -> tuple[KVCacheConfig, Pins]:
    """``header``'s (config, pins), checked (``ValueError`` naming what is wrong)."""
    try:
        fields = json.loads(text)
    except (TypeError, ValueError) as e:
        raise ValueError(f"saved cache config is malformed: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError("saved cache config is malformed: not a JSON object")
    pins = Pins()
    ranges = check_ranges(fields.pop("pinned", []))
    if ranges:
        pins.starts, pins.ends = (np.array(x, np.int64) for x in zip(*ranges, strict=True))
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
        if self._device:  # MLX arrays as they are: no host read (see core.device_saved)
            keys, values = self.keys, self.values
            self.engine.fill_norms(self._float_values)
            spec, arrays = device_saved.snapshot(self.engine)
        else:
            self.engine.fill_norms(self._host_values())  # pending tokens' norms, from storage
            keys, values = self._fetch()
            spec, arrays = pack(snapshot(self.engine))
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
            if spec.startswith(device_saved.PREFIX):
                if config.engine != "mlx" or (N > config.budget + 1 and config.rule.evicts):
                    raise ValueError("saved cache: MLX engine state for a host config or "
                                     f"{N} stored rows for budget {config.budget}")
                engine = device_saved.restore(config, B, H, D, N, spec, arrays)
                self.pins = pins  # checked: now the cache changes
                self.adopt(engine, keys, values, config)
                return
            if config.engine == "mlx":
                raise ValueError("saved cache: host engine state for engine='mlx'")
            engine = restore(config, B * H, D, N, unpack(spec, arrays))
            if engine.slots != N:
                raise ValueError(f"saved cache: {N} stored rows for {engine.slots} slots")
        self.pins = pins
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
