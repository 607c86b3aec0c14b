"""A one-line progress meter for long benchmark runs."""

from __future__ import annotations

import math
import sys
import time


class Progress:
    """A one-line progress meter on stderr: done/total, elapsed, ETA. Silent when quiet."""

    def __init__(self, total: int, label: str = "", quiet: bool = False, every: float = 2.0):
        self.total = max(int(total), 1)
        self.label, self.quiet, self.every = label, quiet, every
        self.done = 0
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        now = time.perf_counter()
        if self.quiet or (now - self._last < self.every and self.done < self.total):
            return
        self._last = now
        elapsed = now - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        print(f"[{self.label}] {self.done}/{self.total} ({100 * self.done / self.total:.0f}%) "
              f"elapsed {_fmt(elapsed)} eta {_fmt(eta)} {note}", file=sys.stderr, flush=True)


def _fmt(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"
