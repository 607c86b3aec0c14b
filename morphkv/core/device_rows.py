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

from .device import DeviceEngine, _lowest, _norms16, move, moves, running_update, widened

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


def widen(arrays: dict, slots: int) -> dict:
    """Every stacked array with ``slots`` slots (``device.widened``): ``full`` rows grow."""
    return {name: widened(a, slots) for name, a in arrays.items()}


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
        rows = rows.astype(mx.float16)  # the reference's rounding
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
        if e.unpinned is not None:
            e.unpinned = e.unpinned.arrived(e.seen, 1, e.pins)
        e.seen, e.slots = e.seen + 1, e.slots + 1
        e.due = e.rule.evicts and e.slots > budget


def nbytes(arrays: dict | None) -> int:
    return 0 if arrays is None else sum(int(a.nbytes) for a in arrays.values())


class RowsEngine(DeviceEngine):
    """What the rules read at a batch's eviction, for every row at once: the stacked arrays
    over the ``budget + 1`` slots every due row holds, each row's own ``seen`` (an (R, 1)
    array) and KV-head index (``row_ids``, as a single sequence numbers its rows). Rows not
    due get a selection too, which the batch discards (``DeviceBatchCache.evict_rows``)."""

    def __init__(self, e0: DeviceEngine, arrays: dict, engines: list, H: int, keys) -> None:
        self.__dict__.update({k: v for k, v in vars(e0).items() if k not in NAMES})
        self.B, self.H, self.rows = len(engines), H, len(engines) * H
        self.row_ids = mx.array(np.tile(np.arange(H, dtype=np.uint32), self.B)[:, None])
        self.seen = np.repeat([0 if e is None else e.seen for e in engines], H)[:, None]
        self.slots = e0.config.budget + 1
        for name in NAMES:
            setattr(self, name, arrays.get(name))
        self.stored_keys, self._keys, self.pins = keys, None, None

    def newest_probs(self):
        at = mx.array(((self.seen - 1) % self.ring_rows)[:, :, None].astype(np.int32))
        return mx.take_along_axis(self.ring, at, axis=1)[:, 0, : self.slots]

    def lowest(self, pinned=None):
        """(R, block) the lowest (score, position) keys among each row's unprotected slots
        (``DeviceEngine.select`` with per-row bounds; ``pinned``: (R, n) or None)."""
        c, n = self.config, self.slots
        pos = self.stored_positions
        scores = self.rule.score(self).astype(mx.float32)
        if pinned is not None and self.pin_rule is not None:
            scores = mx.where(pinned, self.pin_rule.score(self).astype(mx.float32), scores)
        norms = None if self.value_norms is None else self.value_norms[:, :n]
        bounds = np.stack([np.full_like(self.seen, c.n_sink), self.seen - 1 - c.recent])
        bounds = mx.array(bounds.astype(np.int32))
        lowest = _lowest(self.block, norms is not None, pinned is not None)
        if pinned is not None:
            return lowest(scores, norms, pos, bounds, pinned)
        return lowest(scores, norms, pos, bounds)


def evict(arrays: dict, engines: list, due: list[int], pins: list, H: int, keys, values):
    """The evictions due in rows ``due`` (each holds ``budget + 1`` slots), in one set of ops
    for every row: (src, dst) (B * H, block) slot moves for the storage (identity in the rows
    not due), the stacked arrays already moved. ``keys()`` / ``values(start, end)``: every
    row's stored keys (R, n, D) / values rows [start, end) (R, ., Dv) as floats."""
    e0 = engines[due[0]]
    n, block, R = e0.config.budget + 1, e0.block, len(engines) * H
    mine = np.zeros(len(engines), bool)
    mine[due] = True
    mine = np.repeat(mine, H)[:, None]
    if "value_norms" in arrays:  # every row's norms over the columns a due row lacks
        start = min(engines[i].norms_from for i in due)
        if start < n:
            arrays["value_norms"][:, start:n] = _norms16(values(start, n))
    picks = victim_slots(arrays, engines, due, pins, H, keys)
    src, dst = moves(picks, n, block)
    same = mx.broadcast_to(mx.arange(block, dtype=src.dtype), (R, block))
    due_rows = mx.array(mine)
    src, dst = mx.where(due_rows, src, same), mx.where(due_rows, dst, same)
    arrays["positions"] = move(arrays["positions"], src, dst, 1)
    for name in ("accumulated", "value_norms"):
        if name in arrays:
            arrays[name] = move(arrays[name], src, dst, 1)
    if "accumulated" in arrays:  # the freed rows of the due rows: new scores start at 0
        cols = np.arange(arrays["accumulated"].shape[1])
        freed = mx.array(mine & (cols >= n - block) & (cols < n))
        arrays["accumulated"] = mx.where(freed, 0, arrays["accumulated"]).astype(
            arrays["accumulated"].dtype)
    if "ring" in arrays:
        arrays["ring"] = move(arrays["ring"], src[:, None], dst[:, None], 2)
    for i in due:
        e = engines[i]
        e.slots, e.due, e.norms_from = n - block, False, n - block
    return src, dst


def victim_slots(arrays: dict, engines: list, due: list[int], pins: list, H: int, keys):
    """(B * H, block) the slots the due rows evict (other rows: anything): by position when
    every due row's mirror knows its victims (recency, ``core.unpinned``), else scored."""
    e0 = engines[due[0]]
    n, block = e0.config.budget + 1, e0.block
    known = [engines[i].unpinned_victims() for i in due]  # recency: by position
    if all(v is not None for v in known):
        wanted = np.zeros((len(engines), block), np.int32)
        wanted[due] = known
        wanted = mx.array(np.repeat(wanted, H, axis=0))[:, None, :]
        picks = mx.argmax(arrays["positions"][:, :n, None] == wanted, axis=1)
    else:
        rows = RowsEngine(e0, arrays, engines, H, keys)
        pinned = None
        if any(len(pins[i]) for i in due):
            pos = rows.stored_positions
            pinned = mx.concatenate([
                pins[i].device(pos[i * H : (i + 1) * H]) if len(pins[i])
                else mx.zeros((H, n), mx.bool_) for i in range(len(engines))])
        picks = rows.lowest(pinned)
    return picks
