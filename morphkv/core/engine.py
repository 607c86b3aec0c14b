"""The selection engine: which stored slots each rule evicts, in blocks.

It works over every (batch row, KV head) pair at once. The live slots are always the first
``slots`` rows of the cache's storage; a token is appended at row ``slots``. Once ``budget``
tokens are stored, the next token (absolute positions ``budget``, ``budget + block``, ...,
counting from 0) evicts the ``block`` lowest-scoring unprotected tokens at once (``select``)
and at most ``block`` live rows move down into the freed rows (``kernels.moves``; the cache moves
its storage alike), so the next ``block - 1`` tokens are appended again. At most ``budget``
tokens are stored after any update (``budget + 1`` while the evicting token's query attends).
``block = 1`` is the per-token rule.

Between evictions a token costs its position and a reference to its query (``pending``). At an
eviction (and on the same grid of absolute positions before the budget fills: ``at_grid``) the
pending queries' rows come from one batched product with the stored keys (``morphkv.core.rows``),
each query masked to the keys present at its arrival; they feed the window, the running scores
(h2o: a sum; peak: a running, optionally decaying, max). The batches are the same for any
chunking, so any chunking makes the decisions of token-by-token feeding with the same block.

Tie rules: scores are float64 (sums of float16 rows are exact; products of float32 inputs are
exact in float64; float32 decides nothing on the host). Scores within ``TIE_RTOL`` (relative) of
the lowest count as tied and the oldest position goes; a block is ``block`` successive picks.
"""

from __future__ import annotations

import math

import numpy as np

from . import blocks, kernels, storage
from .blocks import concat, cutter, nbytes_of, norms_of, running_kind
from .config import KVCacheConfig
from .host_blas import one_blas_thread
from .pins import host_select
from .rows import causal_rows, proxy_rows
from .rules import make_rule, pin_scorer

TOP = float(np.finfo(np.float64).max)
NO_NORMS = np.zeros((0, 0), np.float16)


def at_grid(config: KVCacheConfig, t):
    """Is position t (or each of an array of them) one where pending tokens are settled:
    budget, budget +- block, ... (every eviction point, and the same grid before the budget
    fills). Settling at fixed absolute positions makes every batch of rows the same for any
    chunking."""
    return (t - config.budget) % config.block == 0


def next_eviction(config: KVCacheConfig, t):
    """The first eviction point (budget, budget + block, ...) at or after position t (or each
    of an array of them)."""
    budget, block = config.budget, config.block
    return budget + (t > budget) * -(-(t - budget) // block) * block


class Engine:
    """Per-layer selection state for ``rows`` = batch * KV heads independent sequences."""

    ARRAYS = ("positions", "accumulated", "value_norms", "ring")
    xp, float, top = np, np.float64, TOP  # what rules read
    pins = None  # positions evicted last (core.pins.Pins), set by the cache

    def __init__(self, config: KVCacheConfig, rows: int, head_dim: int, real_queries: bool) -> None:
        self.config = config
        self.rule = make_rule(config)
        self.pin_rule = pin_scorer(config)  # ranks pinned tokens among themselves (or None)
        self.rows = rows
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim or head_dim)  # the hook sets the model's
        self.block = config.block
        self.real = bool(real_queries and self.rule.attention)
        self.running, self.decay = running_kind(self.rule)
        self.window_rule = self.rule.window_rows is not None  # what the rule reads
        self.reads = 1 if self.rule.window_rows == "newest" else config.window
        self.seen = 0  # tokens fed; the next token's absolute position
        self.slots = 0  # live slots: rows [0, slots) of the storage
        self.capacity = 0
        self.finite = True  # no NaN/inf key or query seen yet: logits need no cleaning
        self.checked = 0  # slots below this were checked for NaN/inf keys
        self.pending: list = []  # queries (B, n_heads, c, D) of tokens without rows yet
        self.pending_count = 0
        self.queries_held = 0  # pending queries kept (the rows something reads)
        self.query_bytes = 0  # bytes of one token's pending query (for the bound)
        self.norms_from = 0  # first slot whose value norm is not computed yet
        self._keys = None  # the stored keys while scores are computed (proxy rows read them)
        self.stored_keys = None  # () -> the stored keys (rows, >= slots, D); set by the cache
        self.positions = np.zeros((rows, 0), np.int32)
        # a running max of float16 rows is a float16 value: stored as such (exact)
        exact16 = self.running == "peak" and self.decay == 1.0 and self.real
        acc = np.float16 if exact16 else np.float64
        self.accumulated = np.zeros((rows, 0), acc) if self.running else None
        self.value_norms = np.zeros((rows, 0), np.float16) if config.morphkv_value else None
        # the window's rows: kept in a ring across evictions only when a block is shorter
        # than the rows read (else all of them are computed at the eviction itself)
        ringed = self.window_rule and self.real and self.reads > self.block
        self.ring = np.zeros((rows, config.window, 0), np.float16) if ringed else None
        self._window = None  # (rows, reads, slots) the window's rows during a ringless eviction

    # ---- what rules read -----------------------------------------------------------------
    @property
    def kept(self) -> int:
        return self.slots

    @property
    def stored_positions(self):
        """(rows, slots) absolute position held by each slot."""
        return self.positions[:, : self.slots]

    def window_probs(self):
        """(rows, window, slots) attention rows of the last ``window`` tokens."""
        if self.ring is not None:
            return self.ring[..., : self.slots]
        if self.real:
            return self._window[..., : self.slots]
        keys = self.slot_keys()
        return proxy_rows(keys, self.stored_positions, self.config.window, self.scale,
                          self.finite, TOP)

    def window_mean(self):
        """(rows, slots) mean of the window's rows (float16 sums are exact in float64)."""
        probs = self.window_probs()
        if probs.dtype != np.float16:
            return probs.sum(axis=1, dtype=np.float64) / probs.shape[1]
        out = np.empty((probs.shape[0], probs.shape[2]))
        kernels.half_mean(probs.view(np.uint16), out)  # (a view of the ring: not copied)
        return out

    def newest_probs(self):
        """(rows, slots) attention of the newest token."""
        if self.ring is not None:
            return self.ring[:, (self.seen - 1) % self.config.window, : self.slots]
        if self.real:
            return self._window[:, -1, : self.slots]
        keys = self.slot_keys()
        return proxy_rows(keys, self.stored_positions, 1, self.scale, self.finite, TOP)[:, 0]

    def slot_keys(self):
        """(rows, slots, D) the stored keys in slot order (proxy rows and key-geometry rules)."""
        keys = self.stored_keys() if self._keys is None else self._keys
        return keys[:, : self.slots]

    # ---- state ---------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the selection state, pending queries included."""
        state = sum(int(getattr(getattr(self, n), "nbytes", 0)) for n in self.ARRAYS)
        return state + self.queries_held * self.query_bytes

    def bound_nbytes(self, query_bytes: int | None = None) -> int | None:
        """Bytes of this engine's state at most (None: never bounded): ``budget + 1`` slots of
        per-slot state, plus the pending queries: ``block`` of them for running scores, at
        most ``min(block, window)`` otherwise (``query_bytes`` per token: this engine's, once
        it has seen one)."""
        if not self.rule.evicts:
            return None
        n = self.config.budget + 1
        per_slot = 4 + 2 * (self.value_norms is not None)
        per_slot += 0 if self.accumulated is None else self.accumulated.itemsize
        per_slot += 2 * self.config.window * (self.ring is not None)
        per_query = self.query_bytes if query_bytes is None else query_bytes
        held = self.block if self.running else min(self.block, self.reads)
        return self.rows * n * per_slot + held * per_query * self.real

    def reserve(self, slots: int) -> None:
        """Widen the slot arrays to hold ``slots`` (as the storage grows: ``storage.capacity``)."""
        if slots <= self.capacity:
            return
        capacity = storage.capacity(slots, self.config, self.rule.evicts)
        pad = capacity - self.capacity
        self.positions = np.pad(self.positions, [(0, 0), (0, pad)])
        for name in ("accumulated", "value_norms"):
            if getattr(self, name) is not None:
                setattr(self, name, np.pad(getattr(self, name), [(0, 0), (0, pad)]))
        if self.ring is not None:
            self.ring = np.pad(self.ring, [(0, 0), (0, 0), (0, pad)])
        self.capacity = capacity

    # ---- feeding -------------------------------------------------------------------------
    def _arrive(self, count: int, queries) -> None:
        """``count`` tokens appended at rows [slots, slots + count); their queries (B, n_heads,
        count, D) as the cache holds them (kept, not read)."""
        self.reserve(self.slots + count)
        s, first = self.slots, self.seen
        if count == 1:
            self.positions[:, s] = first
        else:
            self.positions[:, s : s + count] = first + np.arange(count, dtype=np.int32)
        self.slots += count
        self.seen += count
        self.pending_count += count
        if self.real:  # only the queries whose rows something reads (a suffix: see needed)
            self.query_bytes = self.query_bytes or nbytes_of(queries) // count
            if count == 1:
                if self.needed(first):
                    self.pending.append(queries)
                    self.queries_held += 1
                return
            need = self.needed(first + np.arange(count))
            if need.any():
                j = int(np.argmax(need))
                self.pending.append(queries if j == 0 else queries[:, :, j:])
                self.queries_held += count - j

    @property
    def over(self) -> bool:
        return self.rule.evicts and self.slots > self.config.budget

    def decode(self, queries) -> bool:
        """One token (already written at row ``slots`` of the storage): its queries (B,
        n_heads, 1, D) as given (MLX or NumPy; kept, not read). Returns True when
        ``settle(stored keys)`` must run before the next token (an eviction is due, or the
        token is on the settling grid with rows something reads)."""
        self._arrive(1, queries)
        if self.over:
            return True
        if not at_grid(self.config, self.seen - 1):
            return False
        if self.running or self.queries_held:
            return True  # rows to compute: the stored keys are needed
        self._flush(None)  # nothing to compute: no keys read
        return False

    def settle(self, keys, values=None):
        """Rows of the pending tokens from the stored keys (rows, >= slots, D) in slot order
        (and value norms from the stored values, with ``morphkv_value``); an eviction if one
        is due. Returns the row moves (src, dst), each (rows, block), that the storage must
        apply, or None."""
        self.fill_norms(values)
        self._flush(keys)  # (its BLAS products run on one thread: rows.logits_of)
        if not self.over:
            return None
        _, src, dst = self._evict(keys)
        return src, dst

    def fill_norms(self, values) -> None:
        """Value norms of the slots that have none yet, from the stored values (rows, >=
        slots, Dv) host (float32 norms, stored as float16; NaN counts 0)."""
        if self.value_norms is None or self.norms_from >= self.slots:
            return
        s0, n = self.norms_from, self.slots
        self.value_norms[:, s0:n] = norms_of(values[:, s0:n])
        self.norms_from = n

    def feed_chunk(self, keys, queries, values, stored, stored_values=None):
        self.fill_norms(stored_values)
        with one_blas_thread():
            return self._feed_chunk(keys, queries, values, stored)

    def _feed_chunk(self, keys, queries, values, stored):
        """A chunk of C > 1 tokens: keys (rows, C, D), queries (B, n_heads, C, D) or None,
        values (rows, C, Dv) or None, ``stored`` (rows, >= slots, D) the keys stored before it
        (all host arrays). The cache returned [the ``slots`` stored rows + the C chunk rows]
        ("fetched" rows). Returns (source (rows, slots): the fetched row now in each slot,
        evicted (rows, slots_before + C): the chunk step at which each fetched row was
        evicted, C if it was not)."""
        R, C, D = keys.shape
        cut = cutter(queries)
        norms = None if self.value_norms is None else norms_of(values)
        before = self.slots
        width = before + C if not self.rule.evicts else min(before + C, self.config.budget + 1)
        slot_keys = np.empty((R, width, D), keys.dtype)
        slot_keys[:, :before] = stored[:, :before]
        source = np.zeros((R, width), np.int64)
        source[:, :before] = np.arange(before)
        evicted = np.full((R, before + C), C, np.int64)
        r = np.arange(R)[:, None]
        i = 0
        while i < C:
            k = min(C - i, (self.config.budget - self.seen) % self.block + 1)  # to the grid
            quiet = self._quiet()  # the grid points up to there settle nothing: one step
            if quiet >= k:
                k += (min(quiet, C - i) - k) // self.block * self.block
            s = self.slots
            source[:, s : s + k] = before + i + np.arange(k)
            slot_keys[:, s : s + k] = keys[:, i : i + k]
            self._arrive(k, cut(i, i + k))
            if norms is not None:
                self.value_norms[:, s : s + k] = norms[:, i : i + k]
                self.norms_from = self.slots
            i += k
            if not at_grid(self.config, self.seen - 1):
                continue  # the chunk ends before the grid: its last tokens stay pending
            self._flush(slot_keys)
            if self.over:
                victims, src, dst = self._evict(slot_keys)
                evicted[r, source[r, victims]] = i - 1
                source[r, dst] = source[r, src]
                slot_keys[r, dst] = slot_keys[r, src]
        self.pending = [np.array(q) for q in self.pending]
        return source[:, : self.slots], evicted  # the pending slices copied: the chunk goes

    def _quiet(self) -> int:
        """How many tokens from the next one on arrive before the budget with no row anything
        reads (settling them only drops them; none evicts). 0 with running scores."""
        if self.running:
            return 0
        if not self.rule.evicts:
            return 1 << 62
        first = self.config.budget  # the first position that evicts
        if self.window_rule and self.real:
            first -= self.reads - 1  # the first row the first eviction reads
        return max(first - self.seen, 0)

    # ---- rows, scores, eviction ----------------------------------------------------------
    def needed(self, t):
        """Has the token at position t (or each of an array of positions) a row anything reads:
        every row for running scores, for window rules the rows an eviction's window reads."""
        if self.running or not (self.window_rule and self.real):
            kept = self.running is not None
            return np.full(len(t), kept) if isinstance(t, np.ndarray) else kept
        return next_eviction(self.config, t) <= t + self.reads - 1

    def pending_queries(self, pending=None):
        """Host (B, n_heads, P, D) queries of the pending tokens (real queries only)."""
        return concat([storage.to_numpy(q) for q in (self.pending if pending is None else pending)])

    def _flush(self, keys) -> None:
        """Turn the pending tokens into rows and running scores."""
        P = self.pending_count
        if P == 0:
            return
        n, first = self.slots, self.seen - P
        s0 = n - P
        pending, self.pending, self.pending_count = self.pending, [], 0
        self.queries_held = 0
        need = np.arange(P) if self.running else np.nonzero(self.needed(first + np.arange(P)))[0]
        if need.size == 0:
            return
        keys = keys[:, :n]
        if self.real:
            q = self.pending_queries(pending)  # (B, n_heads, needed, D): the last P - need[0]
            B, K, D = q.shape[0], q.shape[2], q.shape[-1]
            H = self.rows // B
            q = q.reshape(B, H, -1, K, D).transpose(0, 1, 3, 2, 4).reshape(self.rows, K, -1, D)
        else:
            q = keys[:, s0 + need, None]
        if self.finite:  # the keys up to ``checked`` were checked at an earlier settle
            self.finite = blocks.finite(q) and blocks.finite(keys[:, self.checked :])
        self.checked = n
        rows = causal_rows(q, keys, s0 + need, self.scale, self.finite, TOP, self.real)
        if self.ring is not None:
            last = need[-self.config.window :]
            self.ring[:, (first + last) % self.config.window, :n] = rows[:, -last.size :]
        elif self.window_rule and self.real:
            self._window = rows[:, -self.reads :]  # all the window's rows: see _needed
        if self.running:
            blocks.update_running(self.accumulated, self.running, self.decay, rows, s0, n)

    def _evict(self, keys):
        """Pick ``block`` victims per row and compact; returns (victims, src, dst)."""
        self._keys = keys
        try:
            victims = self.select()
        finally:
            self._keys = self._window = None
        src, dst = np.empty_like(victims), np.empty_like(victims)
        kernels.moves(victims, self.slots, src, dst)
        r = np.arange(self.rows)[:, None]
        self.positions[r, dst] = self.positions[r, src]
        for name in ("accumulated", "value_norms"):
            a = getattr(self, name)
            if a is not None:
                a[r, dst] = a[r, src]
        if self.ring is not None:
            self.ring[r, :, dst] = self.ring[r, :, src]
        self.slots -= self.block
        self.norms_from = self.slots
        self.checked = min(self.checked, self.slots)
        return victims, src, dst

    def select(self):
        """(rows, block) slots to evict: lowest scores among unprotected slots, ties to the
        oldest, picked ``block`` times. Scores are >= 0."""
        c = self.config
        positions = self.stored_positions
        with np.errstate(invalid="ignore", over="ignore"):
            scores = np.asarray(self.rule.score(self), np.float64)
        norms = NO_NORMS if self.value_norms is None else self.value_norms[:, : self.slots]
        out = np.empty((self.rows, self.block), np.int64)
        last = self.seen - 1 - c.recent
        bits = norms.view(np.uint16)
        if self.pins:  # pinned slots go last (core.pins), ranked by pin_rule if one
            rule = self.pin_rule
            ranked = None if rule is None else lambda: np.asarray(rule.score(self), np.float64)
            host_select(scores, bits, positions, c.n_sink, last, self.block, self.pins, out,
                        ranked)
            return out
        # protected: the sinks and the last ``recent`` positions; scores times the value norms
        kernels.select(scores, bits, positions, c.n_sink, last, self.block, out)
        return out
