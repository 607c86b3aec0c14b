"""Pinned positions: tokens the caller marks as evicted last (a chat's user turns).

A rule ranks tokens by what the model attended to; it cannot know which words a user will ask
about an hour later. The caller can: in a chat the user's own words are what must be
remembered, and the assistant's turns are what can go first. ``MorphKVCache.pin(positions)``
marks absolute token positions (seen or not yet seen); at an eviction the victims are the
lowest-scored unprotected slots that are NOT pinned, and only when fewer than ``block`` of those
remain in a row do pinned slots go, the lowest-scored first. Sinks and the recent window stay
protected either way. No pins: the selection is unchanged (and costs nothing more).

The engine sets one more key bit (pinned after every unpinned score, before every protected
slot); ``tests/reference.py`` states the same ranking in NumPy.
"""

from __future__ import annotations

import numpy as np

MAX_POSITION = 1 << 40  # positions are int64; this bound only catches nonsense
PRUNE_AT = 32  # ranges held before the ones no longer held are dropped (MorphKVCache.pin)
MAX_RANGES = 64  # ranges held at most after a prune: beyond them the oldest are unpinned
MAX_NBYTES = MAX_RANGES * 16  # what a cache's pins hold at most (counted in nbytes_bound)


class Pins:
    """A set of absolute token positions held as sorted disjoint ranges [start, end): a chat
    pins one range a turn, so the set costs 16 bytes a turn, not a byte a token."""

    def __init__(self) -> None:
        self.starts = np.zeros(0, np.int64)
        self.ends = np.zeros(0, np.int64)
        self._device = None  # (starts, ends) as MLX arrays, made on first use
        self.heard = np.zeros(0, np.uint32)  # pin_repeats: the row's prompts (core.repeats)

    def __len__(self) -> int:
        """Positions pinned (0: the selection is the rule's alone)."""
        return int((self.ends - self.starts).sum())

    def __bool__(self) -> bool:
        """Anything pinned? Ranges are never empty (``add`` makes them, ``keep`` drops whole
        ones), so no sum: the per-token paths ask this."""
        return bool(self.starts.size)

    @property
    def nbytes(self) -> int:
        return self.starts.nbytes + self.ends.nbytes + self.heard.nbytes

    def add(self, positions) -> None:
        p = np.asarray(positions)
        if p.size == 0:
            return
        if p.dtype.kind not in "iu" or p.ndim != 1:
            raise ValueError(f"pin: positions must be a 1-d sequence of integers, got "
                             f"{p.dtype} with shape {p.shape}")
        if p.min() < 0 or p.max() >= MAX_POSITION:
            raise ValueError(f"pin: positions must be in [0, {MAX_POSITION}), got "
                             f"{int(p.min())}..{int(p.max())}")
        p = np.unique(p.astype(np.int64))
        cut = np.nonzero(np.diff(p) > 1)[0] + 1  # runs of consecutive positions
        starts = np.concatenate([self.starts, p[np.r_[0, cut]]])
        ends = np.concatenate([self.ends, p[np.r_[cut - 1, p.size - 1]] + 1])
        order = np.argsort(starts, kind="stable")
        starts, ends = starts[order], ends[order]
        reach = np.maximum.accumulate(ends)  # merge overlapping and touching ranges
        new = np.r_[True, starts[1:] > reach[:-1]]
        self.starts = starts[new]
        self.ends = np.maximum.reduceat(reach, np.nonzero(new)[0])
        self._device = None

    def prune(self, held: np.ndarray, seen: int) -> None:
        """Drop the ranges that hold none of the positions still ``held`` and none still to
        come (at or after ``seen``): they can never matter again. Keeps a long chat's pins
        bounded by what its cache holds."""
        p = np.unique(np.asarray(held, np.int64))
        if p.size:
            i = np.minimum(np.searchsorted(p, self.starts), p.size - 1)
            keep = (p[i] >= self.starts) & (p[i] < self.ends)
        else:
            keep = np.zeros(self.starts.size, np.bool_)
        keep |= self.ends > seen
        self.starts, self.ends = self.starts[keep], self.ends[keep]
        self._device = None

    def limit(self, n: int = MAX_RANGES) -> None:
        """Keep only the newest ``n`` ranges (a conversation of more turns than that, each
        still holding a kept token: its oldest turns are unpinned), so pins stay bounded."""
        if self.starts.size > n:
            self.starts, self.ends = self.starts[-n:], self.ends[-n:]
            self._device = None

    def ranges(self) -> list[list[int]]:
        """[[start, end), ...] as plain ints (what a saved cache holds)."""
        return [[int(a), int(b)] for a, b in zip(self.starts, self.ends, strict=True)]

    def copy(self) -> Pins:
        new = Pins()
        new.starts, new.ends, new.heard = self.starts.copy(), self.ends.copy(), self.heard.copy()
        return new

    def positions(self) -> np.ndarray:
        runs = [np.arange(a, b) for a, b in zip(self.starts, self.ends, strict=True)]
        return np.concatenate(runs).astype(np.int64) if runs else np.zeros(0, np.int64)

    def holds(self, position: int) -> bool:
        """Is one position pinned (a range lookup: a decode token)?"""
        i = int(np.searchsorted(self.ends, position, side="right"))
        return i < len(self.starts) and self.starts[i] <= position

    def host(self, positions: np.ndarray) -> np.ndarray:
        """(rows, slots) bool: which slots hold a pinned position."""
        p = positions[..., None]
        return ((p >= self.starts) & (p < self.ends)).any(axis=-1)

    def device(self, positions):
        """The same on the MLX path: (R, n) bool mx.array."""
        import mlx.core as mx

        if self._device is None:
            self._device = (mx.array(self.starts), mx.array(self.ends))
        starts, ends = self._device
        p = positions.astype(mx.int64)[..., None]
        return ((p >= starts) & (p < ends)).any(axis=-1)


def true_runs(stay: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[begin, end) indices of the runs of True in ``stay``."""
    edges = np.flatnonzero(np.diff(np.r_[0, stay.astype(np.int8), 0]))
    return edges[::2], edges[1::2]


def keep_bounded(pins: Pins, held, seen: int) -> bool:
    """After an ``add``: past ``PRUNE_AT`` ranges drop those no longer holding a kept or future
    token (``held``: a callable giving the kept positions, read only then), then keep at most
    ``MAX_RANGES``. Returns whether ranges that may hold kept tokens were unpinned."""
    if len(pins.starts) > PRUNE_AT:
        pins.prune(held(), seen)
        dropped = len(pins.starts) > MAX_RANGES
        pins.limit()
        return dropped
    return False


def repinned(engine, dropped: bool) -> None:
    """An MLX engine's mirror of the unpinned positions (``core.unpinned``) after its pins
    changed: filtered, or gone when held positions were unpinned (``keep_bounded``)."""
    mirror = getattr(engine, "unpinned", None)
    if mirror is not None:
        engine.unpinned = None if dropped else mirror.repinned(engine.pins)


def check_ranges(ranges) -> list[list[int]]:
    """Saved pinned ranges, checked: sorted disjoint [start, end) int pairs (they may lie
    ahead of the tokens seen: pinned before they are fed), at most ``MAX_RANGES`` +
    ``PRUNE_AT`` of them (``ValueError`` naming the problem)."""
    ok = isinstance(ranges, list) and len(ranges) <= MAX_RANGES + PRUNE_AT and all(
        isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r)
        and 0 <= r[0] < r[1] <= MAX_POSITION for r in ranges)
    ok = ok and all(a[1] < b[0] for a, b in zip(ranges[:-1], ranges[1:], strict=True))
    if not ok:
        raise ValueError("saved cache: its pinned ranges are not sorted disjoint [start, end) "
                         f"integer pairs (at most {MAX_RANGES + PRUNE_AT}): {str(ranges)[:80]}")
    return ranges


def pin(prompt_cache, positions) -> int:
    """Pin ``positions`` in every cache of ``prompt_cache`` that can (``MorphKVCache``); returns
    how many caches took them. Other caches (mlx_lm's) keep every token or evict by age:
    nothing to pin."""
    caches = [c for c in prompt_cache if hasattr(c, "pin")]
    for c in caches:
        c.pin(positions)
    return len(caches)
