"""Summaries, tables and plots of ``morphkv eval recall --data longchat``
(``morphkv.eval.recall``)."""

from __future__ import annotations

import math
from pathlib import Path

LAYER_GROUPS = 6  # per-layer retention is shown as the mean of this many layer groups


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """95% Wilson score interval of a binomial proportion k/n (None for n = 0)."""
    if n == 0:
        return None
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _layers(runs: list[dict]) -> list[float] | None:
    """Per-layer retention, mean over runs."""
    per = [r["retention"] for r in runs if r.get("retention")]
    return [sum(col) / len(col) for col in zip(*per, strict=True)] if per else None


def summarize(records: list[dict], full_label: str, cells, screen: bool) -> dict:
    """Per (arm, budget): recall over the items the full cache answers (with its Wilson
    interval) or, screening, retention over every item; per-layer retention; bytes."""
    counted = records if screen else [r for r in records if r["full"]["correct"]]
    rows = []
    for arm, budget in cells:
        runs = [r["arms"][f"{arm.label}@{budget}"] for r in counted]
        layers = _layers(runs)
        row = {
            "arm": arm.label, "budget": budget, "n": len(runs),
            "retention": _mean(layers or []), "worst_layer": min(layers) if layers else None,
            "layers": layers, "nbytes": _mean([x["nbytes"] for x in runs]),
            "tokens": _mean([x.get("tokens") for x in runs]),
        }
        if not screen:
            row["correct"] = k = sum(x["correct"] for x in runs)
            row["accuracy"] = k / len(runs) if runs else None
            row["interval"] = wilson(k, len(runs))
            by_kind: dict[str, list[int]] = {}
            for r, x in zip(counted, runs, strict=True):
                tally = by_kind.setdefault(r["kind"], [0, 0])
                tally[0] += x["correct"]
                tally[1] += 1
            row["by_kind"] = by_kind
        rows.append(row)
    return {
        "screen": screen, "built": len(records), "counted": len(counted),
        "full_correct": None if screen else len(counted), "full_arm": full_label,
        "full_nbytes": None if screen else _mean([r["full"]["nbytes"] for r in records]),
        "mean_tokens": _mean([r["tokens"] for r in records]),
        "mean_distance": _mean([r["distance"] for r in records]),
        "kinds": sorted({r["kind"] for r in records}),
        "rows": rows,
    }


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _cell(row: dict) -> str:
    mib = (row["nbytes"] or 0) / 2**20
    if row.get("tokens"):
        mib_text = f"{mib:.2f} MiB, {row['tokens']:.0f} tokens"
    else:
        mib_text = f"{mib:.2f} MiB"
    kept = f"retention {_pct(row['retention'])} (worst layer {_pct(row['worst_layer'])})"
    if "accuracy" not in row:
        return f"{kept}, {mib_text}"
    if row["accuracy"] is None:
        return "-"
    lo, hi = row["interval"]
    return (f"**{_pct(row['accuracy'])}** ({row['correct']}/{row['n']}, 95% CI "
            f"{_pct(lo)}-{_pct(hi)}), {kept}, {mib_text}")


def table(summary: dict, budgets: list[int]) -> str:
    """Markdown: one row per arm, one column per budget; per-layer retention; a legend."""
    by = {(r["arm"], r["budget"]): r for r in summary["rows"]}
    arms = list(dict.fromkeys(r["arm"] for r in summary["rows"]))
    lines = ["| arm | " + " | ".join(f"budget {b}" for b in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    if not summary["screen"]:
        k, mib = summary["full_correct"], (summary["full_nbytes"] or 0) / 2**20
        cell = f"100% ({k}/{k}), retention 100%, {mib:.2f} MiB"
        lines.append(f"| {summary['full_arm']} (no eviction) | " + " | ".join(
            [cell] * len(budgets)) + " |")
    lines += [f"| {a} | " + " | ".join(_cell(by[a, b]) for b in budgets) + " |" for a in arms]
    lines += ["", layer_table(summary), ""]
    counted = ("all items screened (prefill only, no answers)" if summary["screen"] else
               f"the full cache answers {summary['full_correct']} correctly")
    lines += [
        f"Items: {summary['built']} built ({', '.join(summary['kinds'])}), {counted}; prompts "
        f"{summary['mean_tokens'] or 0:.0f} tokens on average, the fact "
        f"{summary['mean_distance'] or 0:.0f} tokens before the answer.",
        "Legend: recall over the items the full cache answers (correct/counted, 95% Wilson "
        "interval); retention: fraction of the fact's value tokens stored when the question is "
        "read, mean over layers and KV heads (worst layer: the lowest layer mean); bytes: "
        "cache.nbytes (storage + selection state) summed over layers, mean over items.",
    ]
    return "\n".join(lines)


def layer_table(summary: dict) -> str:
    """Retention by layer group (mean of the layers in each), one row per arm and budget."""
    rows = [r for r in summary["rows"] if r["layers"]]
    if not rows:
        return ""
    n = len(rows[0]["layers"])
    size = max(1, math.ceil(n / LAYER_GROUPS))
    groups = [(i, min(n, i + size)) for i in range(0, n, size)]
    head = "| retention by layer | " + " | ".join(f"{a}-{b - 1}" for a, b in groups) + " |"
    lines = [head, "|---|" + "---|" * len(groups)]
    for r in rows:
        cells = [_pct(sum(r["layers"][a:b]) / (b - a)) for a, b in groups]
        lines.append(f"| {r['arm']} @ {r['budget']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: dict, budgets: list[int], path: Path) -> None:
    """Left: recall (or retention when screening) per budget; right: retention per layer."""
    from .plots import plt as pyplot

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    key = "retention" if summary["screen"] else "accuracy"
    for arm in dict.fromkeys(r["arm"] for r in summary["rows"]):
        rows = [r for r in summary["rows"] if r["arm"] == arm and r[key] is not None]
        left.plot([r["budget"] for r in rows], [100 * r[key] for r in rows], marker="o",
                  label=arm)
        for r in rows:
            if r["layers"]:
                right.plot([100 * x for x in r["layers"]], label=f"{arm} @ {r['budget']}")
    left.set_xscale("log", base=2)
    left.set_xticks(budgets, [str(b) for b in budgets])
    left.set_xlabel("budget (tokens kept per layer and KV head)")
    left.set_ylabel("retention (%)" if summary["screen"] else "recall (% of full-correct)")
    right.set_xlabel("layer")
    right.set_ylabel("fact tokens stored at the question (%)")
    for ax in (left, right):
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
    right.legend(fontsize=7, loc="best")
    fig.suptitle(f"Recall of an early fact: {summary['counted']} items, fact "
                 f"~{summary['mean_distance'] or 0:.0f} tokens back")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
