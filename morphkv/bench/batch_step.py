"""What a batched decode step costs: morphkv's batch cache against mlx_lm's batch caches.

Two measurements, arms interleaved and repeated in one process; each figure is the mean step
of a run (eviction steps included), the median over repeats:

- ``layer``: one attention layer's cache work per decode step at ``--rows`` rows (the
  embedded model's shape: 3 KV heads, 9 query heads, head dim 64, float32): ``update_and_fetch``,
  the queries handed to the cache as the attention hook hands them, the mask, and
  ``mx.fast.scaled_dot_product_attention``, evaluated each step. Rows start from
  single-sequence caches of different lengths merged into one batch (as ``BatchGenerator``
  does), past the budget so that they evict.
- ``model``: a whole decode step of ``mlx_lm``'s ``BatchGenerator`` on the model (default the
  embedded SmolLM2-135M) at ``--rows`` rows, prompts of different lengths (``--context``
  tokens on average), no stop tokens, after ``--warm`` steps.

Arms: ``kvcache`` (``BatchKVCache``), ``rotating`` (``BatchRotatingKVCache(budget, keep 4)``),
``morphkv`` (``recommended(budget)``, evicting in blocks). JSON under --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import mlx.core as mx
import numpy as np

from ..eval.flags import add_flags
from ..eval.models import RANDOM_TINY, load_model
from ..eval.output import environment, finish, markdown_table

NAME = "batch"
H, G, D = 3, 3, 64  # KV heads, query heads per KV head, head dim (SmolLM2-135M)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--rows", 8, "rows in the batch"),
        ("--budget", 64, "tokens kept per KV head (rotating: its max size)"),
        ("--context", 120, "average tokens per row before the timed steps"),
        ("--steps", 64, "timed decode steps per repeat"),
        ("--warm", 8, "untimed decode steps first"),
        ("--repeats", 3, "interleaved repeats"),
        ("--parts", ["layer", "model"], "what to measure: layer, model"),
        ("--arms", ["kvcache", "rotating", "morphkv"], "kvcache, rotating, morphkv"),
        ("--model", None, "model of the model part (default: the embedded SmolLM2)"),
        ("--out", None, "output folder (default results/batch)"),
        ("--quick", False, "tiny run on a random-weight model for tests/CI"),
    ])


def _single(arm: str, budget: int):
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from ..core.cache import MorphKVCache
    from ..core.presets import recommended

    if arm == "kvcache":
        return KVCache()
    if arm == "rotating":
        return RotatingKVCache(max_size=budget, keep=4)
    return MorphKVCache(recommended(budget, head_dim=D, scoring="attention"))


def _lengths(rows: int, context: int) -> list[int]:
    return [max(2, context + (i - rows // 2) * max(1, context // (2 * rows))) for i in range(rows)]


def layer_steps(arm: str, args) -> list[float]:
    """Seconds of each decode step of one layer's cache work + attention."""
    from ..mlxlm.hooks import queries_by_hand

    rng = np.random.default_rng(0)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    scale = D**-0.5
    with queries_by_hand():
        singles = []
        for n in _lengths(args.rows, args.context):
            c = _single(arm, args.budget)
            k, v, q = normal(1, H, n, D), normal(1, H, n, D), normal(1, H * G, n, D)
            c.update_and_fetch(k, v)
            if hasattr(c, "prepare_attention"):
                c.prepare_attention(q, scale, "causal")
                c.size()
            singles.append(c)
        cache = singles[0].merge(singles)
        B = args.rows
        times = []
        for step in range(args.warm + args.steps):
            k, v, q = normal(B, H, 1, D), normal(B, H, 1, D), normal(B, H * G, 1, D)
            mx.eval(k, v, q)
            t0 = time.perf_counter()
            mask = cache.make_mask(1, return_array=False)
            keys, values = cache.update_and_fetch(k, v)
            if hasattr(cache, "prepare_attention"):
                mask = cache.prepare_attention(q, scale, mask)
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
            mx.eval(out, keys, values)
            if step >= args.warm:
                times.append(time.perf_counter() - t0)
    return times


def model_steps(arm: str, model, args) -> list[float]:
    """(wall, CPU) seconds of each decode step of BatchGenerator over the whole model (CPU:
    ``process_time``, all threads of this process: less sensitive to other processes)."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import RotatingKVCache

    from ..core.presets import recommended
    from ..mlxlm.builder import patch_model, unpatch_model

    unpatch_model(model)
    if arm == "morphkv":
        patch_model(model, recommended(args.budget))
    elif arm == "rotating":
        model.make_cache = lambda: [RotatingKVCache(max_size=args.budget, keep=4)
                                    for _ in model.layers]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, 1000, n).tolist() for n in _lengths(args.rows, args.context)]
    gen = BatchGenerator(model, max_tokens=args.warm + args.steps + 1, stop_tokens=[],
                         completion_batch_size=args.rows, prefill_batch_size=args.rows)
    try:
        gen.insert(prompts)
        times, t0 = [], None
        while gen.next_generated():
            t = (time.perf_counter(), time.process_time())
            if t0 is not None:
                times.append((t[0] - t0[0], t[1] - t0[1]))
            t0 = t
    finally:
        gen.close()
        unpatch_model(model)
        if arm == "rotating":
            del model.make_cache
    return times[args.warm : args.warm + args.steps]


def run(args: argparse.Namespace) -> int:
    """CLI entry point: 0 on success."""
    if args.quick:
        args.model = args.model or RANDOM_TINY
        args.rows, args.steps, args.warm, args.repeats, args.context = 3, 8, 2, 1, 60
        args.budget = 32
    model = load_model(args.model)[0] if "model" in args.parts else None
    # per repeat: the mean step (a block's evictions included); model: wall and CPU
    kinds = [("layer", 0)] * ("layer" in args.parts) + [("model", 0), ("model_cpu", 1)] * (
        "model" in args.parts)
    runs = {kind: {arm: [] for arm in args.arms} for kind, _ in kinds}
    for _ in range(args.repeats):
        for arm in args.arms:
            for part in args.parts:
                if part == "layer":
                    t = [(s, s) for s in layer_steps(arm, args)]
                else:
                    t = model_steps(arm, model, args)
                for kind, k in kinds:
                    if kind.startswith(part):
                        runs[kind][arm].append(statistics.fmean(x[k] for x in t))
                print(f"  {part} {arm}: {1e3 * runs[part][arm][-1]:.3f} ms/step", flush=True)
    median = {kind: {arm: statistics.median(v) for arm, v in arms.items()}
              for kind, arms in runs.items()}
    rows = []
    for kind, arms in median.items():
        for arm, s in arms.items():
            rows.append([kind, arm, 1e3 * s, s / arms.get("kvcache", float("nan")),
                         s / arms.get("rotating", float("nan"))])
    table = markdown_table(["part", "arm", "ms/step (mean of a run; median of repeats)",
                            "vs kvcache", "vs rotating"], rows)
    result = {"benchmark": NAME, "args": vars(args), "runs_s": runs, "median_s": median,
              "load_average": os.getloadavg(), "environment": environment()}
    finish(args, NAME, result, table=table)
    return 0
