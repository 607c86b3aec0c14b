"""The selection engine: decides, token by token, which stored slot each rule evicts.

It works over every (batch row, KV head) pair at once. Slots are the rows of the cache's
storage: a new token is written into the slot evicted one step earlier (the "dead" slot), or
appended while the cache is below its budget, so the engine's slot layout is the storage
layout. A chunk of tokens is processed with the same per-token steps as single tokens, so any
chunking of a stream makes identical decisions.

The engine keeps no copy of the stored keys: its state is the position of every slot, the
attention rows of the last ``window`` tokens (``morphkv.core.rows``) for attention rules, and a
running score per slot for h2o and the peak rules. Logits are computed when a token arrives,
from the keys as stored (read through a zero-copy host view on the CPU), as float64 dot
products (exact products, so the order of summation does not change a decision in practice),
scaled by the model's attention scale. A chunk's logits come from one matmul per block of queries.

Arrays live in NumPy on the host (the default), or in ``mlx.core`` for single-token decode steps
on a GPU, where the host must not wait for the device; ``to(xp)`` moves the state.

On the host, the rules ``morphkv.core.fused.fused_code`` knows (recency, morphkv mean/max,
tova, h2o, peak, and the peak fusion of morphkv/tova) with real-query rows or none run through
compiled kernels (``morphkv.core.fused``):
one call per decode step, one per block of a chunk, the same state and decisions. Any other
rule (random, proxy rows, a new rule) runs the generic path below, its own ``score()`` in
NumPy. A new rule joins the fast path with a code in ``kernels`` (a branch of ``_select`` for
its score, of ``_observe`` for its running state) and a line in ``fused_code``; the test in
``tests/test_kernels.py`` then holds it to its ``score()``.
"""

from __future__ import annotations

import contextlib
import math

import mlx.core as mx
import numpy as np

from .config import KVCacheConfig
from .fused import Fused, fused_code
from .host_blas import one_blas_thread
from .rows import CausalRows, ProxyRows
from .rules import make_rule

TIE_RTOL = 1e-9  # scores this close (relative) to the minimum count as tied; oldest goes
BLOCK = 64  # queries per logits matmul inside a chunk
HOST_DTYPES = {  # float arrays come back from the device (float32) in these dtypes
    "accumulated": np.float64,
    "value_norms": np.float16,
    "ring": np.float16,
    "ring_weights": np.float64,
    "ring_shift": np.float64,
    "ring_total": np.float64,
}


def _errors_ignored(finite: bool):
    """NumPy's floating-point warnings off where non-finite logits may occur."""
    return contextlib.nullcontext() if finite else np.errstate(invalid="ignore", over="ignore")


def _array_module(xp) -> tuple:
    """(float dtype, int dtype, largest int, largest safe exponent, largest float) of ``xp``."""
    if xp is np:
        return np.float64, np.int32, np.iinfo(np.int32).max, 700.0, float(np.finfo(np.float64).max)
    return mx.float32, mx.int32, np.iinfo(np.int32).max, 80.0, float(np.finfo(np.float32).max)


class Engine:
    """Per-layer selection state for ``rows`` = batch * KV heads independent sequences."""

    ARRAYS = ("positions", "accumulated", "value_norms", "dead", "row_index")
    kernels = True  # False: every rule through its own score() (tests hold the kernels to it)

    def __init__(self, config: KVCacheConfig, rows: int, head_dim: int, real_queries: bool) -> None:
        self.config = config
        self.rule = make_rule(config)
        self.rows = rows
        self.head_dim = head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim or head_dim)  # the hook sets the model's
        self.on_device = False
        self.float, self.int, self.no_position, self.max_exponent, self.top = _array_module(np)
        self.seen = 0  # tokens fed; the next token's absolute position
        self.slots = 0  # slots in use, the dead one included
        self.dead = None  # (rows,) slot evicted by the last step, or None
        self.finite = True  # no NaN/inf key or query seen yet: logits need no cleaning
        self.head = -1  # ring row of the newest token
        self.capacity = 0
        self.row_index = np.arange(rows)
        self.positions = np.zeros((rows, 0), np.int32)
        self.accumulated = np.zeros((rows, 0)) if self.rule.observes else None
        self.value_norms = np.zeros((rows, 0), np.float16) if config.morphkv_value else None
        self.attention = None
        if self.rule.attention:
            self.attention = (CausalRows if real_queries else ProxyRows)(self)
        code = fused_code(self.rule)
        fusable = self.kernels and code is not None and not isinstance(self.attention, ProxyRows)
        self.fused = Fused(self, code) if fusable else None  # None: the rule's own score()

    @property
    def xp(self):
        return mx if self.on_device else np

    def _arrays(self):
        yield self, self.ARRAYS
        if self.attention is not None:
            yield self.attention, self.attention.ARRAYS

    def to(self, xp) -> Engine:
        """Move every array to array module ``xp`` (numpy or mlx.core); returns self."""
        if (xp is mx) == self.on_device:
            return self
        self.float, self.int, self.no_position, self.max_exponent, self.top = _array_module(xp)
        for owner, names in self._arrays():
            for name in names:
                a = getattr(owner, name)
                if a is None:
                    continue
                if xp is np:
                    a = np.array(a)
                    a = a.astype(HOST_DTYPES.get(name, a.dtype), copy=False)
                else:
                    a = mx.array(a.astype(np.float32) if a.dtype == np.float64 else a)
                setattr(owner, name, a)
        self.on_device = xp is mx
        if xp is not np:
            self.finite = False  # the device cannot promise finiteness without a sync
        return self

    @property
    def nbytes(self) -> int:
        return sum(
            int(getattr(getattr(owner, name), "nbytes", 0))
            for owner, names in self._arrays()
            for name in names
            if name not in ("row_index", "dead")
        )

    def bound_nbytes(self) -> int | None:
        """Bytes of this engine's state once its budget is reached (None: never bounded),
        measured on a fresh engine fed ``budget + 1`` tokens."""
        if not self.rule.evicts:
            return None
        real = isinstance(self.attention, CausalRows)
        probe = Engine(self.config, self.rows, self.head_dim, real)
        zeros = np.zeros((self.rows, self.config.budget + 1, self.head_dim), np.float32)
        probe.feed(zeros, None, zeros[:, :0], zeros)
        return probe.nbytes

    # ---- what rules read -----------------------------------------------------------------
    @property
    def kept(self) -> int:
        """Live tokens per row (slots minus the dead one)."""
        return self.slots - (self.dead is not None)

    @property
    def stored_positions(self):
        """(rows, slots) absolute position held by each slot."""
        return self.positions[:, : self.slots]

    def window_probs(self):
        return self.attention.window_probs()

    def newest_probs(self):
        return self.attention.newest_probs()

    def window_mean(self):
        return self.attention.window_mean()

    # ---- feeding -------------------------------------------------------------------------
    def _next_capacity(self, capacity: int, needed: int) -> int:
        limit = self.config.budget + 1 if self.rule.evicts else needed
        return max(needed, min(max(2 * capacity, 64), limit))

    def _grow(self, needed: int) -> None:
        """Widen the slot arrays (below the budget only: at the budget slots are reused)."""
        self._widen(self._next_capacity(self.capacity, needed))

    def _grow_like_steps(self, slots: int) -> None:
        """The capacity token-by-token steps reach at ``slots`` slots, in one widening."""
        capacity = self.capacity
        while capacity < slots:
            capacity = self._next_capacity(capacity, capacity + 1)
        if capacity > self.capacity:
            self._widen(capacity)

    def _widen(self, capacity: int) -> None:
        pad, xp = capacity - self.capacity, self.xp
        self.positions = xp.pad(self.positions, [(0, 0), (0, pad)])
        if self.accumulated is not None:
            self.accumulated = xp.pad(self.accumulated, [(0, 0), (0, pad)])
        if self.value_norms is not None:
            self.value_norms = xp.pad(self.value_norms, [(0, 0), (0, pad)])
        if self.attention is not None:
            self.attention.widen(pad)
        self.capacity = capacity

    def _logits(self, queries, keys):
        """Scaled logits (rows, Q, G, N): float64 on the host (products of float32/float16
        values are exact in float64), float32 on the device. The scale multiplies the
        queries, the smaller operand."""
        R, Q, G, D = queries.shape
        dtype = np.float64 if self.xp is np else mx.float32
        queries = queries.astype(dtype).reshape(R, Q * G, D) * self.scale
        dots = queries @ keys.astype(dtype).transpose(0, 2, 1)
        return dots.reshape(R, Q, G, keys.shape[1])

    def feed(self, keys, queries, stored, values=None):
        """Feed a chunk: keys (rows, C, D) in stream order, queries (rows, C, G, D) (None:
        the keys stand in, one group), ``stored`` (rows, N, D): the cache's storage after this
        update's keys were placed (for one token it is the slot layout; for a chunk its first
        ``slots`` rows are the slots before the chunk), ``values`` (rows, C, Dv) (read only
        with ``morphkv_value``). Arrays of ``self.xp``. For a chunk (C > 1, on the host)
        returns (rows, C): the position each token's step evicted, -1 where none."""
        queries = keys[:, :, None] if queries is None else queries
        xp, C = self.xp, keys.shape[1]
        host = xp is np
        fused_step = C == 1 and host and self.fused is not None  # the kernel checks finiteness
        if host and self.finite and self.rule.attention and not fused_step:
            self.finite = bool(np.isfinite(keys).all() and np.isfinite(queries).all())
        norms = None
        if self.value_norms is not None:
            v = values.astype(np.float32) if host else values.astype(mx.float32)
            norms = xp.sqrt((v * v).sum(axis=-1))  # (rows, C), stored as float16
            norms = xp.minimum(xp.nan_to_num(norms, nan=0.0), 65504.0).astype(xp.float16)
        if fused_step:
            self.fused.decode(queries, stored, norms)
            return None
        if C == 1:  # a decode step: small arrays, no BLAS threads, nothing to report
            slot = self._place()
            logits = None
            if self.attention is not None:
                logits = self._logits(queries, stored[:, : self.slots])[:, 0]
            with _errors_ignored(self.finite):
                self._step(logits, slot, None if norms is None else norms[:, 0])
            return None
        evicted = np.full((self.rows, C), -1, np.int64)
        with one_blas_thread(), _errors_ignored(self.finite):
            if self.fused is not None:
                self.fused.chunk(keys, queries, stored, evicted, norms, BLOCK)
            else:
                self._feed_chunk(keys, queries, stored, evicted, norms)
        return evicted

    def _feed_chunk(self, keys, queries, stored, evicted, norms) -> None:
        """Token-by-token steps; logits from one matmul per block of ``BLOCK`` queries against
        [the slots' keys at the block's start + the block's keys], gathered into slot order."""
        R, C, D = keys.shape
        r = self.row_index
        slot_keys = None  # the slots' keys as the chunk fills them (attention rules only)
        if self.attention is not None:
            width = max(self.capacity, self.config.budget + 1, self.slots + C)
            slot_keys = np.zeros((R, width, D))
            slot_keys[:, : self.slots] = stored[:, : self.slots]
        needed = self._first_row_needed(C)
        for start in range(0, C, BLOCK):
            end = min(C, start + BLOCK)
            n0 = self.slots
            flat = None
            if self.attention is not None and end > needed:
                columns = np.concatenate([slot_keys[:, :n0], keys[:, start:end]], axis=1)
                logits = self._logits(queries[:, start:end], columns)  # (R, b, G, N)
                _, b, G, N = logits.shape
                flat = logits.reshape(-1)
                # flat index of (row r, step 0, head g, column of slot s); a step adds G * N
                index = (r[:, None] * (b * G) + np.arange(G)[None, :])[..., None] * N
                slot_column = np.zeros((R, self.capacity + end - start), np.int64)
                slot_column[:, :n0] = np.arange(n0)
            for i in range(start, end):
                slot = self._place()
                step_logits = None
                if slot_keys is not None:
                    slot_keys[r, slot] = keys[:, i]
                if flat is not None:
                    slot_column[r, slot] = n0 + i - start
                    if i >= needed:
                        at = index + slot_column[:, None, : self.slots] + (i - start) * G * N
                        step_logits = flat.take(at)
                self._step(step_logits, slot, None if norms is None else norms[:, i])
                if self.dead is not None:
                    evicted[:, i] = self.positions[r, self.dead]

    def _first_row_needed(self, C: int) -> int:
        """Index of the first token of a C-token chunk whose attention row can ever be read.
        Real-query rows are read only by evicting steps, from the last ``window`` rows: before
        the budget fills, only the rows of the last ``window`` steps before it matter (h2o and
        proxy rows need every step)."""
        if not isinstance(self.attention, CausalRows) or self.rule.observes:
            return 0
        first_evicting = 0 if self.dead is not None else self.config.budget - self.slots
        return max(0, min(first_evicting, C) - self.config.window + 1)

    def _place(self):
        """Slot of the next token: the dead one, else a new one."""
        if self.dead is not None:
            return self.dead
        if self.slots == self.capacity:
            self._grow(self.slots + 1)
        self.slots += 1
        return self.xp.full((self.rows,), self.slots - 1, dtype=self.int)

    def _step(self, logits, slot, norm=None) -> None:
        """The token placed in ``slot`` arrives: rows, scores, eviction."""
        r = self.row_index
        self.positions[r, slot] = self.seen
        if norm is not None:
            self.value_norms[r, slot] = norm
        if self.attention is not None:
            self.head = (self.head + 1) % self.config.window
            if logits is not None:  # None: a row no step will read (see _first_row_needed)
                self.attention.add(logits, slot, self.head)
        if self.accumulated is not None:
            self.accumulated[r, slot] = 0.0
        self.seen += 1
        self.rule.observe(self)
        over = self.rule.evicts and self.slots > self.config.budget
        self.dead = self._select() if over else None

    def _select(self):
        """Slot to evict per row: lowest score among unprotected slots, ties to the oldest.
        Scores are >= 0, so the relative tie tolerance needs no sign handling."""
        positions = self.stored_positions
        newest = self.seen - 1
        protected = (positions < self.config.n_sink) | (positions > newest - self.config.recent)
        xp = self.xp
        scores = self.rule.score(self)
        if self.value_norms is not None:
            scores = scores * self.value_norms[:, : self.slots]
        scores = xp.where(protected, np.inf, scores)
        tied = scores <= scores.min(axis=1, keepdims=True) * (1.0 + TIE_RTOL)
        return xp.where(tied, positions, self.no_position).argmin(axis=1).astype(self.int)


def warm_up() -> None:
    """Load (or compile, the first time on a machine) the kernels the host path uses: a tiny
    engine fed a chunk and single tokens, float32 and float16, real-query rows."""
    from .presets import recommended

    config = recommended(32)
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float16):
        engine = Engine(config, 1, 8, real_queries=True)
        keys = rng.standard_normal((1, 48, 8)).astype(dtype)
        queries = rng.standard_normal((1, 48, 2, 8)).astype(dtype)
        values = np.ones((1, 48, 8), dtype)
        engine.feed(keys[:, :40], queries[:, :40], keys[:, :40], values[:, :40])
        for t in range(40, 48):  # the stored keys: any (1, slots, 8) array will do here
            engine.feed(keys[:, t : t + 1], queries[:, t : t + 1], keys[:, :40], values[:, :1])
