"""DeviceBatchCache: mlx_lm's batch-cache protocol on the MLX engine (``engine="mlx"``).

``MorphKVCache.merge`` builds one when every row runs the MLX engine with the model's real
queries (the attention hook is attached: every ``morphkv serve`` request). Each batch row keeps
its own ``DeviceEngine`` (B = 1) for its counters (``seen`` / ``slots`` / ``due``), rule and
pins; the engines' arrays are stacked for all rows (``core.device_rows``) over ONE shared
storage (B, H, budget + 1, D), rows left-aligned. ``full`` rows (no eviction) share it too:
it is as wide as the widest row needs, grown in ``storage.STEP`` slots (``_room``).

* A decode step (every row takes one token): the rows due an eviction evict in one set of ops
  for all rows (``device_rows.evict``; rows not due carry identity moves), the storage moves
  once; one scatter writes every row's token at its row's next slot; the hook's ``attend``
  computes one attention over every row (a (B, 1, 1, L) mask hides each row's free tail) whose
  softmax also gives the rows every engine observes (``device_rows.observe``). The same graph
  at any B, and no host read: the counters are Python ints that follow from the token stream.
* A multi-token chunk (a right-padded prompt, left padding, rows joining with history) is fed
  row by row in pieces that end at that row's eviction grid (``DeviceEngine.piece``), exactly as
  ``MorphKVCache`` feeds one sequence (``core.device_chunk``); padding gets a zero output.

So a row keeps what the same sequence run alone keeps (``tests/test_batch_device.py``);
``filter`` / ``extend`` / ``extract`` move whole rows (storage, engine, pins).
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np

from . import device_chunk, device_rows, device_schedule, quant, storage
from .attention import attend
from .batch import BatchProtocol
from .device import DeviceEngine, move
from .masks import decode_mask
from .pins import Pins

ROW_LISTS = ("engines", "seen", "stored", "lead", "pin_next", "row_pins")


class DeviceBatchCache(BatchProtocol):
    """A batch of MorphKV rows on the MLX engine (see the module docstring)."""

    def __init__(self, config, rows: int, row_class: type):
        self.init_feed(config, rows, 1)
        self.row_class = row_class
        self.row_pins = [Pins() for _ in range(rows)]
        self._held = None  # the update waiting for its queries
        self._arrays = None  # every row's engine arrays, stacked (``core.device_rows``)
        self._H = None  # KV heads
        self._cap = config.budget + 1 if self.evicts else 0  # ``full`` grows (``_room``)

    @classmethod
    def accepts(cls, caches) -> bool:
        """Can these single-sequence caches batch on the MLX engine?"""
        return bool(caches) and all(c.config.scoring == "attention" for c in caches)

    # ---- building -------------------------------------------------------------------------
    @classmethod
    def merge(cls, caches, row_class: type) -> DeviceBatchCache:
        """One batch from single-sequence MLX-engine caches (history allowed; copied)."""
        cls.check_rows(caches, row_class)
        config = caches[0].config
        batch = cls(config, len(caches), row_class)
        batch.row_pins = [c.pins.copy() for c in caches]
        batch.pin_next = [c.pin_next[0] for c in caches]
        full = [c for c in caches if not c.empty()]
        for c in full:
            if c._held is not None:
                raise RuntimeError("merge: a cache's update is still waiting for its queries")
        if not batch.evicts and full:  # ``full`` rows: every row as wide as the widest
            batch._cap = max(c.engine.capacity for c in full)
        for i, c in enumerate(caches):
            if not c.empty():
                batch.engines[i] = e = cls.copy_engine(c.engine, batch.row_pins[i])
                e.reserve(batch.capacity)
                batch.seen[i], batch.stored[i] = c.offset, c.engine.slots
        if full:
            like = full[0]
            for name in ("keys", "values"):
                setattr(batch, name, storage.concat_rows_all(
                    [storage.zeros(getattr(like, name), 1, batch.capacity) if c.empty()
                     else storage.grow(getattr(c, name), batch.capacity) for c in caches]))
            batch._H = quant.dims(like.keys)[1]
            template = next(e for e in batch.engines if e is not None)
            batch._arrays = device_rows.stack(batch.engines, template)
            for e in batch.engines:
                if e is not None:
                    device_rows.detach(e)
        return batch

    @property
    def capacity(self) -> int:
        """Slots of every row's storage: ``budget + 1``, or what ``full`` rows grew to."""
        return self._cap

    def _room(self, slots: int) -> None:
        """``full`` rows grow (steps of ``storage.STEP``): storage, stacked arrays and every
        engine hold ``slots``."""
        if slots <= self._cap:
            return
        cap = storage.capacity(slots, self.config, False)
        if self.keys is not None:
            self.keys, self.values = storage.grow(self.keys, cap), storage.grow(self.values, cap)
        if self._arrays is not None:
            self._arrays = device_rows.widen(self._arrays, cap)
        for e in self.engines:
            if e is not None:
                e.capacity = cap
        self._cap = cap

    @staticmethod
    def copy_engine(engine: DeviceEngine, pins: Pins, slots: int | None = None) -> DeviceEngine:
        """A copy sharing no array object with ``engine`` (slice writes replace an array
        object's contents), ranking with ``pins``; it reads keys only through the batch.
        ``slots``: its arrays cut to that many slots (a ``full`` row handed back)."""
        new = copy.copy(engine)
        for name in DeviceEngine.ARRAYS:
            value = getattr(engine, name)
            if value is not None:
                setattr(new, name, mx.array(value if slots is None else value[..., :slots]))
        if slots is not None:
            new.capacity = slots
        new.pins, new.stored_keys, new._keys = pins, None, None
        return new

    def extract(self, idx: int):
        """A copy of row ``idx`` as a single-sequence ``MorphKVCache`` on the MLX engine."""
        self._no_held("extract")
        cache = self.row_class(self.config)
        cache.pins, cache.pin_next = self.row_pins[idx].copy(), [self.pin_next[idx]]
        engine = self.engines[idx]
        if engine is None:
            return cache
        # ``full``: the row's own width, not the widest row's
        n = self.capacity if self.evicts else storage.capacity(engine.slots, self.config, False)
        engine = device_rows.load(self._arrays, engine, idx, self._H)
        try:
            engine = self.copy_engine(engine, cache.pins, n)
        finally:
            device_rows.detach(self.engines[idx])
        cache.adopt(engine, storage.row_copy(self.keys, idx, n),
                    storage.row_copy(self.values, idx, n))
        return cache

    def filter(self, batch_indices) -> None:
        """Keep only the given rows, in that order."""
        self._no_held("filter")
        keep = self.kept_rows(batch_indices)
        for name in ROW_LISTS:
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        if self._remaining is not None:
            self._remaining = [self._remaining[i] for i in keep]
        self._seal = None
        if self._arrays is not None:
            self._arrays = device_rows.take(self._arrays, keep, self._H)
        if self.keys is not None:
            self.keys = storage.take_rows(self.keys, keep)
            self.values = storage.take_rows(self.values, keep)

    def extend(self, other: DeviceBatchCache) -> None:
        """Append the rows of ``other``."""
        self.check_extend(other)
        self._no_held("extend")
        other._no_held("extend")
        B0 = self.B
        if not self.evicts:
            cap = max(self._cap, other._cap)
            self._room(cap)
            other._room(cap)
        self._extend_remaining(other)
        H = self._H or other._H
        arrays = device_rows.concat(self._arrays, other._arrays, B0 * (H or 0),
                                    other.B * (H or 0))
        self._arrays, self._H = arrays, H
        for name in ROW_LISTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._seal = None
        self.keys, self.values = (storage.concat_batches(a, b, B0, other.B, self.capacity)
                                  for a, b in ((self.keys, other.keys),
                                               (self.values, other.values)))

    def _no_held(self, what: str) -> None:
        if self._held is not None:
            raise RuntimeError(f"{what}: an update is still waiting for its queries")

    # ---- mlx_lm hot path ------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store each row's real tokens (a decode step now; a chunk row by row once its
        queries come, in ``attend``); returns what the hook's attention replaces."""
        C = keys.shape[2]
        self.check(keys, values)  # first: a refused update changes nothing
        self.need_hooks(C)
        self._no_held("update_and_fetch")
        if self.pin_prompts and C and (self.prompt(C) or any(self.pin_next)):
            self.pin_arrived(list(self.seen), self.spans(C)[1], C)
        sk, sv = storage.store_form(keys, self.config), storage.store_form(values, self.config)
        if C == 0:
            if self.keys is None:
                return sk, sv
            n = max(self.stored)
            return storage.fetch(self.keys, n), storage.fetch(self.values, n)
        starts, counts = self.advance(C)
        if self.keys is None:
            self.keys = storage.zeros(sk, self.B, self.capacity)
            self.values = storage.zeros(sv, self.B, self.capacity)
        for i in np.nonzero(counts)[0]:
            if self.engines[i] is None:
                self.engines[i] = self._new_engine(int(i), keys.shape[1], keys.shape[3])
        if not self.evicts:
            self._room(int(max(np.add(self.stored, counts))))
        self.seen = np.add(self.seen, counts).tolist()
        if C == 1 and (counts == 1).all():  # a plain decode step
            due = [i for i, e in enumerate(self.engines) if e.due]
            if due and self.config.block == 1 and device_schedule.fits(self.engines[0]):
                return self._replace_decode(due, sk, sv, values.shape[-1])
            self.evict_rows(due)
            slots = [e.slots for e in self.engines]
            self.keys = storage.write(self.keys, slots, sk)
            self.values = storage.write(self.values, slots, sv)
            self.stored = [s + 1 for s in slots]
            self._held = ("decode", slots, values.shape[-1])
            n = max(self.stored)
            return storage.fetch(self.keys, n), storage.fetch(self.values, n)
        self._held = ("chunk", (sk, sv), starts, counts, values.shape[-1])
        return keys, values

    def _replace_decode(self, due: list[int], sk, sv, Dv: int):
        """A decode step of a position-only rule at block 1 (``DeviceEngine.replace`` for
        every row at once): each due row's token takes its victim's slot, the others' their
        next slot; one scatter per array, no row moves, every row's bookkeeping done here."""
        B, H, n = self.B, self._H, self.capacity
        picks = device_rows.victim_slots(self._arrays, self.engines, due, self.row_pins, H,
                                         lambda: self._floats(self.keys, 0, n))
        mine = np.zeros(B, bool)
        mine[due] = True
        nxt = np.repeat([e.slots for e in self.engines], H)[:, None].astype(np.int32)
        index = mx.where(mx.array(np.repeat(mine, H)[:, None]), picks.astype(mx.int32),
                         mx.array(nxt))
        seen = np.repeat([e.seen for e in self.engines], H)[:, None].astype(np.int32)
        self._arrays["positions"] = mx.put_along_axis(self._arrays["positions"], index,
                                                      mx.array(seen), axis=1)
        slot = index.reshape(B, H, 1, 1)
        put = lambda p, x: mx.put_along_axis(p, slot, x, axis=2)  # noqa: E731
        self.keys, self.values = quant.apply(put, self.keys, sk), quant.apply(put, self.values, sv)
        for i, e in enumerate(self.engines):
            if e.unpinned is not None:
                e.unpinned = e.unpinned.arrived(e.seen, 1, e.pins)
            e.seen, e.slots = e.seen + 1, e.slots + (0 if mine[i] else 1)
            e.due = e.slots > self.config.budget
        self.stored = [e.slots for e in self.engines]
        self._held = ("replaced", self.stored, Dv)
        n = max(self.stored)
        return storage.fetch(self.keys, n), storage.fetch(self.values, n)

    def _new_engine(self, i: int, H: int, head_dim: int) -> DeviceEngine:
        e = DeviceEngine(self.config, 1, H, head_dim, True)
        e.reserve(self._cap)  # ``full``: as wide as the other rows
        e.pins = self.row_pins[i]
        if self._scale is not None:
            e.scale = self._scale
        if self._arrays is None:
            self._H = H
            self._arrays = device_rows.stack([None] * self.B, e)
        device_rows.store(self._arrays, e, i, H)
        return e

    def evict_rows(self, rows) -> None:
        """The due evictions of ``rows``, in one set of ops for all rows
        (``device_rows.evict``); the storage moves once."""
        if not rows:
            return
        B, H, block = self.B, self._H, self.config.block
        n = self.capacity
        src, dst = device_rows.evict(
            self._arrays, self.engines, rows, self.row_pins, H,
            lambda: self._floats(self.keys, 0, n), lambda a, b: self._floats(self.values, a, b))
        for i in rows:
            self.stored[i] = self.engines[i].slots
        src, dst = (x.reshape(B, H, block, 1) for x in (src, dst))
        self.keys = quant.apply(lambda x: move(x, src, dst, 2), self.keys)
        self.values = quant.apply(lambda x: move(x, src, dst, 2), self.values)

    def _floats(self, x, start: int, end: int) -> mx.array:
        """Every row's stored slots [start, end) as floats (B * H, end - start, D)."""
        part = storage.floats(storage.fetch(x, end, start), self.config)
        return part.reshape(-1, end - start, part.shape[-1])

    def _quant(self):
        c = self.config
        return None if c.kv_bits is None else (c.kv_group_size, c.kv_bits)

    def attend(self, queries, scale: float, mask=None, sinks=None):
        """The attention output of the held update for ``queries`` (B, n_heads, C, D); every
        row's engine observes its tokens on the way."""
        held, self._held = self._held, None
        if held is None:
            raise RuntimeError("DeviceBatchCache.attend: no update is waiting for its queries")
        self.set_scale(float(scale))
        if held[0] == "decode":
            return self._attend_decode(queries, sinks, held[1])
        if held[0] == "replaced":  # written and observed already (``_replace_decode``)
            counts = held[1]
            return attend(queries, self.keys, self.values, max(counts), self._scale, sinks,
                          self._quant(), valid=decode_mask(counts))[0]
        return device_chunk.attend_chunk(self, queries, sinks, *held[1:])

    def _attend_decode(self, queries, sinks, slots):
        counts = [s + 1 for s in slots]
        L = max(counts)
        out, rows = attend(queries, self.keys, self.values, L, self._scale, sinks, self._quant(),
                           valid=decode_mask(counts))
        device_rows.observe(self._arrays, self.engines, rows, self._H)
        return out

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs):
        """The mask mlx_lm builds before the layers run; unused: ``attend`` masks each row."""
        self.no_window(window_size)
        return None if N == 1 else "causal"

    def _held_positions(self, i: int) -> np.ndarray:
        H, slots = self._H, self.engines[i].slots
        return np.asarray(self._arrays["positions"][i * H : (i + 1) * H, :slots]).reshape(-1)

    # ---- accounting -------------------------------------------------------------------------
    @property
    def state(self) -> list:
        """The storage and every row's engine arrays (what ``mx.eval`` must compute); a batch
        is not saved as such: ``extract`` rows and save those."""
        if self.keys is None:
            return []
        arrays = [] if self._arrays is None else list(self._arrays.values())
        return [*quant.parts(self.keys), *quant.parts(self.values), *arrays]

    @property
    def nbytes(self) -> int:
        held = 0 if self.keys is None else quant.nbytes(self.keys) + quant.nbytes(self.values)
        engines = device_rows.nbytes(self._arrays)
        return held + engines + sum(p.nbytes for p in self.row_pins)

    @property
    def tokens_kept(self) -> list[int]:
        return [0 if e is None else e.kept for e in self.engines]

    def __deepcopy__(self, memo):
        if self._held is not None:
            raise RuntimeError("deepcopy: an update is still waiting for its queries")
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        pins = [p.copy() for p in self.row_pins]
        for name, value in vars(self).items():
            if name == "engines":
                value = [None if e is None else self.copy_engine(e, p)
                         for e, p in zip(value, pins, strict=True)]
            elif name == "row_pins":
                value = pins
            elif name != "row_class":
                value = copy.deepcopy(value, memo)
            setattr(new, name, value)
        return new
