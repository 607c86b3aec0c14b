"""One layer's cache update alone, side by side with mlx_lm's RotatingKVCache of the same size.

One layer (B=1, 4 KV heads, head_dim 64, ``--dtype``, 4 sinks, ``--budget`` tokens). Arms are
specs as in the other modes; ``seed`` is the bare ``KVCacheConfig(method="morphkv", ...)`` used
alone (keys as proxy queries, block 1: the seed's API); ``--velox`` adds veloxquant-mlx's
MorphKV cache (when importable) as an arm ``velox``, timed like ``seed``. Rules that read
attention get real queries (``--groups`` per KV head) and every cache of that arm, the
reference too, is timed with the layer's attention (``attention_step``). Per arm:
``decode_us``, one single-token update once full (mean over each eviction block, median over
blocks), interleaved token by token with a RotatingKVCache (``decode_ratio``); ``chunk_ms``,
one ``--chunk``-token update into an empty cache (median of ``--chunk-repeats``, interleaved);
each also in CPU time (``_cpu_``). An update is timed until the cache holds its result.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from types import SimpleNamespace

import mlx.core as mx

from ..eval.arms import Arm
from ..eval.runner import Evaluation, add_flags, markdown_table, standard
from ..mlxlm.hooks import attention_step, queries_by_hand

NAME = "layer"
B, H, D = 1, 4, 64
DTYPES = {"float16": mx.float16, "float32": mx.float32, "bfloat16": mx.bfloat16}
COLUMNS = ("arm", "engine", "queries", "decode_us", "rotating_us", "decode_ratio",
           "decode_cpu_ratio", "chunk_ms", "chunk_cpu_ms", "rotating_chunk_ms")


def stream(n: int, dtype, groups: int, seed: int = 0):
    """Keys, values (B, H, n, D) and queries (B, H * groups, n, D)."""
    mx.random.seed(seed)
    k, v, q = (mx.random.normal((B, h, n, D)).astype(dtype) for h in (H, H, H * groups))
    mx.eval(k, v, q)
    return k, v, q


def make_cache(spec: str, budget: int, window: int, n_sink: int = 4):
    """(cache, real queries?) for ``rotating``, ``velox``, ``seed[:options]`` or an arm spec."""
    from mlx_lm.models.cache import RotatingKVCache

    from ..mlxlm.builder import KVCacheBuilder

    if spec == "rotating":
        return RotatingKVCache(max_size=budget, keep=n_sink), False
    if spec == "velox":
        from veloxquant_mlx.cache.morphkv_cache import MorphKVKVCache

        return MorphKVKVCache(SimpleNamespace(morphkv_budget=budget, morphkv_n_sink=n_sink,
                                              morphkv_window=window)), False
    seed = spec.split(":")[0] == "seed"
    if seed:  # the bare config, used alone: keys as proxy queries
        spec = "morphkv" + spec[len("seed"):]
    config = Arm.parse(spec, window=window).config(budget, n_sink=n_sink)
    real = not seed and config.scoring != "proxy"  # as a hooked model builds it
    if real:
        config = dataclasses.replace(config, scoring="attention")
    return KVCacheBuilder.build(config), real


def held(cache, depth: int = 3) -> list:
    """Every MLX array the cache holds (its own attributes, its engine's and theirs),
    without building a saved state (``state`` snapshots, which decode never does)."""
    found = []
    for value in vars(cache).values():
        value = list(value.values()) if isinstance(value, dict) else value
        for x in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(x, mx.array):
                found.append(x)
            elif depth > 1 and hasattr(x, "__dict__") and type(x).__module__.startswith(
                    ("morphkv", "veloxquant")):
                found += held(x, depth - 1)
    return found


def timed(cache, k, v, q=None, read: bool = False) -> tuple[float, float]:
    """Seconds of one update (with ``q``: and its attention) until its result is held: wall
    and CPU (``process_time``, all threads: what other processes' load changes far less).
    ``read``: then read ``tokens_kept`` (a morphkv cache's deferred work joins the graph; a
    decode step is timed without it: its deferred work lands in the next step, as in a model,
    where a read between tokens would also evict early). The bench's own walk for the held
    arrays (``held``: Python, ~175 us a step over a morphkv cache's config fields, ~8 us over
    a RotatingKVCache) is timed apart and left out: it is not the cache's cost."""
    start, cpu = time.perf_counter(), time.process_time()
    out = cache.update_and_fetch(k, v) if q is None else attention_step(cache, q, k, v, D**-0.5)
    if read:
        getattr(cache, "tokens_kept", None)
    walk, walk_cpu = time.perf_counter(), time.process_time()
    arrays = held(cache)  # lazy: no computation runs here
    walk, walk_cpu = time.perf_counter() - walk, time.process_time() - walk_cpu
    mx.eval(out, arrays)
    return time.perf_counter() - start - walk, time.process_time() - cpu - walk_cpu


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--budget", 512, "tokens kept"),
        ("--window", 8, "MorphKV window (arms that do not set their own)"),
        ("--arms", ["seed", "tuned", "tuned:block=1"],
         "arm specs (seed: the bare config alone)"),
        ("--groups", 3, "query heads per KV head for the rules that read attention"),
        ("--repeats", 100, "timed eviction blocks (single-token updates at block 1) per arm"),
        ("--chunk", 2048, "tokens of the one-chunk update"),
        ("--chunk-repeats", 3, "timed chunks per arm"),
        ("--dtype", "float16", "keys/values dtype", list(DTYPES)),
        ("--velox", False, "also time veloxquant-mlx's MorphKV cache (arm 'velox')"),
        ("--quick", False, "tiny run for tests/CI"),
        *standard(NAME, "out", "quiet", "no_plot"),
    ])


class Layer(Evaluation):
    """Every arm (an item) timed beside a RotatingKVCache on one stream of keys and values."""

    name, key, command, stem_of = NAME, "rows", "morphkv bench speed", "layer{_quick}"
    model = False  # one layer alone

    def arms(self) -> list:
        a = self.args
        if a.quick:
            a.budget, a.repeats, a.chunk, a.chunk_repeats = 64, 8, 128, 1
        arms = list(a.arms)
        if a.velox:
            try:
                import veloxquant_mlx.cache.morphkv_cache  # noqa: F401

                arms.append("velox")
            except Exception:  # noqa: BLE001 (any import failure: the arm is skipped)
                print("veloxquant-mlx is not importable: no 'velox' arm")
        caches = [make_cache(s, a.budget, a.window)[0] for s in arms]  # bad specs fail now
        block = max(getattr(getattr(c, "config", None), "block", 1) for c in caches)
        n = max(a.chunk, a.budget + 16 + (a.repeats + 2) * block)
        self.kvq = stream(n, DTYPES[a.dtype], a.groups)
        return arms

    def steps(self, arms) -> int:
        return len(arms)

    def measure(self, model, tok, spec, arms, bar) -> dict:
        """Decode and chunk times of one arm, each interleaved with a RotatingKVCache's."""
        (k, v, q), args = self.kvq, self.args
        with queries_by_hand():  # the rules that read attention are handed the queries
            cache, real = make_cache(spec, args.budget, args.window)
            caches = {"arm": cache, "rotating": make_cache("rotating", args.budget, args.window)[0]}
            block = getattr(getattr(cache, "config", None), "block", 1)

            def cut(i: int, j: int) -> list:  # keys, values and (real queries only) queries
                return [k[:, :, i:j], v[:, :, i:j], q[:, :, i:j] if real else None]

            warm = args.budget + 16
            for c in caches.values():
                timed(c, *cut(0, warm))
            first = warm + (-(warm - args.budget) % block)  # the first token after an eviction
            times = {name: [] for name in caches}  # (wall, CPU) seconds per step
            for t in range(warm, first + args.repeats * block):
                token = cut(t, t + 1)
                mx.eval([x for x in token if x is not None])
                for name, c in caches.items():
                    seconds = timed(c, *token)
                    times[name] += [seconds] if t >= first else []
            chunk = {name: [] for name in caches}
            for _ in range(args.chunk_repeats):
                for name, each in (("arm", spec), ("rotating", "rotating")):
                    c = make_cache(each, args.budget, args.window)[0]
                    chunk[name].append(timed(c, *cut(0, args.chunk), True))
        config = getattr(cache, "config", None)
        row = {"arm": spec, "queries": "real" if real else "proxy", "block": block,
               "chunk_tokens": args.chunk, "engine": type(cache).__name__ if config is None else
               config.engine if config.engine != "auto" else config.default_engine}
        for w, tag in ((0, ""), (1, "cpu_")):
            decode = {n: statistics.median(  # the mean per token of each eviction block
                sum(x[w] for x in ts[i : i + block]) / block
                for i in range(0, len(ts) - block + 1, block)) for n, ts in times.items()}
            chunks = {n: statistics.median(x[w] for x in ts) for n, ts in chunk.items()}
            row.update({f"decode_{tag}us": decode["arm"] * 1e6,
                        f"rotating_{tag}us": decode["rotating"] * 1e6,
                        f"decode_{tag}ratio": decode["arm"] / decode["rotating"],
                        f"chunk_{tag}ms": chunks["arm"] * 1e3,
                        f"rotating_chunk_{tag}ms": chunks["rotating"] * 1e3})
        bar.update(1, f"{spec}: decode x{row['decode_cpu_ratio']:.2f} (CPU), "
                      f"chunk {row['chunk_ms']:.0f} ms")
        return row

    def report(self, rows: list, arms) -> tuple:
        return None, ("decode_us: one single-token update once full (mean over each eviction "
                      "block, median over blocks), interleaved with RotatingKVCache's "
                      "(rotating_us); chunk_ms: one chunk into an empty cache, median, beside "
                      "RotatingKVCache's; _cpu_: the same in CPU time; queries: real (timed "
                      "with the layer's attention, the reference too) or proxy (update alone)\n"
                      + markdown_table(list(COLUMNS), [[r[c] for c in COLUMNS] for r in rows]))

    def plot(self, result: dict, path) -> None:
        from ..eval import plots

        rows = result["rows"]
        fig, axes = plots.panels(2, 6, 4.5)
        labels = [r["arm"] for r in rows]
        plots.grouped_bars(axes[0][0], labels, {"decode x rotating": [r["decode_ratio"]
                                                                       for r in rows]},
                           "decode update x RotatingKVCache")
        plots.grouped_bars(axes[0][1], labels, {"chunk ms": [r["chunk_ms"] for r in rows]},
                           f"one {self.args.chunk}-token update, ms")
        plots.save(fig, path, 100)


EVALUATION = Layer
