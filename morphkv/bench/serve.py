"""Benchmark morphkv serve against mlx_lm's server with its default cache: throughput, latency
and server memory.

Both servers are the same mlx_lm server machinery on the same model (``morphkv serve``, and
the same with mlx_lm's default ``KVCache``), started one after the other on loopback and driven
with the official ``openai`` client on the same prompts: 1, 2 and 4 concurrent clients sending
the same requests (streamed: time to first token, request latency, total tokens/s), then a
multi-turn conversation that runs well past the budget while the server's MLX memory (active,
and peak since the conversation began, sampled in the server process) is recorded after each
turn. Prints and saves JSON +
PNG (default under results/serve/).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from ..eval import plots
from .servers import Server, in_threads, model_flag, settings_of, stream_chat, write_report

PROMPTS = [
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain in detail how a steam engine works.",
    "Describe a journey across a desert, day by day.",
    "Write a detailed recipe for bread, with every step explained.",
]
TURNS = [
    "Tell me about the planet {}.",
    "What else is interesting about {}?",
    "How would a spacecraft reach {}?",
    "Summarize what we said about {} so far.",
    "Compare {} with Earth.",
]
PLANETS = ["Mercury", "Venus", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune", "Pluto"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="Model to serve (default: embedded).")
    parser.add_argument("--method", default="morphkv")
    parser.add_argument("--budget", type=int, default=128, help="morphkv budget (tokens).")
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64, help="Tokens per request.")
    parser.add_argument("--repeats", type=int, default=3, help="Runs per concurrency (median).")
    parser.add_argument("--turns", type=int, default=20, help="Conversation turns.")
    parser.add_argument("--turn-tokens", type=int, default=48, help="Tokens per reply.")
    parser.add_argument("--out", default="results/serve", help="Output directory.")
    parser.add_argument("--quick", action="store_true", help="Seconds-scale smoke run.")


def _streamed(client, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    r = stream_chat(client, [{"role": "user", "content": prompt}], max_tokens)
    end = time.perf_counter()
    return {"start": t0, "ttft_s": (r["first"] or end) - t0, "latency_s": end - t0,
            "tokens": r["tokens"]}


def concurrency_run(client, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """Send ``prompts`` with ``clients`` workers; total tokens/s and per-request latency."""
    pending, results, lock = list(prompts), [], threading.Lock()

    def worker(_):
        while True:
            with lock:
                if not pending:
                    return
                prompt = pending.pop(0)
            results.append(_streamed(client, prompt, max_tokens))

    t0 = time.perf_counter()
    in_threads(worker, range(clients), None)
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "latency_s": statistics.median(r["latency_s"] for r in results),
            "ttft_s": statistics.median(r["ttft_s"] for r in results)}


def conversation(client, server, turns: int, max_tokens: int) -> list[dict]:
    messages, rows = [], []
    for i in range(turns):
        question = TURNS[i % len(TURNS)].format(PLANETS[(i // len(TURNS)) % len(PLANETS)])
        messages.append({"role": "user", "content": question})
        t0 = time.perf_counter()
        r = client.chat.completions.create(model="default_model", messages=messages,
                                           max_tokens=max_tokens)
        latency = time.perf_counter() - t0
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        active, peak = server.latest()
        details = r.usage.prompt_tokens_details
        rows.append({"turn": i + 1, "prompt_tokens": r.usage.prompt_tokens,
                     "completion_tokens": r.usage.completion_tokens,
                     "cached_tokens": details.cached_tokens if details else None,
                     "latency_s": latency, "active_bytes": active, "peak_bytes": peak})
    return rows


def bench_server(cache: str, args, out: Path) -> dict:
    flags = ["--budget", str(args.budget), "--window", str(args.window), "--sinks",
             str(args.sinks), "--method", args.method, *model_flag(args)]
    kind = "morphkv" if cache == "morphkv" else "kvcache"  # the same server, mlx_lm's cache
    server = Server(kind, flags, out, label=cache, every=0.1)
    try:
        client = server.client(600)
        prompts = PROMPTS[: args.n_prompts]
        concurrency_run(client, prompts, 1, 4)  # warm-up: the prompts' segments are cached
        levels = []
        for clients in args.levels:
            runs = [concurrency_run(client, prompts, clients, args.max_tokens)
                    for _ in range(args.repeats)]
            levels.append({k: statistics.median(r[k] for r in runs) for k in runs[0]})
            print(f"  {cache}: {clients} clients: {levels[-1]['tokens_per_s']:.1f} tokens/s, "
                  f"latency {levels[-1]['latency_s']:.2f} s", flush=True)
        server.reset_peak()
        turns = conversation(client, server, args.turns, args.turn_tokens)
        startup = server.output.read_text().split("\n")[0]
    finally:
        server.stop()
    return {"startup": startup, "concurrency": levels, "conversation": turns}


def summarize(result: dict, budget: int) -> dict:
    levels = {c["clients"]: c for c in result["concurrency"]}
    one, most = levels[min(levels)], levels[max(levels)]
    turns = result["conversation"]
    past = [t for t in turns if t["prompt_tokens"] > budget]  # the budget is reached
    growth = past[-1]["peak_bytes"] / past[0]["peak_bytes"] - 1 if len(past) > 1 else None
    return {"speedup_most_vs_one": most["tokens_per_s"] / one["tokens_per_s"],
            "budget_reached_at_turn": past[0]["turn"] if past else None,
            "peak_growth_after_budget": growth,
            "peak_first_to_last": turns[-1]["peak_bytes"] / turns[0]["peak_bytes"] - 1}


def plot(results: dict, budget: int, path: Path) -> None:
    fig, axes = plots.panels(3, 5, 4.2)
    axes = axes[0]
    for name, r in results.items():
        c, t = r["concurrency"], r["conversation"]
        axes[0].plot([x["clients"] for x in c], [x["tokens_per_s"] for x in c], "o-", label=name)
        axes[1].plot([x["clients"] for x in c], [x["latency_s"] for x in c], "o-", label=name)
        axes[2].plot([x["turn"] for x in t], [x["peak_bytes"] / 2**20 for x in t], "o-", label=name)
        reached = r["summary"]["budget_reached_at_turn"]
        if name == "morphkv" and reached:
            axes[2].axvline(reached, color="gray", ls=":", label=f"budget {budget} reached")
    plots.labelled(axes, [("concurrent clients", "total tokens/s"),
                          ("concurrent clients", "median request latency (s)"),
                          ("conversation turn", "server MLX peak (MiB)")])
    fig.suptitle("morphkv serve vs mlx_lm server (default cache)")
    plots.save(fig, path, 120)


def run(args) -> int:
    if args.quick:
        args.levels, args.n_prompts, args.repeats = [1, 2], 2, 1
        args.max_tokens, args.turns, args.turn_tokens = 4, 3, 8
        args.budget = min(args.budget, 32)
    else:
        args.levels, args.n_prompts = [1, 2, 4], 4
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for cache in ("morphkv", "mlx_lm"):
        print(f"{cache} server ...", flush=True)
        results[cache] = bench_server(cache, args, out)
        results[cache]["summary"] = summarize(results[cache], args.budget)
    name = "serve_quick" if args.quick else "serve"
    write_report(out, name, {"settings": settings_of(args), "results": results},
                 lambda path: plot(results, args.budget, path))
    for cache, r in results.items():
        s = r["summary"]
        growth = s["peak_growth_after_budget"]
        print(f"{cache}: {max(args.levels)} clients {s['speedup_most_vs_one']:.2f}x tokens/s of "
              f"one at a time; MLX peak growth after the budget: "
              f"{'n/a' if growth is None else f'{100 * growth:.1f}%'}, first to last turn "
              f"{100 * s['peak_first_to_last']:.1f}%")
    print(f"wrote {out / name}.json and .png")
    return 0
