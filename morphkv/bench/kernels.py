"""MLX kernels per layer per decode step and host synchronizations per step, per cache.

One layer (B=1, 4 KV heads, head_dim 64, float16, real queries: ``--groups`` query heads per
KV head, handed in as the attention hook hands them), filled past its budget; then ``--blocks``
eviction blocks of single-token updates. Each update's MLX graph (everything the cache adds
between the new key/value and what attention reads, plus the storage it keeps) is exported
with ``mx.export_to_dot`` before it is evaluated and its nodes counted: ``kernels`` are the
primitives that run code on the device, ``views`` the ones that only re-describe memory
(slices, reshapes, broadcasts, transposes). Host synchronizations are the updates that read
MLX arrays on the host (a morphkv eviction: the stored keys and the pending queries), counted
on the CPU. Averages are over whole eviction blocks. RotatingKVCache is the reference.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from pathlib import Path

import mlx.core as mx

from ..eval.util import add_flags, environment, markdown_table, out_dir, write_json
from ..mlxlm.hooks import queries_by_hand
from .layer import B, D, H, make_cache, stream

NAME = "kernels"
VIEWS = {"Slice", "Reshape", "Broadcast", "Transpose", "ExpandDims", "Squeeze", "Copy",
         "AsStrided", "StopGradient"}


def graph_nodes(arrays) -> list[str]:
    """Primitive names in the unevaluated graph behind ``arrays``."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "g.dot"
        mx.export_to_dot(str(path), *arrays)
        text = path.read_text()
    return re.findall(r'label\s*=\s*"([A-Za-z]+)[^"]*"\s*,?\s*shape\s*=\s*"?rectangle', text) or [
        label for label in re.findall(r'label\s*=\s*"([A-Za-z]+)', text) if label[0].isupper()
    ]


def storage_of(cache) -> list:
    """The arrays a cache keeps after an update (so that its writes are in the graph)."""
    parts = [cache.keys, cache.values]
    return [p for x in parts for p in (x if isinstance(x, tuple) else (x,)) if p is not None]


def count(spec: str, budget: int, groups: int, blocks: int) -> dict:
    cache = make_cache(spec, budget, groups=groups)
    block = getattr(getattr(cache, "config", None), "block", 1)
    steps = blocks * block
    n = budget + 32 + steps + block
    k, v, q = stream(n, mx.float16, groups)
    warm = budget + 8
    warm += -(warm - budget) % block  # start right after an eviction
    cache.update_and_fetch(k[:, :, :warm], v[:, :, :warm])
    if hasattr(cache, "prepare_attention"):
        cache.prepare_attention(q[:, :, :warm], D**-0.5, None)
        cache.size()
    mx.eval(storage_of(cache))
    syncs = [0]
    engine = getattr(cache, "engine", None)
    if engine is not None:
        settle = engine.settle

        def counted(*args):
            syncs[0] += 1
            return settle(*args)

        engine.settle = counted
    kernels = views = 0
    for t in range(warm, warm + steps):
        token = [x[:, :, t : t + 1] for x in (k, v, q) if x is not None]
        mx.eval(token)
        out = cache.update_and_fetch(token[0], token[1])
        if hasattr(cache, "prepare_attention"):
            cache.prepare_attention(token[2], D**-0.5, None)
            cache.size()  # the step's deferred work (an eviction's row moves) joins its graph
        nodes = graph_nodes([*out, *storage_of(cache)])
        kernels += sum(1 for x in nodes if x not in VIEWS)
        views += sum(1 for x in nodes if x in VIEWS)
        mx.eval(*out, *storage_of(cache))
    if engine is not None:
        del engine.settle
    return {"cache": spec, "block": block, "kernels_per_step": kernels / steps,
            "views_per_step": views / steps, "host_syncs_per_step": syncs[0] / steps,
            "steps": steps, "rows": B * H}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--budget", 512, "tokens kept"),
        ("--groups", 3, "query heads per KV head (real-query scoring)"),
        ("--blocks", 4, "eviction blocks counted per cache"),
        ("--arms", ["rotating", "recommended", "recommended:block=8",
                    "recommended:block=16", "paper", "paper:block=8"], "cache specs"),
        ("--out", None, "output folder (default results/kernels)"),
        ("--quick", False, "tiny run for tests/CI"),
    ])


def execute(args: argparse.Namespace) -> dict:
    if args.quick:
        args.budget, args.blocks = 64, 1
    with queries_by_hand():
        rows = [count(spec, args.budget, args.groups, args.blocks) for spec in args.arms]
    columns = ["cache", "block", "kernels_per_step", "views_per_step", "host_syncs_per_step"]
    print(markdown_table(columns, [[r[c] for c in columns] for r in rows]))
    result = {"benchmark": NAME, "args": vars(args), "rows": rows, "environment": environment()}
    write_json(out_dir(args, NAME) / f"{NAME}{'_quick' if args.quick else ''}.json", result)
    return result
