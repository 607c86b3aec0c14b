"""``morphkv eval recall --data longchat``: recall of a fact stated early in a long chat, per arm
and budget.

Items (``morphkv.eval.recall_items``) are chats whose first turn states a fact, followed by
distractor turns and the question. Every arm (an arm spec of ``morphkv.eval.arms``: any
``KVCacheConfig`` field, presets, mlx_lm's caches) prefills the prompt through fresh caches
(exact chunks: ``KVCacheBuilder.for_model`` attaches the attention hook) and reports its
*retention*: per layer, the fraction of the fact's value tokens still stored when the question
is read (mean over KV heads). With ``--screen`` that is all (a prefill per item and arm, no
generation: cheap enough to screen many settings); otherwise the model then answers greedily
for a few tokens, the answer counts when the fact's words appear in it, and recall is counted
over the items the full cache answers correctly, with a 95% Wilson interval. Total bytes
(``cache.nbytes``: storage + selection state, summed over layers) stand next to every figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from .arms import Arm as SpecArm
from .models import load_model
from .output import environment, out_dir, write_json
from .progress import Progress
from .recall_items import build_item, is_correct
from .recall_natural import build_natural_item
from .recall_report import plot, summarize, table

NAME = "recall"
DEFAULT_ARMS = "full,streaming_llm,tuned,h2o,peak:recent=32:value=true"
FIXED = ("method", "morphkv_budget", "budget", "head_dim")  # set by the arm name / --budgets


class Arm:
    """One setting, budget aside: ``label`` as given, parsed by the bench's arm parser."""

    def __init__(self, label: str, spec: SpecArm) -> None:
        self.label, self.spec = label, spec

    @property
    def is_full(self) -> bool:
        return self.spec.method in ("full", "kvcache")

    def config(self, budget: int, n_sink: int):
        return self.spec.config(budget, n_sink=n_sink)  # the spec's own sinks win

    def caches(self, model, budget: int, n_sink: int) -> list:
        return self.spec.caches(model, budget, n_sink)


def parse_arms(text: str) -> list[Arm]:
    """Comma-separated specs ``method[:field=value]...``; a piece ``field=value`` with no ``:``
    continues the previous spec (``morphkv:window=32,fusion=max``)."""
    specs: list[str] = []
    for piece in filter(None, (p.strip() for p in text.split(","))):
        if "=" in piece and ":" not in piece and specs:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    if not specs:
        raise ValueError("--arms is empty")
    arms = []
    for spec in specs:
        method, _, rest = spec.partition(":")
        parts = [p.strip() for p in rest.replace(",", ":").split(":") if p.strip()]
        for part in parts:
            if "=" not in part:
                raise ValueError(f"arm {spec!r}: {part!r} is not field=value")
            key = part.partition("=")[0].strip()
            if key in FIXED or f"morphkv_{key}" in FIXED:
                raise ValueError(f"arm {spec!r}: {key} is set by the command (--budgets)")
        arms.append(Arm(spec, SpecArm.parse(":".join([method, *parts]))))
    return arms


def stored_positions(cache) -> np.ndarray:
    """(KV heads, n) absolute positions a layer's cache holds (morphkv or mlx_lm's caches)."""
    if hasattr(cache, "kept_positions"):
        return cache.kept_positions[0]
    offset = int(cache.offset)
    if hasattr(cache, "max_size") and offset > cache.max_size:  # RotatingKVCache
        keep = cache.keep
        kept = np.r_[np.arange(keep), np.arange(offset - cache.max_size + keep, offset)]
    else:
        kept = np.arange(offset)
    return kept[None, :]


def retention(caches, positions: tuple[int, ...]) -> list[float] | None:
    """Per layer: the fraction of ``positions`` stored, mean over KV heads."""
    if not positions:
        return None
    want = np.asarray(positions)
    return [float(np.isin(want, p).mean(axis=-1) if p.ndim == 1 else
                  np.mean([np.isin(want, row).mean() for row in p]))
            for p in map(stored_positions, caches)]


def run_arm(model, tok, item, caches, args, answer: bool) -> dict:
    """Prefill all but the prompt's last token in ``--chunk`` chunks, read the retention, then
    (``answer``) feed the last token and decode ``--max-tokens`` greedily."""
    import mlx.core as mx

    from .models import greedy_tokens

    ids = mx.array(list(item.ids))[None]
    for s in range(0, len(item.ids) - 1, args.chunk):
        mx.eval(model(ids[:, s : min(s + args.chunk, len(item.ids) - 1)], cache=caches))
    kept = retention(caches, item.fact_positions)
    out = {"retention": kept, "nbytes": int(sum(c.nbytes for c in caches))}
    budgets = {c.config.budget for c in caches if hasattr(c, "config")}
    if budgets:  # tokens per KV head the arm held (resolved from a memory size, or as given)
        out["tokens"] = max(budgets)
    if answer:
        text = tok.decode(greedy_tokens(model, caches, [item.ids[-1]], args.max_tokens))
        out.update(answer=text, correct=is_correct(text, item.value))
    return out


def make_item(tok, args, index: int):
    """Item ``index`` of the chosen set: ``natural`` (the asked fact 3-6 budgets back) or
    ``canned`` (at least ``--distance`` tokens back)."""
    if args.set == "natural":
        return build_natural_item(tok, args.seed, args.split, index, max(args.budgets))
    return build_item(tok, args.seed, args.split, index, args.distance)


def evaluate(model, tok, args, arms: list[Arm]) -> dict:
    """Build items one by one (``args.indices`` when set, else ``--first`` on); screen every
    arm, or answer with every arm on the items the full cache answers correctly."""
    screen = args.screen
    full = next((a for a in arms if a.is_full), None) or parse_arms("full")[0]
    cells = [(a, b) for a in arms if not a.is_full for b in args.budgets]
    indices = getattr(args, "indices", None) or range(args.first, args.first + args.items)
    bar = Progress(len(indices) * (len(cells) + (not screen)), NAME, args.quiet, every=5.0)
    records, start = [], time.perf_counter()
    for index in indices:
        if args.max_minutes and time.perf_counter() - start > 60 * args.max_minutes:
            print(f"[recall] --max-minutes reached before item {index}", file=sys.stderr)
            break
        item = make_item(tok, args, index)
        rec = {"index": index, "kind": item.kind, "value": item.value, "tokens": len(item.ids),
               "distance": item.distance, "turns": item.turns,
               "distractors": list(item.distractors), "arms": {}}
        ok = True
        if not screen:
            caches = full.caches(model, max(args.budgets), args.n_sink)
            rec["full"] = run_arm(model, tok, item, caches, args, answer=True)
            ok = rec["full"]["correct"]
            bar.total -= 0 if ok else len(cells)
            bar.update(1, f"item {index}: full {'ok' if ok else 'wrong'}")
        for arm, budget in cells if ok else []:
            caches = arm.caches(model, budget, args.n_sink)
            rec["arms"][f"{arm.label}@{budget}"] = run_arm(model, tok, item, caches, args,
                                                           answer=not screen)
            bar.update(1, f"item {index}: {arm.label} @ {budget}")
        records.append(rec)
    return {"items": records, "summary": summarize(records, full.label, cells, screen)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--quick", action="store_true", help="smoke run (seconds): 2 short items")
    add("--screen", action="store_true",
        help="retention only: prefill each item through each arm, no answers (cheap)")
    add("--out", default=None, help="output folder (default results/recall)")
    add("--model", default=None, help="model (default: the embedded SmolLM2)")
    add("--arms", default=DEFAULT_ARMS,
        help="comma-separated arm specs, method[:field=value]... with KVCacheConfig fields "
        f"(morphkv_ prefix optional) or presets (default {DEFAULT_ARMS})")
    add("--budgets", default="128", help="comma-separated budgets (default 128)")
    add("--items", type=int, default=48, help="items to build (default 48)")
    add("--first", type=int, default=0, help="index of the first item")
    add("--max-minutes", type=float, default=0, help="stop adding items after this")
    add("--seed", type=int, default=0)
    add("--split", choices=("tune", "test"), default="test")
    add("--set", choices=("canned", "natural"), default="canned",
        help="items: canned (short fixed replies, one fact; recall_items) or natural (long "
        "reference-prose turns, three facts in passing, a reworded question, the asked fact 3-6 "
        "budgets back; recall_natural) (default canned)")
    add("--distance", type=int, default=0,
        help="min tokens after the fact (0: 3 x the largest budget)")
    add("--max-tokens", type=int, default=8, help="answer tokens generated (default 8)")
    add("--n-sink", type=int, default=4)
    add("--chunk", type=int, default=256, help="prefill chunk (exact either way)")
    add("--stem", default=None, help="output file name stem (default recall, or recall_screen)")
    add("--quiet", action="store_true")


def _settings(args: argparse.Namespace) -> tuple[list[Arm], list[int]]:
    """Arms and budgets checked before any work; ValueError names the problem."""
    if args.quick:
        args.arms, args.budgets, args.items = "full,streaming_llm,morphkv", "32", min(args.items, 2)
        args.distance = args.distance or 48
    try:
        budgets = [int(b) for b in str(args.budgets).split(",") if b.strip()]
    except ValueError:
        msg = f"--budgets must be comma-separated integers, got {args.budgets!r}"
        raise ValueError(msg) from None
    if not budgets:
        raise ValueError("--budgets is empty")
    arms = parse_arms(args.arms)
    for arm in arms:
        for budget in budgets:
            if arm.spec.is_baseline:
                continue
            try:
                arm.config(budget, args.n_sink)
            except (TypeError, ValueError) as e:
                raise ValueError(f"arm {arm.label!r} at budget {budget}: {e}") from None
    args.budgets = budgets
    args.distance = args.distance or 3 * max(budgets)
    if args.items < 1 or args.first < 0:
        raise ValueError(f"need --items >= 1 and --first >= 0, got {args.items}, {args.first}")
    return arms, budgets


def run(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("morphkv eval recall --data longchat needs matplotlib: pip install matplotlib",
              file=sys.stderr)
        return 2
    try:
        arms, budgets = _settings(args)
    except ValueError as e:
        print(f"morphkv eval recall --data longchat: error: {e}", file=sys.stderr)
        return 2
    model, tok = load_model(args.model)
    start, load = time.perf_counter(), os.getloadavg()
    result = evaluate(model, tok, args, arms)
    result["table"] = table(result["summary"], budgets)
    print(result["table"])
    folder = out_dir(args, NAME)
    stem = args.stem or f"{NAME}{'_screen' if args.screen else ''}"
    result["args"] = vars(args) | {"arms": args.arms}
    result["environment"] = environment()
    result["seconds"] = time.perf_counter() - start
    result["load_average"] = {"start": load, "end": os.getloadavg()}
    write_json(folder / f"{stem}.json", result)
    plot(result["summary"], budgets, folder / f"{stem}.png")
    print(f"wrote {folder / f'{stem}.json'} and {folder / f'{stem}.png'}")
    return 0
