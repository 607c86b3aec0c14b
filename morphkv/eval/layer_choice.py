"""Which layers of a model with sliding-window layers (Gemma 3) a budget bounds: the global
layers only (``KVCacheBuilder.for_model``'s layout: sliding layers keep mlx_lm's
``RotatingKVCache`` at the model's window, 512 for Gemma 3) or the sliding layers too, cut to
the budget (``RotatingKVCache(budget, keep=sinks)``: sinks + the most recent tokens; a
``MorphKVCache`` refuses sliding-window layers, whose mask must also drop tokens older than the
window), at each budget.

Teacher-forced, chunked (exact with the attention hook): mean KL(reference || arm) over the
positions from the budget on, against the model's own layout (full global layers, window
sliding layers), with everything each layout holds at the end (all layers, storage and
selection state). One process, all arms fed chunk by chunk side by side, so the reference's
log-probabilities are never stored whole (262k-token vocabulary).

    python -m morphkv.eval.layer_choice --model gemma3-270m --budgets 128,256
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..core.config import KVCacheConfig
from ..core.presets import PRESETS
from ..mlxlm.builder import KVCacheBuilder
from ..mlxlm.layout import native_caches
from .metrics import held_bytes
from .texts import prose_documents

WHERE = ("global", "+sliding")


def config_for(method: str, budget: int) -> KVCacheConfig:
    if method in PRESETS:
        return PRESETS[method](budget)
    return KVCacheConfig(method=method, morphkv_budget=budget)


def caches_for(model, config: KVCacheConfig, where: str) -> list:
    """``global``: the budget bounds the full-attention layers only; ``+sliding``: the
    sliding-window layers are cut to the budget as well (sinks + recent)."""
    from mlx_lm.models.cache import RotatingKVCache

    caches = KVCacheBuilder.for_model(model, config)  # attaches the hook
    if where == "+sliding":
        b, s = config.budget, config.morphkv_n_sink
        caches = [
            RotatingKVCache(max_size=b, keep=s) if isinstance(c, RotatingKVCache) and
            c.max_size > b else c for c in caches
        ]  # fmt: skip
    return caches


def _logprobs(model, x: mx.array, caches: list) -> mx.array:
    return nn.log_softmax(model(x, cache=caches)[0].astype(mx.float32), axis=-1)


def run(model, tokens: list[int], arms: dict[str, list], budget: int, chunk: int) -> dict:
    """Mean KL per arm over positions >= budget, and the bytes each arm holds at the end."""
    ref = native_caches(model)
    kl = dict.fromkeys(arms, 0.0)
    n = 0
    for start in range(0, len(tokens), chunk):
        x = mx.array([tokens[start : start + chunk]])
        want = _logprobs(model, x, ref)
        first = max(budget - start, 0)
        for name, caches in arms.items():
            got = _logprobs(model, x, caches)
            d = (mx.exp(want) * (want - got)).sum(axis=-1)[first:].sum()
            kl[name] += d.item()
        n += max(x.shape[1] - first, 0)
    held = {name: sum(held_bytes(c) for c in caches) for name, caches in arms.items()}
    held["reference"] = sum(held_bytes(c) for c in ref)
    return {"kl": {k: v / max(n, 1) for k, v in kl.items()}, "bytes": held, "n": n}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m morphkv.eval.layer_choice", description=__doc__)
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--budgets", default="128,256")
    p.add_argument("--methods", default="tuned,streaming_llm")
    p.add_argument("--tokens", type=int, default=1100, help="prose tokens (default 1100)")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--out", default="results/layer_choice")
    args = p.parse_args(argv)
    from ..model import load

    t0 = time.time()
    model, tok = load(args.model)
    tokens = prose_documents(tok, args.tokens)[0]
    results = []
    for budget in (int(b) for b in args.budgets.split(",")):
        arms = {
            f"{m} {w}": caches_for(model, config_for(m, budget), w)
            for m in args.methods.split(",")
            for w in WHERE
        }
        r = run(model, tokens, arms, budget, args.chunk)
        results.append({"budget": budget, **r})
        for name in arms:
            mib, ref = r["bytes"][name] / 2**20, r["bytes"]["reference"] / 2**20
            print(f"budget {budget:4d}  {name:24s}  KL {r['kl'][name]:.4f}  held {mib:6.2f} MiB"
                  f"  (reference {ref:.2f} MiB, {r['n']} positions)", flush=True)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layer_choice.json").write_text(json.dumps(
        {"model": args.model, "tokens": len(tokens), "chunk": args.chunk, "results": results,
         "seconds": round(time.time() - t0, 1)}, indent=1))  # fmt: skip
    print(f"wrote {out / 'layer_choice.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
