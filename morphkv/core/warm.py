"""Warming the selection engine up once per process (benchmarks: first-call costs out of the
timings)."""

from __future__ import annotations

import numpy as np

from .engine import Engine
from .presets import recommended


def warm_up() -> None:
    """Run a tiny engine once (first-call costs of NumPy's paths stay out of timings)."""
    rng = np.random.default_rng(0)
    engine = Engine(recommended(40), 1, 8, real_queries=True)
    keys = rng.standard_normal((1, 48, 8)).astype(np.float32)
    queries = rng.standard_normal((1, 2, 48, 8)).astype(np.float32)
    values = np.ones((1, 48, 8), np.float32)
    engine.feed_chunk(keys, queries, values, keys[:, :0], values[:, :0])
