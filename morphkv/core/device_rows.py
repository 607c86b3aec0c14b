"""The batch's selection state on the MLX engine: every row's ``DeviceEngine`` arrays, stacked.

``DeviceBatchCache`` keeps one ``DeviceEngine`` per row for its counters (``seen``, ``slots``,
``due``: Python ints that follow from the token stream) and its rule, and ONE array per kind
(positions, running scores, value norms, the window's ring) of (B * H, ...) for all rows, so
a decode step observes every row's token with the same few MLX ops at any B (``observe``).
Work on one row (an eviction, a prompt chunk, ``extract``) ``load``s the row's slices into its
engine and ``store``s them back; between, the engine's own array attributes are placeholders.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .device import DeviceEngine, running_update

NAMES = DeviceEngine.ARRAYS
DETACHED = mx.zeros((0,), mx.float16)  # an engine's array while the stack holds it


def kinds(engine: DeviceEngine) -> list[str]:
    return [n for n in NAMES if getattr(engine, n) is not None]


def stack(engines: list, template: DeviceEngine) -> dict:
    """The stacked arrays of ``engines`` (None: a row with no token yet, zeros)."""
    out = {}
    for name in kinds(template):
        zero = mx.zeros_like(getattr(template, name))
        out[name] = mx.concatenate([zero if e is None else getattr(e, name) for e in engines])
    return out


def detach(engine: DeviceEngine) -> DeviceEngine:
    for name in kinds(engine):
        setattr(engine, name, DETACHED)
    return engine


def load(arrays: dict, engine: DeviceEngine, i: int, H: int) -> DeviceEngine:
    """Row i's arrays into its engine (views of the stack)."""
    for name, a in arrays.items():
        setattr(engine, name, a[i * H : (i + 1) * H])
    return engine


def store(arrays: dict, engine: DeviceEngine, i: int, H: int) -> None:
    """Row i's engine arrays back into the stack; the engine is detached."""
    for name, a in arrays.items():
        a[i * H : (i + 1) * H] = getattr(engine, name)
    detach(engine)


def take(arrays: dict, keep: list[int], H: int) -> dict:
    index = mx.array((np.asarray(keep, np.int32)[:, None] * H + np.arange(H)).reshape(-1))
    return {name: a[index] for name, a in arrays.items()}


def concat(a: dict | None, b: dict | None, rows_a: int, rows_b: int) -> dict | None:
    """Rows of ``a`` then ``b`` (a side without arrays: zeros)."""
    if a is None or b is None:
        like = a if b is None else b
        if like is None:
            return None
        a = a if a is not None else {n: mx.zeros((rows_a, *x.shape[1:]), x.dtype)
                                     for n, x in like.items()}
        b = b if b is not None else {n: mx.zeros((rows_b, *x.shape[1:]), x.dtype)
                                     for n, x in like.items()}
    return {n: mx.concatenate([a[n], b[n]]) for n in a}


def observe(arrays: dict, engines: list, rows, H: int) -> None:
    """One decode token per row: every engine observes its token (written at its slot
    ``slots``, position ``seen``) and its attention row (rows (B * H, 1, L) float32, zero past
    each row's ``slots + 1`` columns), as ``DeviceEngine.observe`` with k = 1, for all rows in
    one set of MLX ops."""
    e0 = engines[0]
    seen = np.repeat(np.array([e.seen for e in engines], np.int32), H)[:, None]
    slots = np.repeat(np.array([e.slots for e in engines], np.int32), H)[:, None]
    L = rows.shape[-1]
    arrays["positions"] = mx.put_along_axis(arrays["positions"], mx.array(slots),
                                            mx.array(seen), axis=1)
    if e0.real and e0.needs_rows:
        rows = rows.astype(mx.float16)  # the host engine's rounding
        if e0.running == "sum":
            rows = rows.astype(mx.float32)
    if "ring" in arrays:
        ring = arrays["ring"]
        at = mx.array((seen % e0.ring_rows)[:, :, None])
        ring[:, :, :L] = mx.put_along_axis(ring[:, :, :L], mx.broadcast_to(at, rows.shape),
                                           rows.astype(ring.dtype), axis=1)
    if e0.running:
        running_update(arrays["accumulated"], rows, L, 1, e0.running, e0.decay)
    budget = e0.config.budget
    for e in engines:
        e.seen, e.slots = e.seen + 1, e.slots + 1
        e.due = e.rule.evicts and e.slots > budget


def nbytes(arrays: dict | None) -> int:
    return 0 if arrays is None else sum(int(a.nbytes) for a in arrays.values())
