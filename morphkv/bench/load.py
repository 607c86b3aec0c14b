"""Load and fault benchmark of morphkv serve against mlx_lm's own server with its default
cache: throughput, p50/p95 latency, memory, errors, with the official openai client.

Both servers (``servers.Server``) load the same model, one after the other, with the same
flags. The load, the same for both: (1) warm-up (the most clients, long prompts: the peak is
reached), then short chats from 8 clients (the throughput comparison); (2) N = 4, 8, 16
clients, each a bounded script (``load_clients.User``: chats, streams, completions, a
conversation far past the budget, prompts of 10x the budget, dropped streams, malformed
requests); (3) the mixed-length level (``drive_mixed``: --mixed requests with 2k and 8k
prompts); (4) 8 long conversations (throughput past 4x the budget); (5) every malformed request
once, then a health check. Memory is sampled in the server every 0.25 s, morphkv's prompt-cache
bytes from ``GET /morphkv/stats``. Every loop is bounded in count and time. JSON + PNG under
--out (default results/serve_load).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

from .load_clients import PROBE_BAD, User, long_text, raw_post
from .servers import Server, add_server_arguments, each_server, in_threads, loadavg, server_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser, 8, "results/serve_load")
    a = parser.add_argument
    a("--levels", default="4,8,16", help="Concurrent clients of the mixed load.")
    a("--rounds", type=int, default=8, help="Requests per client per level.")
    a("--level-seconds", type=float, default=240, help="Time limit per level.")
    a("--short", type=int, default=4, help="Short chats per client, 8 clients.")
    a("--turns", type=int, default=10, help="Turns of each long conversation.")
    a("--mixed", type=int, default=96, help="Requests of the mixed-length level (short chats, 2k "
      "and 8k prompts, drops, malformed) at the most clients (0: off; the issue's level: 500).")
    a("--mixed-seconds", type=float, default=3600, help="Time limit of the mixed level.")


# ---- the load -------------------------------------------------------------------------------
def drive(users: list[User], seconds: float, request, join_s: float = 300,
          label: str = "", total: int = 0) -> tuple[list, float]:
    """Every user, in its own thread, runs ``request(user, n)`` for n = 0, 1, ... until it
    returns None or ``seconds`` pass; with ``label``, a progress line every 25 requests."""
    records, lock = [], threading.Lock()
    deadline, t0 = time.monotonic() + seconds, time.perf_counter()

    def work(u: User):
        n = 0
        while time.monotonic() < deadline and (r := request(u, n)) is not None:
            n += 1
            with lock:
                records.append(r)
                if label and len(records) % 25 == 0:
                    bad = sum(not x["ok"] for x in records if x["kind"] != "bad")
                    print(f"    {label} {len(records)}/{total} requests, "
                          f"{time.perf_counter() - t0:.0f} s, failed good {bad}", flush=True)

    in_threads(work, users, seconds + join_s)
    return records, time.perf_counter() - t0


def rounds(users: list[User], n: int, seconds: float, kinds=None) -> tuple[list, float]:
    """Every user runs ``n`` steps of its script (``kinds``: of these kinds only)."""
    return drive(users, seconds, lambda u, k: u.step(k, kinds) if k < n else None)


SHORT = ["chat", "stream", "completion", "turn", "chat", "drop", "stream", "bad"]
CLASSES = {"short": ("chat", "stream", "completion", "turn"), "long2k": ("long2k",),
           "long8k": ("long8k",)}


def kind_of(k: int, with_8k: bool = True) -> str:
    """Request ``k`` of the mixed level: the one 8k-token prompt (non-streamed) at k = 3, a
    2k-token prompt (streamed: its time to first token is recorded) at every k = 10 mod 25,
    else the short script in turn (every long prompt starts with its own number: no prompt
    cache reuses another's prefill). The warm-up is the level without the 8k prompt."""
    if with_8k and k == 3:
        return "long8k"
    return "long2k" if k % 25 == 10 else SHORT[k % len(SHORT)]


def drive_mixed(users: list[User], total: int, seconds: float, with_8k: bool = True,
                label: str = "") -> tuple[list, float]:
    """The users take the next request number (``kind_of``) until ``total`` are taken or
    ``seconds`` pass; a progress line every 25 requests."""
    counter, lock = iter(range(total)), threading.Lock()

    def request(u: User, _):
        with lock:
            k = next(counter, None)
        return None if k is None else getattr(u, f"_{kind_of(k, with_8k)}")(k)

    return drive(users, seconds, request, 1200, label, total)


def pct(values, q: float):
    """The ``q`` quantile of ``values`` (the element at ``int(q * n)``), None when empty."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def by_class(records: list[dict]) -> dict:
    """Per request class (short, long2k, long8k): count, failed, p50/p95 total, median TTFT."""
    out = {}
    for name, kinds in CLASSES.items():
        rows = [r for r in records if r["kind"] in kinds]
        done = [r["end"] - r["start"] for r in rows if r["ok"]]
        out[name] = {"requests": len(rows), "failed": len(rows) - len(done),
                     "p50_s": pct(done, 0.5), "p95_s": pct(done, 0.95), "ttft_p50_s": pct(
                         [r["ttft_s"] for r in rows if r["ok"] and r.get("ttft_s") is not None],
                         0.5)}
    return out


def figures(records: list[dict], wall: float, budget: int | None = None) -> dict:
    good = [r for r in records if r["kind"] != "bad"]
    done = [r for r in good if r["ok"]]
    lat = [r["end"] - r["start"] for r in done if r["kind"] != "drop"]
    bad = [r for r in records if r["kind"] == "bad"]
    tokens = sum(r["tokens"] for r in done)
    out = {
        "requests": len(records), "wall_s": wall, "tokens": tokens,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "requests_per_s": len(done) / wall if wall else 0.0,
        "p50_s": pct(lat, 0.5), "p95_s": pct(lat, 0.95),
        "failed_good": len(good) - len(done),
        "responses_5xx": sum(1 for r in records if (r["status"] or 0) >= 500),
        "bad": len(bad), "bad_4xx": sum(1 for r in bad if r["ok"]),
        "dropped": sum(1 for r in records if r["kind"] == "drop"),
        "errors": sorted({r.get("error") or "" for r in records if not r["ok"]} - {""})[:5],
    }
    if budget is not None:  # the requests whose prompt is past 4x the budget
        past = [r for r in done if r["prompt_tokens"] > 4 * budget]
        if past:
            span = max(r["end"] for r in past) - min(r["start"] for r in past)
            out["past_4x_requests"] = len(past)
            out["past_4x_tokens_per_s"] = sum(r["tokens"] for r in past) / span
    return out


def bench_server(kind: str, args, out: Path, long_prompt: str) -> dict:
    server = Server(kind, server_flags(kind, args), out)
    client = server.client(180)
    patient = server.client(1200)  # the mixed level's 8k prompt
    cache_samples, done = [], threading.Event()

    def sample_cache():
        while not done.is_set():
            n = server.prompt_cache_bytes()
            if n is not None:
                cache_samples.append((time.time(), n))
            time.sleep(0.25)

    threading.Thread(target=sample_cache, daemon=True).start()
    phases, marks = {}, {}
    try:
        def mk(n, c=client):
            return [User(c, server.url, i, args.max_tokens, long_prompt) for i in range(n)]

        def phase(name: str, f: dict) -> None:  # a phase's figures, its end time, one line
            phases[name], marks[name] = f, time.time()
            print(f"  {kind} {name}: {f['requests']} requests, {f['tokens_per_s']:.1f} tok/s, "
                  f"p95 {f['p95_s']}, failed {f['failed_good']}, 5xx {f['responses_5xx']}, "
                  f"bad 4xx {f['bad_4xx']}/{f['bad']}, {loadavg()}", flush=True)

        # warm-up at the highest concurrency with the mixed level's kinds and lengths (2k
        # prompts, no 8k): the peak that batch sizes and prefill pieces reach is set here, so
        # what grows afterwards grows with time
        top = max(args.levels)
        drive_mixed(mk(top, patient), 3 * top, args.level_seconds * 2, False, "warm-up")
        marks["warm"] = time.time()
        phase("short_8", figures(*rounds(mk(8), args.short, args.level_seconds, ["chat"])))
        for n in args.levels:
            phase(f"load_{n}", figures(*rounds(mk(n), args.rounds, args.level_seconds),
                                       args.budget))
        if args.mixed:
            records, wall = drive_mixed(mk(top, patient), args.mixed, args.mixed_seconds,
                                        with_8k=not args.quick, label=f"{kind} mixed x{top}")
            phase(f"mixed_{top}", {**figures(records, wall, args.budget),
                                   "classes": by_class(records)})
        phases["conversations_8"] = figures(
            *rounds(mk(8), args.turns, args.level_seconds, ["turn"]), args.budget)
        marks["end"], probe = time.time(), phases.setdefault("probe", [])
        for name, body, headers in PROBE_BAD:  # every malformed request once, then /health
            t0 = time.perf_counter()
            status, answer = raw_post(server.url, body, headers, timeout=20)
            probe.append({"name": name, "status": status, "seconds": time.perf_counter() - t0,
                          "answer": answer[:160]})
        probe.append({"name": "health afterwards", "status": server.health()})
    finally:
        done.set()
        status = server.stop()
    text = server.output.read_text()
    return {"phases": phases, "marks": marks, "memory": server.memory(),
            "prompt_cache": cache_samples, "exit_status": status, "startup": server.startup(),
            "tracebacks_in_log": text.count("Traceback"), "log_lines": len(text.splitlines())}


def run(args) -> int:
    from .load_report import plot, summarize

    args.levels = [int(x) for x in str(args.levels).split(",")]
    if args.quick:
        args.levels, args.rounds, args.short, args.turns = [4], 4, 1, 3
        args.mixed, args.budget = min(args.mixed, 12), min(args.budget, 32)

    def report(results):
        summary = summarize(results, args)
        print(json.dumps(summary, indent=2))
        return {"summary": summary, "results": results}

    each_server(args, "serve_load", bench_server, long_text(10 * args.budget), report,
                lambda results, path: plot(results, args, path))
    return 0
