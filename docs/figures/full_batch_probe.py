"""`full` rows in a batch, row-wise (``BatchMorphKVCache``, before stop 67) vs one storage
(``DeviceBatchCache``), side by side in one process on the embedded model: decode tokens per
second of ``batch_generate`` with 4 rows, alternated runs, medians.

    python docs/figures/full_batch_probe.py [--rows 4] [--tokens 128] [--runs 3]
"""

import morphkv  # noqa: F401, I001  (before MLX: OpenBLAS)
import argparse
import json
import statistics
from pathlib import Path

from mlx_lm.generate import batch_generate

from morphkv import KVCacheConfig, patch_model
from morphkv.core import cache as cache_module
from morphkv.core.batch import BatchMorphKVCache
from morphkv.model import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    model, tok = load()[:2]
    patch_model(model, KVCacheConfig(method="full"))
    words = "lighthouse keeper,fox,clockmaker,river,owl,baker,comet,garden".split(",")
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Tell a story about a {w}."}],
                                       add_generation_prompt=True) for w in words[: args.rows]]
    device_merge = cache_module.MorphKVCache.merge.__func__

    def row_wise(cls, caches):
        return BatchMorphKVCache.merge(caches, row_class=cls)

    paths = {"row-wise": classmethod(row_wise), "one storage": classmethod(device_merge)}
    times = {k: [] for k in paths}
    batch_generate(model, tok, prompts, max_tokens=4)  # warm-up
    for run in range(args.runs):
        for name in (list(paths) if run % 2 == 0 else list(paths)[::-1]):
            cache_module.MorphKVCache.merge = paths[name]
            res = batch_generate(model, tok, prompts, max_tokens=args.tokens)
            times[name].append(res.stats.generation_tps)
    out = {name: {"generation_tps": v, "median": statistics.median(v)} for name, v in times.items()}
    out["ratio"] = out["one storage"]["median"] / out["row-wise"]["median"]
    print(json.dumps(out, indent=1))
    Path(__file__).with_name("full_batch_probe.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
