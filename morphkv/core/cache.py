"""MorphKVCache: one constant-size KV cache class for every eviction rule, drop-in for mlx_lm.

Storage is (B, n_kv_heads, slots, head_dim) in the dtype the keys arrive in. Each (batch row,
KV head) keeps its own set of tokens, so slots are not in position order: a new token is
written into the slot its row evicted one step earlier. Attention does not care about the
order of stored keys, and with a multi-token update the new tokens are returned after the
stored ones, so mlx_lm's bottom-right-aligned "causal" mask stays right.

With ``kv_bits`` set, keys and values are stored quantized (``morphkv.core.quant``: mlx_lm's
``QuantizedKVCache`` layout, one token row per slot, so slot reuse stays in place), the cache
exposes ``bits`` and ``group_size``, and mlx_lm's attention takes its quantized path. The
selection engine scores the keys as stored (dequantized), new tokens included.

Semantics of one update of C tokens (C = 1 when decoding): the returned keys and values are
[tokens kept before the update + all C new tokens]; then, token by token, each new token is
appended and, while more than ``budget`` tokens are stored, the rule evicts one. The kept set
is therefore the same for any chunking of a stream, and at most ``budget`` tokens remain.

One engine, on the device (``morphkv.core.device_cache``, ``morphkv.core.device``); batches
of these caches are built by ``merge`` (``morphkv.core.device_batch``, ``morphkv.core.batch``).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_causal_mask

from . import quant, storage
from .batch import BatchMorphKVCache
from .config import KVCacheConfig
from .device_batch import DeviceBatchCache
from .device_cache import DevicePath
from .feed import Feed
from .pins import MAX_NBYTES, keep_bounded, repinned
from .quant import QuantizedAttributes
from .repeats import HEARD
from .saved import SavedState
from .unpinned import follows, of_kept


class MorphKVCache(DevicePath, Feed, SavedState, QuantizedAttributes, mlx_cache._BaseCache):
    """A fixed-budget KV cache for one attention layer (see the module docstring)."""

    def __init__(self, config: KVCacheConfig) -> None:
        config = config.validate()
        if config.scoring == "auto":  # built without a model: only keys will be seen
            config = dataclasses.replace(config, scoring="proxy")
        if config.engine == "auto":
            config = dataclasses.replace(config, engine=config.default_engine)
        self.init_feed(config, 1, None)  # one engine for all the batch rows it is given
        self.offset = 0  # tokens seen: the RoPE position of the next token

    @property
    def engine(self):
        """The selection engine (``DeviceEngine``; None before the first token)."""
        return self.engines[0]

    @engine.setter
    def engine(self, engine) -> None:
        self.engines = [engine]
        if engine is not None:
            engine.pins = self.pins

    def pin(self, positions) -> None:
        """Evict the tokens at these absolute positions last (``morphkv.core.pins``): a chat
        pins its user turns. Positions not fed yet may be pinned ahead. Past ``PRUNE_AT``
        ranges the ones no longer holding a kept token are dropped, and at most
        ``MAX_RANGES`` (the newest) are kept."""
        self.pins.add(positions)  # the engines share this object (``Feed.init_feed``)
        if self.engine is not None:  # reads the kept positions once a turn at most
            dropped = keep_bounded(self.pins, lambda: self.kept_positions, self.engine.seen)
            repinned(self.engine, dropped)

    def pin_range(self, i: int, start: int, end: int) -> None:
        """``pin="prompt"`` (``Feed.pin_arrived``): one engine, every row."""
        self.pin(np.arange(start, end))

    def adopt(self, engine, keys, values, config: KVCacheConfig | None = None) -> None:
        """Hold ``engine``'s state over the stored ``keys`` / ``values`` (every token handed
        over; a loaded, extracted, converted or requantized cache)."""
        pins = getattr(self, "pins", None)  # kept across a conversion
        pin_next = getattr(self, "pin_next", None)
        self.init_feed(config or self.config, 1, None if keys is None else quant.dims(keys)[0])
        self.pins = self.pins if pins is None else pins
        self.pin_next = self.pin_next if pin_next is None else pin_next
        self._held = None
        self.keys, self.values, self.engine = keys, values, engine
        self.offset = 0 if engine is None else engine.seen
        if engine is not None:
            self.seen, self.stored = [engine.seen], [engine.slots]
            engine.stored_keys = self._stored_float_keys
            if follows(engine.rule):  # one read: the kept positions
                kept = np.array(engine.positions[:, : engine.slots])
                engine.unpinned = of_kept(kept, engine.pins)

    # ---- mlx_lm hot path -----------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store new keys/values (B, n_kv_heads, C, head_dim); return what attention reads."""
        C = keys.shape[2]
        if self.pin_prompts and (self.prompt(C) or self.pin_next[0]):  # checked first,
            self.check(keys, values)  # so a refused update pins nothing
            self.pin_arrived((self.offset,), (C,), C)
        return self.store(keys, values)

    def store(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """``update_and_fetch`` without the ``pin="prompt"`` step (a batch row: the batch pins)."""
        self.check(keys, values)
        self.need_hooks(keys.shape[2])
        return self._device_update(keys, values)

    def prepare_attention(self, queries: mx.array, scale: float, mask):
        """The queries handed in without the hook's ``attend`` (benchmarks, memory probes):
        the held update attends now; returns ``mask``."""
        if self._held is not None:
            self.attend(queries, scale, mask)
        return mask

    def _flush(self) -> None:
        """Everything waiting reaches the engine (queued lazily: no host read)."""
        self._settle_device()
        self._evict_due()

    def _fetch(self, rows: int | None = None) -> tuple:
        """The first ``rows`` (default: the live) slots of the storage."""
        rows = self.engine.slots if rows is None else rows
        return storage.fetch(self.keys, rows), storage.fetch(self.values, rows)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs):
        """Mask for N new queries against [stored + N new] keys, as mlx_lm expects (the
        hook's ``attend`` masks each piece itself)."""
        if window_size is not None:
            raise NotImplementedError(
                f"{type(self).__name__} does not support sliding-window attention layers; "
                "keep mlx_lm's RotatingKVCache for those layers")
        if N == 1:
            return None
        return create_causal_mask(N, offset=self.tokens_kept) if return_array else "causal"

    # ---- accounting (per sequence, per KV head) ------------------------------------------
    @property
    def tokens_seen(self) -> int:
        return self.offset

    @property
    def tokens_kept(self) -> int:
        self._flush()
        return 0 if self.engine is None else self.engine.kept

    def _bytes_per_token(self, bits: int | None) -> int:
        """K+V bytes of one token stored with ``bits`` (None: the arriving dtype)."""
        if self.keys is None:
            return 0
        size, group_size = quant.dtype(self.keys).size, self.config.kv_group_size
        return sum(
            quant.row_bytes(quant.head_dim(x, group_size), size, bits, group_size)
            for x in (self.keys, self.values)
        )

    @property
    def morphkv_kept_bytes(self) -> int:
        """K+V bytes of the tokens kept as stored (quantized: packed bits, scales and biases),
        per sequence and KV head."""
        return self.tokens_kept * self._bytes_per_token(self.config.kv_bits)

    @property
    def full_seq_bytes(self) -> int:
        """K+V bytes a full unquantized cache (mlx_lm's ``KVCache``, in the dtype the keys
        arrive in) would hold, per sequence and KV head."""
        return self.tokens_seen * self._bytes_per_token(None)

    @property
    def compression_ratio(self) -> float:
        return self.full_seq_bytes / self.morphkv_kept_bytes if self.tokens_kept else 1.0

    @property
    def kept_positions(self) -> np.ndarray:
        """Absolute positions of the kept tokens, (B, n_kv_heads, n_kept), ascending."""
        self._flush()
        if self.engine is None:
            return np.zeros((0, 0, 0), np.int64)
        B, H, _ = quant.dims(self.keys)
        kept = np.sort(np.array(self.engine.stored_positions).astype(np.int64), axis=1)
        return kept.reshape(B, H, -1)

    @property
    def storage_nbytes(self) -> int:
        """Bytes of the K/V storage (budget + 1 rows once full: one slot awaits reuse)."""
        self._flush()  # a pending chunk is compacted first
        return 0 if self.keys is None else quant.nbytes(self.keys) + quant.nbytes(self.values)

    @property
    def engine_nbytes(self) -> int:
        """Bytes of the selection engine's state: slot positions, and for attention rules the
        window's attention rows (h2o: a running score per slot), pinned ranges. No copy of the
        keys."""
        self._flush()
        return self.pins.nbytes + (0 if self.engine is None else self.engine.nbytes)

    @property
    def nbytes(self) -> int:
        """Every byte the cache holds: K/V storage + selection state (what mlx_lm's prompt
        cache limits sum)."""
        return self.storage_nbytes + self.engine_nbytes

    @property
    def nbytes_bound(self) -> int | None:
        """Every byte this cache will hold once its budget is reached (K/V storage of
        ``budget + 1`` slots + the selection state + the pinned ranges: with ``pin="prompt"``
        the most they hold, else what is pinned now); None for ``method="full"``. Known after
        the first update (it needs the shapes)."""
        engine = None if self.engine is None else self.engine.bound_nbytes()
        if engine is None:
            return None
        per_slot = self.storage_nbytes // quant.dims(self.keys)[2]  # plain or quantized rows
        pins = MAX_NBYTES if self.pin_prompts else self.pins.nbytes  # pinned ranges
        if self.pin_prompts and self.config.pin_repeats:  # held by a row's first cache alone
            pins += HEARD * 4  # (core.repeats), counted in every layer's bound
        return per_slot * (self.config.budget + 1) + engine + pins

    def size(self) -> int:
        return self.tokens_kept

    def empty(self) -> bool:
        return self.keys is None

    @classmethod
    def merge(cls, caches: list):
        """mlx_lm's batch protocol (``batch_generate``, ``BatchGenerator``, the server): one
        batched cache over single-sequence caches. Rows with real queries batch over one
        storage (``morphkv.core.device_batch``; ``full`` rows too, the storage as wide as the
        widest row needs); keys as proxies (no hook) keep their rows as they are
        (``morphkv.core.batch``)."""
        if DeviceBatchCache.accepts(caches):
            return DeviceBatchCache.merge(caches, row_class=cls)
        return BatchMorphKVCache.merge(caches, row_class=cls)


# load_prompt_cache looks cache classes up in mlx_lm.models.cache by name.
mlx_cache.MorphKVCache = MorphKVCache
