"""Fairness under mixed lengths: does a long prompt hold short requests hostage?

Each server (``servers.Server``: morphkv serve, fair batching; mlx_lm's own server; with
``--cache-flags "--batching mlx_lm --prefill-step-size 2048"`` morphkv serve with mlx_lm's
scheduler) is sent, streamed with the ``openai`` client: a short chat alone, the long prompt
alone, the long prompt with 4 short chats at once ("together"), and the long prompt followed by
4 short chats ``--after-s`` seconds later ("after"); every prompt starts with its own number (no
prompt cache reuses another's prefill). Per request: time to first token and total time. The
targets (issue 35): a short chat's TTFT together / after <= 2x its TTFT alone + a quarter of
the long prompt's time alone; the long prompt together <= 1.3x alone. JSON + PNG (default
under results/serve_fair/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ..eval import plots
from .load_clients import QUESTIONS, User, long_text
from .servers import Server, add_server_arguments, each_server, in_threads, server_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser, 16, "results/serve_fair")
    a = parser.add_argument
    a("--long-tokens", type=int, default=2000, help="The long prompt, ~tokens.")
    a("--shorts", type=int, default=4, help="Short chats sent with it.")
    a("--after-s", type=float, default=2.0, help="'after': delay of the short chats.")


_counter = iter(range(10**9))


def _streamed(client, content: str, max_tokens: int, kind: str) -> dict:
    """One streamed chat (``User.ask``), its prompt numbered: no prompt cache reuses another's."""
    r = User(client, "", 0, max_tokens, "").ask(kind, f"Request {next(_counter)}. {content}",
                                                 stream=True, temperature=0.0)
    return {**r, "total_s": r["end"] - r["start"]}


def _at_once(jobs: list[tuple[float, callable]]) -> list[dict]:
    """Run each job (delay seconds, function) in its own thread; the results in job order."""
    results: list = [None] * len(jobs)

    def work(i):
        time.sleep(jobs[i][0])
        results[i] = jobs[i][1]()

    in_threads(work, range(len(jobs)), 1800)
    return results


def summarize(runs: dict, args) -> dict:
    def med(rows, key, kind=None):
        vals = [r[key] for r in rows if r["ok"] and r.get(key) is not None
                and (kind is None or r["kind"] == kind)]
        return statistics.median(vals) if vals else None

    short_ttft = med(runs["short_alone"], "ttft_s")
    long_total = med(runs["long_alone"], "total_s")
    limit = 2 * short_ttft + 0.25 * long_total if short_ttft and long_total else None
    s = {"short_alone_ttft_s": short_ttft, "short_alone_total_s": med(runs["short_alone"],
                                                                      "total_s"),
         "long_alone_ttft_s": med(runs["long_alone"], "ttft_s"), "long_alone_total_s": long_total,
         "short_ttft_limit_s": limit,
         "failed": sum(not r["ok"] for rows in runs.values() for r in rows)}
    for name in ("together", "after"):
        rows = runs[name]
        worst = max((r["ttft_s"] or 1e9 for r in rows if r["kind"] == "short"), default=None)
        s[name] = {"short_ttft_median_s": med(rows, "ttft_s", "short"), "short_ttft_max_s": worst,
                   "short_total_median_s": med(rows, "total_s", "short"),
                   "long_ttft_s": med(rows, "ttft_s", "long"),
                   "long_total_s": med(rows, "total_s", "long"),
                   "short_ttft_target_met": limit is not None and worst is not None
                   and worst <= limit}
        if long_total and s[name]["long_total_s"]:
            s[name]["long_vs_alone"] = s[name]["long_total_s"] / long_total
    s["together"]["long_target_met"] = s["together"].get("long_vs_alone", 9) <= 1.3
    return s


def bench_server(kind: str, args, out: Path, long_prompt: str) -> dict:
    server = Server(kind, server_flags(kind, args), out)
    client = server.client(1200)

    def short(i=0):
        return lambda: _streamed(client, QUESTIONS[i % len(QUESTIONS)], args.max_tokens, "short")

    def long():
        return _streamed(client, long_prompt, args.max_tokens, "long")

    try:
        short()()  # warm-up (first-request costs: tokenizer, kernels)
        runs = {"short_alone": [short(i)() for i in range(3)], "long_alone": [long()],
                "together": _at_once([(0, long)] + [(0, short(i)) for i in range(args.shorts)]),
                "after": _at_once([(0, long)] + [(args.after_s, short(i))
                                                 for i in range(args.shorts)])}
    finally:
        status = server.stop()
    summary = summarize(runs, args)
    print(json.dumps({kind: summary}, indent=1), flush=True)
    return {"runs": runs, "summary": summary, "exit_status": status,
            "startup": server.startup(),
            "tracebacks_in_log": server.output.read_text().count("Traceback")}


def plot(results: dict, path: Path) -> None:
    fig, axes = plots.panels(2, 5.5, 4)
    axes = axes[0]
    names = list(results)
    for ax, key, title in ((axes[0], "short_ttft_max_s", "short chats: slowest first token (s)"),
                           (axes[1], "long_total_s", "long prompt: total time (s)")):
        for j, scen in enumerate(("together", "after")):
            vals = [results[n]["summary"][scen][key] or 0 for n in names]
            ax.bar([i + 0.4 * j for i in range(len(names))], vals, width=0.4, label=scen)
        alone = [results[n]["summary"]["short_ttft_limit_s" if j == 0 else "long_alone_total_s"]
                 for n in names for j in [0 if key.startswith("short") else 1]]
        ax.scatter(range(len(names)), alone, color="k", marker="_", s=400,
                   label="target limit" if key.startswith("short") else "alone")
        ax.set_xticks([i + 0.2 for i in range(len(names))], names)
        ax.set_title(title)
        ax.legend()
    plots.save(fig, path, 110)


def run(args) -> int:
    if args.quick:
        args.long_tokens, args.max_tokens, args.budget = 600, 4, min(args.budget, 32)
    each_server(args, "serve_fair", bench_server, "Summarize this text. "
                + long_text(args.long_tokens), lambda results: {"results": results}, plot)
    return 0
