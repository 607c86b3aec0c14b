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
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_causal_mask

from . import device_saved, quant
from .batch import BatchMorphKVCache
from .config import KVCacheConfig
from .device_cache import DevicePath
from .engine import Engine
from .liveness import liveness
from .quant import QuantizedAttributes
from .queries import hooks_attached
from .saved import SavedState
from .storage import SlotStorage, check_pair, to_numpy


@dataclass
class _Chunk:
    """One update: what the engine must see, and what exact attention needs to know."""

    keys: mx.array | None  # (B, n_kv_heads, C, head_dim) as stored, until fed
    values: mx.array | None  # the same for values (read by the engine with morphkv_value)
    before: int  # slots in use before the update
    rows: int = 0  # rows of the returned keys
    fetched: tuple | None = None  # the returned keys and values, until compacted
    queries: mx.array | None = None  # (B, n_heads, C, head_dim), attention scoring only
    stored: tuple | None = None  # a decode step's keys and values as stored (block 1 moves)
    fed: bool = False  # the engine has seen it
    evicted: np.ndarray | None = None  # (rows, before + C) step each fetched row was evicted


class _Seal(tuple):
    """The shapes and dtypes of the last accepted update (see ``MorphKVCache._check``); a copy
    of a cache starts without one (MLX dtypes do not deep-copy)."""

    def __new__(cls, *fields):
        return super().__new__(cls, fields)

    def __deepcopy__(self, memo):
        return None


class MorphKVCache(DevicePath, SlotStorage, SavedState, QuantizedAttributes,
                   mlx_cache._BaseCache):
    """A fixed-budget KV cache for one attention layer (see the module docstring)."""

    def __init__(self, config: KVCacheConfig) -> None:
        config = config.validate()
        if config.scoring == "auto":  # built without a model: only keys will be seen
            config = dataclasses.replace(config, scoring="proxy")
        if config.engine == "auto":
            config = dataclasses.replace(config, engine=config.default_engine)
        self.config = config
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.engine: Engine | None = None
        self.offset = 0  # tokens seen: the RoPE position of the next token
        self._chunk: _Chunk | None = None  # the last update, until the engine has seen it

    # ---- mlx_lm hot path -----------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store new keys/values (B, n_kv_heads, C, head_dim); return what attention reads."""
        self._check(keys, values)
        B, H, C, D = keys.shape
        if C and self.config.scoring == "attention" and not hooks_attached():
            raise RuntimeError(
                "scoring='attention' ranks tokens by the model's real queries, which reach the "
                "cache only through morphkv.attach(model, config): call it before generating"
            )
        if self._device:
            return self._device_update(keys, values)
        self._flush()
        if C == 0 and self.keys is not None:
            return self._fetch()
        stored_keys, stored_values = self._store_form(keys), self._store_form(values)
        if C == 0:
            return stored_keys, stored_values
        if self.engine is None:
            self.engine = Engine(self.config, B * H, D, self.config.scoring == "attention")
            self.engine.stored_keys = self._host_keys
        if self.config.kv_bits is not None:  # the engine reads the keys (values) as stored
            keys, values = stored_keys, stored_values
        chunk = _Chunk(
            keys=keys,
            values=values if self.config.morphkv_value else None,
            before=self.engine.slots,
        )
        chunk.rows = self._place(stored_keys, stored_values)
        if C == 1:
            chunk.stored = stored_keys, stored_values
        chunk.fetched = fetched = self._fetch(chunk.rows)
        self._chunk = chunk  # the engine sees it later: see _flush
        self.offset += C
        return fetched

    def prepare_attention(self, queries: mx.array, scale: float, mask):
        """Called by the attention hook (``morphkv.attach``) with this layer's queries
        (B, n_heads, C, head_dim) and the scale the model uses. Keeps the queries for
        attention scoring and returns the mask for the update: mlx_lm's own for one token (the
        engine runs later, see ``_flush``), for several the liveness mask, which needs the
        engine's decisions now: query i sees exactly what token-by-token feeding would store."""
        if self._device:  # the hook attends through ``attend``; here: a caller that only
            if self._held is not None:  # hands the queries in (benchmarks, memory probes)
                self.attend(queries, scale, mask)
            return mask
        chunk = self._chunk
        if chunk is None:
            return mask
        if self.engine is not None:
            self.engine.scale = float(scale)
        if self.config.scoring == "attention" and not chunk.fed:
            # a new array object: mlx_lm's quantized attention scales its queries in place
            # (``queries *= scale``), which would change the ones kept for the engine
            chunk.queries = mx.stop_gradient(queries) if self.config.kv_bits else queries
        B, n_heads, C, _ = queries.shape
        if C == 1:
            return mask
        H = self.engine.rows // B
        chunk = self._flush()
        if (chunk.evicted == C).all():  # no eviction inside the chunk: plain causal attention
            return "causal"
        visible = mx.array(liveness(chunk.before, chunk.evicted))  # (B*H, C, rows)
        rows = visible.shape[-1]
        if self.config.kv_bits is not None:  # mlx_lm's quantized attention adds the group axis
            return visible.reshape(B, H, C, rows)
        visible = mx.broadcast_to(visible.reshape(B, H, 1, C, rows), (B, H, n_heads // H, C, rows))
        return visible.reshape(B, n_heads, C, rows)

    def _flush(self) -> _Chunk | None:
        """Run the selection engine over the last update and compact the storage if slots
        were reused inside it. Returns the chunk record, its ``evicted`` filled in.

        This runs when the result is first needed: by the attention hook for a multi-token
        chunk (its mask needs the evictions), else at the next update or read. By then a
        decode step's keys (and queries) have been computed, so reading them on the host does
        not cut the model's graph into one evaluation per layer."""
        if self._device:  # a read: everything due runs (lazily)
            self._settle_device()
            self._evict_due()
            return None
        chunk = self._chunk
        if chunk is None or chunk.fed:
            return chunk
        if chunk.queries is None and self.config.scoring == "attention":
            raise RuntimeError("attention scoring: the cache was read before its queries came")
        engine = self.engine
        keys = chunk.keys
        B, H, C = keys.shape[:3] if isinstance(keys, mx.array) else quant.dims(keys)
        if C == 1:  # a decode step: nothing is read unless an eviction (or a flush) is due
            if engine.decode(chunk.queries):
                moves = engine.settle(self._host_keys(), self._host_values())
                if moves is not None:  # block 1: the newest token fills the hole
                    self._move(moves, chunk.stored if engine.block == 1 else None)
        else:
            D = quant.head_dim(chunk.keys, self.config.kv_group_size)
            keys = self._host(chunk.keys).reshape(B * H, C, D)
            stored = self._host(chunk.fetched[0]).reshape(B * H, -1, D)
            queries = None if chunk.queries is None else to_numpy(chunk.queries)
            values = stored_values = None
            if chunk.values is not None:
                values = self._host(chunk.values).reshape(B * H, C, -1)
                stored_values = self._host(chunk.fetched[1]).reshape(B * H, chunk.rows, -1)
            source, chunk.evicted = engine.feed_chunk(keys, queries, values, stored,
                                                      stored_values)
            if source.shape[1] < chunk.rows or (source != np.arange(source.shape[1])).any():
                self._compact(chunk.fetched, source)
        chunk.fed = True
        chunk.keys = chunk.values = chunk.queries = chunk.fetched = chunk.stored = None
        return chunk

    def _host_keys(self) -> np.ndarray:
        """The stored keys on the host, (rows, stored rows, head_dim), in slot order."""
        B, H, N = quant.dims(self.keys)
        return self._host(self.keys).reshape(B * H, N, -1)

    def _host_values(self) -> np.ndarray | None:
        """The stored values on the host (rows, stored rows, Dv) with ``morphkv_value``."""
        if not self.config.morphkv_value:
            return None
        B, H, N = quant.dims(self.values)
        return self._host(self.values).reshape(B * H, N, -1)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """Mask for N new queries against [stored + N new] keys, as mlx_lm expects."""
        if window_size is not None:
            raise NotImplementedError(
                "MorphKVCache does not support sliding-window attention layers; "
                "keep mlx_lm's RotatingKVCache for those layers"
            )
        if N == 1:
            return None
        if return_array:
            return create_causal_mask(N, offset=self.tokens_kept)
        return "causal"

    def _check(self, keys: mx.array, values: mx.array) -> None:
        """Reject malformed input before anything is changed. Input shaped like the last
        accepted one (the same config and storage dtype) passes at once: the checks below
        depend on nothing else."""
        stored = None
        if isinstance(self.keys, mx.array):  # cheap: the dtype and dims of the storage
            stored = (self.keys.dtype, self.keys.shape[:2], self.keys.shape[3],
                      self.values.shape[3])
        elif self.keys is not None:
            group_size = self.config.kv_group_size
            stored = (quant.dtype(self.keys), quant.dims(self.keys)[:2],
                      quant.head_dim(self.keys, group_size),
                      quant.head_dim(self.values, group_size))
        k, v = keys.shape, values.shape
        seal = (keys.ndim, values.ndim, k[:2], k[3:], v[:2], v[3:], keys.dtype, values.dtype,
                stored)
        accepted = getattr(self, "_accepted", None)
        if (accepted is not None and accepted[0] is self.config and accepted[1] == seal
                and k[2] == v[2]):
            return
        self._full_check(keys, values)
        if stored is not None:  # checked against the storage too (and this config)
            self._accepted = _Seal(self.config, seal)

    def _full_check(self, keys: mx.array, values: mx.array) -> None:
        check_pair(keys, values)
        if 0 in (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3]):
            raise ValueError(
                "batch, n_kv_heads and head_dim must be >= 1; got keys "
                f"{tuple(keys.shape)} and values {tuple(values.shape)}"
            )
        head_dim = self.config.head_dim
        if head_dim is not None and keys.shape[3] != head_dim:
            raise ValueError(f"keys have head_dim {keys.shape[3]} but config.head_dim={head_dim}")
        group_size = self.config.kv_group_size
        if self.config.kv_bits is not None and (
            keys.shape[3] % group_size or values.shape[3] % group_size
        ):
            raise ValueError(
                f"kv_group_size={group_size} must divide the head dims of keys "
                f"{keys.shape[3]} and values {values.shape[3]}"
            )
        if self.keys is None:
            return
        for name, new, old in (("keys", keys, self.keys), ("values", values, self.values)):
            B, H, _ = quant.dims(old)
            D = quant.head_dim(old, group_size)
            if (new.shape[0], new.shape[1], new.shape[3]) != (B, H, D):
                raise ValueError(
                    f"{name} of shape {tuple(new.shape)} do not match the cache: expected "
                    f"batch {B}, n_kv_heads {H}, head_dim {D}"
                )
            if new.dtype != quant.dtype(old):
                raise ValueError(
                    f"{name} dtype {new.dtype} differs from the stored {quant.dtype(old)}"
                )

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
        window's attention rows (h2o: a running score per slot). No copy of the keys."""
        self._flush()
        return 0 if self.engine is None else self.engine.nbytes

    @property
    def nbytes(self) -> int:
        """Every byte the cache holds: K/V storage + selection state (what mlx_lm's prompt
        cache limits sum)."""
        return self.storage_nbytes + self.engine_nbytes

    @property
    def nbytes_bound(self) -> int | None:
        """Every byte this cache will hold once its budget is reached (K/V storage of
        ``budget + 1`` slots + the selection state); None for ``method="full"``. Known after
        the first update (it needs the shapes)."""
        engine = None if self.engine is None else self.engine.bound_nbytes()
        if engine is None:
            return None
        per_slot = self.storage_nbytes // quant.dims(self.keys)[2]  # plain or quantized rows
        return per_slot * (self.config.budget + 1) + engine

    def size(self) -> int:
        return self.tokens_kept

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        """False: eviction is irreversible, so tokens cannot be taken back."""
        return False

    def trim(self, n: int) -> int:
        return 0

    @classmethod
    def merge(cls, caches: list):
        """mlx_lm's batch protocol (``batch_generate``, ``BatchGenerator``, the server): one
        batched cache over single-sequence caches; see ``morphkv.core.batch``. The batch runs
        the host engine: caches on the MLX path are handed over as host copies."""
        return BatchMorphKVCache.merge(
            [c.on_host() if isinstance(c, cls) else c for c in caches], row_class=cls)

    def on_host(self) -> MorphKVCache:
        """This cache on the host engine: itself when it runs there, else a copy (the same
        kept tokens and selection state; reads the device once)."""
        if not self._device:
            return self
        self._flush()
        new = copy.copy(self)
        new.config, new._held = dataclasses.replace(self.config, engine="host"), None
        if self.engine is not None:
            self.engine.fill_norms(self._float_values)
            new.engine = device_saved.to_host(self.engine, new.config)
            new.engine.stored_keys = new._host_keys
            new.keys, new.values = self._fetch()
        return new


# load_prompt_cache looks cache classes up in mlx_lm.models.cache by name.
mlx_cache.MorphKVCache = MorphKVCache
