"""Sweep cache settings on the fidelity texts: KL against the full cache, per text, as a
ratio to StreamingLLM's at the same budget.

Settings are chosen on ``--split tune`` texts and reported on ``--split heldout`` texts (see
``texts.split_texts``: disjoint prose, conversations and continuations). Arms are fidelity arm
specs, including presets and budget fractions (``tuned``, ``morphkv:recent=0.5:attn``);
``--grid`` adds every combination of ``key=v1/v2`` options over ``--grid-base``. Every arm
is compared with ``streaming_llm`` fed the same text at the same budget; ``--equal-bytes``
gives every arm the budget at which its caches hold what StreamingLLM's hold.
"""

from __future__ import annotations

import argparse
import statistics

import mlx.core as mx

from . import plots
from .arms import check_specs, grid_specs
from .fidelity import run_fidelity
from .flags import add_flags, standard
from .models import load_model
from .output import finish, markdown_table
from .plots import require_matplotlib
from .runner import Feeder
from .texts import split_texts

NAME = "sweep"
BASELINE = "streaming_llm"


def grid_arms(base: str, grid: list[str]) -> list[str]:
    values = {}
    for item in grid:
        key, _, options = item.partition("=")
        if not options:
            raise SystemExit(f"morphkv: error: --grid {item!r}: expected key=v1/v2/...")
        values[key] = options.split("/")
    return grid_specs(base, **values) if values else []


def ratios(rows: list[dict]) -> list[dict]:
    """Per (arm, budget): KL / StreamingLLM's KL on each text, and their mean over texts."""
    base = {(r["text"], r["budget"]): r["kl"] for r in rows if r["arm"].startswith(BASELINE)}
    table: dict = {}
    for r in rows:
        ref = base.get((r["text"], r["budget"]))
        if r["budget"] is None or not ref:
            continue
        entry = table.setdefault((r["arm"], r["budget"]), {"arm": r["arm"], "budget": r["budget"]})
        entry[r["text"]] = r["kl"] / ref
    for entry in table.values():
        texts = [v for k, v in entry.items() if k not in ("arm", "budget")]
        entry["mean_ratio"] = statistics.fmean(texts)
        entry["worst_ratio"] = max(texts)
    return sorted(table.values(), key=lambda e: (e["budget"], e["mean_ratio"]))


def ratio_table(table: list[dict], texts: list[str]) -> str:
    headers = ["arm", "budget", *texts, "mean_ratio", "worst_ratio"]
    return markdown_table(headers, [[e.get(h, float("nan")) for h in headers] for e in table])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--split", "tune", "tune: texts for choosing; heldout: texts for reporting",
         ["tune", "heldout"]),
        ("--budgets", [64, 128, 256], "budgets in tokens per KV head"),
        ("--arms", [BASELINE, "paper", "tuned"], "arm specs (fidelity's spelling)"),
        ("--grid", [], "options key=v1/v2 (comma between keys); every combination is added "
         "over --grid-base"),
        ("--grid-base", "morphkv:attn", "the arm the --grid options apply to"),
        ("--equal-bytes", False, "every arm at the budget where it holds StreamingLLM's bytes"),
        ("--prose-tokens", 1024, "tokens of the prose text"),
        ("--continuation-tokens", 600, "tokens of the model's own continuation"),
        *standard(NAME, "model", "out", "quiet"),
        ("--quick", False, "tiny smoke run (seconds)"),
    ])


def execute(args: argparse.Namespace, model=None, tokenizer=None) -> dict:
    require_matplotlib()
    arms = list(dict.fromkeys([BASELINE, *args.arms, *grid_arms(args.grid_base, args.grid)]))
    check_specs(arms)
    if args.quick:
        args.budgets, args.prose_tokens, args.continuation_tokens = [32], 96, 40
    if model is None:
        model, tokenizer = load_model(args.model)
    mx.random.seed(0)
    texts = split_texts(tokenizer, model, args.split, args.prose_tokens, args.continuation_tokens)
    if args.quick:
        texts = {k: v[:96] for k, v in list(texts.items())[:2]}
    result = run_fidelity(
        model, texts, arms, args.budgets, feeder=Feeder("auto", 256), quiet=args.quiet,
        include_full=False, equal_bytes=BASELINE if args.equal_bytes else None,
    )
    result["benchmark"] = NAME
    result["settings"].update(split=args.split, quick=bool(args.quick), model=args.model)
    result["ratios"] = table = ratios(result["rows"])
    print(f"KL(full || arm) / KL(full || {BASELINE}) per text, same budget (lower is better; "
          "mean_ratio: mean over texts; worst_ratio: the largest)")

    def plot(path):
        fig, axes = plots.panels(1, 9, 5)
        labels = [f"{e['arm']} b{e['budget']}" for e in table]
        plots.grouped_bars(axes[0, 0], labels, {"mean ratio": [e["mean_ratio"] for e in table],
                                                "worst ratio": [e["worst_ratio"] for e in table]},
                           f"KL / {BASELINE}'s ({args.split} texts)")
        plots.save(fig, path)

    finish(args, NAME, result, f"{NAME}_{args.split}{'_quick' if args.quick else ''}", plot,
           ratio_table(table, sorted(texts)))
    return result


def section(result: dict) -> str:
    """The report's section (``morphkv report``): ratios per text, and the raw KL."""
    from .output import pivot

    s, table = result["settings"], result["ratios"]
    names = sorted({k for e in table for k in e} - {"arm", "budget", "mean_ratio", "worst_ratio"})
    rows = [{**r, "kl_at": f"{r['text']}"} for r in result["rows"]]
    kl_table = markdown_table(*pivot(rows, ["arm", "budget"], "kl_at", "kl"))
    sized = ", ".join(
        f"{r['arm']} b{r['budget']} -> {r['arm_budget']} tokens"
        for r in result["rows"] if "arm_budget" in r and r["arm_budget"] != r["budget"]
        and r["text"] == result["rows"][0]["text"]
    )
    notes = []
    for e in table:
        if e["arm"].startswith(BASELINE):
            continue
        wins = "never worse than StreamingLLM" if e["worst_ratio"] <= 1 else (
            f"worse than StreamingLLM on {sum(v > 1 for k, v in e.items() if k in names)} text(s)")
        notes.append(f"- {e['arm']} at budget {e['budget']}: mean ratio {e['mean_ratio']:.3f}, "
                     f"{wins}.")
    texts = ", ".join(f"{k} {v}" for k, v in s["texts"].items())
    intro = (
        f"`morphkv eval fidelity --mode sweep --split {s['split']}`: teacher-forced "
        "KL(full || arm) per token past "
        f"the budget on the {s['split']} texts ({texts} tokens), as a ratio to StreamingLLM's at "
        "the same budget"
        + (f"; at equal total bytes (every arm sized to StreamingLLM's bytes: {sized})"
           if s.get("equal_bytes") else "") + "."
    )
    body = [ratio_table(table, names), "", "KL per text:", "", kl_table, ""]
    lines = [f"## Sweep, {s['split']} texts (`morphkv eval fidelity --mode sweep`)", "", intro, "",
             *body]
    lines += ["Notes (computed from the numbers):", "", *notes, ""]
    return "\n".join(lines)
