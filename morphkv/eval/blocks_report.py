"""Summaries of ``morphkv eval fidelity --mode blocks`` (``morphkv.eval.blocks``): the KL
bootstrap, one row per
arm, the choice of block, the speed join, the table and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import plots
from .output import markdown_table

REFERENCE = "block 1"


def _interval(draws: np.ndarray) -> list[float]:
    lo, hi = np.nanpercentile(draws, [2.5, 97.5])
    return [float(lo), float(hi)]


def bootstrap(per: dict[str, dict[str, np.ndarray]], reference: str = REFERENCE,
              size: int = 64, draws: int = 2000, seed: int = 0) -> dict:
    """Per arm: mean over texts of each text's mean KL, its 95% percentile interval and the
    ratio to ``reference`` with its paired interval. A draw resamples, within each text, blocks
    of ``size`` consecutive positions with replacement (positions are correlated), the same
    blocks for every arm."""
    rng = np.random.default_rng(seed)
    texts = list(per[reference])
    totals = {label: np.zeros(draws) for label in per}
    for text in texts:
        n = per[reference][text].size
        starts = np.arange(0, n, size)
        counts = np.minimum(size, n - starts)
        pick = rng.integers(0, starts.size, (draws, starts.size))
        weight = counts[pick].sum(axis=1)
        for label, kl in per.items():
            sums = np.add.reduceat(kl[text], starts)
            totals[label] += sums[pick].sum(axis=1) / weight
    ref_mean = float(np.mean([per[reference][t].mean() for t in texts]))
    out = {}
    with np.errstate(divide="ignore", invalid="ignore"):
        for label, kl in per.items():
            mean = float(np.mean([kl[t].mean() for t in texts]))
            mine = totals[label] / len(texts)
            out[label] = {"mean": mean, "interval": _interval(mine),
                          "per_text": {t: float(kl[t].mean()) for t in texts},
                          "ratio": mean / ref_mean if ref_mean else None,
                          "ratio_interval": _interval(mine / (totals[reference] / len(texts)))}
    kind = (f"block bootstrap: {size} consecutive positions per block, resampled within each "
            f"text, {draws} draws, seed {seed}, percentile interval")
    return {"arms": out, "bootstrap": kind}


def _recall_rows(recall: dict, specs: dict[str, str], budget: int) -> dict[str, dict]:
    """Per label: correct / counted with the Wilson interval; items lost / gained vs block 1."""
    by_spec = {r["arm"]: r for r in recall["summary"]["rows"]}
    counted = [r for r in recall["items"] if r["full"]["correct"]]
    ref = [r["arms"][f"{specs[REFERENCE]}@{budget}"]["correct"] for r in counted]
    out = {}
    for label, spec in specs.items():
        mine = [r["arms"][f"{spec}@{budget}"]["correct"] for r in counted]
        row = by_spec[spec]
        out[label] = {"correct": row["correct"], "n": row["n"], "accuracy": row["accuracy"],
                      "interval": row["interval"],
                      "lost": sum(a and not b for a, b in zip(ref, mine, strict=True)),
                      "gained": sum(b and not a for a, b in zip(ref, mine, strict=True))}
    return out


def _inside(value, interval) -> bool | None:
    if value is None or interval is None:
        return None
    return bool(interval[0] - 1e-12 <= value <= interval[1] + 1e-12)


def rows(result: dict) -> list[dict]:
    """One row per arm: block, bytes, recall, KL, speed, and whether recall and KL lie inside
    block 1's 95% intervals."""
    specs, budget = result["specs"], result["budget"]
    rec = _recall_rows(result["recall"], specs, budget) if "recall" in result else {}
    kl = result.get("kl", {}).get("arms", {})
    speed = result.get("speed") or {}
    out = []
    for label, spec in specs.items():
        row = {"arm": label, "spec": spec, "block": int(label.split()[1])
               if label.startswith("block ") else None,
               "bytes_bound": result["bytes_bound"].get(label),
               "tokens": result["tokens"].get(label), "recall": rec.get(label),
               "kl": kl.get(label), "speed": speed.get(label)}
        ref_rec, ref_kl = rec.get(REFERENCE), kl.get(REFERENCE)
        row["within"] = {
            "recall": _inside(row["recall"]["accuracy"], ref_rec["interval"])
            if row["recall"] and ref_rec else None,
            "kl": _inside(row["kl"]["mean"], ref_kl["interval"]) if row["kl"] else None}
        out.append(row)
    return out


def choose(table_rows: list[dict]) -> dict:
    """The cheapest block whose recall and KL (those measured) lie inside block 1's 95%
    intervals: lowest decode ratio from --speed (then prefill), else the largest block."""
    ok = [r for r in table_rows if r["block"] is not None
          and all(v is not False for v in r["within"].values())]
    timed = [r for r in ok if r["speed"]]
    if timed:
        def cost(r):
            first = next(iter(r["speed"]["contexts"].values()))
            return first["decode"], first["prefill"]
        best = min(timed, key=cost)
        rule = ("lowest decode ratio (then prefill) from --speed among the blocks inside that "
                f"it timed ({', '.join(str(r['block']) for r in timed)})")
    else:
        best = max(ok, key=lambda r: r["block"])
        rule = "no --speed: the largest block inside (fewer evictions, fewer host syncs)"
    return {"block": best["block"], "inside": [r["block"] for r in ok],
            "rule": "recall and KL inside block 1's 95% intervals; " + rule}


def read_speed(path: str, setting: str, blocks: list[int]) -> dict:
    """Per ``block N`` label: decode and prefill (wall and CPU) over ``rotating`` per context,
    from a ``morphkv bench speed --mode overhead`` JSON (arm ``<setting>:block=N``, or the bare
    setting
    when its own block at that JSON's budget is N)."""
    from ..core.presets import PRESETS

    try:
        data = json.loads(Path(path).read_text())
        budget = int(data["args"]["budget"])
        contexts = data.get("by_context") or {str(data["args"]["prompt_tokens"]): data["median"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"morphkv: error: --speed {path}: not a bench speed --mode overhead "
                         f"JSON ({e})") from None
    own = PRESETS[setting](budget).block
    out: dict[str, dict] = {}
    for block in blocks:
        for ctx, arms in contexts.items():
            key = f"{setting}:block={block}"
            key = setting if key not in arms and own == block else key
            if key not in arms or "rotating" not in arms:
                continue
            a, r = arms[key], arms["rotating"]
            entry = out.setdefault(f"block {block}", {"budget": budget, "contexts": {}})
            entry["contexts"][ctx] = {
                "decode": a["decode_ms"] / r["decode_ms"],
                "prefill": a["prefill_s"] / r["prefill_s"],
                "decode_cpu": a["decode_cpu_ms"] / r["decode_cpu_ms"],
                "prefill_cpu": a["prefill_cpu_s"] / r["prefill_cpu_s"]}
    return out


def _ci(interval, pct: bool = False) -> str:
    if interval is None:
        return "-"
    f = (lambda x: f"{100 * x:.0f}%") if pct else (lambda x: f"{x:.3f}")
    return f"{f(interval[0])}-{f(interval[1])}"


def _cells(r: dict) -> list[str]:
    rec, kl, sp = r["recall"], r["kl"], r["speed"]
    recall = "-"
    if rec and rec["n"]:
        recall = f"{rec['correct']}/{rec['n']} ({_ci(rec['interval'], True)})"
        if r["block"] not in (None, 1):
            recall += f", -{rec['lost']}/+{rec['gained']}"
    kls = "-" if not kl else f"{kl['mean']:.4f} ({_ci(kl['interval'])})"
    ratio = "-" if not kl or kl["ratio"] is None else \
        f"{kl['ratio']:.3f} ({_ci(kl['ratio_interval'])})"
    speed = ["-", "-"] if not sp else [
        ", ".join(f"{c['decode']:.3f}" for c in sp["contexts"].values()),
        ", ".join(f"{c['prefill']:.3f}" for c in sp["contexts"].values())]
    inside = "/".join({True: "yes", False: "NO", None: "-"}[v] for v in r["within"].values())
    mib = "-" if r["bytes_bound"] is None else f"{r['bytes_bound'] / 2**20:.2f}"
    return [r["arm"], mib, str(r["tokens"]), recall, kls, ratio, *speed, inside]


def table(result: dict) -> str:
    timed = next(iter((result.get("speed") or {}).values()), None)
    at = f" (contexts {', '.join(timed['contexts'])})" if timed else ""
    headers = ["arm", "MiB held (bound)", "tokens", "recall (95% CI), lost/gained vs block 1",
               "mean KL (95% CI)", "KL / block 1 (paired 95% CI)",
               f"decode x rotating{at}", f"prefill x rotating{at}",
               "inside block 1's CI (recall/KL)"]
    body = [_cells(r) for r in result["rows"]]
    lines = [markdown_table(headers, body), ""]
    if "recall" in result:
        s = result["recall"]["summary"]
        lines.append(f"Recall: {s['built']} natural items built ({result['split']} split), "
                     f"{s['counted']} answered by the full cache (the counted items, the same for "
                     f"every arm); prompts {s['mean_tokens'] or 0:.0f} tokens on average.")
    if "kl" in result:
        k = result["kl"]
        lines.append(f"KL: texts {k['texts']} (tokens), scored from position {k['first']} "
                     f"({sum(k['positions'].values())} positions); {k['bootstrap']}.")
    lines.append(f"Choice: block {result['choice']['block']} ({result['choice']['rule']}).")
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    """Recall and KL against the block, 95% intervals drawn; block 1's interval shaded,
    StreamingLLM at equal bytes dashed."""
    fig, axes = plots.panels(3, 5, 4.2)
    axes = axes[0]
    blocks = [r for r in result["rows"] if r["block"] is not None]
    xs = [r["block"] for r in blocks]
    panels = (("recall", "accuracy", "interval", 100, "recall (% of full-correct items)"),
              ("kl", "mean", "interval", 1, "mean KL(full || arm), nats/token"),
              ("kl", "ratio", "ratio_interval", 1, "KL / block 1's (paired 95% interval)"))
    for ax, (key, point, band, scale, label) in zip(axes, panels, strict=True):
        got = [r for r in blocks if r[key] and r[key][point] is not None]
        if got:
            ys = np.array([scale * r[key][point] for r in got])
            lo = np.array([scale * r[key][band][0] for r in got])
            hi = np.array([scale * r[key][band][1] for r in got])
            ax.errorbar([r["block"] for r in got], ys, yerr=[ys - lo, hi - ys], marker="o",
                        capsize=4, label=result["setting"])
            if point != "ratio":
                ax.axhspan(lo[0], hi[0], color="C0", alpha=0.12, label="block 1's 95% interval")
        for r in result["rows"]:
            if r["block"] is None and r[key] and r[key][point] is not None:
                ax.axhline(scale * r[key][point], color="C3", ls="--",
                           label=f"{r['arm']} (equal bytes)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set(xlabel="eviction block (tokens evicted at once)", ylabel=label)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"{result['setting']} at budget {result['budget']}, {result['split']} split")
    plots.save(fig, path, 110)


def main(argv: list[str] | None = None) -> None:
    """``python -m morphkv.eval.blocks_report RESULT.json``: redraw its table and PNG."""
    import sys

    for name in argv if argv is not None else sys.argv[1:]:
        path = Path(name)
        result = json.loads(path.read_text())
        result["table"] = table(result)
        path.write_text(json.dumps(result, indent=1) + "\n")
        plot(result, path.with_suffix(".png"))
        print(result["table"])


if __name__ == "__main__":
    main()
