"""MLX kernels per layer per decode step and host synchronizations per step, per cache.

One layer (``bench.layer``'s stream, real queries), filled past its budget, then ``--blocks``
eviction blocks of single-token steps, each the update and attention as the hooked model runs
them (``attention_step``). Each step's MLX graph (the output plus the storage the cache keeps)
and every array the cache holds (its selection state: positions, running scores, rings) is
exported with ``mx.export_to_dot`` before it is evaluated: ``kernels`` are the primitives
that run code on the device, ``views`` those that only re-describe memory (slices, reshapes,
...). Host syncs are the reads of MLX arrays on the host inside a step (``SyncCounter``),
counted as they happen; averages over whole eviction blocks. ``--rows 4``: a batch of 4 rows
merged as the server merges them (single caches at different eviction phases). RotatingKVCache
(update + mlx_lm's attention) is the reference.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

import mlx.core as mx

from ..eval.runner import Evaluation, add_flags, markdown_table
from ..mlxlm.hooks import attention_step, queries_by_hand
from .layer import D, H, held, make_cache, stream

NAME = "kernels"
VIEWS = {"Slice", "Reshape", "Broadcast", "Transpose", "ExpandDims", "Squeeze", "Copy",
         "AsStrided", "StopGradient"}


def graph_nodes(arrays) -> list[str]:
    """Primitive names in the unevaluated graph behind ``arrays``."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "g.dot"
        mx.export_to_dot(str(path), *arrays)
        text = path.read_text()
    return re.findall(r'label\s*=\s*"([A-Za-z]+)[^"]*"\s*,?\s*shape\s*=\s*"?rectangle', text) or [
        label for label in re.findall(r'label\s*=\s*"([A-Za-z]+)', text) if label[0].isupper()
    ]


def storage_of(cache) -> list:
    """The arrays a cache keeps after an update (so that its writes are in the graph)."""
    parts = [cache.keys, cache.values]
    return [p for x in parts for p in (x if isinstance(x, tuple) else (x,)) if p is not None]


class SyncCounter:
    """Counts host reads of MLX arrays while active: every way Python code reaches an array's
    data (``item``, ``tolist``, ``__array__``, scalar conversions, NumPy's constructors,
    ``mx.eval``), each a synchronization with the device."""

    METHODS = ("item", "tolist", "__array__", "__float__", "__int__", "__bool__", "__index__")
    NUMPY = ("asarray", "array", "ascontiguousarray")

    def __init__(self) -> None:
        self.count, self.active, self._saved = 0, False, []

    def _wrap(self, fn):
        def wrapped(*args, **kwargs):
            if self.active and any(isinstance(a, mx.array) for a in args[:1]):
                self.count += 1
            return fn(*args, **kwargs)

        return wrapped

    def __enter__(self):
        import numpy as np

        for name in self.METHODS:
            if hasattr(mx.array, name):
                self._saved.append((mx.array, name, getattr(mx.array, name)))
        for name in self.NUMPY:
            self._saved.append((np, name, getattr(np, name)))
        self._saved.append((mx, "eval", mx.eval))
        for owner, name, fn in self._saved:
            setattr(owner, name, self._wrap(fn))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)


def count(spec: str, budget: int, groups: int, blocks: int, rows: int = 1) -> dict:
    """Kernels and host syncs of one layer's decode steps (update + attention, as the hooked
    model runs them: ``attention_step``), averaged over ``blocks`` eviction blocks; with
    ``rows`` > 1, of a batch of that many rows merged from single caches (as the server's
    batches are) at different eviction phases."""
    block = getattr(getattr(make_cache(spec, budget, 8)[0], "config", None), "block", 1)
    steps = blocks * block
    k, v, q = stream(budget + 32 + steps + block + 3 * rows, mx.float16, groups)
    warm = budget + 8
    warm += -(warm - budget) % block  # start right after an eviction
    caches = [make_cache(spec, budget, 8)[0] for _ in range(rows)]
    for i, c in enumerate(caches):  # fed the first tokens (update and attention): phases differ
        n = warm + 3 * i
        mx.eval(attention_step(c, q[:, :, :n], k[:, :, :n], v[:, :, :n], D**-0.5))
    cache = caches[0] if rows == 1 else type(caches[0]).merge(caches)  # as BatchGenerator does
    if rows > 1:
        k, v, q = (mx.concatenate([x] * rows) for x in (k, v, q))
    if hasattr(cache, "prepare_attention"):
        cache.size()
    mx.eval(storage_of(cache))
    start = warm + 3 * rows
    kernels = views = 0
    with SyncCounter() as syncs:
        for t in range(start, start + steps):
            token = [x[:, :, t : t + 1] for x in (k, v, q)]
            mx.eval(token)
            syncs.active = True
            out = attention_step(cache, token[2], token[0], token[1], D**-0.5)
            if hasattr(cache, "prepare_attention"):
                cache.size()  # the step's deferred work (an eviction) joins its graph
            syncs.active = False
            nodes = graph_nodes([out, *storage_of(cache), *held(cache)])
            kernels += sum(1 for x in nodes if x not in VIEWS)
            views += sum(1 for x in nodes if x in VIEWS)
            mx.eval(out, *storage_of(cache), *getattr(cache, "state", []))
    return {"cache": spec, "block": block, "kernels_per_step": kernels / steps,
            "views_per_step": views / steps, "host_syncs_per_step": syncs.count / steps,
            "steps": steps, "rows": H, "batch": rows, "class": type(cache).__name__}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--budget", 512, "tokens kept"),
        ("--groups", 3, "query heads per KV head (real-query scoring)"),
        ("--blocks", 4, "eviction blocks counted per cache"),
        ("--arms", ["rotating", "recommended", "tuned", "tuned:block=8",
                    "tuned:block=1", "paper", "paper:block=1"], "cache specs"),
        ("--rows", 1, "batch rows (> 1: single caches merged as the server batches them)"),
        ("--out", None, "output folder (default results/kernels)"),
        ("--quick", False, "tiny run for tests/CI"),
    ])


class Kernels(Evaluation):
    """Every cache spec (an item): kernels and host syncs per decode step."""

    name, key, command, stem_of = NAME, "rows", "morphkv bench speed", "kernels{_quick}"
    model = False  # one layer alone
    columns = ["cache", "class", "batch", "block", "kernels_per_step", "views_per_step",
               "host_syncs_per_step"]

    def arms(self) -> list:
        if self.args.quick:
            self.args.budget, self.args.blocks = 64, 1
        return self.args.arms

    def measure(self, model, tok, spec, arms, bar) -> dict:
        a = self.args
        with queries_by_hand():
            return count(spec, a.budget, a.groups, a.blocks, a.rows)

    def report(self, rows: list, arms) -> tuple:
        return None, markdown_table(self.columns, [[r[c] for c in self.columns] for r in rows])


EVALUATION = Kernels
