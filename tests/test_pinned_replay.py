"""``core.pinned_replay``: a pinned prompt's key-ranked evictions replayed several tokens per
pass decide exactly what ``device_schedule.schedule``'s per-token loop alone decides (the
evicted-at table, the kept rows, the count and the due flag), ties and near-ties included."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from morphkv import KVCacheConfig
from morphkv.core import device_schedule, pinned_replay
from morphkv.core.pins import Pins
from morphkv.core.rules import make_rule


def _both(monkeypatch, config, pos0, t0, k, pins, keys):
    got = []
    for replay in (True, False):
        if not replay:
            monkeypatch.setattr(pinned_replay, "advance", lambda *a: 0)
        engine = SimpleNamespace(config=config, seen=t0, pins=pins, rows=pos0.shape[0],
                                 due=False, rule=make_rule(config))
        got.append((*device_schedule.schedule(engine, pos0, k, lambda: keys), engine.due))
        monkeypatch.undo()
    return got


def test_replayed_pinned_picks_are_the_loop_s(monkeypatch):
    rng = np.random.default_rng(3)
    for trial in range(120):
        n_sink, recent = int(rng.integers(0, 5)), int(rng.integers(0, 9))
        budget = int(rng.integers(n_sink + recent + 2, n_sink + recent + 60))
        config = KVCacheConfig(method="streaming_llm", morphkv_budget=budget,
                               morphkv_n_sink=n_sink, morphkv_window=max(recent, 1),
                               morphkv_recent=recent, engine="mlx", scoring="attention",
                               pin="prompt", pin_rank="keydiff")
        R, D = int(rng.integers(1, 4)), int(rng.choice([8, 16, 64, 128]))
        n0 = int(rng.integers(0, budget + 1))
        k = int(rng.integers(1, 4 * budget))
        t0 = n0 + int(rng.integers(0, 30))
        pos0 = np.stack([rng.permutation(rng.choice(t0, n0, replace=False)) if n0 else
                         np.zeros(0, int) for _ in range(R)]).astype(np.int32).reshape(R, n0)
        pins = Pins()
        if trial % 3:  # every token pinned (a pinned prompt)
            pins.add(np.arange(t0 + k))
        else:  # some stored tokens unpinned: recency takes them first, then the keys rank
            pins.add(np.nonzero(rng.random(t0 + k) < 0.7)[0])
            pins.add(np.arange(t0, t0 + k))
        keys = (rng.standard_normal((R, n0 + k, D)) + rng.standard_normal(D) * 3)
        if trial % 4 == 1:  # exact ties: repeated keys (and a few zero keys)
            keys[:, 1::3] = keys[:, 0:1]
            keys[:, 5::17] = 0.0
        if trial % 4 == 2:  # near-ties: repeated keys nudged in the last bits
            keys[:, 1::2] = keys[:, 0:1] * (1 + 1e-7 * rng.standard_normal((R, 1, 1)))
        keys = keys.astype(np.float32)
        (ev, kept, m, due), (ev2, kept2, m2, due2) = _both(monkeypatch, config, pos0, t0, k,
                                                           pins, keys)
        np.testing.assert_array_equal(ev, ev2)
        np.testing.assert_array_equal(kept, kept2)
        assert (m, due) == (m2, due2)


def test_the_replay_runs_for_a_pinned_prompt_over_the_budget(monkeypatch):
    """The steady state is replayed several tokens per pass, and only there."""
    decided = []
    advance = pinned_replay.advance
    monkeypatch.setattr(pinned_replay, "advance",
                        lambda *a: decided.append(advance(*a)) or decided[-1])
    config = KVCacheConfig(method="streaming_llm", morphkv_budget=100, pin="prompt",
                           pin_rank="keydiff", engine="mlx", scoring="attention")
    rng = np.random.default_rng(0)
    pins = Pins()
    pins.add(np.arange(400))
    engine = SimpleNamespace(config=config, seen=100, pins=pins, rows=2, due=False,
                             rule=make_rule(config))
    pos0 = np.tile(np.arange(100, dtype=np.int32), (2, 1))
    keys = rng.standard_normal((2, 400, 16)).astype(np.float32)
    device_schedule.schedule(engine, pos0, 300, lambda: keys)
    assert sum(decided) >= 290 and max(decided) == pinned_replay.STEPS
