"""Build ``docs/results.md`` from the benchmark JSON files present (results/<name>/<name>.json,
or docs/figures/<name>.json), with headline tables, settings and honest notes.

``python -m morphkv.bench.report [--results results] [--docs docs] [--copy]``; ``--copy``
also copies each benchmark's JSON and PNG into ``docs/figures/`` (small files only).
``readme_headline()`` returns a short markdown table for the README.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from ._util import main, markdown_table

BENCHES = ("mechanism", "fidelity", "generation")
MAX_COPY_BYTES = 2_000_000
DESIGN_TABLE = {  # design notes: independent implementation, prose 1,100 tokens, 4 sinks
    128: {"streaming_llm_w8": 0.233, "random_w8": 0.338, "h2o_w8": 1.030, "tova_w8": 0.730,
          "morphkv_mean_w8": 0.489, "morphkv_mean_w32": 0.350, "h2o_w8_attn": 0.763,
          "morphkv_mean_w8_attn": 0.179, "morphkv_mean_w32_attn": 0.158},
    256: {"streaming_llm_w8": 0.130, "random_w8": 0.207, "h2o_w8": 0.725, "tova_w8": 0.363,
          "morphkv_mean_w8": 0.267, "morphkv_mean_w32": 0.206, "h2o_w8_attn": 0.466,
          "morphkv_mean_w8_attn": 0.083, "morphkv_mean_w32_attn": 0.067},
}  # fmt: skip


def load_results(results: Path | str = "results", docs: Path | str = "docs") -> dict:
    """{bench: result dict} for every benchmark JSON found (results/ first, then docs/figures)."""
    found = {}
    for name in BENCHES:
        for path in (
            Path(results) / name / f"{name}.json",
            Path(docs) / "figures" / f"{name}.json",
        ):
            if path.is_file():
                data = json.loads(path.read_text())
                data["_path"] = str(path)
                found[name] = data
                break
    return found


# ---- mechanism -------------------------------------------------------------------------------


def _mech_cell(result, scenario, length, budget, window, arm, key):
    for r in result["rows"]:
        if (r["scenario"], r["length"], r["budget"], r["window"], r["arm"]) == (
            scenario,
            length,
            budget,
            window,
            arm,
        ):
            return r[key]
    return float("nan")


def mechanism_section(result: dict) -> str:
    s = result["settings"]
    arms = s["arms"]
    L, B = max(s["lengths"]), max(s["budgets"])
    W = 8 if 8 in s["windows"] else s["windows"][0]
    lines = [
        "## Mechanism: synthetic retention (`morphkv bench mechanism`)",
        "",
        f"Key streams per head (head_dim {s['head_dim']}, {s['heads']} heads, "
        f"{s['n_sink']} sinks, {s['seeds']} seeds; grid lengths {s['lengths']} x budgets "
        f"{s['budgets']} x windows {s['windows']}). `kept`: fraction of the relevant region "
        "(topic_shift: the axis-B tokens; recall: the recalled topic's tokens; stable: every "
        "token) still stored at the end. `err`: relative L2 error of a probe query's attention "
        "output (query on the relevant axis, random values) read from the kept set instead of "
        "the full set. All arms protect the same sinks and recent window; H2O is the standard "
        "cumulative rule. Scoring is the key-as-query proxy (a bare cache sees no queries).",
        "",
        f"Headline grid point: length {L}, budget {B}, window {W}.",
        "",
    ]
    body = []
    for sc in s["scenarios"]:
        for key in ("kept", "err"):
            body.append([sc, key] + [_mech_cell(result, sc, L, B, W, a, key) for a in arms])
    lines.append(markdown_table(["scenario", "metric", *arms], body))
    lines += ["", "Notes (computed from the numbers):", ""]
    for sc in s["scenarios"]:
        for length in s["lengths"]:
            for budget in s["budgets"]:
                for window in s["windows"]:
                    m = _mech_cell(result, sc, length, budget, window, "morphkv_mean", "err")
                    st = _mech_cell(result, sc, length, budget, window, "streaming_llm", "err")
                    if m == m and st == st and m > st:
                        lines.append(
                            f"- {sc} L{length} b{budget} w{window}: morphkv_mean probe error "
                            f"{m:.3f} is worse than streaming_llm {st:.3f}."
                        )
    ts_m = _mech_cell(result, "topic_shift", L, B, W, "morphkv_mean", "kept")
    ts_s = _mech_cell(result, "topic_shift", L, B, W, "streaming_llm", "kept")
    if ts_m == ts_m:
        lines.append(
            f"- topic_shift: MorphKV keeps {ts_m:.3f} of the new topic and StreamingLLM "
            f"{ts_s:.3f}: when the relevant tokens are also the most recent ones, recency "
            "keeps as much of them as attention ranking does; MorphKV's edge there is only "
            "*which* of them it keeps (lower probe error). Cumulative H2O keeps the old topic."
        )
    rc = {a: _mech_cell(result, "recall", L, B, W, a, "kept") for a in arms}
    if rc.get("morphkv_mean") == rc.get("morphkv_mean"):
        lines.append(
            "- recall: kept fraction of the recalled topic "
            + ", ".join(f"{a} {v:.3f}" for a, v in rc.items())
            + ". Recency cannot keep a topic last seen 1.5 budgets ago; window 1 (TOVA) "
            "already does most of the work in this synthetic setting."
        )
    st = {a: _mech_cell(result, "stable", L, B, W, a, "err") for a in arms}
    if st.get("random") == st.get("random"):
        lines.append(
            "- stable (control): probe error "
            + ", ".join(f"{a} {v:.3f}" for a, v in st.items())
            + ". No attention rule is worse than random eviction here."
        )
    if result.get("skipped"):
        skipped = sorted({(x["budget"], x["window"]) for x in result["skipped"]})
        lines.append(
            "- Skipped invalid grid points (budget must exceed sinks + window): "
            + ", ".join(f"budget {b} window {w}" for b, w in skipped)
            + "."
        )
    lines += ["", "![mechanism](figures/mechanism.png)", ""]
    return "\n".join(lines)


# ---- fidelity --------------------------------------------------------------------------------


def fidelity_summary(result: dict, metric: str = "kl"):
    from .fidelity import summary

    return summary(result, metric)


def fidelity_section(result: dict) -> str:
    s = result["settings"]
    texts = ", ".join(f"{k} ({v} tokens)" for k, v in s["texts"].items())
    lines = [
        "## Fidelity: teacher-forced, against the full cache (`morphkv eval fidelity`)",
        "",
        f"Model: {s.get('model', '?')}. Texts: {texts}. {s['n_sink']} sinks. Feeding: "
        f"`{s['feed']}` (chunked = exact chunks through the attention hook; stacked/step = "
        "token by token; the three agree to float rounding in the tests, on a tiny model). "
        "Metrics over the positions whose context exceeds the budget, averaged over texts "
        "(weighted by positions). `_attn` = the model's real queries; the rest use the "
        "key-as-query proxy.",
        "",
    ]
    for metric, label in (
        ("kl", "Mean KL(full || method), nats/token (lower is better)"),
        ("top1", "Top-1 agreement with the full cache"),
        ("ppl_ratio", "Perplexity ratio, method / full"),
    ):
        headers, body = fidelity_summary(result, metric)
        lines += [f"### {label}", "", markdown_table(headers, body), ""]
    full = [r for r in result["rows"] if r["arm"] == "full"]
    if full:
        lines.append(
            "The `full` arm (MorphKVCache method=full, fed like the others) has KL "
            + ", ".join(f"{r['kl']:.2e}" for r in full)
            + " against the mlx_lm KVCache reference: the pipeline itself adds nothing."
        )
        lines.append("")
    # per-budget bytes
    byte_rows = []
    for b in s["budgets"]:
        rs = [r for r in result["rows"] if r["budget"] == b]
        if rs:
            r = rs[0]
            byte_rows.append([b, r["kv_bytes_kept"] / 2**20, r["kv_bytes_storage"] / 2**20])
    if full:
        byte_rows.append(
            ["full", full[0]["kv_bytes_kept"] / 2**20, full[0]["kv_bytes_storage"] / 2**20]
        )
    lines += [
        "KV bytes at the end of the first text (all layers, measured on the caches):",
        "",
        markdown_table(["budget", "kept MiB", "storage MiB"], byte_rows),
        "",
    ]
    lines += ["### Notes (computed from the numbers)", ""]
    headers, body = fidelity_summary(result, "kl")
    table = {row[0]: dict(zip(s["budgets"], row[1:], strict=True)) for row in body}
    for b in s["budgets"]:
        base = table.get("streaming_llm_w8", {}).get(b)
        rnd = table.get("random_w8", {}).get(b)
        if base is None:
            continue
        for arm, vals in table.items():
            if not arm.startswith("morphkv") or vals.get(b) is None:
                continue
            v = vals[b]
            rel = (v - base) / base if base else float("nan")
            verdict = "better than" if v < base else "WORSE than"
            extra = f"; random eviction {rnd:.3f}" if rnd is not None else ""
            lines.append(
                f"- budget {b}: {arm} KL {v:.3f} is {verdict} streaming_llm {base:.3f} "
                f"({100 * rel:+.0f}% KL){extra}."
            )
    lines += per_text_section(result)
    common = [b for b in DESIGN_TABLE if b in s["budgets"]]
    if common and any(k.startswith("prose0") or k == "prose0" for k in s["texts"]):
        lines += ["", "### Sanity check against the design notes (prose text, KL)", ""]
        prose_tokens = s["texts"].get("prose0")
        if prose_tokens and prose_tokens != 1100:
            lines += [
                f"This run's prose text is {prose_tokens} tokens; the design notes used the "
                "first 1,100, so compare the ordering only (on the same 1,100 tokens this "
                "code reproduced their figures within ~3%: streaming 0.230 vs 0.233, real-query "
                "MorphKV w8 0.180 vs 0.179 at budget 128).",
                "",
            ]
        arms = [a for a in DESIGN_TABLE[128] if a in table]
        rows = []
        for b in common:
            ours = {
                r["arm"]: r["kl"]
                for r in result["rows"]
                if r["text"] == "prose0" and r["budget"] == b
            }
            rows.append([f"{b} (design notes)"] + [DESIGN_TABLE[b][a] for a in arms])
            rows.append([f"{b} (this run)"] + [ours.get(a, float("nan")) for a in arms])
        lines += [markdown_table(["budget", *arms], rows), ""]
        off = []
        for b in common:
            for r in result["rows"]:
                if r["text"] == "prose0" and r["budget"] == b and r["arm"] in DESIGN_TABLE[b]:
                    ref = DESIGN_TABLE[b][r["arm"]]
                    if abs(r["kl"] - ref) > 0.1 * ref:
                        off.append(f"{r['arm']} at {b} ({r['kl']:.3f} vs {ref:.3f})")
        lines.append(
            "Arms more than 10% away from the design notes' independent implementation: "
            + (", ".join(off) if off else "none")
            + ". (Random eviction depends on the seed; a deviation elsewhere would point to a "
            "difference in the rule's details, e.g. which tokens it protects or how it breaks "
            "ties.)"
        )
        if any(x.startswith("tova_w8") for x in off):
            lines.append(
                "TOVA's deviation is the protected window: the design notes' TOVA protected only "
                "the newest token. A side run of `--arms tova:1 --texts prose` on the same "
                "1,100 tokens gave 0.700 (budget 128) and 0.356 (budget 256), matching their "
                "0.730 and 0.363; TOVA here protects the same 8 recent tokens as the other arms."
            )
        lines.append("")
    if result.get("notes"):
        lines += ["", *[f"- {n}" for n in result["notes"]]]
    lines += ["", "![fidelity](figures/fidelity.png)", ""]
    return "\n".join(lines)


PER_TEXT_ARMS = (
    "streaming_llm_w8",
    "tova_w8_attn",
    "morphkv_mean_w8_attn",
    "morphkv_mean_w32_attn",
)


def per_text_section(result: dict) -> list[str]:
    """KL per text for recency vs the real-query rules: where each one wins."""
    rows = [r for r in result["rows"] if r["arm"] in PER_TEXT_ARMS]
    texts = sorted({r["text"] for r in rows})
    if len(texts) < 2:
        return []
    kl = {(r["text"], r["arm"], r["budget"]): r["kl"] for r in rows}
    budgets = result["settings"]["budgets"]
    body, notes = [], []
    for text in texts:
        for arm in PER_TEXT_ARMS:
            body.append([text, arm] + [kl.get((text, arm, b), float("nan")) for b in budgets])
        for b in budgets:
            base, ours = (
                kl.get((text, "streaming_llm_w8", b)),
                kl.get((text, "morphkv_mean_w8_attn", b)),
            )
            if base is not None and ours is not None and ours > base:
                notes.append(
                    f"- {text}, budget {b}: StreamingLLM ({base:.3f}) beats real-query MorphKV "
                    f"w8 ({ours:.3f})."
                )
    return [
        "",
        "### KL per text (where each rule wins)",
        "",
        markdown_table(["text", "arm", *[f"budget {b}" for b in budgets]], body),
        "",
        *(notes or ["- Real-query MorphKV w8 has the lower KL on every text and budget."]),
        "",
    ]


def fidelity_headline(result: dict) -> str:
    """Two sentences: which arm has the lowest KL per budget; proxy vs real queries."""
    headers, body = fidelity_summary(result, "kl")
    budgets = result["settings"]["budgets"]
    lines = ["## Summary", ""]
    for i, b in enumerate(budgets, start=1):
        ranked = sorted((r[i], r[0]) for r in body if r[i] == r[i])
        if ranked:
            lines.append(
                f"- Budget {b}: lowest KL {ranked[0][1]} ({ranked[0][0]:.3f}), then "
                + ", ".join(f"{a} ({v:.3f})" for v, a in ranked[1:4])
                + "."
            )
    table = {r[0]: r[1:] for r in body}
    stream = table.get("streaming_llm_w8")
    if stream:
        for group, label in (
            ([a for a in table if a.startswith("morphkv") and not a.endswith("_attn")], "proxy"),
            ([a for a in table if a.startswith("morphkv") and a.endswith("_attn")], "real-query"),
        ):
            if not group:
                continue
            wins = sum(table[a][i] < stream[i] for a in group for i in range(len(budgets)))
            total = len(group) * len(budgets)
            lines.append(
                f"- {label} MorphKV arms ({', '.join(group)}) have lower KL than StreamingLLM "
                f"in {wins} of {total} (arm, budget) cells."
            )
    lines.append(
        "- The synthetic benchmark below shows the proxy rule keeping a recalled topic that "
        "recency drops; on the real model that advantage does not appear with proxy scoring. "
        "Read the two together."
    )
    lines.append("")
    return "\n".join(lines)


# ---- generation ------------------------------------------------------------------------------


def generation_section(result: dict) -> str:
    from .generation import summary

    s = result["settings"]
    headers, body = summary(result)
    lines = [
        "## Free generation (`morphkv eval generation`)",
        "",
        f"Model: {s.get('model', '?')}. Greedy, up to {s['max_tokens']} tokens, "
        f"{s['prompts']} prompt(s) asking for long answers, {s['n_sink']} sinks; means over "
        "prompts. 10-gram repetition: fraction of the answer's 10-grams already seen in it "
        "(lower is better). Speed and memory were measured on a shared 2-core CPU: compare "
        "them within this table only.",
        "",
        markdown_table(headers, body),
        "",
    ]
    if s["prompts"] < 3 or s["max_tokens"] < 1000:
        lines.append(
            f"- Small sample: {s['prompts']} prompt(s) x {s['max_tokens']} tokens, one greedy "
            "answer per arm. Treat the differences as anecdotes, not as a ranking: a single "
            "greedy trajectory can fall into (or out of) a loop for reasons unrelated to the "
            "cache rule."
        )
    prompts = sorted({r["prompt"] for r in result["rows"]})
    if len(prompts) > 1:
        per = []
        for arm, b in [(r[0], None if r[1] == "-" else r[1]) for r in body]:
            cells = {
                r["prompt"]: r["rep10"]
                for r in result["rows"]
                if r["arm"] == arm and r["budget"] == b
            }
            per.append(
                [arm, b if b is not None else "-"] + [cells.get(p, float("nan")) for p in prompts]
            )
        lines += [
            "",
            "10-gram repetition per prompt (the spread between prompts is as large as the "
            "spread between arms):",
            "",
            markdown_table(["arm", "budget", *[f"prompt {p}" for p in prompts]], per),
            "",
        ]
    full = [r for r in body if r[0] == "full"]
    if full:
        f_rep = full[0][3]
        worse = [f"{r[0]} b{r[1]} ({r[3]:.3f})" for r in body if r[0] != "full" and r[3] > f_rep]
        lines.append(
            f"- Full cache 10-gram repetition {f_rep:.3f}. Arms repeating more: "
            + (", ".join(worse) if worse else "none")
            + "."
        )
    lines += ["", "![generation](figures/generation.png)", ""]
    return "\n".join(lines)


# ---- assembly --------------------------------------------------------------------------------


def build_report(found: dict) -> str:
    parts = [
        "# Results",
        "",
        "Generated by `python -m morphkv.bench.report` from the benchmark JSON files "
        "(docs/figures/*.json). Every number below is measured by this repository's code on "
        "the machine named in each file's `environment`; nothing is copied from the paper.",
        "",
    ]
    if not found:
        parts.append("No results found: run the benchmarks first.")
    if "fidelity" in found:
        parts.append(fidelity_headline(found["fidelity"]))
    if "mechanism" in found:
        parts.append(mechanism_section(found["mechanism"]))
    if "fidelity" in found:
        parts.append(fidelity_section(found["fidelity"]))
    if "generation" in found:
        parts.append(generation_section(found["generation"]))
    if found:
        parts += ["## Runs", ""]
    for name, data in found.items():
        env = data.get("environment", {})
        parts.append(
            f"- {name}: {data.get('elapsed_s', float('nan')):.0f} s on {env.get('cpus', '?')} "
            f"CPUs, mlx {env.get('mlx', '?')}, mlx_lm {env.get('mlx_lm', '?')}, "
            f"{env.get('date', '?')}; quick={data.get('settings', {}).get('quick')}"
        )
    return "\n".join(parts) + "\n"


def readme_headline(found: dict | None = None, budget: int = 128) -> str:
    """A short markdown table for the README: fidelity KL at one budget, and the recall row."""
    found = load_results() if found is None else found
    lines = []
    fid = found.get("fidelity")
    if fid and budget in fid["settings"]["budgets"]:
        headers, body = fidelity_summary(fid, "kl")
        top1 = dict((r[0], r) for r in fidelity_summary(fid, "top1")[1])
        i = fid["settings"]["budgets"].index(budget) + 1
        rows = [[r[0], r[i], top1[r[0]][i]] for r in body]
        lines.append(
            markdown_table(
                ["arm", f"KL vs full, budget {budget}", "top-1 agreement"],
                sorted(rows, key=lambda r: r[1]),
            )
        )
    mech = found.get("mechanism")
    if mech:
        s = mech["settings"]
        L, B = max(s["lengths"]), max(s["budgets"])
        W = 8 if 8 in s["windows"] else s["windows"][0]
        lines.append(
            f"\nSynthetic recall (L{L}, budget {B}, window {W}), fraction of the recalled "
            "topic kept: "
            + ", ".join(
                f"{a} {_mech_cell(mech, 'recall', L, B, W, a, 'kept'):.2f}" for a in s["arms"]
            )
        )
    return "\n".join(lines)


def copy_figures(results: Path, docs: Path) -> list[Path]:
    dest = docs / "figures"
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in BENCHES:
        for ext in ("json", "png"):
            src = results / name / f"{name}.{ext}"
            if src.is_file() and src.stat().st_size <= MAX_COPY_BYTES:
                shutil.copy2(src, dest / src.name)
                copied.append(dest / src.name)
    return copied


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", default="results")
    parser.add_argument("--docs", default="docs")
    parser.add_argument("--copy", action="store_true", help="copy JSON+PNG into docs/figures")
    parser.add_argument("--out", default=None, help="report path (default <docs>/results.md)")


def run(args: argparse.Namespace) -> int:
    """CLI entry point (``morphkv`` command contract): 0 on success."""
    execute(args)
    return 0


def execute(args: argparse.Namespace) -> str:
    results, docs = Path(args.results), Path(args.docs)
    if args.copy:
        for p in copy_figures(results, docs):
            print("copied", p)
    text = build_report(load_results(results, docs))
    out = Path(args.out) if args.out else docs / "results.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return text


if __name__ == "__main__":
    raise SystemExit(main(add_arguments, run, __doc__.splitlines()[0]))
