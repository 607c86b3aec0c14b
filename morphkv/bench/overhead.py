"""What the cache costs inside a real model: prefill and decode time per arm.

Arms are interleaved and repeated so machine noise hits all of them alike; by default mlx_lm's
``KVCache`` (grows without bound) and ``RotatingKVCache(budget, keep=4)``, MorphKV with the
model's real queries and with keys as proxy queries (both exact chunks through the attention
hook). Prefill: a ``--prompt-tokens`` prompt of Python-docs prose in chunks of
``--prefill-step`` (mlx_lm's default 2048); decode: ``--decode`` greedy tokens after it,
per-token median. Ratios: prefill vs ``kvcache``, decode vs ``rotating``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from . import plots
from ._util import (
    RANDOM_TINY,
    Progress,
    add_flags,
    environment,
    load_model,
    out_dir,
    require_matplotlib,
    write_json,
)
from .arms import parse_arms
from .texts import PROSE_TOPICS, prose_text

NAME = "overhead"
ALIASES = {"morphkv": "morphkv:attn", "proxy": "morphkv:proxy"}  # the old script's arm names


def run_arm(arm, model, prompt: mx.array, args) -> dict[str, float]:
    caches = arm.caches(model, args.budget, 4)
    start = time.perf_counter()
    for i in range(0, prompt.size, args.prefill_step):
        logits = model(prompt[None, i : i + args.prefill_step], cache=caches)
        mx.eval(logits)
    prefill = time.perf_counter() - start
    token = mx.argmax(logits[:, -1], axis=-1)
    times = []
    for _ in range(args.decode):
        start = time.perf_counter()
        logits = model(token[None], cache=caches)
        token = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(token)
        times.append(time.perf_counter() - start)
    return {"prefill_s": prefill, "decode_ms": statistics.median(times) * 1e3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--model", None, "model (default: the embedded SmolLM2)"),
        ("--budget", 512, "tokens kept per KV head"),
        ("--prompt-tokens", 2048, "prompt length"),
        ("--prefill-step", 2048, "prefill chunk"),
        ("--decode", 48, "decode steps"),
        ("--repeats", 2, "interleaved repeats"),
        ("--arms", ["kvcache", "rotating", "morphkv", "proxy"], "kvcache, rotating, morphkv "
         "(real queries), proxy (keys as queries), or arm specs"),
        ("--out", None, "output folder (default results/overhead)"),
        ("--no-plot", False, "skip the PNG"),
        ("--quick", False, "tiny run on a random-weight model for tests/CI"),
    ])


def run(args: argparse.Namespace) -> int:
    """CLI entry point (``morphkv`` command contract): 0 on success."""
    require_matplotlib(args)
    if args.quick:
        args.model = args.model or RANDOM_TINY
        args.budget, args.prompt_tokens, args.prefill_step = 32, 128, 64
        args.decode, args.repeats = 8, 1
    arms = dict(zip(args.arms, parse_arms([ALIASES.get(a, a) for a in args.arms]), strict=True))
    model, tokenizer = load_model(args.model)
    text = prose_text(PROSE_TOPICS)
    ids = tokenizer.encode(text) if tokenizer is not None else [b % 256 for b in text.encode()]
    prompt = mx.array(ids[: args.prompt_tokens])
    runs: dict[str, list] = {name: [] for name in arms}
    bar = Progress(args.repeats * len(arms), NAME)
    for _ in range(args.repeats):
        for name, arm in arms.items():
            runs[name].append(run_arm(arm, model, prompt, args))
            r = runs[name][-1]
            bar.update(1, f"{name}: prefill {r['prefill_s']:.2f} s, decode {r['decode_ms']:.1f} ms")
    median = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("prefill_s", "decode_ms")}
        for name, rs in runs.items()
    }
    result = {"benchmark": NAME, "args": vars(args), "runs": runs, "median": median}
    result["environment"] = environment()
    folder = out_dir(args, NAME)
    write_json(folder / f"{NAME}{'_quick' if args.quick else ''}.json", result)
    from .report import overhead_section  # the same table the report shows

    print(overhead_section(result))
    if not args.no_plot:
        fig, axes = plots.panels(2, 5, 4)
        for ax, key in zip(axes[0], ("prefill_s", "decode_ms"), strict=True):
            plots.grouped_bars(ax, list(median), {key: [m[key] for m in median.values()]}, key)
        plots.save(fig, folder / f"{NAME}.png")
    print(f"wrote {folder}/{NAME}.json")
    return 0
