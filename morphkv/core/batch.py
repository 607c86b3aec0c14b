"""BatchMorphKVCache: mlx_lm's batch-cache protocol over one MorphKVCache per sequence.

``mlx_lm.batch_generate``, ``BatchGenerator`` and the server's continuous batching build a
batched cache with ``caches[0][i].merge([...])`` and then drive it like ``BatchKVCache``:
left-padded history, right-padded prompts (``prepare(lengths=, right_padding=)`` ...
``finalize()``), per-row RoPE offsets, rows leaving (``filter``), joining (``extend``) and
handed back as single-sequence caches (``extract``).

Design: each row is its own single-sequence ``MorphKVCache``. An update routes each row's real
tokens (padding dropped) to its cache, and the outputs are stacked, zero-filled on the right
to the longest row; the mask hides the fill. Rows never share eviction decisions, so every
row keeps exactly what a single-sequence run of the same tokens keeps. The attention hook
(``morphkv.attach``) hands the layer's queries to ``prepare_attention``, which gives each row
its own queries and assembles the rows' masks (the liveness mask for multi-token chunks).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_causal_mask


@dataclass(frozen=True)
class _Span:
    """Where a row's real tokens sit in a chunk: columns [start, start + count)."""

    start: int
    count: int


def _pad_axis(x: mx.array, axis: int, before: int, after: int, value: bool) -> mx.array:
    """Concatenate constant blocks before/after ``x`` along ``axis`` (bool masks)."""
    parts = []
    for n in (before, after):
        shape = list(x.shape)
        shape[axis] = n
        parts.append(mx.full(shape, value, dtype=mx.bool_) if n else None)
    pieces = [p for p in (parts[0], x, parts[1]) if p is not None]
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=axis)


def _row_block(mask, span: _Span, C: int, K: int, n_heads: int) -> mx.array:
    """One row's (1, n_heads, C, K) mask: its own (.., count, R) mask placed at its span;
    padding queries see every column (all are finite: real keys or zero fill)."""
    if span.count == 0:  # padding only
        return mx.ones((1, n_heads, C, K), dtype=mx.bool_)
    R = mask.shape[-1]
    mask = mx.broadcast_to(mask.reshape(1, -1, span.count, R), (1, n_heads, span.count, R))
    mask = _pad_axis(mask, 3, 0, K - R, False)
    return _pad_axis(mask, 2, span.start, C - span.start - span.count, True)


class BatchMorphKVCache(mlx_cache._BaseCache):
    """A batch of independent single-sequence ``MorphKVCache`` rows (see module docstring)."""

    def __init__(self, rows: list, left_padding: list[int] | None = None):
        self.rows = list(rows)
        lead = [0] * len(self.rows) if left_padding is None else [int(p) for p in left_padding]
        if len(lead) != len(self.rows):
            raise ValueError(f"left_padding has {len(lead)} entries for {len(self.rows)} rows")
        self._lead = lead  # padding columns still to skip at the start of the next updates
        self._remaining: list[int] | None = None  # real tokens left per row (right padding)
        self._layout: tuple[list[_Span], list[int]] | None = None  # the last update

    # ---- building -------------------------------------------------------------------------
    @classmethod
    def merge(cls, caches, row_class: type) -> BatchMorphKVCache:
        """One batched cache from single-sequence caches of ``row_class`` (``MorphKVCache``,
        whose own ``merge`` calls this; history allowed). The inputs are copied, never updated
        (``batch_generate``'s contract)."""
        rows = []
        for i, c in enumerate(caches):
            if not isinstance(c, row_class):
                raise TypeError(
                    f"cache {i} is a {type(c).__name__}; BatchMorphKVCache.merge needs MorphKVCache"
                )
            if c.empty():
                rows.append(row_class(c.config))
                continue
            if c.keys.shape[0] != 1:
                raise ValueError(
                    f"cache {i} holds a batch of {c.keys.shape[0]}; merge takes "
                    "single-sequence caches"
                )
            c.size()  # settles a pending update before copying
            rows.append(copy.deepcopy(c))
        return cls(rows)

    def extract(self, idx: int):
        """A copy of row ``idx`` as a single-sequence cache (the row keeps going)."""
        row = self.rows[idx]
        row.size()  # settles a pending update before copying
        return copy.deepcopy(row)

    def filter(self, batch_indices) -> None:
        """Keep only the given rows, in that order."""
        keep = [
            int(i)
            for i in (batch_indices.tolist() if hasattr(batch_indices, "tolist") else batch_indices)
        ]
        self.rows = [self.rows[i] for i in keep]
        self._lead = [self._lead[i] for i in keep]
        if self._remaining is not None:
            self._remaining = [self._remaining[i] for i in keep]
        self._layout = None

    def extend(self, other: BatchMorphKVCache) -> None:
        """Append the rows of ``other``."""
        if not isinstance(other, BatchMorphKVCache):
            raise TypeError(f"cannot extend a BatchMorphKVCache with {type(other).__name__}")
        if (self._remaining is None) != (other._remaining is None) and self.rows and other.rows:
            raise ValueError("cannot extend while only one of the batches is mid-prompt")
        if other._remaining is not None:
            self._remaining = (self._remaining or [0] * len(self.rows)) + other._remaining
        elif self._remaining is not None:
            self._remaining += [0] * len(other.rows)
        self.rows += other.rows
        self._lead += other._lead
        self._layout = None

    # ---- padding --------------------------------------------------------------------------
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """``left_padding``: leading columns of the next updates to skip per row.
        ``lengths``/``right_padding``: the next updates are right-padded prompts with
        ``lengths`` real tokens per row, until ``finalize``."""
        if left_padding is not None:
            left_padding = [int(p) for p in left_padding]
            if len(left_padding) != len(self.rows) or min(left_padding, default=0) < 0:
                raise ValueError(f"left_padding {left_padding} does not fit {len(self.rows)} rows")
            self._lead = [a + b for a, b in zip(self._lead, left_padding, strict=True)]
        if right_padding is not None and max(right_padding, default=0) > 0:
            if lengths is None or len(lengths) != len(self.rows):
                raise ValueError("prepare(right_padding=...) needs lengths, one per row")
            self._remaining = [int(n) for n in lengths]

    def finalize(self) -> None:
        """End of a right-padded prompt (the padding was never stored)."""
        self._remaining = None

    def _spans(self, C: int) -> list[_Span]:
        spans = []
        for i in range(len(self.rows)):
            skip = min(self._lead[i], C)
            count = C - skip
            if self._remaining is not None:
                count = max(0, min(count, self._remaining[i]))
            spans.append(_Span(skip, count))
        return spans

    def _consume(self, spans: list[_Span]) -> None:
        for i, s in enumerate(spans):
            self._lead[i] -= s.start
            if self._remaining is not None:
                self._remaining[i] -= s.count

    # ---- mlx_lm hot path ------------------------------------------------------------------
    @property
    def offset(self) -> mx.array:
        """Per-row RoPE offset of the next chunk's first column."""
        return mx.array([r.offset - p for r, p in zip(self.rows, self._lead, strict=True)])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Route each row's real tokens to its cache; return the rows' keys/values stacked,
        zero-filled on the right to the longest row."""
        if keys.ndim != 4 or keys.shape[0] != len(self.rows):
            raise ValueError(
                f"keys of shape {tuple(keys.shape)} do not match a batch of {len(self.rows)} rows"
            )
        B, H, C, D = keys.shape
        spans = self._spans(C)
        fetched = []
        for i, (row, s) in enumerate(zip(self.rows, spans, strict=True)):
            cols = slice(s.start, s.start + s.count)
            fetched.append(
                row.update_and_fetch(keys[i : i + 1, :, cols], values[i : i + 1, :, cols])
                if s.count
                else None
            )
        self._consume(spans)
        lengths = [0 if f is None else f[0].shape[2] for f in fetched]
        K = max(max(lengths), 1)
        self._layout = (spans, lengths)
        out = []
        for which, template in ((0, keys), (1, values)):
            parts = []
            for f, n in zip(fetched, lengths, strict=True):
                fill = mx.zeros((1, H, K - n, template.shape[3]), template.dtype)
                parts.append(
                    fill
                    if f is None
                    else f[which]
                    if n == K
                    else mx.concatenate([f[which], fill], axis=2)
                )
            out.append(parts[0] if B == 1 else mx.concatenate(parts, axis=0))
        return out[0], out[1]

    def prepare_attention(self, queries: mx.array, scale: float, mask):
        """Attention hook: each row takes its own queries and returns its mask; the rows'
        masks are assembled into one (B, n_heads, C, K) mask over the stacked keys."""
        if self._layout is None:
            return mask
        spans, lengths = self._layout
        B, n_heads, C, _ = queries.shape
        K = max(max(lengths), 1)
        row_masks = []
        for i, (row, s) in enumerate(zip(self.rows, spans, strict=True)):
            if s.count == 0:
                row_masks.append(None)
                continue
            q = queries[i : i + 1, :, s.start : s.start + s.count]
            row_masks.append(row.prepare_attention(q, scale, None if s.count == 1 else "causal"))
        if C == 1:
            return _decode_mask(lengths)
        blocks = []
        for m, s, n in zip(row_masks, spans, lengths, strict=True):
            if s.count == 1 or isinstance(m, str):  # a row without the liveness mask
                m = create_causal_mask(s.count, offset=n - s.count)[None, None]
            blocks.append(_row_block(m, s, C, K, n_heads))
        return blocks[0] if B == 1 else mx.concatenate(blocks, axis=0)

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs
    ):
        """Mask for N new columns, as mlx_lm builds it before the layers run (the attention
        hook replaces it per layer with the rows' own masks)."""
        if window_size is not None:
            raise NotImplementedError(
                "BatchMorphKVCache does not support sliding-window attention layers"
            )
        spans = self._spans(N)
        kept = [r.tokens_kept for r in self.rows]
        lengths = [k + s.count if s.count else 0 for k, s in zip(kept, spans, strict=True)]
        uniform = all(s == _Span(0, N) for s in spans) and len(set(kept)) <= 1
        if N == 1:
            return None if uniform else _decode_mask(lengths)
        if uniform and not return_array:
            return "causal"
        K = max(max(lengths), 1)
        blocks = [
            _row_block(create_causal_mask(s.count, offset=k)[None, None], s, N, K, 1)
            if s.count
            else _row_block(None, s, N, K, 1)
            for s, k in zip(spans, kept, strict=True)
        ]
        return blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=0)

    # ---- accounting and the rest of the protocol -------------------------------------------
    @property
    def state(self) -> list:
        """The rows' stored keys and values (what ``mx.eval`` must compute); a batched cache
        is not saved as such: ``extract`` rows and save those."""
        return [a for r in self.rows for a in (r.keys, r.values) if a is not None]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    @property
    def tokens_kept(self) -> list[int]:
        return [r.tokens_kept for r in self.rows]

    def size(self) -> int:
        return max((r.tokens_kept for r in self.rows), default=0)

    def empty(self) -> bool:
        return all(r.empty() for r in self.rows)

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0


def _decode_mask(lengths: list[int]):
    """(B, 1, 1, K) mask for one new token per row: row i sees its first lengths[i] columns."""
    K = max(max(lengths), 1)
    if len(set(lengths)) <= 1 and lengths[0] == K:
        return None
    n = mx.array([m if m else K for m in lengths])  # a padding-only row sees all columns
    mask = mx.arange(K)[None, :] < n[:, None]
    return mask.reshape(len(lengths), 1, 1, K)
