"""Per-layer cache update cost, side by side with mlx_lm's RotatingKVCache of the same size.

One layer, B=1, 4 KV heads, head_dim 64, float16 (``--dtype``), 4 sinks. Per case: the median
single-token update once the cache is full, interleaved token by token with a RotatingKVCache
(so the ratio is measured side by side), and one ``--chunk``-token update into an empty cache.
Each update is timed with its selection step (``tokens_kept`` forces morphkv's deferred step).
``--groups G`` scores with real queries (G query heads per KV head) and times each update with
the layer's attention, as the hooked model runs them (``attention_step``; the MLX engine
computes both from one softmax), for every cache alike; 0 uses keys as proxy queries and times
the update alone. Arms compare the engines side by side: ``recommended:engine=host``
(the float64 host reference) next to ``recommended`` (the MLX path). Memory per case once
full: K/V storage, the selection engine's state, both next to the kept K+V and to the
RotatingKVCache's bytes.
Default: each of ``--methods`` at ``--budget``; ``--grid``: morphkv across budgets x windows,
plus the other methods at 512 (also ``morphkv bench speed --micro``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import mlx.core as mx

from ..eval import plots
from ..eval.arms import Arm
from ..eval.flags import add_flags, standard
from ..eval.output import environment, finish, markdown_table
from ..eval.plots import require_matplotlib
from ..eval.progress import Progress
from ..mlxlm.hooks import attention_step, queries_by_hand

NAME = "layer"
B, H, D = 1, 4, 64
COLUMNS = ("method", "budget", "window", "decode_us", "rotating_us", "decode_ratio", "python_us",
           "mlx_us", "reads_us", "engine_us", "chunk_ms", "engine_pct", "total_vs_rotating")
PARTS = ("python", "mlx", "reads", "engine")
DTYPES = {"float16": mx.float16, "float32": mx.float32, "bfloat16": mx.bfloat16}


def stream(n: int, dtype=mx.float16, groups: int = 0, seed: int = 0):
    """Keys, values (B, H, n, D) and queries (B, H * groups, n, D), or None for proxy."""
    mx.random.seed(seed)
    k = mx.random.normal((B, H, n, D)).astype(dtype)
    v = mx.random.normal((B, H, n, D)).astype(dtype)
    q = mx.random.normal((B, H * groups, n, D)).astype(dtype) if groups else None
    mx.eval(k, v, q)
    return k, v, q


def timed_parts(cache, k, v, q=None) -> dict[str, float]:
    """One morphkv update split into its parts (seconds): ``python`` (the update's
    bookkeeping and the MLX graph of the slot write and fetch), ``mlx`` (evaluating it),
    ``reads`` (the selection step's host reads of keys and queries) and ``engine`` (the
    selection engine: keeping the query between evictions, the batched rows, scores and
    selection at an eviction)."""
    engine_time = []
    engine = cache.engine

    def timed(fn):
        def wrapped(*a, **kw):
            start = time.perf_counter()
            out = fn(*a, **kw)
            engine_time.append(time.perf_counter() - start)
            return out

        return wrapped

    engine.decode, engine.settle = timed(engine.decode), timed(engine.settle)
    try:
        t0 = time.perf_counter()
        out = cache.update_and_fetch(k, v) if q is None else attention_step(cache, q, k, v, D**-0.5)
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        _ = cache.tokens_kept
        t3 = time.perf_counter()
    finally:
        del engine.decode, engine.settle
    spent = sum(engine_time)
    return {"python": t1 - t0, "mlx": t2 - t1, "reads": t3 - t2 - spent, "engine": spent}


def timed_update(cache, k, v, q=None) -> float:
    """Seconds of one update; with queries, of the update and the layer's attention as the
    hooked model runs them (``attention_step``: the MLX path computes both at once)."""
    start = time.perf_counter()
    out = cache.update_and_fetch(k, v) if q is None else attention_step(cache, q, k, v, D**-0.5)
    mx.eval(out)
    getattr(cache, "tokens_kept", None)  # morphkv runs a token's selection step when read
    return time.perf_counter() - start


def make_cache(spec: str, budget: int, window: int = 8, n_sink: int = 4, groups: int = 0):
    from mlx_lm.models.cache import RotatingKVCache

    from ..mlxlm.builder import KVCacheBuilder

    if spec == "rotating":
        return RotatingKVCache(max_size=budget, keep=n_sink)
    config = Arm.parse(spec, window=window).config(budget, n_sink=n_sink)
    if groups and config.rule.attention:  # the rules that read attention rows
        config = dataclasses.replace(config, scoring="attention")
    return KVCacheBuilder.build(config)


def memory(cache, rotating) -> dict:
    """Bytes once full: storage, engine, kept K+V (all KV heads) and the ratios."""
    kept = cache.morphkv_kept_bytes * B * H
    return {"storage_bytes": cache.storage_nbytes, "engine_bytes": cache.engine_nbytes,
            "kept_kv_bytes": kept, "rotating_bytes": rotating.nbytes,
            "engine_pct": 100.0 * cache.engine_nbytes / kept,
            "total_vs_rotating": cache.nbytes / rotating.nbytes}


def _at(x, start: int, end: int):
    return None if x is None else x[:, :, start:end]


def _token(k, v, q, t: int) -> tuple:
    """Token t's keys, values and queries, evaluated before any timing (in a model they are
    computed before the cache sees them)."""
    token = _at(k, t, t + 1), _at(v, t, t + 1), _at(q, t, t + 1)
    mx.eval([x for x in token if x is not None])
    return token


def decode_costs(spec: str, budget: int, window: int, repeats: int, k, v, q) -> dict:
    """Seconds per single-token update once full, averaged over each eviction block (the
    median over ``repeats`` blocks): the arm and a RotatingKVCache of the same size,
    interleaved token by token; and both caches' bytes."""
    groups = 0 if q is None else q.shape[1] // H
    caches = {"arm": make_cache(spec, budget, window, groups=groups),
              "rotating": make_cache("rotating", budget)}
    warm = budget + 16
    for cache in caches.values():
        timed_update(cache, k[:, :, :warm], v[:, :, :warm], _at(q, 0, warm))
        for t in range(warm, warm + 8):  # the rotating cache switches to in-place updates
            timed_update(cache, k[:, :, t : t + 1], v[:, :, t : t + 1], _at(q, t, t + 1))
    block = getattr(getattr(caches["arm"], "config", None), "block", 1)
    first = warm + 8 + (-(warm + 8 - budget) % block)  # the first token after an eviction
    times = {name: [] for name in caches}
    parts = []
    steps = repeats * block
    for t in range(first, first + steps):
        for name, cache in caches.items():
            token = _token(k, v, q, t)
            times[name].append(timed_update(cache, *token))
    arm = caches["arm"]
    if hasattr(getattr(arm, "engine", None), "settle"):  # host engine: the parts, in steps
        for t in range(first + steps, first + 2 * steps):
            parts.append(timed_parts(arm, *_token(k, v, q, t)))
    out = {name: statistics.median(per_block(ts, block)) for name, ts in times.items()}
    out["parts"] = {p: statistics.median(per_block([x[p] for x in parts], block))
                    for p in PARTS} if parts else {}
    if hasattr(caches["arm"], "engine_nbytes"):
        out["memory"] = memory(caches["arm"], caches["rotating"])
    return out


def per_block(times: list[float], block: int) -> list[float]:
    """Mean per token of each run of ``block`` consecutive steps (one eviction each)."""
    return [sum(times[i : i + block]) / block for i in range(0, len(times) - block + 1, block)]


def measure(spec: str, budget: int, window: int, args, k, v, q) -> dict:
    d = decode_costs(spec, budget, window, args.repeats, k, v, q)
    groups = 0 if q is None else q.shape[1] // H
    n = args.chunk
    chunk = statistics.median(
        timed_update(make_cache(spec, budget, window, groups=groups), k[:, :, :n], v[:, :, :n],
                     _at(q, 0, n)) for _ in range(args.chunk_repeats))
    return {"method": spec, "budget": budget,
            "window": Arm.parse(spec, window=window).window,  # the spec's own window wins
            "decode_us": d["arm"] * 1e6, "rotating_us": d["rotating"] * 1e6,
            "decode_ratio": d["arm"] / d["rotating"],
            **{f"{p}_us": d["parts"].get(p, float("nan")) * 1e6 for p in PARTS},
            "chunk_tokens": args.chunk, "chunk_ms": chunk * 1e3, "groups": groups,
            **d.get("memory", {"engine_pct": float("nan"), "total_vs_rotating": float("nan")})}


def cases(args) -> list[tuple[str, int, int]]:
    if not args.grid:
        return [(m, args.budget, args.window) for m in args.methods]
    budgets, windows = (
        ([32, 64], [1, 4]) if args.quick else ([128, 256, 512, 1024, 2048], [1, 8, 64])
    )
    top = budgets[-1] if args.quick else 512
    found = [("morphkv", b, w) for b in budgets for w in windows]
    return found + [(m, top, min(8, windows[-1])) for m in args.methods if m != "morphkv"]


def plot(result: dict, path) -> str:
    rows = result["rows"]
    fig, axes = plots.panels(2, 6, 4.5)
    labels = [f"{r['method']} b{r['budget']} w{r['window']}" for r in rows]
    us = {k: [r[k] for r in rows] for k in ("decode_us", "rotating_us")}
    plots.grouped_bars(axes[0, 0], labels, us, "decode update, us (arm vs RotatingKVCache)")
    axes[0, 0].legend(fontsize=7)
    ms = {f"{result['chunk']}-token update": [r["chunk_ms"] for r in rows]}
    plots.grouped_bars(axes[0, 1], labels, ms, f"one {result['chunk']}-token update, ms")
    return plots.save(fig, path, 100)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--budget", 512, "tokens kept"),
        ("--window", 8, "protected recent window"),
        ("--repeats", 300, "timed eviction blocks (single-token updates at block 1) per case"),
        ("--chunk", 2048, "tokens of the one-chunk update"),
        ("--methods", ["morphkv", "h2o", "tova", "streaming_llm", "random", "keydiff"],
         "arm specs"),
        ("--groups", 0, "query heads per KV head: real-query scoring (0: keys as proxies)"),
        ("--dtype", "float16", "keys/values dtype: float16, float32 or bfloat16"),
        ("--grid", False, "morphkv over budgets x windows, the other methods at budget 512"),
        ("--quick", False, "tiny run for tests/CI"),
        *standard(NAME, "out", "quiet", "no_plot"),
    ])


def run(args: argparse.Namespace) -> int:
    """CLI entry point (``morphkv`` command contract): 0 on success."""
    execute(args)
    return 0


def execute(args: argparse.Namespace) -> dict:
    require_matplotlib(args)
    args.chunk_repeats = 1 if args.quick else (3 if args.grid else 5)
    if args.quick:
        args.budget, args.repeats, args.chunk = min(args.budget, 64), min(args.repeats, 20), 128
    todo = cases(args)
    if args.dtype not in DTYPES:
        raise SystemExit(f"morphkv: error: --dtype must be one of {sorted(DTYPES)}")
    blocks = [getattr(make_cache(s, b, w, groups=args.groups), "config", None) for s, b, w in todo]
    block = max(getattr(c, "block", 1) for c in blocks)
    n = max(args.chunk, max(b for _, b, _ in todo) + 24 + 2 * (args.repeats + 1) * block)
    k, v, q = stream(n, DTYPES[args.dtype], args.groups)
    bar, rows = Progress(len(todo), NAME, getattr(args, "quiet", False)), []
    for spec, budget, window in todo:
        with queries_by_hand():
            rows.append(measure(spec, budget, window, args, k, v, q))
        bar.update(1, f"{spec} b{budget} w{window}: x{rows[-1]['decode_ratio']:.2f} vs rotating")
    result = {"benchmark": NAME, "budget": args.budget, "chunk": args.chunk, "rows": rows}
    result.update(grid=args.grid, repeats=args.repeats, environment=environment())
    result.update(groups=args.groups, dtype=args.dtype)
    print("decode_us: one single-token update once full (averaged over each eviction block, "
          "median over blocks); rotating_us: RotatingKVCache's, "
          "interleaved; decode_ratio: their ratio; python/mlx/reads/engine_us: medians of "
          "the update's parts (bookkeeping and MLX graph, MLX evaluation, host reads of keys "
          "and queries, the selection engine), timed in steps of their own; "
          "chunk_ms: one chunk into an empty cache; "
          "engine_pct: selection state / kept K+V bytes; total_vs_rotating: all bytes held / "
          "a RotatingKVCache of the same budget")
    finish(args, NAME, result, f"{NAME}{'_quick' if args.quick else ''}",
           lambda path: plot(result, path),
           markdown_table(list(COLUMNS), [[r[c] for c in COLUMNS] for r in rows]), png=NAME)
    return result
