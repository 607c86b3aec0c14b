"""Probe (stop 70): a prompt chunk whose pins cannot pass the vote's room, run whole or cut.

The model's forward pass used to cut every chunk longer than a quarter of the vote's room into
pieces (a vote before each) even where no vote could run; ``vote.plan`` now joins the leading
pieces no vote needs. This times one prompt into fresh caches of ``recommended(memory=...)``
both ways (the old way by making ``plan`` return every piece), alternated, 5 runs each, and
checks that the logits are the same.

    OPENBLAS_NUM_THREADS=1 python docs/figures/whole_chunk_probe.py

Writes docs/figures/whole_chunk_probe.json."""

from __future__ import annotations  # noqa: I001 (morphkv, which loads OpenBLAS, before MLX)

import json
import statistics
import time
from pathlib import Path

import morphkv  # noqa: F401
import mlx.core as mx

from morphkv import KVCacheBuilder, recommended
from morphkv.core import vote
from morphkv.model import load

REPO = Path(__file__).resolve().parents[2]
CASES = ((None, 180, 2.81), ("qwen2.5-0.5b", 150, 1.5))  # model (None: SmolLM2), tokens, MiB


def one(name: str, tokens: int, mib: float, runs: int = 5) -> dict:
    model, tok = load(name)
    ids = mx.array(tok.encode((REPO / "docs/engine.md").read_text())[:tokens])[None]
    config, plan = recommended(memory=int(mib * 2**20)), vote.plan
    times, logits = {"cut": [], "whole": []}, {}
    try:
        for r in range(runs):
            for way in (("cut", "whole") if r % 2 else ("whole", "cut")):
                vote.plan = (lambda c, C, size: vote.pieces(C, size)) if way == "cut" else plan
                caches = KVCacheBuilder.for_model(model, config)
                t = time.perf_counter()
                logits[way] = model(ids, cache=caches)
                mx.eval(logits[way], [c.state for c in caches])
                times[way].append(time.perf_counter() - t)
    finally:
        vote.plan = plan
    built = KVCacheBuilder.for_model(model, config)[0].config
    return {"model": name or "smollm2-135m", "tokens": tokens, "memory_mib": mib,
            "budget": built.budget, "piece_when_cut": max(2, min(tokens, vote.room(built) // 4)),
            "cut_s": sorted(times["cut"]), "whole_s": sorted(times["whole"]),
            "median_whole_over_cut": statistics.median(
                w / c for w, c in zip(times["whole"], times["cut"], strict=True)),
            "max_abs_logit_diff": float(mx.max(mx.abs(logits["cut"] - logits["whole"])))}


def main() -> None:
    rows = [one(*case) for case in CASES]
    for r in rows:
        print(f"{r['model']}: {r['tokens']} tokens, budget {r['budget']}: cut into pieces of "
              f"{r['piece_when_cut']} {statistics.median(r['cut_s']):.2f} s, whole "
              f"{statistics.median(r['whole_s']):.2f} s (x{r['median_whole_over_cut']:.2f}), "
              f"logits differ by {r['max_abs_logit_diff']}")
    path = REPO / "docs/figures/whole_chunk_probe.json"
    path.write_text(json.dumps({"command": "OPENBLAS_NUM_THREADS=1 python "
                                "docs/figures/whole_chunk_probe.py", "rows": rows}, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
