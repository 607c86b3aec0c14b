"""MLX CPU speed with and without the OpenBLAS preload (morphkv.blas).

Runs itself twice as a subprocess (LD_PRELOAD stripped / set) and times, in each:
a 1024x1024 float32 matmul, a 256-token prompt forward of the embedded SmolLM2-135M, and a
short greedy generation. Prints the ratios and writes results/blas_speed.json.

Run: python benchmarks/blas_speed.py [--tokens 32] [--out results/blas_speed.json]
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(max_tokens: int) -> dict:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from morphkv.model import load

    a = mx.random.normal((1024, 1024))
    b = mx.random.normal((1024, 1024))
    mx.eval(a, b)
    mx.eval(a @ b)  # warm up
    times = []
    for _ in range(5):
        t = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - t)
    matmul_s = statistics.median(times)

    t = time.perf_counter()
    model, tok = load()
    load_s = time.perf_counter() - t

    from pydoc_data.topics import topics

    ids = mx.array(tok.encode(topics["for"] + topics["with"])[:256])[None]
    mx.eval(model(ids[:, :8]))  # warm up
    t = time.perf_counter()
    mx.eval(model(ids))
    forward_s = time.perf_counter() - t

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Write a short paragraph about the ocean."}],
        add_generation_prompt=True,
    )
    resp = None
    t = time.perf_counter()
    for r in mlx_lm.stream_generate(
        model, tok, prompt, max_tokens=max_tokens, sampler=make_sampler(0.0)
    ):
        resp = r
    gen_wall = time.perf_counter() - t
    return {
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "matmul_1024_f32_s": matmul_s,
        "model_load_s": load_s,
        "forward_256_tokens_s": forward_s,
        "prompt_tokens": resp.prompt_tokens,
        "prompt_tps": resp.prompt_tps,
        "generation_tokens": resp.generation_tokens,
        "generation_tps": resp.generation_tps,
        "generation_wall_s": gen_wall,
    }


def run_child(env: dict, max_tokens: int) -> dict:
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", "--tokens", str(max_tokens)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        sys.exit(f"worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32, help="tokens to generate")
    ap.add_argument("--out", default=str(REPO / "results" / "blas_speed.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.tokens)))
        return 0

    sys.path.insert(0, str(REPO))
    from morphkv.blas import blas_env, find_blas

    lib = find_blas()
    if lib is None:
        print("no OpenBLAS found (or MORPHKV_NO_BLAS_PRELOAD set): nothing to compare")
        return 1
    env_off = blas_env(enable=False)
    env_off.pop("MORPHKV_BLAS_REEXEC", None)
    env_on = blas_env(enable=True)
    print(f"OpenBLAS: {lib}", flush=True)
    print("running without preload ...", flush=True)
    off = run_child(env_off, args.tokens)
    print("running with preload ...", flush=True)
    on = run_child(env_on, args.tokens)
    ratios = {
        "matmul_1024_f32": off["matmul_1024_f32_s"] / on["matmul_1024_f32_s"],
        "forward_256_tokens": off["forward_256_tokens_s"] / on["forward_256_tokens_s"],
        "prompt_tps": on["prompt_tps"] / off["prompt_tps"],
        "generation_tps": on["generation_tps"] / off["generation_tps"],
    }
    result = {
        "blas_library": lib,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "without_preload": off,
        "with_preload": on,
        "speedup": ratios,
    }
    print(f"{'':26s}{'reference BLAS':>16s}{'OpenBLAS':>12s}{'speedup':>10s}")
    rows = [
        ("matmul 1024^2 f32 (s)", "matmul_1024_f32_s", "matmul_1024_f32"),
        ("256-token forward (s)", "forward_256_tokens_s", "forward_256_tokens"),
        ("prompt tok/s", "prompt_tps", "prompt_tps"),
        ("generation tok/s", "generation_tps", "generation_tps"),
    ]
    for label, key, rkey in rows:
        print(f"{label:26s}{off[key]:16.4f}{on[key]:12.4f}{ratios[rkey]:9.1f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
