"""Build a results report (``<results>/report.md``) from the benchmark JSON files present:
tables drawn from the data and notes computed from the numbers.

Each benchmark's JSON is looked for in ``<results>/<name>/`` and then in ``<docs>/figures/``
(``SOURCES``); each section is one function in ``SECTIONS`` (``result -> markdown``). A new
benchmark adds one entry to each, or names a ``module:function`` of its own in ``SECTIONS``.
``--copy`` also copies each benchmark's JSON and PNG into ``docs/figures/`` (small files only).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
from pathlib import Path

from .flags import add_flags
from .output import markdown_table, pivot

MAX_COPY_BYTES = 2_000_000
SOURCES = {  # name -> JSON file names, newest spelling first
    "mechanism": ("mechanism.json",), "fidelity": ("fidelity.json",),
    "generation": ("generation.json",), "speed": ("speed.json",),
    "layer": ("layer.json", "cache_speed.json"), "blas": ("blas.json", "blas_speed.json"),
    "overhead": ("overhead.json", "model_overhead.json"),
    "sweep_tune": ("sweep_tune.json",), "sweep_heldout": ("sweep_heldout.json",),
    "recall": ("recall.json",), "chatrecall": ("chatrecall_test_sizes.json",),
}
BASELINE = "streaming_llm_w8"
DESIGN_ARMS = ("streaming_llm_w8", "random_w8", "h2o_w8", "tova_w8", "morphkv_mean_w8",
               "morphkv_mean_w32", "h2o_w8_attn", "morphkv_mean_w8_attn", "morphkv_mean_w32_attn")
DESIGN_TABLE = {  # design notes: independent implementation, prose 1,100 tokens, 4 sinks, KL
    128: (0.233, 0.338, 1.030, 0.730, 0.489, 0.350, 0.763, 0.179, 0.158),
    256: (0.130, 0.207, 0.725, 0.363, 0.267, 0.206, 0.466, 0.083, 0.067),
}
NAN = float("nan")


def load_results(results: Path | str = "results", docs: Path | str = "docs") -> dict:
    """{name: result dict} for every benchmark JSON found (results/ first, then docs/figures)."""
    found = {}
    for name, files in SOURCES.items():
        paths = [Path(results) / name / f for f in files]
        paths += [Path(docs) / "figures" / f for f in files]
        for path in [p for p in paths if p.is_file()][:1]:
            found[name] = {**json.loads(path.read_text()), "_path": str(path)}
    return found


def _fmt(v) -> str:
    return f"{v:.3f}"


def _section(title: str, intro: str, body: list[str], notes: list[str], figure=None) -> str:
    lines = [f"## {title}", "", intro, "", *body]
    lines += ["Notes (computed from the numbers):", "", *notes, ""] if notes else []
    lines += [f"![{figure}](figures/{figure}.png)", ""] if figure else []
    return "\n".join(lines)


def mechanism_section(result: dict) -> str:
    s, grid = result["settings"], ("scenario", "length", "budget", "window")
    arms, L, B = s["arms"], max(s["lengths"]), max(s["budgets"])
    W = 8 if 8 in s["windows"] else s["windows"][0]
    at = [r for r in result["rows"] if (r["length"], r["budget"], r["window"]) == (L, B, W)]
    rows = [{**r, "metric": m, "value": r[m]} for m in ("kept", "err") for r in at]
    table = markdown_table(*pivot(rows, ["scenario", "metric"], "arm", "value", arms))
    notes = []
    for sc in s["scenarios"]:
        cells = {r["arm"]: r for r in at if r["scenario"] == sc}
        best = min(cells.values(), key=lambda r: r["err"])
        kept = ", ".join(f"{a} {_fmt(c['kept'])}" for a, c in cells.items())
        low = f"{best['arm']} ({_fmt(best['err'])})"
        notes.append(f"- {sc}: kept {kept}; lowest probe error {low}.")
    stream = {tuple(r[k] for k in grid): r for r in result["rows"] if r["arm"] == "streaming_llm"}
    for r in (r for r in result["rows"] if r["arm"] == "morphkv_mean"):
        other = stream.get(tuple(r[k] for k in grid))
        if other and r["err"] > other["err"]:
            notes.append(f"- {r['scenario']} L{r['length']} b{r['budget']} w{r['window']}: "
                         f"morphkv_mean probe error {_fmt(r['err'])} is worse than "
                         f"streaming_llm {_fmt(other['err'])}.")
    pts = sorted({(x["budget"], x["window"]) for x in result.get("skipped", [])})
    if pts:
        where = ", ".join(f"budget {b} window {w}" for b, w in pts)
        notes.append(f"- Skipped (budget must exceed sinks + window): {where}.")
    intro = (
        f"Key streams per head (head_dim {s['head_dim']}, {s['heads']} heads, {s['n_sink']} "
        f"sinks, {s['seeds']} seeds; lengths {s['lengths']} x budgets {s['budgets']} x windows "
        f"{s['windows']}), proxy scoring. `kept`: fraction of the relevant region still stored "
        "at the end. `err`: relative L2 error of a probe query's attention output read from the "
        f"kept set instead of the full set. Table: length {L}, budget {B}, window {W}."
    )
    title = "Mechanism: synthetic retention (`morphkv bench mechanism`)"
    return _section(title, intro, [table, ""], notes, "mechanism")


def fidelity_headline(result: dict) -> str:
    """Per budget, the arms with the lowest KL; per arm, at how many budgets it beats recency."""
    from .fidelity import summary

    body, lines = summary(result, "kl")[1], ["## Summary (`morphkv eval fidelity`)", ""]
    for i, b in enumerate(result["settings"]["budgets"], start=1):
        ranked = sorted((r[i], r[0]) for r in body if r[i] == r[i])
        rest = ", ".join(f"{a} ({_fmt(v)})" for v, a in ranked[1:4])
        lines += [f"- Budget {b}: lowest KL {ranked[0][1]} ({_fmt(ranked[0][0])}), then {rest}."]
    table = {r[0]: r[1:] for r in body}
    for arm, vals in table.items() if BASELINE in table else []:
        wins = sum(v < w for v, w in zip(vals, table[BASELINE], strict=True))
        lines += [f"- {arm}: lower KL than {BASELINE} at {wins} of {len(vals)} budgets."] * (
            arm != BASELINE
        )
    return "\n".join(lines + [""])


def fidelity_section(result: dict) -> str:
    from .fidelity import tables

    s, rows, body = result["settings"], result["rows"], tables(result)
    scored = [r for r in rows if r["budget"] is not None]
    notes = [f"- {n}" for n in result.get("notes", [])]
    full = [f"{r['kl']:.2e}" for r in rows if r["arm"] == "full"]
    if full:
        notes.append(f"- The `full` arm (MorphKVCache, method full, fed like the others) has KL "
                     f"{', '.join(full)} against mlx_lm's KVCache.")
    kl = {(r["text"], r["arm"], r["budget"]): r["kl"] for r in scored}
    for (text, arm, b), v in kl.items():
        base = kl.get((text, BASELINE, b))
        if arm.startswith("morphkv") and arm.endswith("_attn") and base is not None and v > base:
            note = f"{BASELINE} ({_fmt(base)}) beats {arm} ({_fmt(v)})"
            notes.append(f"- {text}, budget {b}: {note}.")
    notes += _design_check(result)
    if s.get("equal_bytes"):
        notes.append(f"- Equal bytes: each arm ran at the budget where its caches hold what "
                     f"{s['equal_bytes']} holds at the column's budget (`arm_budget`)")
    texts = ", ".join(f"{k} ({v} tokens)" for k, v in s["texts"].items())
    intro = (
        f"Model: {s.get('model', '?')}. Texts: {texts}. {s['n_sink']} sinks. Feeding: "
        f"`{s['feed']}`. Metrics over the positions whose context exceeds the budget, averaged "
        "over texts (weighted by positions). `_attn` = the model's real queries; the rest use "
        "the key-as-query proxy."
    )
    title = "Fidelity: teacher-forced, against the full cache (`morphkv eval fidelity`)"
    return _section(title, intro, body, notes, "fidelity")


def _design_check(result: dict) -> list[str]:
    """Arms more than 10% away from the design notes' independent figures (prose0 only)."""
    tokens = result["settings"]["texts"].get("prose0")
    ours = {(r["arm"], r["budget"]): r["kl"] for r in result["rows"] if r["text"] == "prose0"}
    cells = [(a, b, ref) for b, t in DESIGN_TABLE.items()
             for a, ref in zip(DESIGN_ARMS, t, strict=True) if (a, b) in ours]
    off = [f"{a} at {b} ({_fmt(ours[a, b])} vs {_fmt(ref)})" for a, b, ref in cells
           if abs(ours[a, b] - ref) > 0.1 * ref]
    caveat = "" if tokens == 1100 else f" (this prose text has {tokens} tokens, theirs 1,100)"
    return [f"- Design notes' independent figures{caveat}: {len(cells)} cells compared, more "
            f"than 10% away: {', '.join(off) or 'none'}."] if cells else []


def generation_section(result: dict) -> str:
    from .generation import summary

    s = result["settings"]
    headers, body = summary(result)
    rows = [{**r, "budget": r["budget"] or "-", "p": f"prompt {r['prompt']}"}
            for r in result["rows"]]
    tables = [markdown_table(headers, body), "", "10-gram repetition per prompt:", "",
              markdown_table(*pivot(rows, ["arm", "budget"], "p", "rep10")), ""]
    notes = []
    if s["prompts"] < 3 or s["max_tokens"] < 1000:
        notes.append(f"- Small sample ({s['prompts']} prompt(s) x {s['max_tokens']} tokens, one "
                     "greedy answer each): differences are anecdotes, not a ranking.")
    rep = headers.index("10-gram rep.")
    for f in (r for r in body if r[0] == "full"):
        worse = [f"{r[0]} b{r[1]} ({_fmt(r[rep])})" for r in body
                 if r[0] != "full" and r[rep] > f[rep]]
        notes.append(f"- Full cache 10-gram repetition {_fmt(f[rep])}; arms repeating more: "
                     f"{', '.join(worse) or 'none'}.")
    intro = (
        f"Model: {s.get('model', '?')}. Greedy, up to {s['max_tokens']} tokens, {s['prompts']} "
        f"prompt(s), {s['n_sink']} sinks; means over prompts. 10-gram repetition: fraction of "
        "the answer's 10-grams already seen in it (lower is better)."
    )
    title = "Free generation (`morphkv eval generation`)"
    return _section(title, intro, tables, notes, "generation")


def speed_section(result: dict) -> str:
    recs = [{**r, "arm": a, "MiB": r["peak_bytes"] / 2**20} for a, rs in result["records"].items()
            for r in rs]
    body = ["median decode ms/token:", "",
            markdown_table(*pivot(recs, ["position"], "arm", "ms_per_token_median")), "",
            "MLX peak memory, MiB:", "", markdown_table(*pivot(recs, ["position"], "arm", "MiB")),
            ""]
    notes = [f"- {'PASS' if t['pass'] else 'MISS'} {t['target']}: {t['value']:.3f} ({t['detail']})"
             for t in result.get("targets", [])]
    intro = "Decode time and memory as the context grows, teacher-forced on real text."
    title = "Speed and memory at length (`morphkv bench speed`)"
    return _section(title, intro, body, notes, "speed_memory")


def layer_section(result: dict) -> str:
    cols = ["method", "budget", "window", "decode_us", "rotating_us", "decode_ratio", "chunk_ms"]
    rows = [{"budget": result["budget"], "window": 8, "chunk_ms": r.get("chunk2048_ms"), **r}
            for r in result["rows"]]
    intro = ("One cache layer alone (B=1, 4 KV heads, head_dim 64, float16): median single-token "
             "update once full, side by side with mlx_lm's RotatingKVCache of the same size, "
             f"and one {result.get('chunk', 2048)}-token update into an empty cache.")
    table = markdown_table(cols, [[r[c] for c in cols] for r in rows])
    return _section("Per-layer update cost (`morphkv bench speed --mode layer`)", intro,
                    [table, ""], [])


def overhead_section(result: dict) -> str:
    med, a = result["median"], result["args"]
    ref = {k: med[arm][k] if arm in med else NAN
           for k, arm in (("prefill_s", "kvcache"), ("decode_ms", "rotating"))}
    rows = [[arm, m["prefill_s"], m["prefill_s"] / ref["prefill_s"], m["decode_ms"],
             m["decode_ms"] / ref["decode_ms"]] for arm, m in med.items()]
    headers = ["cache", "prefill s", "vs kvcache", "decode ms/token", "vs rotating"]
    intro = (f"SmolLM2-135M, a {a['prompt_tokens']}-token prompt in chunks of "
             f"{a['prefill_step']}, then {a['decode']} greedy steps; budget {a['budget']}; "
             f"{a['repeats']} interleaved repeats, medians.")
    title = "What the cache costs in the model (`morphkv bench speed --mode overhead`)"
    return _section(title, intro, [markdown_table(headers, rows), ""], [])


def blas_section(result: dict) -> str:
    off, on, up = result["without_preload"], result["with_preload"], result["speedup"]
    keys = {"matmul_1024_f32_s": "matmul_1024_f32", "forward_256_tokens_s": "forward_256_tokens",
            "prompt_tps": "prompt_tps", "generation_tps": "generation_tps"}
    rows = [[k, off[k], on[k], up[u]] for k, u in keys.items()]
    table = markdown_table(["measure", "reference BLAS", "OpenBLAS", "speed-up"], rows)
    intro = f"Library: {result['blas_library']}."
    return _section("OpenBLAS preload (`morphkv bench blas`)", intro, [table, ""], [])


SECTIONS = {  # name -> section builder (a callable, or "module:function")
    "mechanism": mechanism_section,
    "fidelity": fidelity_section,
    "generation": generation_section,
    "speed": speed_section,
    "layer": layer_section,
    "overhead": overhead_section,
    "blas": blas_section,
    "sweep_tune": "morphkv.eval.sweep:section",
    "sweep_heldout": "morphkv.eval.sweep:section",
    "recall": "morphkv.eval.recall:section",
    "chatrecall": "morphkv.eval.chat_report:section",
}


OLD_ENGINE = (
    "> Measured with the previous selection engine (engine 1: a float64 copy of the keys, "
    "real-query rows revised as tokens arrive). Scoring and speed have changed since; the "
    "command above measures the current engine.\n\n"
)


def _dated(result: dict, text: str) -> str:
    """A section measured before the current engine says so under its title."""
    if result.get("environment", {}).get("engine"):
        return text
    title, _, rest = text.partition("\n\n")
    return f"{title}\n\n{OLD_ENGINE}{rest}"


def _builder(spec):
    if callable(spec):
        return spec
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)


def build_report(found: dict) -> str:
    parts = [
        "# Results",
        "",
        "Generated by `morphkv report` from the benchmark JSON files (docs/figures/*.json). "
        "Every number below is measured by this repository's code on the machine named in each "
        "file's `environment`; nothing is copied from the paper.",
        "",
    ]
    if not found:
        parts.append("No results found: run the benchmarks first.")
    if "fidelity" in found:
        parts.append(_dated(found["fidelity"], fidelity_headline(found["fidelity"])))
    parts += [_dated(found[name], _builder(f)(found[name]))
              for name, f in SECTIONS.items() if name in found]
    parts += ["## Runs", ""] if found else []
    for name, data in found.items():
        env, run = data.get("environment", {}), Path(data["_path"]).name
        if env:
            quick = data.get("settings", {}).get("quick")
            run += (f", {data.get('elapsed_s', NAN):.0f} s on {env.get('cpus')} CPUs, mlx "
                    f"{env.get('mlx')}, {env.get('date')}; quick={quick}")
        parts.append(f"- {name}: {run}")
    return "\n".join(parts) + "\n"


def copy_figures(results: Path, docs: Path) -> list[Path]:
    dest = docs / "figures"
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in SOURCES:
        for src in sorted((results / name).glob("*.json")) + sorted((results / name).glob("*.png")):
            skip = ".partial." in src.name or "_quick" in src.name
            if not skip and src.stat().st_size <= MAX_COPY_BYTES:
                shutil.copy2(src, dest / src.name)
                copied.append(dest / src.name)
    return copied


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--results", "results", "benchmark output folder"),
        ("--docs", "docs", "docs folder"),
        ("--copy", False, "copy each benchmark's JSON and PNG into <docs>/figures first"),
        ("--out", None, "report path (default <results>/report.md; the docs keep only "
                     "current figures)"),
    ])


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
    out = Path(args.out) if args.out else results / "report.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return text
