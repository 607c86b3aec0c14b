"""MLX CPU speed with and without the OpenBLAS preload (morphkv.runtime.blas).

Runs a worker process twice (``LD_PRELOAD`` stripped / set) and times, in each: a 1024x1024
float32 matmul (median of 5), a 256-token prompt forward of the model and a short greedy
generation (``--tokens``). Prints the speed-ups; JSON under ``results/blas/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from ..eval import plots
from ..eval.flags import add_flags, standard
from ..eval.models import RANDOM_TINY, load_model
from ..eval.output import environment, finish, markdown_table
from ..eval.plots import require_matplotlib

NAME = "blas"
MEASURES = {  # label -> (worker key, speed-up key, higher is better)
    "matmul 1024^2 f32 (s)": ("matmul_1024_f32_s", "matmul_1024_f32", False),
    "256-token forward (s)": ("forward_256_tokens_s", "forward_256_tokens", False),
    "prompt tok/s": ("prompt_tps", "prompt_tps", True),
    "generation tok/s": ("generation_tps", "generation_tps", True),
}


def worker(max_tokens: int, model_name: str | None) -> dict:
    from pydoc_data.topics import topics

    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    a, b = mx.random.normal((1024, 1024)), mx.random.normal((1024, 1024))
    mx.eval(a, b, a @ b)  # warm up
    times = []
    for _ in range(5):
        t = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    model, tok = load_model(model_name)
    load_s = time.perf_counter() - t
    text = topics["for"] + topics["with"]
    ids = tok.encode(text) if tok is not None else [c % 256 for c in text.encode()]
    ids = mx.array(ids[:256])[None]
    mx.eval(model(ids[:, :8]))  # warm up
    t = time.perf_counter()
    mx.eval(model(ids))
    forward_s = time.perf_counter() - t
    t = time.perf_counter()
    steps = generate_step(ids[0, :32], model, max_tokens=max_tokens, sampler=make_sampler(0.0))
    first = None
    for n, _ in enumerate(steps, start=1):  # noqa: B007 - n is the count after the loop
        first = first or time.perf_counter()
    end = time.perf_counter()
    return {
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "matmul_1024_f32_s": statistics.median(times),
        "model_load_s": load_s,
        "forward_256_tokens_s": forward_s,
        "prompt_tokens": 32,
        "prompt_tps": 32 / (first - t),
        "generation_tokens": n,
        "generation_tps": (n - 1) / (end - first) if end > first else float("nan"),
        "generation_wall_s": end - t,
    }


def run_child(env: dict, args: argparse.Namespace) -> dict:
    argv = [sys.executable, "-m", "morphkv.bench.blas", "--worker", "--tokens", str(args.tokens)]
    argv += ["--model", args.model] if args.model else []
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"morphkv: error: blas worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--tokens", 32, "tokens to generate"),
        *standard(NAME, "model", "out"),
        ("--quick", False, "tiny run on a random-weight model for tests/CI"),
    ])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """CLI entry point (``morphkv`` command contract): 0 on success, 1 when no BLAS is found."""
    if args.worker:
        print(json.dumps(worker(args.tokens, args.model)))
        return 0
    from ..runtime.blas import blas_env, find_blas

    require_matplotlib()
    if args.quick:
        args.model, args.tokens = args.model or RANDOM_TINY, min(args.tokens, 8)
    lib = find_blas()
    if lib is None:
        print("no OpenBLAS found (or MORPHKV_NO_BLAS_PRELOAD set): nothing to compare")
        return 1
    env_off = blas_env(enable=False)
    env_off.pop("MORPHKV_BLAS_REEXEC", None)
    print(f"OpenBLAS: {lib}; timing without, then with the preload ...", flush=True)
    off, on = run_child(env_off, args), run_child(blas_env(enable=True), args)
    speedup = {s: (on[k] / off[k] if up else off[k] / on[k]) for k, s, up in MEASURES.values()}
    result = {"benchmark": NAME, "blas_library": lib, "without_preload": off,
              "with_preload": on, "speedup": speedup,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "environment": environment()}
    rows = [[label, off[k], on[k], speedup[s]] for label, (k, s, _) in MEASURES.items()]

    def plot(path):
        fig, axes = plots.panels(1, 6, 4)
        plots.grouped_bars(axes[0, 0], list(speedup), {"speed-up": list(speedup.values())}, lib)
        plots.save(fig, path)

    finish(args, NAME, result, f"{NAME}{'_quick' if args.quick else ''}", plot,
           markdown_table(["", "reference BLAS", "OpenBLAS", "speed-up"], rows), png=NAME)
    return 0


if __name__ == "__main__":  # the worker processes
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
