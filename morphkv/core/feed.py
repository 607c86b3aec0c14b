"""The host path of every morphkv cache: its rows' engines, and how tokens reach them.

One feed serves ``MorphKVCache`` (one engine over all its batch rows: they advance together)
and ``BatchMorphKVCache`` (one engine per row: rows differ in length, so their eviction points
differ). Counters, one entry per engine: ``seen`` (tokens taken: the RoPE position), ``stored``
(slots holding its tokens, waiting ones included), ``waiting`` (decode tokens written to the
storage but not yet handed to the engine; their queries are the last ``waiting`` entries of
``steps``), ``lead`` (left-padding columns still to skip) and, during a right-padded prompt,
``_remaining`` (real tokens left).

A decode step writes every row's token at its next slot (``storage.write``) and keeps the
step's queries (one reference): nothing per row runs. A row's waiting tokens are handed to its
engine token by token (``Engine.decode``, then ``Engine.settle`` when it asks) once its newest
token is on the engine's grid (``engine.at_grid``), or when the cache is read, a chunk comes or
the row leaves; the storage is read on the host once for all those rows and their slot moves
are applied together. A multi-token chunk goes through ``Engine.feed_chunk`` per engine (at
once by the attention hook when the chunk evicts or is long, for its liveness mask; else at the
next update or read) and the storage is gathered once. So every row keeps exactly what
token-by-token feeding of its own tokens keeps.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import quant, storage
from .engine import Engine, at_grid
from .masks import Chunk, causal_mask, chunk_mask, decode_mask
from .pins import Pins
from .queries import hooks_attached
from .rules import make_rule

DEFER_TOKENS = 64  # a chunk this short that evicts nothing is fed at the next update
PIN_AFTER = 2  # pin="prompt": one-token updates after a multi-token one that are pinned too


class Feed:
    """Engines, counters and storage of the host path (see the module docstring)."""

    def init_feed(self, config, engines: int, per: int | None) -> None:
        """``engines`` engines of ``per`` batch rows each (None: known at the first update)."""
        self.config = config
        self.evicts = make_rule(config).evicts
        self.per = per
        self.engines: list = [None] * engines
        # Python lists, not arrays: a decode step touches each once (NumPy costs ~1 us a call)
        self.seen, self.stored, self.waiting, self.lead = ([0] * engines for _ in range(4))
        self._remaining: list[int] | None = None
        self.steps: list[mx.array] = []  # each decode step's queries (B, n_heads, 1, D)
        self._queries_due = False  # a decode step waits for its queries
        self._chunk: Chunk | None = None  # the last multi-token update, until fed
        self._scale: float | None = None
        self._last = None  # the last decode step's tokens as stored (block 1 puts them)
        self._seal = None
        self.keys = self.values = None
        self.pins = Pins()  # positions evicted last (core.pins; the single cache's ``pin``)
        self.pin_prompts = config.pin == "prompt"  # the policy (KVCacheConfig.pin)
        self.pin_next = [0] * engines  # per engine: one-token updates still to pin (PIN_AFTER)

    @property
    def needs_queries(self) -> bool:
        return self.config.scoring == "attention"

    def span(self, i: int) -> slice:
        """The batch rows of engine i."""
        return slice(i * self.per, (i + 1) * self.per)

    def rows_of(self, x, i: int):
        """Engine i's rows of a host (B, H, N, D) array, as (rows, N, D)."""
        return None if x is None else x[self.span(i)].reshape(-1, *x.shape[2:])

    def key_reader(self):
        """What a new engine reads its stored keys through (the batch: only ``settle``)."""
        return no_reader

    def start_rows(self, rows, H: int, head_dim: int) -> None:
        """Engines for the rows that get their first tokens now."""
        for i in rows:
            if self.engines[i] is None:
                e = Engine(self.config, self.per * H, head_dim, self.needs_queries)
                e.stored_keys = self.key_reader()
                e.pins = self.pins_of(i)
                if self._scale is not None:
                    e.scale = self._scale
                self.engines[i] = e

    def pins_of(self, i: int) -> Pins:
        """The pins engine i ranks with (the single cache: one set for all its rows)."""
        return self.pins

    def pin_arrived(self, firsts, counts, C: int) -> None:
        """``pin="prompt"``: for an update of ``C`` columns in which engine i takes
        ``counts[i]`` tokens from position ``firsts[i]`` on, pin them if the update is a
        multi-token one, or one of the ``PIN_AFTER`` one-token updates right after one: mlx_lm
        feeds a prompt's last token alone, and its prefill can end in a one-token chunk (so a
        turn's first generated token is pinned too, at times). Called before the update is
        stored (positions may be pinned ahead), so the pins are there before any eviction
        that could take them. The callers skip it for a plain decode step (no row due)."""
        for i, n in enumerate(counts):
            if n and C > 1 and self.config.pin_replies:
                self.pin_reply(i, int(firsts[i]))
            if n and (C > 1 or self.pin_next[i]):
                self.pin_range(i, int(firsts[i]), int(firsts[i]) + int(n))  # the cache's
            if n:
                self.pin_next[i] = PIN_AFTER if C > 1 else max(0, self.pin_next[i] - 1)

    def pin_reply(self, i: int, first: int) -> None:
        """``pin_replies``: a prompt arrives at ``first`` in row i; the row's tokens since its
        last pinned range (the model's reply) are pinned if at most ``pin_replies``. Read from
        the pins alone: merged, extracted, saved and loaded rows keep the policy. ``pin_fit``:
        only while the pinned positions, the reply with them, fit in the budget."""
        pins = self.pins_of(i)
        ends = pins.ends[pins.ends <= first]
        n = first - int(ends.max()) if ends.size else 0
        if 0 < n <= self.config.pin_replies and not (
                self.config.pin_fit and len(pins) + n > self.config.budget):
            self.pin_range(i, int(ends.max()), first)

    def set_scale(self, scale: float) -> None:
        if scale != self._scale:
            self._scale = scale
            for e in self.engines:
                if e is not None:
                    e.scale = scale

    # ---- counters ---------------------------------------------------------------------------
    def plain_decode(self) -> bool:
        """A one-token update takes one token for every row (no padding to skip)."""
        return not any(self.lead) and (self._remaining is None or all(self._remaining))

    def due(self) -> list[int]:
        """Engines whose newest token is on their grid: they must see it before the next token
        (an eviction, or a flush of pending rows)."""
        seen, config = self.seen, self.config
        return [i for i, w in enumerate(self.waiting) if w and at_grid(config, seen[i] - 1)]

    def settled(self) -> list[int]:
        """Slots each engine holds once its waiting tokens are handed over (no sync)."""
        stored, budget = list(self.stored), self.config.budget
        for i in self.due() if self.evicts else ():
            stored[i] -= self.config.block if stored[i] > budget else 0
        return stored

    def chunk_waits(self, chunk: Chunk, C: int) -> bool:
        """May this chunk attend causally and reach the engines later (at the next update or
        read)? Yes when no row evicts inside it and it is short (its keys and queries are held
        until then: at most ``DEFER_TOKENS`` columns)."""
        if C > DEFER_TOKENS:
            return False
        if not self.evicts:
            return True
        return not ((chunk.before + chunk.counts > self.config.budget) & (chunk.counts > 0)).any()

    def spans(self, C: int) -> tuple[np.ndarray, np.ndarray]:
        """(first column, count) of each engine's real tokens in a chunk of C columns."""
        starts = np.minimum(np.array(self.lead, np.int64), C)
        counts = C - starts
        if self._remaining is not None:
            counts = np.clip(np.minimum(counts, self._remaining), 0, None)
        return starts, counts

    def reserve(self, slots: int, keys, values) -> None:
        """Storage for ``slots`` slots per row (created like the arriving, stored-form keys)."""
        if self.keys is None:
            cap = storage.capacity(slots, self.config, self.evicts)
            rows = self.per * len(self.engines)
            self.keys = storage.zeros(keys, rows, cap)
            self.values = storage.zeros(values, rows, cap)
        elif slots > quant.dims(self.keys)[2]:
            cap = storage.capacity(slots, self.config, self.evicts)
            self.keys, self.values = storage.grow(self.keys, cap), storage.grow(self.values, cap)

    def _trim_steps(self) -> None:
        """Forget the queries no row waits for."""
        keep = max(self.waiting, default=0)
        if len(self.steps) > keep:
            self.steps = self.steps[len(self.steps) - keep :] if keep else []

    def is_trimmable(self) -> bool:
        """False: eviction is irreversible, so tokens cannot be taken back."""
        return False

    def trim(self, n: int) -> int:
        return 0

    # ---- the hot path -----------------------------------------------------------------------
    def check(self, keys: mx.array, values: mx.array) -> None:
        """Reject malformed input before anything is changed (``storage.accepted``)."""
        rows = None if self.per is None else self.per * len(self.engines)
        self._seal = storage.accepted(keys, values, self.config, self._seal, self.keys,
                                      self.values, rows)
        if self.per is None and keys.shape[2]:  # the single cache: its batch, from now on
            self.per = keys.shape[0]

    def need_hooks(self, C: int) -> None:
        if C and self.needs_queries and not hooks_attached():
            raise RuntimeError(
                "scoring='attention' ranks tokens by the model's real queries, which reach the "
                "cache only through morphkv.attach(model, config): call it before generating")

    def host_update(self, keys: mx.array, values: mx.array):
        """Store each row's real tokens after its live slots; return every row's slots up to
        the longest row (a mask hides each row's free tail)."""
        self.check(keys, values)
        C = keys.shape[2]
        self.need_hooks(C)
        self.flush_chunk()
        sk, sv = storage.store_form(keys, self.config), storage.store_form(values, self.config)
        if C == 0:
            if self.keys is None:
                return sk, sv
            self.catch_up(range(len(self.engines)))
            n = max(self.stored)
            return storage.fetch(self.keys, n), storage.fetch(self.values, n)
        if C == 1 and self.plain_decode():
            self.settle_due()
            n = max(self.stored) + 1
            self.reserve(n, sk, sv)
            if None in self.engines:
                self.start_rows(range(len(self.engines)), keys.shape[1], keys.shape[3])
            self.keys = storage.write(self.keys, self.stored, sk)
            self.values = storage.write(self.values, self.stored, sv)
            self._last = (sk, sv) if self.config.block == 1 else None
            self.stored = [s + 1 for s in self.stored]
            self.seen = [t + 1 for t in self.seen]
            self.waiting = [w + 1 for w in self.waiting]
            self._queries_due = self.needs_queries
            return storage.fetch(self.keys, n), storage.fetch(self.values, n)
        self.catch_up(range(len(self.engines)))
        self._last = None
        starts, counts = self.spans(C)
        before = np.array(self.stored, np.int64)
        width = max(int((before + counts).max(initial=0)), 1)
        self.reserve(width, sk, sv)
        self.start_rows(np.nonzero(counts)[0], keys.shape[1], keys.shape[3])
        if not starts.any() and (counts == C).all() and (before == before[0]).all():
            self.keys = storage.write(self.keys, before, sk)
            self.values = storage.write(self.values, before, sv)
        else:
            for i in np.nonzero(counts)[0]:
                span = (int(starts[i]), int(counts[i]))
                storage.write_span(self.keys, int(i), int(before[i]), sk, span)
                storage.write_span(self.values, int(i), int(before[i]), sv, span)
        self.lead = np.subtract(self.lead, starts).tolist()
        if self._remaining is not None:
            self._remaining = np.subtract(self._remaining, counts).tolist()
        self.seen, self.stored = np.add(self.seen, counts).tolist(), (before + counts).tolist()
        self._chunk = Chunk(starts, counts, before, width)
        return storage.fetch(self.keys, width), storage.fetch(self.values, width)

    def host_attention(self, queries: mx.array, scale: float, mask=None):
        """Attention hook: keeps this layer's queries (one reference per decode step) and
        returns the mask: for a decode step (B, 1, 1, L), or ``mask`` with one engine (its
        rows hold equally many slots), each row's liveness for a chunk."""
        self.set_scale(float(scale))
        chunk = self._chunk
        if chunk is None:
            if self._queries_due:
                # a new array: mlx_lm's quantized attention scales its queries in place
                self.steps.append(mx.stop_gradient(queries) if self.config.kv_bits else queries)
                self._queries_due = False
            return decode_mask(self.stored) if len(self.engines) > 1 else mask
        if not chunk.fed and self.needs_queries:
            chunk.queries = mx.stop_gradient(queries) if self.config.kv_bits else queries
        B, n_heads, C, _ = queries.shape
        if self.chunk_waits(chunk, C):  # nothing evicted inside it: causal, fed later
            return causal_mask(chunk, C)
        self.flush_chunk()
        if not chunk.evicts_inside():
            return causal_mask(chunk, C)
        H = quant.dims(self.keys)[1]
        return chunk_mask(chunk, C, H, n_heads, self.config.kv_bits is not None, self.per)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs):
        """Mask for N new columns, as mlx_lm builds it before the layers run (the attention
        hook hands each layer the same for a decode step, the rows' liveness for a chunk)."""
        if window_size is not None:
            raise NotImplementedError(
                f"{type(self).__name__} does not support sliding-window attention layers; "
                "keep mlx_lm's RotatingKVCache for those layers")
        self.flush_chunk()
        if N == 1 and self.plain_decode():
            return decode_mask([s + 1 for s in self.settled()])
        settled = np.array(self.settled(), np.int64)  # what the update's catch-up leaves
        starts, counts = self.spans(N)
        width = max(int((settled + counts).max(initial=0)), 1)
        if N == 1:
            return decode_mask(np.where(counts > 0, settled + counts, width))
        return causal_mask(Chunk(starts, counts, settled, width), N, return_array, self.per)

    # ---- handing tokens to the engines ------------------------------------------------------
    def settle_due(self) -> None:
        """Hand over the waiting tokens of the engines whose newest token is on their grid."""
        due = self.due()
        if due:
            self.catch_up(due)

    def catch_up(self, rows) -> None:
        """Hand every waiting token of the engines ``rows`` over; apply the evictions."""
        waiting = self.waiting
        rows = [int(i) for i in rows if waiting[i]]
        if not rows:
            return
        longest = max(waiting[i] for i in rows)
        steps = queries = None
        if self.needs_queries:
            if len(self.steps) < longest:
                raise RuntimeError("attention scoring: the cache was read before its queries came")
            steps = self.steps[-longest:]
            if len(self.engines) > 1:  # one host read, then a slice per row (one engine: the
                # steps' queries as they are, kept by the engine, read at its settle)
                queries = steps[0] if longest == 1 else mx.concatenate(steps, axis=2)
                mx.eval(queries, *quant.parts(self.keys), *quant.parts(self.values))
                queries = storage.to_numpy(queries)
        keys = values = None
        moves, single = [], longest == 1
        for i in rows:
            engine, due = self.engines[i], False
            for k in range(longest - waiting[i], longest):
                due = engine.decode(None if steps is None else steps[k] if queries is None
                                    else queries[self.span(i), :, k : k + 1])
            if due:
                if keys is None:
                    keys = storage.host(self.keys, self.config)
                    if self.config.morphkv_value:
                        values = storage.host(self.values, self.config)
                m = engine.settle(self.rows_of(keys, i), self.rows_of(values, i))
                if m is not None:
                    moves.append((i, m))
            waiting[i] = 0
            self.stored[i] = engine.slots
        if any(waiting):
            self._trim_steps()
        else:
            self.steps = []
        if moves:
            B, H = quant.dims(self.keys)[:2]
            src, dst = (np.zeros((B, H, self.config.block), np.int64) for _ in range(2))
            for i, (s, d) in moves:
                src[self.span(i)], dst[self.span(i)] = (x.reshape(self.per, H, -1) for x in (s, d))
            # block 1, every row evicting its newest token's slot: put the token in the hole
            token = self._last if single and len(moves) == len(self.engines) else None
            self.keys = storage.move(self.keys, src, dst, None if token is None else token[0])
            self.values = storage.move(self.values, src, dst, None if token is None else token[1])
        self._last = None

    def flush_chunk(self) -> None:
        """Feed the last multi-token chunk to the engines (by the attention hook, with the
        chunk's queries, else at the next update or read) and compact the storage."""
        chunk = self._chunk
        if chunk is None or chunk.fed:
            return
        if chunk.queries is None and self.needs_queries:
            raise RuntimeError("attention scoring: the cache was read before its queries came")
        config = self.config
        # the chunk's rows are in the storage already: one evaluation, then host views
        reads = [storage.fetch(self.keys, chunk.width)]
        if config.morphkv_value:
            reads.append(storage.fetch(self.values, chunk.width))
        mx.eval(*[p for x in reads for p in quant.parts(x)],
                *([] if chunk.queries is None else [chunk.queries]))
        stored = storage.host(reads[0], config)
        stored_values = storage.host(reads[1], config) if config.morphkv_value else None
        queries = storage.to_numpy(chunk.queries)
        sources, chunk.evicted = {}, {}
        for i in np.nonzero(chunk.counts)[0]:
            s, c, b = int(chunk.starts[i]), int(chunk.counts[i]), int(chunk.before[i])
            keys, values = self.rows_of(stored, i), self.rows_of(stored_values, i)
            source, chunk.evicted[i] = self.engines[i].feed_chunk(
                keys[:, b : b + c],
                None if queries is None else queries[self.span(i), :, s : s + c],
                None if values is None else values[:, b : b + c],
                keys[:, :b],
                None if values is None else values[:, :b],
            )
            n = source.shape[1]
            if n < b + c or (source != np.arange(n)).any():
                sources[i] = source
            self.stored[i] = self.engines[i].slots
        B, H, capacity = quant.dims(self.keys)
        if self.evicts and (sources or capacity > config.budget + 1):  # back to budget + 1
            capacity = max(config.budget + 1, max(self.stored, default=0))
        if sources or capacity != quant.dims(self.keys)[2]:
            index = np.minimum(np.arange(capacity), chunk.width - 1)
            index = np.broadcast_to(index, (B, H, capacity)).copy()
            for i, source in sources.items():
                index[self.span(i), :, : source.shape[1]] = source.reshape(self.per, H, -1)
            self.keys = storage.gather(storage.fetch(self.keys, chunk.width), index)
            self.values = storage.gather(storage.fetch(self.values, chunk.width), index)
        chunk.fed = True
        chunk.queries = None
        self._chunk = None

    def flush(self) -> None:
        """Everything waiting reaches the engines (a read of the cache)."""
        self.flush_chunk()
        self.catch_up(range(len(self.engines)))


def no_reader():
    raise RuntimeError("a batch row's engine reads its keys only through settle")
