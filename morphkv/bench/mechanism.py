"""Synthetic retention benchmark: which tokens does each eviction rule keep, and does it matter?

Key streams are drawn per head (head_dim 32, 4 heads per stream, each head with its own random
orthonormal axes) and fed through one ``MorphKVCache`` layer per arm. Three scenarios:

``topic_shift``
    The first 70% of keys carry a strong component on axis A (norm 6, small noise); the last
    30% a weaker component on a distinct axis B (norm 4) plus per-token noise (std 1 per
    dimension). The recent window reads B. Relevant region: the B tokens.
``stable``
    Every key is on axis A with per-token noise: the control, where no token is special.
    Relevant region: every non-sink token (so the kept fraction is the same for every arm;
    only the probe perturbation is informative).
``recall``
    ``[sinks][filler][topic A, budget/2 tokens][filler, 1.5 * budget tokens][A again, 16]``.
    Filler keys are random directions (std 1 per dimension) unrelated to A. The final window
    reads topic A, last seen 1.5 budgets ago, so recency alone cannot keep it. Relevant region:
    the first topic-A segment.

Observables at the end of the stream, per arm:

``kept``
    Fraction of the relevant region still stored.
``mass``
    Fraction of the full-set softmax attention mass of a probe query (the relevant axis times
    its norm in the stream) that falls on the kept tokens.
``err``
    Relative L2 error of the probe's attention output read against the kept set vs the full
    set, with i.i.d. N(0, 1) values.

Arms: MorphKV (mean and max fusion), TOVA, H2O (standard cumulative score), StreamingLLM and
random eviction, all protecting the same 2 sinks and the same recent window (the grid's
``window``). Grid points with ``window >= budget - sinks`` are invalid for the cache and skipped.
"""

from __future__ import annotations

import argparse
import itertools
import math

import mlx.core as mx
import numpy as np

from ..eval import plots
from ..eval.arms import Arm, check_specs
from ..eval.flags import add_flags, standard
from ..eval.output import environment, finish, markdown_table, pivot
from ..eval.plots import require_matplotlib
from ..eval.progress import Progress
from ..mlxlm.builder import KVCacheBuilder

NAME = "mechanism"
HEAD_DIM = 32
N_HEADS = 4
N_SINK = 2
SCENARIOS = ("topic_shift", "stable", "recall")
ARMS = {  # name -> arm spec (any spec works in --arms; its name is then the spec itself)
    "morphkv_mean": "morphkv:mean",
    "morphkv_max": "morphkv:max",
    "tova": "tova",
    "h2o": "h2o",
    "streaming_llm": "streaming_llm",
    "random": "random",
}
STRONG, WEAK, NOISE, SMALL_NOISE = 6.0, 4.0, 1.0, 0.5
RECALL_TAIL = 16
GRID = ("length", "budget", "window")


def _axes(rng: np.random.Generator, n: int = 2) -> np.ndarray:
    q, _ = np.linalg.qr(rng.standard_normal((HEAD_DIM, HEAD_DIM)))
    return q[:, :n].T  # (n, D) orthonormal


def make_stream(scenario: str, length: int, budget: int, rng: np.random.Generator):
    """Keys (H, L, D), relevant mask (L,), probe queries (H, D) for one scenario."""
    keys = np.empty((N_HEADS, length, HEAD_DIM))
    probes = np.empty((N_HEADS, HEAD_DIM))
    relevant = np.zeros(length, bool)
    for h in range(N_HEADS):
        a, b = _axes(rng)
        noise = rng.standard_normal((length, HEAD_DIM))
        if scenario == "topic_shift":
            split = int(0.7 * length)
            keys[h, :split] = STRONG * a + SMALL_NOISE * noise[:split]
            keys[h, split:] = WEAK * b + NOISE * noise[split:]
            relevant[split:] = True
            probes[h] = WEAK * b
        elif scenario == "stable":
            keys[h] = STRONG * a + NOISE * noise
            relevant[N_SINK:] = True
            probes[h] = STRONG * a
        elif scenario == "recall":
            topic_len, gap = budget // 2, (3 * budget) // 2
            end_topic = length - RECALL_TAIL - gap
            start_topic = end_topic - topic_len
            if start_topic < N_SINK:
                raise ValueError(f"recall needs length >= {N_SINK + topic_len + gap + 16}")
            keys[h] = NOISE * noise  # unrelated filler
            topic = STRONG * a + SMALL_NOISE * noise
            keys[h, start_topic:end_topic] = topic[start_topic:end_topic]
            keys[h, length - RECALL_TAIL :] = topic[length - RECALL_TAIL :]
            relevant[start_topic:end_topic] = True
            probes[h] = STRONG * a
        else:
            raise ValueError(f"unknown scenario {scenario!r}; valid: {SCENARIOS}")
    return keys, relevant, probes


def probe_metrics(keys, values, kept, probes):
    """(mass, err) per head: attention mass of the probe on the kept set and relative L2 error
    of the probe's output read from the kept set instead of the full set."""
    H = keys.shape[0]
    mass, err = np.empty(H), np.empty(H)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    for h in range(H):
        logits = keys[h] @ probes[h] * scale
        w = np.exp(logits - logits.max())
        full = w / w.sum()
        out_full = full @ values[h]
        wk = w[kept[h]]
        out_kept = (wk / wk.sum()) @ values[h][kept[h]]
        mass[h] = full[kept[h]].sum()
        err[h] = np.linalg.norm(out_kept - out_full) / np.linalg.norm(out_full)
    return mass, err


def run_point(scenario, length, budget, window, arm, seed) -> dict:
    """One stream through one arm: kept fraction, probe mass and error (head means)."""
    rng = np.random.default_rng([seed, length, budget, SCENARIOS.index(scenario)])
    keys, relevant, probes = make_stream(scenario, length, budget, rng)
    values = rng.standard_normal((N_HEADS, length, HEAD_DIM))
    spec = Arm.parse(ARMS.get(arm, arm))
    cache = KVCacheBuilder.build(
        spec.config(budget, n_sink=N_SINK, window=window, seed=seed, scoring="proxy")
    )
    k = mx.array(keys[None].astype(np.float32))
    cache.update_and_fetch(k, mx.array(values[None].astype(np.float32)))
    kept = cache.kept_positions[0]  # (H, n_kept)
    kept_frac = np.mean([relevant[kept[h]].sum() / relevant.sum() for h in range(N_HEADS)])
    mass, err = probe_metrics(keys, values, kept, probes)
    return {"kept": float(kept_frac), "mass": float(mass.mean()), "err": float(err.mean())}


def grid(args) -> tuple[list[tuple], list[dict]]:
    points, skipped = [], []
    for length, budget, window in itertools.product(args.lengths, args.budgets, args.windows):
        if budget <= N_SINK + window:
            why = f"budget {budget} <= sinks {N_SINK} + window {window}"
            skipped.append({"length": length, "budget": budget, "window": window, "why": why})
        else:
            points.append((length, budget, window))
    return points, skipped


def run_benchmark(scenarios=SCENARIOS, lengths=(256, 512), budgets=(32, 64), windows=(1, 8, 32),
                  arms=tuple(ARMS), seeds=5, quiet=False) -> dict:
    check_specs([ARMS.get(arm, arm) for arm in arms])
    ns = argparse.Namespace(lengths=list(lengths), budgets=list(budgets), windows=list(windows))
    points, skipped = grid(ns)
    bar = Progress(len(scenarios) * len(points) * len(arms) * seeds, NAME, quiet)
    rows = []
    for scenario in scenarios:
        for length, budget, window in points:
            for arm in arms:
                per_seed = [run_point(scenario, length, budget, window, arm, s)
                            for s in range(seeds)]
                bar.update(seeds)
                row = dict(scenario=scenario, length=length, budget=budget, window=window)
                row.update(arm=arm, seeds=seeds)
                for key in ("kept", "mass", "err"):
                    vals = np.array([p[key] for p in per_seed])
                    row[key] = float(vals.mean())
                    row[key + "_std"] = float(vals.std())
                rows.append(row)
    settings = dict(scenarios=list(scenarios), lengths=list(lengths), budgets=list(budgets))
    settings.update(windows=list(windows), arms=list(arms), seeds=seeds, n_sink=N_SINK)
    settings.update(head_dim=HEAD_DIM, heads=N_HEADS, strong=STRONG, weak=WEAK, noise=NOISE)
    settings.update(small_noise=SMALL_NOISE, recall_tail=RECALL_TAIL)
    return {"benchmark": NAME, "settings": settings, "skipped": skipped, "rows": rows,
            "elapsed_s": bar.elapsed, "environment": environment()}


def table(result: dict, scenario: str | None = None, metric: str = "kept") -> str:
    """Markdown tables: one line per grid point, one column per arm."""
    arms = result["settings"]["arms"]
    out = []
    for sc in [scenario] if scenario else result["settings"]["scenarios"]:
        rows = sorted((r for r in result["rows"] if r["scenario"] == sc), key=_point)
        out.append(markdown_table(*pivot(rows, ["scenario", *GRID], "arm", metric, arms)))
    return "\n\n".join(out)


def _point(row: dict) -> tuple:
    return tuple(row[k] for k in GRID)


def plot(result: dict, path) -> str:
    arms, scenarios = result["settings"]["arms"], result["settings"]["scenarios"]
    metrics = {"kept": "relevant region kept", "err": "probe output rel. L2 error"}
    fig, axes = plots.panels(2, 6.5, 3.2, rows=len(scenarios))
    for i, sc in enumerate(scenarios):
        rows = sorted((r for r in result["rows"] if r["scenario"] == sc), key=_point)
        headers, body = pivot(rows, list(GRID), "arm", "kept", arms)
        labels = [f"L{k[0]} b{k[1]} w{k[2]}" for k in body]
        for j, (metric, title) in enumerate(metrics.items()):
            body = pivot(rows, list(GRID), "arm", metric, arms)[1]
            series = {a: [line[3 + n] for line in body] for n, a in enumerate(arms)}
            plots.grouped_bars(axes[i, j], labels, series, f"{sc}: {title}")
    axes[0, 0].legend(fontsize=7, ncol=3)
    return plots.save(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--quick", False, "tiny smoke grid (seconds)"),
        *standard(NAME, "out", "quiet"),
        ("--scenarios", list(SCENARIOS), "scenarios"),
        ("--lengths", [256, 512], "stream lengths"),
        ("--budgets", [32, 64], "budgets"),
        ("--windows", [1, 8, 32], "protected recent windows"),
        ("--arms", list(ARMS), "arm names or arm specs"),
        ("--seeds", 5, "seeds per grid point"),
    ])


def execute(args: argparse.Namespace) -> dict:
    require_matplotlib()
    if args.quick:
        args.lengths, args.budgets, args.windows, args.seeds = [160], [32], [1, 8], 2
    result = run_benchmark(args.scenarios, args.lengths, args.budgets, args.windows, args.arms,
                           args.seeds, args.quiet)
    result["settings"]["quick"] = bool(args.quick)
    legend = {"kept": "fraction of the relevant tokens still stored at the end",
              "err": "relative L2 error of a probe query's attention output, kept set vs full set"}
    for metric, meaning in legend.items():
        print(f"\n## {metric}: {meaning} (mean over {args.seeds} seeds)\n")
        print(table(result, metric=metric))
    for s in result["skipped"]:
        print(f"skipped L{s['length']} budget {s['budget']} window {s['window']}: {s['why']}")
    finish(args, NAME, result, plot=lambda path: plot(result, path))
    return result
