"""What morphkv costs inside a real model: prefill and decode on the embedded SmolLM2-135M.

Arms, interleaved and repeated so machine noise hits all of them alike:
  kvcache   mlx_lm's KVCache (grows without bound)
  rotating  mlx_lm's RotatingKVCache(max_size=budget, keep=4)
  morphkv   MorphKV, real-query scoring, exact chunks (attached hook) - the default
  proxy     MorphKV, key-as-query scoring, exact chunks
Prefill: a 2048-token prompt of Python-docs prose in chunks of --prefill-step (mlx_lm's default
2048). Decode: --decode greedy tokens after it, per-token median. Prints ratios and writes
results/model_overhead.json. Run with OpenBLAS preloaded on Linux (see README):
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python benchmarks/model_overhead.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from pydoc_data.topics import topics

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from morphkv import KVCacheBuilder, KVCacheConfig
from morphkv.model import load

TOPICS = ["assignment", "exceptions", "for", "import", "lambda", "with", "class", "numbers"]


def make_caches(arm: str, model, budget: int):
    if arm == "kvcache":
        return [KVCache() for _ in model.layers]
    if arm == "rotating":
        return [RotatingKVCache(max_size=budget, keep=4) for _ in model.layers]
    scoring = "attention" if arm == "morphkv" else "proxy"
    config = KVCacheConfig(method="morphkv", morphkv_budget=budget, scoring=scoring)
    return KVCacheBuilder.for_model(model, config)


def run_arm(arm: str, model, prompt: mx.array, args) -> dict[str, float]:
    caches = make_caches(arm, model, args.budget)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--prefill-step", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--arms", default="kvcache,rotating,morphkv,proxy")
    parser.add_argument("--out", default="results/model_overhead.json")
    args = parser.parse_args()

    model, tokenizer = load()
    text = "\n\n".join(topics[t] for t in TOPICS)
    prompt = mx.array(tokenizer.encode(text)[: args.prompt_tokens])
    arms = args.arms.split(",")
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    for repeat in range(args.repeats):
        for arm in arms:
            result = run_arm(arm, model, prompt, args)
            runs[arm].append(result)
            print(
                f"repeat {repeat} {arm:<9} prefill {result['prefill_s']:.2f} s, "
                f"decode {result['decode_ms']:.1f} ms/token",
                flush=True,
            )
    summary = {
        arm: {k: statistics.median(r[k] for r in rs) for k in ("prefill_s", "decode_ms")}
        for arm, rs in runs.items()
    }
    print(f"\nbudget {args.budget}, {prompt.size}-token prompt in chunks of {args.prefill_step}")
    for arm, s in summary.items():
        line = f"{arm:<9} prefill {s['prefill_s']:7.2f} s   decode {s['decode_ms']:6.1f} ms/token"
        if "kvcache" in summary:
            line += f"   prefill x{s['prefill_s'] / summary['kvcache']['prefill_s']:.2f} vs KVCache"
        if "rotating" in summary:
            line += (
                f"   decode x{s['decode_ms'] / summary['rotating']['decode_ms']:.2f} vs Rotating"
            )
        print(line)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "runs": runs, "median": summary}, indent=2)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
