"""The selection engine on the device: every statistic, pick and move an MLX op, no host sync.

It keeps, as MLX arrays of fixed width ``budget + 1`` per (batch row, KV head) (``full``:
growing, ``reserve``): each slot's position, running score (h2o: a sum, peak: a running max),
value norm, and for real-query window rules a ring of the last ``window`` tokens' attention
rows (float16, as ``tests/reference.py`` rounds them). Rows come from the attention the layer
computes anyway (``morphkv.core.attention``): a piece of tokens is observed once its attention
is known (``observe``). Tokens are fed in pieces that end at the eviction grid (positions
``budget``, ``budget + block``, ...), so a piece never needs more than ``budget + 1`` stored
rows and every query sees what token-by-token feeding would store.

At a grid point the rule scores the slots (rules read ``xp = mlx.core``), the ``block`` lowest
unprotected scores go (``select``: one argpartition over (float32 score bits, position) keys,
so exact ties go to the oldest), and at most ``block`` rows move down (``moves``), all lazily.
Scores are float32 of float16 rows where the reference's are float64 of the same rows: two
candidates whose scores are within ``RTOL`` (relative) may be ranked the other way, and two
whose float32 attention flushes to 0 (under 1.2e-38: keys a query all but ignores) tie, and the
oldest goes.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import numpy as np

from . import device_proxy
from .device_proxy import TOP_BITS  # above every float32's bits (NaN included)
from .rules import make_rule, pin_scorer
from .storage import capacity
from .unpinned import Unpinned, follows

RTOL = 2.0**-9  # two float16 ulps: rows rounded from float32 instead of float64 (+ value norms)
PIN_BIT = mx.array(0x80000000, mx.uint32)  # a pinned slot: above every score >= 0
SHIFT = mx.array(32, mx.uint64)


def next_eviction(config, t: int) -> int:
    """The first eviction point (budget, budget + block, ...) at or after position t."""
    budget, block = config.budget, config.block
    return budget + (t > budget) * -(-(t - budget) // block) * block


def norms16(values) -> mx.array:
    """(R, k) float16 norms of values (R, k, Dv): float32, capped at 65504."""
    v = values.astype(mx.float32)
    return mx.minimum(mx.sqrt((v * v).sum(axis=-1)), 65504.0).astype(mx.float16)


_norms16 = mx.compile(norms16, shapeless=True)
_LOWEST: dict = {}


def _lowest(block: int, weighted: bool, pinned: bool):
    """Compiled: the ``block`` lowest (score [x value norm], position) keys per row among the
    slots whose positions are in [bounds[0], bounds[1]] (the unprotected ones); with
    ``pinned`` a (R, n) mask, pinned slots rank after every unpinned one (``core.pins``)."""
    if (block, weighted, pinned) not in _LOWEST:

        def lowest(scores, norms, pos, bounds, pins=None):
            if weighted:
                scores = scores * norms.astype(mx.float32)
            protected = (pos < bounds[0]) | (pos > bounds[1])
            bits = mx.maximum(scores, 0.0).view(mx.uint32)  # < 2**31: the top bit is free
            if pinned:
                bits = mx.where(pins, bits | PIN_BIT, bits)
            bits = mx.where(protected, TOP_BITS, bits)
            key = (bits.astype(mx.uint64) << SHIFT) | pos.astype(mx.uint64)
            if block == 1:
                return mx.argmin(key, axis=1, keepdims=True)
            return mx.argpartition(key, block - 1, axis=1)[:, :block]

        _LOWEST[block, weighted, pinned] = mx.compile(lowest)
    return _LOWEST[block, weighted, pinned]


def moves(victims, n: int, block: int):
    """Row moves (src, dst), each (R, block), filling the victims' rows below the line
    ``n - block`` with the live rows above it."""
    if block == 1:
        return mx.full(victims.shape, n - 1, mx.uint32), victims
    above = mx.arange(n - block, n).astype(victims.dtype)
    dead = (victims[:, :, None] == above[None, None, :]).any(axis=1)  # (R, block)
    order = mx.argsort(dead.astype(mx.int32) * block + mx.arange(block), axis=1)
    return (order + (n - block)).astype(victims.dtype), mx.sort(victims, axis=1)


def widened(a, slots: int):
    """``a`` with ``slots`` slots on its last axis (zeros appended): ``full``'s growth."""
    return mx.concatenate([a, mx.zeros((*a.shape[:-1], slots - a.shape[-1]), a.dtype)], axis=-1)


def move(x, src, dst, axis: int):
    """x with the rows dst (along ``axis``) replaced by the rows src."""
    return mx.put_along_axis(x, dst, mx.take_along_axis(x, src, axis=axis), axis=axis)


@functools.cache
def _one_row(kind: str, decay: float):
    """``running_update``'s new scores for one token's row (R, n), compiled: one fused
    kernel a decode step instead of ~7 (shapeless: ``n`` grows until the cache is full)."""

    def new(old, row):
        row = mx.where(mx.isnan(row), 0.0, row)
        if kind == "sum":
            return (old + row).astype(old.dtype)
        if decay == 1.0:
            return mx.maximum(old, row).astype(old.dtype)
        return mx.maximum(old * decay, row.astype(mx.float32)).astype(old.dtype)

    return mx.compile(new, shapeless=True)


def running_update(acc, rows, n: int, k: int, kind: str, decay: float) -> None:
    """``acc[:, :n]`` (running scores) after k tokens' attention rows (R, k, n): h2o sums,
    peak keeps a running max (``decay``: max(d * peak, row) per token). Columns a row's
    tokens do not reach must carry zero rows (a batch: ``core.device_batch``). A NaN entry (a
    non-finite key or query) adds nothing, as in the reference, so the running scores do not
    depend on how the tokens were chunked."""
    old = acc[:, :n]
    if k == 1:  # a decode token
        acc[:, :n] = _one_row(kind, decay)(old, rows[:, 0])
        return
    rows = mx.where(mx.isnan(rows), 0.0, rows)
    if kind == "sum":
        new = old + (rows[:, 0] if k == 1 else rows.astype(mx.float32).sum(axis=1))
    elif decay == 1.0:
        new = mx.maximum(old, rows[:, 0] if k == 1 else rows.max(axis=1))
    else:  # max(d^k old, max_i d^(k-1-i) row_i): k steps of max(d * peak, row)
        powers = mx.array(decay ** np.arange(k - 1, -1, -1), mx.float32)
        rows = rows.astype(mx.float32) * powers[None, :, None]
        new = mx.maximum(old * (decay**k), rows.max(axis=1))
    acc[:, :n] = new.astype(acc.dtype)


class DeviceEngine:
    """Per-layer selection state on the device for B * H independent sequences."""

    xp, float = mx, mx.float32  # what rules read
    pins = None  # positions evicted last (core.pins.Pins), set by the cache
    proxy = None  # the compiled proxy step's state (core.device_proxy), built on first use
    key_bytes = 2  # bytes of a stored key element (set by the cache)
    ARRAYS = ("positions", "accumulated", "value_norms", "ring")

    def __init__(self, config, B: int, H: int, head_dim: int, real_queries: bool) -> None:
        self.config, self.rule = config, make_rule(config)
        self.pin_rule = pin_scorer(config)  # ranks pinned tokens among themselves (or None)
        self.B, self.H, self.rows, self.head_dim = B, H, B * H, head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim or head_dim)
        self.block = config.block
        self.real = bool(real_queries and self.rule.attention)
        self.running = self.rule.running  # the running score per slot: "sum", "peak" or None
        self.decay = self.rule.decay if self.running == "peak" else 1.0
        self.window_rule = self.rule.window_rows is not None  # what the rule reads
        self.newest_only = self.rule.window_rows == "newest"
        self.seen = self.slots = self.norms_from = 0
        self.due = False  # an eviction is due before the next token
        # recency: the unpinned stored positions, followed on the host (core.unpinned)
        self.unpinned = Unpinned() if follows(self.rule) else None
        self._keys = None  # float stored keys (R, n, D) while a proxy window is scored
        self.stored_keys = None  # () -> the float stored keys (R, >= slots, D); set by the cache
        R = self.rows
        cap = config.budget + 1 if self.rule.evicts else 0  # ``full`` grows (``reserve``)
        self.capacity = cap
        self.positions = mx.zeros((R, cap), mx.int32)
        exact16 = self.running == "peak" and self.decay == 1.0 and self.real
        acc = mx.float16 if exact16 else mx.float32
        self.accumulated = mx.zeros((R, cap), acc) if self.running else None
        self.value_norms = mx.zeros((R, cap), mx.float16) if config.morphkv_value else None
        self.ring_rows = 1 if self.newest_only else config.window
        ringed = self.window_rule and self.real
        self.ring = mx.zeros((R, self.ring_rows, cap), mx.float16) if ringed else None

    # ---- what rules read -----------------------------------------------------------------
    @property
    def kept(self) -> int:
        return self.slots - self.block if self.due else self.slots

    @property
    def stored_positions(self):
        return self.positions[:, : self.slots]

    def window_probs(self):
        if self.ring is not None:
            return self.ring[..., : self.slots]
        from .attention import proxy_window

        return proxy_window(self.slot_keys(), self.stored_positions, self.config.window,
                            self.scale)

    def window_mean(self):
        probs = self.window_probs()
        return probs.astype(mx.float32).sum(axis=1) / probs.shape[1]

    def newest_probs(self):
        if self.ring is not None:
            return self.ring[:, (self.seen - 1) % self.ring_rows, : self.slots]
        return self.window_probs()[:, -1]  # the newest key is the last of the window

    def slot_keys(self):
        """(rows, slots, D) the float stored keys in slot order (key-geometry rules read them)."""
        keys = self.stored_keys() if self._keys is None else self._keys
        return keys[:, : self.slots]

    @property
    def needs_rows(self) -> bool:
        """Does observing a piece read its attention rows?"""
        return bool(self.running or self.ring is not None)

    # ---- state ---------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        arrays = (getattr(self, n) for n in self.ARRAYS)
        held = sum(int(a.nbytes) for a in arrays if a is not None)
        return held + (self.proxy.nbytes if self.proxy else 0)

    def bound_nbytes(self) -> int | None:
        """Fixed-size arrays: the most ever held (the proxy step's state included); None
        for ``full`` (it grows)."""
        if not self.rule.evicts:
            return None
        return self.nbytes + (0 if self.proxy else device_proxy.bound_nbytes(self))

    def piece(self, remaining: int) -> int:
        """Tokens of the next piece: up to and including the next eviction point."""
        if not self.rule.evicts:
            return remaining
        return min(remaining, next_eviction(self.config, self.seen) - self.seen + 1)

    def reserve(self, n: int) -> None:
        """Room for ``n`` slots (``full`` only: an evicting rule never holds more than
        ``budget + 1``): the arrays grow by ``storage.capacity``'s rule."""
        if n <= self.capacity:
            return
        cap = capacity(n, self.config, False)
        for name in self.ARRAYS:
            a = getattr(self, name)
            if a is not None:
                setattr(self, name, widened(a, cap))
        self.capacity = cap

    # ---- feeding -------------------------------------------------------------------------
    def fill_norms(self, values) -> None:
        """Value norms of the slots that have none yet (``norms_from`` on: the tokens since
        the last eviction, contiguous), from ``values(start, end)`` -> (R, end - start, Dv)
        float: once per eviction block, not per token."""
        if self.value_norms is None or self.norms_from >= self.slots:
            return
        start, end = self.norms_from, self.slots
        self.value_norms[:, start:end] = _norms16(values(start, end))
        self.norms_from = end

    def observe(self, k: int, rows=None) -> None:
        """k tokens written at rows [slots, slots + k) of the storage; ``rows`` (R, k, n)
        float32 their attention rows over the n = slots + k stored rows (when
        ``needs_rows``). Their value norms wait for ``fill_norms``."""
        n0, n, t0 = self.slots, self.slots + k, self.seen
        self.reserve(n)
        self.proxy = None  # another path changes the storage: rebuilt when next needed
        self.positions[:, n0:n] = t0 if k == 1 else mx.arange(t0, t0 + k, dtype=mx.int32)
        if self.real and rows is not None:
            rows = rows.astype(mx.float16)  # the reference's rounding
            if self.running == "sum":
                rows = rows.astype(mx.float32)  # (float16 rows summed in float32)
        if self.ring is not None:
            self._ring(rows, t0, k, n)
        if self.running:
            self._running(rows, n0, n, k)
        self.seen, self.slots = t0 + k, n
        self.due = self.rule.evicts and n > self.config.budget
        if self.unpinned is not None:
            self.unpinned = self.unpinned.arrived(t0, k, self.pins)

    def _ring(self, rows, t0: int, k: int, n: int) -> None:
        W = self.ring_rows
        m = min(k, W)
        last = rows[:, k - m :]
        first = (t0 + k - m) % W
        head = min(m, W - first)
        self.ring[:, first : first + head, :n] = last[:, :head]
        if head < m:
            self.ring[:, : m - head, :n] = last[:, head:]

    def _running(self, rows, n0: int, n: int, k: int) -> None:
        """The rows [n0, n) start at 0: never written yet, or cleared by ``evict``."""
        running_update(self.accumulated, rows, n, k, self.running, self.decay)

    # ---- selection -----------------------------------------------------------------------
    def unpinned_victims(self):
        """The due eviction's victims by position when the mirror knows them all (the
        ``block`` oldest unpinned candidates: ``core.unpinned``), else None; the mirror
        follows the eviction either way."""
        if self.unpinned is None:
            return None
        c = self.config
        victims, self.unpinned = self.unpinned.due(c.n_sink, self.seen - 1 - c.recent,
                                                   self.block)
        return victims if len(victims) == self.block else None

    def select(self, keys=None):
        """(R, block) uint32 slots to evict: the lowest (score, position) keys among the
        unprotected slots. ``keys``: the stored keys (R, n, D) float, for proxy windows."""
        c, n = self.config, self.slots
        victims = self.unpinned_victims()
        if victims is not None:  # known by position: find their slots
            if len(victims) == 1:  # one position: a scalar compare
                return mx.argmax(self.stored_positions == victims[0], axis=1, keepdims=True)
            wanted = mx.array(np.array(victims, np.int32))
            return mx.argmax(self.stored_positions[:, :, None] == wanted, axis=1)
        self._keys = keys
        pos = self.stored_positions
        pinned = self.pins.device(pos) if self.pins else None
        try:
            scores = self.rule.score(self).astype(mx.float32)
            if pinned is not None and self.pin_rule is not None:
                scores = mx.where(pinned, self.pin_rule.score(self).astype(mx.float32), scores)
        finally:
            self._keys = None
        norms = None if self.value_norms is None else self.value_norms[:, :n]
        bounds = mx.array([c.n_sink, self.seen - 1 - c.recent], mx.int32)
        if pinned is not None:
            return _lowest(self.block, norms is not None, True)(scores, norms, pos, bounds, pinned)
        return _lowest(self.block, norms is not None, False)(scores, norms, pos, bounds)

    def replace(self):
        """Block 1 for a rule that keeps positions only (``device_schedule.fits``): the due
        eviction and the next token at once: returns the (R, 1) victim slots the token takes
        (the storage writes it there) and records it; the slots stay ``budget + 1``, so no
        row moves."""
        slot = self.select()
        self.positions = mx.put_along_axis(
            self.positions, slot, mx.full(slot.shape, self.seen, mx.int32), axis=1)
        if self.unpinned is not None:
            self.unpinned = self.unpinned.arrived(self.seen, 1, self.pins)
        self.seen += 1
        return slot

    def evict(self, keys=None, values=None):
        """The due eviction: returns (src, dst) (R, block) row moves for the storage, the
        engine's own arrays already moved. ``values(start, end)``: stored values rows, for
        the value norms (``fill_norms``)."""
        self.fill_norms(values)
        n, block, self.proxy = self.slots, self.block, None  # (rows move: proxy state stale)
        src, dst = moves(self.select(keys), n, block)
        self.positions = move(self.positions, src, dst, 1)
        for name in ("accumulated", "value_norms"):
            if getattr(self, name) is not None:
                setattr(self, name, move(getattr(self, name), src, dst, 1))
        if self.accumulated is not None:  # the freed rows: new tokens' scores start at 0
            self.accumulated[:, n - block : n] = 0
        if self.ring is not None:
            self.ring = move(self.ring, src[:, None], dst[:, None], 2)
        self.slots, self.due = n - block, False
        self.norms_from = min(self.norms_from, self.slots)
        return src, dst
