"""Speed and memory at length: decode tokens/s, MLX memory and stored KV bytes as the context
grows, for mlx_lm's own caches and the MorphKV eviction family at one budget.

Decode is measured teacher-forced: a short prompt is prefilled, then real text (Python's
``pydoc_data.topics``) is fed one token at a time and the logits evaluated every step. Every
``--every`` tokens each arm records tokens/s over the last block, the median ms/token, MLX
active and peak memory (peak reset once per arm) and the stored KV bytes (the caches'
``nbytes``). How the arms are driven: ``length.py``. ``--micro`` runs the per-layer grid of
``morphkv bench speed --mode layer`` instead (kept for compatibility).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from ..eval import plots
from ..eval.arms import check_specs
from ..eval.flags import add_flags
from ..eval.models import RANDOM_TINY
from ..eval.output import markdown_table, pivot
from ..eval.plots import require_matplotlib
from .length import FULL, run_length, worker_main

__all__ = ["RANDOM_TINY", "DEFAULT_ARMS", "execute", "add_arguments"]
DEFAULT_ARMS = ("full", "rotating", "morphkv", "h2o", "tova", "streaming_llm")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_flags(parser, [
        ("--model", None, "model (default: the embedded SmolLM2-135M)"),
        ("--tokens", 20000, "context length to reach"),
        ("--every", 500, "record every N tokens"),
        ("--budget", 512, "tokens kept per KV head"),
        ("--window", 8, "MorphKV window / protected tail"),
        ("--n-sink", 4, "protected first tokens"),
        ("--arms", ",".join(DEFAULT_ARMS), "comma list of arm specs: full (mlx_lm KVCache), "
         "rotating, or an eviction method with options, e.g. morphkv:window=32"),
        ("--scoring", "auto", "scoring of the morphkv-family arms", ["auto", "proxy", "attention"]),
        ("--prompt-tokens", 32, "prefilled prompt length"),
        ("--full-max-tokens", 8000, "stop the full-cache arm at this context length"),
        ("--sample", 0, "time only the last N single-token steps of each block, feed the rest "
         "as untimed chunks of --chunk tokens (0: decode every token)"),
        ("--chunk", 256, "chunk size for --sample"),
        ("--in-process", False, "run the arms in this process, one after another"),
        ("--quick", False, "tiny run for tests/CI"),
        ("--micro", False, "the per-layer grid instead (same as "
         "`morphkv bench speed --mode layer --grid`)"),
        ("--repeats", 0, "micro: timed repeats (0: auto)"),
        ("--out", "results/speed", "output directory"),
        ("--no-plot", False, "skip the PNG plots"),
    ])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser


def _apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.tokens, args.every = min(args.tokens, 300), min(args.every, 50)
        args.budget, args.window = min(args.budget, 64), min(args.window, 8)
        args.full_max_tokens = min(args.full_max_tokens, args.tokens)
        args.prompt_tokens = min(args.prompt_tokens, 16)


def _at(records: list[dict], position: int, field: str) -> float | None:
    """The record at ``position`` (the nearest one at or below it)."""
    below = [r for r in records if r["position"] <= position]
    return below[-1][field] if below else None


def evaluate_targets(result: dict, args: argparse.Namespace) -> list[dict]:
    """The length targets (positions 2000 / 20000 / 8000 in a full run), computed."""
    late = (args.tokens // args.every) * args.every
    early = 2000 if late >= 4000 else max(args.every, (late // 2 // args.every) * args.every)
    cross = max(args.every, (min(8000, args.full_max_tokens, late) // args.every) * args.every)
    recs, out, ms, mib = result["records"], [], "ms_per_token_median", 2**-20
    f, rot = recs.get("full"), recs.get("rotating")
    bounded = [v for k, v in recs.items() if k not in ("full", "rotating")]  # the first one
    m = recs.get("morphkv") or (bounded[0] if bounded else None)

    def target(name, value, ok, detail):
        out.append({"target": name, "value": value, "pass": ok, "detail": detail})

    if m:
        p0, p1 = _at(m, early, "peak_bytes"), _at(m, late, "peak_bytes")
        detail = f"peak {p0 * mib:.1f} MiB @ {early} -> {p1 * mib:.1f} MiB @ {late}"
        if f:
            fe, fl = _at(f, early, "peak_bytes"), f[-1]["peak_bytes"]
            detail += (f"; full: {fe * mib:.1f} -> {fl * mib:.1f} MiB @ {f[-1]['position']} "
                       f"(+{100 * (fl / fe - 1):.1f}%)")
        growth = p1 / p0 - 1
        target(f"morphkv peak memory growth {early}->{late} < 2%", growth, growth < 0.02, detail)
        t0, t1 = _at(m, early, ms), _at(m, late, ms)
        target(f"morphkv decode ms/token @ {late} within 10% of @ {early}", t1 / t0,
               t1 / t0 <= 1.10, f"{t0:.2f} ms -> {t1:.2f} ms")
    past = [r for r in (m if m and rot else []) if r["position"] > 2 * args.budget]
    ratios = [r[ms] / b for r in past if (b := _at(rot, r["position"], ms))]
    if ratios:
        ratio = float(np.median(ratios))
        target("morphkv decode <= 1.15x RotatingKVCache", ratio, ratio <= 1.15,
               f"median over {len(ratios)} blocks past {2 * args.budget} tokens of the per-block "
               "median-ms ratio")
    if m and f and f[-1]["position"] >= cross:
        tm, tf = _at(m, cross, ms), _at(f, cross, ms)
        target(f"morphkv decodes faster than full @ {cross} tokens", tm / tf, tm < tf,
               f"morphkv {tm:.2f} ms vs full {tf:.2f} ms")
    return out


TABLES = {  # printed table -> (record field, scale)
    "tokens/s over the block": ("tokens_per_s", 1),
    "median ms/token": ("ms_per_token_median", 1),
    "peak memory MiB (MLX)": ("peak_bytes", 2**-20),
    "active memory MiB (MLX)": ("active_bytes", 2**-20),
    "stored KV MiB (the caches' nbytes)": ("kv_bytes", 2**-20),
}


def format_table(result: dict, args: argparse.Namespace | None = None) -> str:
    recs = [{**r, "arm": a} for a, rs in result["records"].items() for r in rs]
    positions = sorted({r["position"] for r in recs})
    if len(positions) > 12:  # a dozen rows, always the first and the last
        idx = np.unique(np.linspace(0, len(positions) - 1, 12).round().astype(int))
        keep = {positions[i] for i in idx}
        recs = [r for r in recs if r["position"] in keep]
    recs.sort(key=lambda r: r["position"])
    out = []
    for title, (field, scale) in TABLES.items():
        scaled = [{**r, "v": r[field] * scale} for r in recs]
        out += [f"\n{title}", markdown_table(*pivot(scaled, ["position"], "arm", "v"))]
    return "\n".join(out)


def plot_length(result: dict, out: Path) -> list[str]:
    recs, x = result["records"], "context position (tokens)"

    def series(field, scale=1):
        return {a: ([r["position"] for r in rs], [r[field] * scale for r in rs])
                for a, rs in recs.items()}

    fig, axes = plots.panels(1, 8, 5)
    speed = "Decode speed vs context length"
    plots.lines(axes[0, 0], series("tokens_per_s"), x, "decode tokens/s (block)", speed)
    paths = [plots.save(fig, out / "speed_tokens_per_s.png", 100)]
    fig, axes = plots.panels(3, 5.3, 5)
    panels = {"peak_bytes": "MLX peak memory", "active_bytes": "MLX active memory",
              "kv_bytes": "stored KV bytes"}
    for ax, (field, title) in zip(axes[0], panels.items(), strict=True):
        plots.lines(ax, series(field, 2**-20), x, "MiB", title)
    return paths + [plots.save(fig, out / "speed_memory.png", 100)]


def _meta(args: argparse.Namespace) -> dict:
    import mlx.core as mx

    return {"args": {k: v for k, v in vars(args).items() if k != "worker"},
            "mlx": mx.__version__, "ld_preload": os.environ.get("LD_PRELOAD", ""),
            "cpu_count": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def execute(args: argparse.Namespace, model=None, tokenizer=None) -> dict:
    """Run the benchmark ``args`` selects; write JSON (+ PNG) under ``args.out``; return the
    result. ``model`` (and ``tokenizer``) may be passed in to skip loading."""
    if getattr(args, "worker", None):
        return {"exit": worker_main(args)}
    if args.micro:  # the per-layer grid: morphkv bench speed --mode layer --grid
        from . import layer

        grid = argparse.ArgumentParser()
        layer.add_arguments(grid)
        grid = grid.parse_args(["--grid", "--out", args.out] + ["--quick"] * args.quick)
        grid.repeats, grid.no_plot = args.repeats or (20 if args.quick else 200), args.no_plot
        return layer.execute(grid)
    require_matplotlib(args)
    _apply_quick(args)
    arms = [a.strip() for a in str(args.arms).split(",") if a.strip()]
    check_specs(arms, FULL)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"meta": _meta(args), **run_length(args, arms, model, tokenizer)}
    result["targets"] = evaluate_targets(result, args)
    print(f"speed bench: {result['mode']}; {result['wall_s']:.0f}s")
    if "full" in result["records"] and args.full_max_tokens < args.tokens:
        print(f"note: the full arm was stopped at {args.full_max_tokens} tokens")
    print(format_table(result, args) + "\n")
    for t in result["targets"]:
        print(f"{'PASS' if t['pass'] else 'MISS'} {t['target']}: {t['value']:.3f} ({t['detail']})")
    if not args.no_plot:
        result["plots"] = plot_length(result, out)
    path = out / f"speed{'_quick' if args.quick else ''}.json"
    path.write_text(json.dumps(result, indent=1))
    result["json"] = str(path)
    print(f"wrote {path}" + "".join(f", {p}" for p in result.get("plots", [])))
    return result


if __name__ == "__main__":  # the worker processes: python -m morphkv.bench.speed --worker ARM
    args = add_arguments(argparse.ArgumentParser(prog="morphkv bench speed")).parse_args()
    sys.exit(int(execute(args).get("exit", 0)))
