"""``morphkv eval fidelity --mode blocks``: quality per eviction block: natural-chat recall and KL
to full cache.

For one setting (``tuned`` MorphKV by default, ``paper`` or ``recommended``) at one budget,
every block of ``--blocks`` (arms ``<setting>:block=N``) is measured on the SAME items and
texts of one split:

- recall (``morphkv eval recall --data longchat --set natural``'s items and runner): a fact said in
passing in
  the first turns of a chat, asked 3-6 budgets later; counted over the items the full cache
  answers, with a 95% Wilson interval, and per block the items lost / gained against block 1;
- teacher-forced KL(full || arm) (``runner.Feeder``, exact chunks): per position from the first
  one a cache of ``budget`` tokens lacks a token; mean over texts of each text's mean, with a
  95% interval from a bootstrap over blocks of 64 consecutive positions (resampled within each
  text, the same draws for every arm, so the ratio to block 1 has a paired interval too).

References: the full cache (recall's base) and StreamingLLM (sinks + recency) holding as many
bytes as the largest of the block arms (``memory=`` resolved by ``KVCacheBuilder.for_model``;
bytes = every byte a cache can hold, storage + selection state + pending queries).
Texts: ``tune`` = Python's language reference prose (``pydoc_data``), conversation 0, the
model's continuation of ``CONTINUATION_PROMPT``; ``test`` = standard-library docstrings (the test
items' distractor source), conversations 1 and 2, the continuation of another prompt.
``--speed`` joins decode/prefill ratios from a ``morphkv bench speed --mode overhead`` JSON (arms
``<setting>:block=N``) into the table; the choice (``blocks_report.choose``) is the cheapest
block whose recall and KL lie inside block 1's 95% intervals.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import blocks_report as R
from . import recall
from .flags import add_flags, csv_ints, standard
from .metrics import held_bytes
from .models import load_model
from .output import environment, finish
from .runner import position_kl, reference_logprobs
from .texts import split_texts

NAME = "blocks"
N_SINK = 4
SETTINGS = ("tuned", "paper", "recommended")


def block_specs(setting: str, blocks: list[int]) -> dict[int, str]:
    return {b: f"{setting}:block={b}" for b in blocks}


def held_bound(model, arm, budget: int, extra: int) -> tuple[int, int]:
    """(bytes, tokens): the most bytes ``arm``'s caches hold (sum over layers of max(nbytes,
    nbytes_bound)) once run ``extra`` tokens past the budget (past an eviction) and one decode
    step; the tokens per KV head they keep (resolved from ``memory=`` if given)."""
    caches = arm.caches(model, budget, N_SINK)
    ids = mx.random.randint(0, int(model.args.vocab_size), (1, budget + extra),
                            key=mx.random.key(budget))
    mx.eval(model(ids, cache=caches))
    mx.eval(model(ids[:, -1:], cache=caches))
    held = sum(max(held_bytes(c), int(getattr(c, "nbytes_bound", 0) or 0)) for c in caches)
    return held, max(c.config.budget for c in caches)


def kl_positions(model, arm, tokens: list[int], ref: mx.array, budget: int, first: int,
                 chunk: int = 256) -> np.ndarray:
    """KL(full || arm) at every position ``first``..end-2 (the last has no target)."""
    caches = arm.caches(model, budget, N_SINK)
    return position_kl(model, caches, tokens, ref, first, first - 1, chunk)[0]


def stdlib_prose(tokenizer, n_tokens: int) -> list[int]:
    """``n_tokens`` tokens of standard-library docstring prose (``recall_natural.pool("test")``)."""
    from .recall_natural import pool

    text = "\n\n".join(p for _, paras in pool("test") for p in paras)
    return list(tokenizer.encode(text))[:n_tokens]


def kl_texts(tokenizer, model, args, first: int) -> dict[str, list[int]]:
    """The split's KL texts (module doc), each cut to ``--max-text-tokens`` (0: whole)."""
    tune = args.split == "tune"
    texts = split_texts(tokenizer, model, "tune" if tune else "heldout", args.prose_tokens,
                        args.continuation_tokens)
    if not tune:  # heldout's prose is pydoc too (tune's source): take another source
        texts.pop("prose")
        texts = {"prose_stdlib": stdlib_prose(tokenizer, args.prose_tokens), **texts}
    cap = args.max_text_tokens or None
    return {k: v[:cap] for k, v in texts.items() if len(v[:cap]) > first + 1}


def item_indices(path: str, args) -> list[int]:
    """Indices of the items the full cache answered in a recall or blocks JSON of the same
    split, seed and budget (items depend on all three)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"morphkv: error: --items-from {path}: {e}") from None
    data = data.get("recall", data)
    given, items = data.get("args", {}), data.get("items")
    if not isinstance(items, list):
        raise SystemExit(f"morphkv: error: --items-from {path}: no recall items in it")
    want = {"split": args.split, "seed": args.seed, "set": "natural",
            "budgets": [args.budget]}
    for key, value in want.items():
        if given.get(key) != value:
            raise SystemExit(f"morphkv: error: --items-from {path}: {key} is "
                             f"{given.get(key)!r}, this run needs {value!r}")
    return [int(r["index"]) for r in items if r.get("full", {}).get("correct")]


def run_recall(model, tok, args, specs: dict[str, str]) -> dict:
    """Recall of every arm on the same natural items (``recall.evaluate``)."""
    rargs = argparse.Namespace(
        set="natural", split=args.split, seed=args.seed, budgets=[args.budget], items=args.items,
        first=args.first, max_minutes=args.max_minutes, screen=False, chunk=256,
        max_tokens=8, n_sink=N_SINK, quiet=args.quiet, distance=0,
        indices=args.indices)
    arms = recall.parse_arms(",".join(["full", *specs.values()]))
    found = recall.evaluate(model, tok, rargs, arms)
    found["args"] = {k: v for k, v in vars(rargs).items()}
    return found


def run_kl(model, tok, args, specs: dict[str, str], first: int) -> dict:
    """Per text and arm, KL at every scored position; their bootstrap summary."""
    arms = {label: recall.parse_arms(spec)[0].spec for label, spec in specs.items()}
    texts = kl_texts(tok, model, args, first)
    per: dict[str, dict[str, np.ndarray]] = {label: {} for label in arms}
    for name, tokens in texts.items():
        ref = reference_logprobs(model, tokens)
        for label, arm in arms.items():
            per[label][name] = kl_positions(model, arm, tokens, ref, args.budget, first)
            if not args.quiet:
                print(f"[blocks] KL {name} {label}: {per[label][name].mean():.4f} over "
                      f"{per[label][name].size} positions", flush=True)
        del ref
    summary = R.bootstrap(per, reference="block 1", size=args.bootstrap_block,
                          draws=args.draws)
    return {"texts": {k: len(v) for k, v in texts.items()}, "first": first,
            "positions": {k: int(v.size) for k, v in per["block 1"].items()}, **summary}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--quick", False, "smoke run: budget 32, blocks 1,4,8, 2 items, short texts"),
        ("--setting", "tuned", "the setting whose block varies", list(SETTINGS)),
        ("--blocks", "1,4,8,16,32", "comma-separated blocks (1 is the reference)"),
        ("--budget", 128, "tokens per KV head"),
        ("--split", "tune", "items and texts: tune or test (module doc)", ["tune", "test"]),
        ("--items", 40, "recall items to build (counted: those the full cache answers)"),
        ("--first", 0, "index of the first item (with --items-from: the lowest index used)"),
        ("--items-from", None, "a recall/blocks JSON (same split, seed, budget): only its "
         "items the full cache answered (re-checked here)"),
        ("--max-minutes", 0.0, "stop adding recall items after this (0: no limit)"),
        ("--seed", 0, "item seed"),
        ("--prose-tokens", 1024, "tokens of the prose text"),
        ("--continuation-tokens", 600, "tokens of the model's own continuation"),
        ("--max-text-tokens", 0, "cut every KL text to this many tokens (0: whole)"),
        ("--bootstrap-block", 64, "positions per bootstrap block"),
        ("--draws", 2000, "bootstrap draws"),
        ("--no-recall", False, "KL only"),
        ("--no-kl", False, "recall only"),
        ("--speed", None, "a `morphkv bench speed --mode overhead` JSON with arms "
         "<setting>:block=N: "
         "decode/prefill ratios joined into the table"),
        *standard(NAME, "model", "out", "quiet"),
        ("--stem", None, "output file stem (default blocks_<split>, _<budget> unless 128)"),
    ])


def settings(args: argparse.Namespace) -> list[int]:
    """Check the flags before any work; the blocks. SystemExit names the problem."""
    if args.quick:
        args.budget, args.blocks, args.items = 32, "1,4,8", min(args.items, 2)
        args.prose_tokens, args.continuation_tokens, args.max_text_tokens = 160, 40, 160
        args.draws = min(args.draws, 200)
    try:
        blocks = sorted(set(csv_ints(args.blocks)))
    except ValueError:
        raise SystemExit(f"morphkv: error: --blocks must be integers, got {args.blocks!r}") \
            from None
    if not blocks or blocks[0] != 1:
        raise SystemExit("morphkv: error: --blocks must include 1 (the reference)")
    if args.no_recall and args.no_kl:
        raise SystemExit("morphkv: error: --no-recall and --no-kl leave nothing to measure")
    if args.items < 1 or args.first < 0 or args.draws < 10 or args.bootstrap_block < 1:
        raise SystemExit("morphkv: error: need --items >= 1, --first >= 0, --draws >= 10, "
                         "--bootstrap-block >= 1")
    args.indices = None
    if args.items_from:  # --first applies to its indices too
        args.indices = [i for i in item_indices(args.items_from, args) if i >= args.first]
    if args.items_from and not args.indices:
        raise SystemExit(f"morphkv: error: --items-from {args.items_from}: the full cache "
                         "answered none of its items")
    for spec in block_specs(args.setting, blocks).values():
        try:
            recall.parse_arms(spec)[0].config(args.budget, N_SINK)
        except ValueError as e:
            raise SystemExit(f"morphkv: error: {spec} at budget {args.budget}: {e}") from None
    return blocks


def execute(args: argparse.Namespace, model=None, tokenizer=None) -> dict:
    blocks = settings(args)
    speed = R.read_speed(args.speed, args.setting, blocks) if args.speed else None
    if model is None:
        model, tokenizer = load_model(args.model)
    if tokenizer is None:
        raise SystemExit("morphkv: error: eval fidelity --mode blocks needs a model with a "
                         "tokenizer")
    start, load = time.perf_counter(), os.getloadavg()
    specs = {f"block {b}": s for b, s in block_specs(args.setting, blocks).items()}
    held = {label: held_bound(model, recall.parse_arms(s)[0].spec, args.budget, 2 * b + 16)
            for (label, s), b in zip(specs.items(), blocks, strict=True)}
    specs["streaming_llm"] = f"streaming_llm:memory={max(b for b, _ in held.values())}"
    held["streaming_llm"] = held_bound(model, recall.parse_arms(specs["streaming_llm"])[0].spec,
                                       args.budget, 2 * max(blocks) + 16)
    result = {"benchmark": NAME, "setting": args.setting, "split": args.split,
              "budget": args.budget, "blocks": blocks, "specs": specs,
              "bytes_bound": {k: b for k, (b, _) in held.items()},
              "tokens": {k: t for k, (_, t) in held.items()}, "args": vars(args)}
    if not args.no_recall:
        result["recall"] = run_recall(model, tokenizer, args, specs)
    if not args.no_kl:
        result["kl"] = run_kl(model, tokenizer, args, specs, args.budget + 1)
    result["speed"] = speed
    result["rows"] = R.rows(result)
    result["choice"] = R.choose(result["rows"])
    result["table"] = R.table(result)
    result.update(environment=environment(), seconds=time.perf_counter() - start,
                  load_average={"start": load, "end": os.getloadavg()})
    stem = args.stem or f"{NAME}_{args.split}" + ("" if args.budget == 128 else f"_{args.budget}")
    finish(args, NAME, result, stem, lambda path: R.plot(result, path), result["table"])
    return result
