"""The engine's state (``morphkv.core.device``) out and in: saved and loaded (checked on
load).

``state`` must not read the device (mlx_lm evaluates every cache's ``state`` after each prefill
chunk): the engine's arrays travel as they are, MLX arrays, behind a spec string
``device:name:dtype:d0xd1;...``; the counters as one int32 array. Loading reads them on the
host once and checks them (``restore``) before anything is built.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .device import DeviceEngine

PREFIX = "device:"
NAMES = ("positions", "accumulated", "value_norms", "ring")


def snapshot(engine: DeviceEngine) -> tuple[str, list]:
    """(spec, arrays) of the engine (its value norms filled first: ``fill_norms``)."""
    arrays = {n: getattr(engine, n) for n in NAMES if getattr(engine, n) is not None}
    arrays["counters"] = mx.array([engine.seen, engine.slots, int(engine.due)], mx.int32)
    arrays["scale"] = mx.array([engine.scale], mx.float32)
    names = sorted(arrays)
    spec = ";".join(
        f"{n}:{str(arrays[n].dtype).split('.')[-1]}:{'x'.join(map(str, arrays[n].shape))}"
        for n in names
    )
    return PREFIX + spec, [arrays[n] for n in names]


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"saved cache is inconsistent: {what}")


def restore(config, B: int, H: int, head_dim: int, stored_rows: int, spec: str, data: list):
    """A ``DeviceEngine`` from ``snapshot`` output, after checking it."""
    engine = DeviceEngine(config, B, H, head_dim, config.scoring == "attention")
    evicts = engine.rule.evicts
    if not evicts:  # ``full``: its arrays are as wide as its storage
        engine.reserve(stored_rows)
    entries = spec[len(PREFIX) :].split(";") if spec[len(PREFIX) :] else []
    _need(len(entries) == len(data), f"{len(entries)} arrays named but {len(data)} stored")
    saved = {}
    for entry, a in zip(entries, data, strict=True):
        name = entry.split(":")[0]
        _need(isinstance(a, mx.array) and entry == f"{name}:{str(a.dtype).split('.')[-1]}:"
              + "x".join(map(str, a.shape)), f"array entry {entry!r}")
        saved[name] = a
    expected = {"counters", "scale"} | {n for n in NAMES if getattr(engine, n) is not None}
    _need(set(saved) == expected, f"arrays {sorted(saved)} != {sorted(expected)}")
    for name in NAMES:
        if name in saved:
            want = getattr(engine, name)
            _need(saved[name].shape == want.shape and saved[name].dtype == want.dtype,
                  f"{name} is {saved[name].dtype}{saved[name].shape}")
    counters = np.array(saved["counters"])
    _need(counters.shape == (3,), "counters")
    seen, slots, due = (int(x) for x in counters)
    scale = float(np.array(saved["scale"])[0])
    _need(np.isfinite(scale) and scale > 0, "scale")
    most = min(seen, config.budget + 1, stored_rows) if evicts else stored_rows
    _need(due in (0, 1) and 0 <= slots <= most, f"slots={slots} after {seen} tokens")
    _need(bool(due) == (evicts and slots > config.budget),
          f"{slots} slots for budget {config.budget}")
    _need(evicts or slots == seen, f"{slots} slots after {seen} tokens without eviction")
    kept = np.array(saved["positions"])[:, :slots].astype(np.int64)
    _need(bool(((kept >= 0) & (kept < seen)).all()), "positions out of range")
    ordered = np.sort(kept, axis=1)
    _need(not (ordered[:, 1:] == ordered[:, :-1]).any(), "a position stored twice")
    _need(seen == 0 or bool((kept == seen - 1).any(axis=1).all()), "newest token missing")
    for name in ("accumulated", "value_norms", "ring"):
        if name in saved:
            a = np.array(saved[name].astype(mx.float32))
            _need(bool(((a >= 0) & np.isfinite(a)).all()), f"{name} negative or not finite")
    engine.seen, engine.slots, engine.due, engine.scale = seen, slots, bool(due), scale
    engine.norms_from = slots  # a snapshot has every norm filled
    engine.unpinned = None  # its pins come with the cache (``MorphKVCache.adopt`` rebuilds it)
    for name in NAMES:
        if name in saved:
            setattr(engine, name, saved[name])
    return engine
