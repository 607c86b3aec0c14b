"""The unpinned stored positions of a recency rule, known on the host without reading the device.

Recency (``streaming_llm``, ``sliding_window``) evicts the oldest unpinned candidate, by
position alone; only when a row has fewer than ``block`` unpinned candidates do pinned tokens
go, ranked by keys (``pin_rank="keydiff"``) or age. So the unpinned tokens every KV head holds
are the same positions, a function of the token stream and the pins: the engine follows them
here (an immutable sorted tuple) and, when the due eviction takes only unpinned tokens, knows
its victims by position: the MLX engine then finds their slots (one comparison) instead of
scoring every slot, pins and keys included (``DeviceEngine.select``). Positions unpinned while
held (``Pins.limit`` dropping an old range) break the premise: the engine drops its mirror
(None) and scores on the device from then on.
"""

from __future__ import annotations

import numpy as np


class Unpinned:
    """Sorted unpinned stored positions (see the module docstring); operations return new
    objects, so engine copies may share one."""

    __slots__ = ("positions",)

    def __init__(self, positions=()) -> None:
        self.positions = tuple(positions)

    def arrived(self, start: int, k: int, pins) -> Unpinned:
        """After tokens [start, start + k) are stored (``pins``: the row's Pins or None)."""
        if not pins:  # None, or no ranges (``Pins.__bool__``: no sum per token)
            return Unpinned(self.positions + tuple(range(start, start + k)))
        if k == 1:  # a decode token: one range lookup
            return self if pins.holds(start) else Unpinned(self.positions + (start,))
        new = np.arange(start, start + k)
        new = new[~pins.host(new)]
        return Unpinned(self.positions + tuple(int(p) for p in new))

    def due(self, n_sink: int, last: int, block: int) -> tuple[tuple, Unpinned]:
        """(victims, after) of an eviction among candidates [n_sink, last]: victims are the
        ``block`` oldest unpinned candidates, or all of them (fewer: pinned ones go too,
        chosen on the device)."""
        p = self.positions
        i = 0
        while i < len(p) and p[i] < n_sink:
            i += 1
        j = i
        while j < len(p) and j - i < block and p[j] <= last:
            j += 1
        return p[i:j], Unpinned(p[:i] + p[j:])

    def repinned(self, pins) -> Unpinned:
        """After positions were pinned (none unpinned)."""
        if not self.positions or pins is None or not len(pins):
            return self
        held = np.array(self.positions)
        return Unpinned(held[~pins.host(held)].tolist())


def follows(rule) -> bool:
    """Does an engine of this rule keep the mirror?"""
    return rule.scheduled == "recency"


def of_kept(positions: np.ndarray, pins) -> Unpinned | None:
    """The mirror of kept positions (rows, n) read or known on the host: None when the rows'
    unpinned positions differ."""
    pinned = pins.host(positions) if pins is not None and len(pins) else np.zeros(
        positions.shape, bool)
    rows = [tuple(sorted(int(p) for p in row[~mask])) for row, mask in zip(positions, pinned,
                                                                          strict=True)]
    return Unpinned(rows[0]) if all(r == rows[0] for r in rows) else None
