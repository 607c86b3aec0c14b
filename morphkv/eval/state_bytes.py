"""``morphkv eval fidelity --mode state``: what every byte of a bounded cache holds, per rule.

Each arm (default: every evicting rule of the registry and the recommended presets, at the same
memory size, 8-bit storage where the arm says so) is built for the model, fed 1,024 token ids
(a fixed ramp: bytes do not depend on the text; longer than the budget, so the selection state
is at its largest: rings full, pending queries held),
and measured: tokens kept per KV head, bytes per slot of K/V storage and of selection state
(positions, running scores, value norms, the window's attention ring, pending queries), and the
state's share of all bytes held. Every byte that is state is a token recency holds instead.

    morphkv eval fidelity --mode state --model qwen2.5-0.5b --memory 1572864
"""

from __future__ import annotations

import argparse

from ..core.quant import dims
from .arms import Arm
from .models import load_model
from .output import markdown_table, out_dir, write_json

DEFAULT_ARMS = ("streaming_llm:memory={m}:bits=8,h2o:memory={m}:bits=8:block=16,"
                "tova:memory={m}:bits=8:block=16,peak:memory={m}:bits=8:block=16,"
                "keydiff:memory={m}:bits=8:block=16,"
                "morphkv:memory={m}:bits=8:window=16:block=16,"
                "morphkv:memory={m}:bits=8:window=16:block=1,"
                "morphkv:memory={m}:bits=8:window=16:recent=0.5:value=true:peak=0.02:block=16,"
                "recommended:memory={m},tuned:memory={m},paper:memory={m}")


def measure(model, spec: str, tokens: int) -> dict:
    import mlx.core as mx

    caches = Arm.parse(spec).caches(model, 128)
    x = mx.arange(tokens)[None] % 1000 + 100
    for s in range(0, tokens, 256):
        mx.eval(model(x[:, s : s + 256], cache=caches))
    c = [k for k in caches if hasattr(k, "engine_nbytes")]
    slots = sum((k.config.budget + 1) * dims(k.keys)[1] for k in c)  # per layer x KV head
    storage = sum(k.storage_nbytes for k in c)
    state = sum(k.engine_nbytes for k in c)
    return {"arm": spec, "tokens": c[0].config.budget, "kv_bytes_per_slot": storage / slots,
            "state_bytes_per_slot": state / slots, "state_share": state / (storage + state),
            "bytes_held": storage + state}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=None, help="model (default: the embedded SmolLM2)")
    add("--memory", type=int, default=1572864, help="bytes per sequence (default 1.5 MiB)")
    add("--arms", default=None, help="comma-separated arm specs ({m} stands for --memory)")
    add("--out", default=None, help="output folder (default results/state)")


def run(args: argparse.Namespace) -> int:
    model, _ = load_model(args.model)
    specs = (args.arms or DEFAULT_ARMS).format(m=args.memory).split(",")
    rows = []
    for spec in specs:
        r = measure(model, spec, 1024)
        rows.append(r)
        print(f"{spec}: {r['tokens']} tokens, state {r['state_bytes_per_slot']:.1f} of "
              f"{r['kv_bytes_per_slot'] + r['state_bytes_per_slot']:.1f} bytes a slot "
              f"({100 * r['state_share']:.1f}%)", flush=True)
    table = markdown_table(["arm", "tokens per KV head", "K/V bytes a slot",
                            "state bytes a slot", "state share"],
                           [[r["arm"], r["tokens"], f"{r['kv_bytes_per_slot']:.1f}",
                             f"{r['state_bytes_per_slot']:.1f}",
                             f"{100 * r['state_share']:.1f}%"] for r in rows])
    print(table)
    path = out_dir(args, "state") / "state_bytes.json"
    write_json(path, {"benchmark": "state", "args": vars(args), "rows": rows, "table": table})
    print(f"wrote {path}")
    return 0
