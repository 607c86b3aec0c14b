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
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from ..eval.process import free_port, stop_process

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


# ---- the server side (a child process) ----------------------------------------------------
def server_main(argv: list[str]) -> int:
    """Child process: ``<memory log> <morphkv|mlx_lm> [morphkv serve flags]``."""
    import mlx.core as mx

    from ..server import app as serve

    log_path, cache, *flags = argv
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(flags)

    reset = Path(log_path + ".reset")  # the bench asks for a fresh peak through this file

    def sample():
        with open(log_path, "a") as f:
            while True:
                if reset.exists():
                    mx.reset_peak_memory()
                    reset.unlink()
                t, active, peak = time.time(), mx.get_active_memory(), mx.get_peak_memory()
                f.write(f"{t:.3f} {active} {peak}\n")
                f.flush()
                time.sleep(0.1)

    threading.Thread(target=sample, daemon=True).start()
    return serve.serve(args, serve.cache_config(args) if cache == "morphkv" else None)


class Server:
    """One server process on loopback, stopped by its process id."""

    def __init__(self, cache: str, args, out: Path):
        from ..runtime.blas import blas_env

        self.port, self.log = free_port(), out / f"memory_{cache}.log"
        self.log.unlink(missing_ok=True)
        flags = [
            "--port",
            str(self.port),
            "--log-level",
            "WARNING",
            "--budget",
            str(args.budget),
            "--window",
            str(args.window),
            "--sinks",
            str(args.sinks),
            "--method",
            args.method,
        ] + (["--model", args.model] if args.model else [])
        code = (
            "import sys; from morphkv.bench.serve import server_main; "
            "sys.exit(server_main(sys.argv[1:]))"
        )
        self.output = out / f"server_{cache}.txt"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(self.log), cache, *flags],
            stdout=self.output.open("w"),
            stderr=subprocess.STDOUT,
            env=blas_env(dict(os.environ)),
        )
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{cache} server did not start:\n{self.output.read_text()}")
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def memory(self) -> tuple[int, int]:
        """(active, peak) MLX bytes in the server, sampled after now."""
        start = time.time()
        while True:
            lines = self.log.read_text().split("\n")
            last = [x for x in lines if x][-1].split()
            if float(last[0]) > start:
                return int(last[1]), int(last[2])
            time.sleep(0.05)

    def reset_peak(self) -> None:
        """Restart the server's MLX peak memory count (it includes model loading before)."""
        flag = Path(f"{self.log}.reset")
        flag.touch()
        while flag.exists():
            time.sleep(0.05)

    def stop(self) -> None:
        stop_process(self.proc, 20)


# ---- the client side -------------------------------------------------------------------------
def _streamed(client, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first, tokens = None, 0
    stream = client.chat.completions.create(
        model="default_model",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {"start": t0, "ttft_s": (first or end) - t0, "latency_s": end - t0, "tokens": tokens}


def concurrency_run(client, prompts: list[str], clients: int, max_tokens: int) -> dict:
    """Send ``prompts`` with ``clients`` workers; total tokens/s and per-request latency."""
    pending, results, lock = list(prompts), [], threading.Lock()

    def worker():
        while True:
            with lock:
                if not pending:
                    return
                prompt = pending.pop(0)
            results.append(_streamed(client, prompt, max_tokens))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    return {
        "clients": clients,
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "latency_s": statistics.median(r["latency_s"] for r in results),
        "ttft_s": statistics.median(r["ttft_s"] for r in results),
    }


def conversation(client, server: Server, turns: int, max_tokens: int) -> list[dict]:
    messages, rows = [], []
    for i in range(turns):
        question = TURNS[i % len(TURNS)].format(PLANETS[(i // len(TURNS)) % len(PLANETS)])
        messages.append({"role": "user", "content": question})
        t0 = time.perf_counter()
        r = client.chat.completions.create(
            model="default_model", messages=messages, max_tokens=max_tokens
        )
        latency = time.perf_counter() - t0
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        active, peak = server.memory()
        details = r.usage.prompt_tokens_details
        rows.append(
            {
                "turn": i + 1,
                "prompt_tokens": r.usage.prompt_tokens,
                "completion_tokens": r.usage.completion_tokens,
                "cached_tokens": details.cached_tokens if details else None,
                "latency_s": latency,
                "active_bytes": active,
                "peak_bytes": peak,
            }
        )
    return rows


def bench_server(cache: str, args, out: Path) -> dict:
    import openai

    server = Server(cache, args, out)
    try:
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="unused", timeout=600, max_retries=0
        )
        prompts = PROMPTS[: args.n_prompts]
        concurrency_run(client, prompts, 1, 4)  # warm-up: the prompts' segments are cached
        levels = []
        for clients in args.levels:
            runs = [
                concurrency_run(client, prompts, clients, args.max_tokens)
                for _ in range(args.repeats)
            ]
            levels.append({k: statistics.median(r[k] for r in runs) for k in runs[0]})
            print(
                f"  {cache}: {clients} clients: {levels[-1]['tokens_per_s']:.1f} tokens/s, "
                f"latency {levels[-1]['latency_s']:.2f} s",
                flush=True,
            )
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
    growth = None
    if len(past) > 1:
        growth = past[-1]["peak_bytes"] / past[0]["peak_bytes"] - 1
    return {
        "speedup_most_vs_one": most["tokens_per_s"] / one["tokens_per_s"],
        "budget_reached_at_turn": past[0]["turn"] if past else None,
        "peak_growth_after_budget": growth,
        "peak_first_to_last": turns[-1]["peak_bytes"] / turns[0]["peak_bytes"] - 1,
    }


def plot(results: dict, budget: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, r in results.items():
        c = r["concurrency"]
        axes[0].plot([x["clients"] for x in c], [x["tokens_per_s"] for x in c], "o-", label=name)
        axes[1].plot([x["clients"] for x in c], [x["latency_s"] for x in c], "o-", label=name)
        t = r["conversation"]
        axes[2].plot([x["turn"] for x in t], [x["peak_bytes"] / 2**20 for x in t], "o-", label=name)
        reached = r["summary"]["budget_reached_at_turn"]
        if name == "morphkv" and reached:
            axes[2].axvline(reached, color="gray", ls=":", label=f"budget {budget} reached")
    labels = [
        ("concurrent clients", "total tokens/s"),
        ("concurrent clients", "median request latency (s)"),
        ("conversation turn", "server MLX peak (MiB)"),
    ]
    for ax, (x, y) in zip(axes, labels, strict=True):
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.legend()
    fig.suptitle("morphkv serve vs mlx_lm server (default cache)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
    settings = {k: v for k, v in vars(args).items() if not callable(v)}
    report = {"settings": settings, "results": results}
    name = "serve_quick" if args.quick else "serve"
    (out / f"{name}.json").write_text(json.dumps(report, indent=2))
    plot(results, args.budget, out / f"{name}.png")
    for cache, r in results.items():
        s = r["summary"]
        growth = s["peak_growth_after_budget"]
        print(
            f"{cache}: {max(args.levels)} clients {s['speedup_most_vs_one']:.2f}x tokens/s of "
            f"one at a time; MLX peak growth after the budget: "
            f"{'n/a' if growth is None else f'{100 * growth:.1f}%'}, first to last turn "
            f"{100 * s['peak_first_to_last']:.1f}%"
        )
    print(f"wrote {out / name}.json and .png")
    return 0
