"""Speed and memory at length: decode tokens/s, MLX memory and stored KV bytes as the
context grows, for mlx_lm's own caches and the MorphKV eviction family at one budget.

Decode is measured teacher-forced: a short prompt is prefilled, then real text (Python's
``pydoc_data.topics``) is fed one token at a time through ``model(x, cache=caches)`` and the
logits are evaluated every step. Every ``--every`` tokens each arm records tokens/s over the
last block, the median ms/token, ``mx.get_active_memory()``, ``mx.get_peak_memory()`` (reset
once per arm) and the stored KV bytes (sum of the caches' ``nbytes``).

Arms run in separate worker processes (so each one's memory figures are its own) that are
driven in turn, one block of tokens at a time, so machine noise hits all arms alike. When a
model object is passed to ``run`` directly the arms run in this process, one after another.

``--micro`` runs the per-layer micro benchmark instead: the cost of one cache update
(B=1, 4 KV heads, head_dim 64, float16) for a decode step while evicting and for one
2048-token update, across budgets and windows, next to mlx_lm's ``RotatingKVCache``.

Run ``python -m morphkv.bench.speed --help`` (or ``morphkv bench speed``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_ARMS = ("full", "rotating", "morphkv", "h2o", "tova", "streaming_llm")
MORPH_ARMS = ("morphkv", "h2o", "tova", "streaming_llm", "sliding_window", "random")
RANDOM_TINY = "random-tiny"  # a tiny random-weight llama built in-process (tests, no download)
TOPICS = ("assignment", "exceptions", "for", "import", "lambda", "with", "class", "numbers")


# ---- arguments ------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None, help="model (default: embedded SmolLM2-135M)")
    parser.add_argument("--tokens", type=int, default=20000, help="context length to reach")
    parser.add_argument("--every", type=int, default=500, help="record every N tokens")
    parser.add_argument("--budget", type=int, default=512, help="tokens kept per KV head")
    parser.add_argument("--window", type=int, default=8, help="MorphKV window / protected tail")
    parser.add_argument("--n-sink", type=int, default=4, help="protected first tokens (keep=)")
    parser.add_argument(
        "--arms",
        default=",".join(DEFAULT_ARMS),
        help="comma list of: full, rotating, " + ", ".join(MORPH_ARMS),
    )
    parser.add_argument(
        "--scoring",
        default="auto",
        choices=("auto", "proxy", "attention"),
        help="KVCacheConfig.scoring of the morphkv-family arms",
    )
    parser.add_argument("--prompt-tokens", type=int, default=32, help="prefilled prompt length")
    parser.add_argument(
        "--full-max-tokens",
        type=int,
        default=8000,
        help="stop the full-cache arm at this context length (it slows down linearly)",
    )
    parser.add_argument(
        "--sample",
        type=int,
        default=0,
        help="time only the last N single-token steps of each block and feed the rest as "
        "untimed chunks of --chunk tokens (0: decode every token; makes 20k-token runs cheap; "
        "peak memory is then reset before each timed window)",
    )
    parser.add_argument("--chunk", type=int, default=256, help="chunk size for --sample")
    parser.add_argument("--in-process", action="store_true", help="run arms in this process")
    parser.add_argument("--quick", action="store_true", help="tiny run for tests/CI")
    parser.add_argument("--micro", action="store_true", help="per-layer micro benchmark")
    parser.add_argument("--repeats", type=int, default=0, help="micro: timed repeats (0: auto)")
    parser.add_argument("--out", default="results/speed", help="output directory")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser


def _apply_quick(args: argparse.Namespace) -> None:
    if not args.quick:
        return
    args.tokens = min(args.tokens, 300)
    args.every = min(args.every, 50)
    args.budget = min(args.budget, 64)
    args.window = min(args.window, 8)
    args.full_max_tokens = min(args.full_max_tokens, args.tokens)
    args.prompt_tokens = min(args.prompt_tokens, 16)


def _arms(args: argparse.Namespace) -> list[str]:
    arms = [a.strip() for a in str(args.arms).split(",") if a.strip()]
    for arm in arms:
        if arm not in ("full", "rotating", *MORPH_ARMS):
            raise SystemExit(f"unknown arm {arm!r}; valid: full, rotating, {', '.join(MORPH_ARMS)}")
    return arms


# ---- model, text, caches --------------------------------------------------------------------


def load_model(name: str | None):
    """(model, tokenizer or None)."""
    if name == RANDOM_TINY:
        from ._util import tiny_llama

        return tiny_llama(), None
    from morphkv.model import load

    return load(name)


def text_tokens(tokenizer, n: int, vocab_size: int | None = None) -> list[int]:
    """``n`` token ids of real English prose (pydoc topics, repeated if needed). Without a
    tokenizer the UTF-8 bytes are used (modulo the vocabulary)."""
    from pydoc_data.topics import topics

    names = list(TOPICS) + sorted(k for k in topics if k not in TOPICS)
    ids: list[int] = []
    i = 0
    while len(ids) < n:
        text = topics[names[i % len(names)]] + "\n\n"
        i += 1
        if tokenizer is None:
            new = list(text.encode("utf-8"))
            if vocab_size:
                new = [t % vocab_size for t in new]
        else:
            new = list(tokenizer.encode(text))
        ids.extend(new)
    return ids[:n]


def _vocab_size(model) -> int | None:
    return getattr(getattr(model, "args", None), "vocab_size", None)


def make_caches(
    model, arm: str, budget: int, window: int, n_sink: int, scoring: str = "auto"
) -> list:
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    layers = list(model.layers)
    if arm == "full":
        return [KVCache() for _ in layers]
    if arm == "rotating":
        return [RotatingKVCache(max_size=budget, keep=n_sink) for _ in layers]
    from morphkv import KVCacheBuilder, KVCacheConfig

    config = KVCacheConfig(
        method=arm,
        morphkv_budget=budget,
        morphkv_window=window,
        morphkv_n_sink=n_sink,
        scoring=scoring,
    )
    return KVCacheBuilder.for_model(model, config)


# ---- one arm --------------------------------------------------------------------------------
class ArmRunner:
    """Feeds one arm's caches through the stream and records every ``every`` tokens."""

    def __init__(self, model, arm: str, ids: list[int], args: argparse.Namespace) -> None:
        import mlx.core as mx

        self.mx = mx
        self.model, self.arm, self.ids, self.args = model, arm, ids, args
        mx.clear_cache()
        self.caches = make_caches(model, arm, args.budget, args.window, args.n_sink, args.scoring)
        mx.reset_peak_memory()
        prompt = mx.array([ids[: args.prompt_tokens]])
        mx.eval(model(prompt, cache=self.caches))
        self.pos = args.prompt_tokens
        self.last_record = self.pos

    def _forward(self, tokens: list[int]) -> None:
        mx = self.mx
        logits = self.model(mx.array([tokens]), cache=self.caches)
        mx.eval(logits)

    def advance(self, until: int) -> list[dict]:
        """Feed tokens up to position ``until``; return the records made on the way."""
        mx, args = self.mx, self.args
        records = []
        times: list[float] = []
        while self.pos < until:
            end = min(until, (self.pos // args.every + 1) * args.every)
            if args.sample and end - self.pos > args.sample:  # untimed fast-forward
                stop = end - args.sample
                while self.pos < stop:
                    n = min(args.chunk, stop - self.pos)
                    self._forward(self.ids[self.pos : self.pos + n])
                    self.pos += n
                mx.reset_peak_memory()
            while self.pos < end:
                t0 = time.perf_counter()
                self._forward([self.ids[self.pos]])
                times.append(time.perf_counter() - t0)
                self.pos += 1
            if self.pos % args.every == 0 and times:
                records.append(self._record(times))
                times = []
        return records

    def _record(self, times: list[float]) -> dict:
        mx = self.mx
        kept = getattr(self.caches[0], "tokens_kept", None)
        if kept is None:
            kept = int(self.caches[0].size())
        return {
            "position": self.pos,
            "timed_tokens": len(times),
            "tokens_per_s": len(times) / sum(times),
            "ms_per_token_median": 1e3 * float(np.median(times)),
            "ms_per_token_mean": 1e3 * float(np.mean(times)),
            "active_bytes": int(mx.get_active_memory()),
            "peak_bytes": int(mx.get_peak_memory()),
            "kv_bytes": int(sum(c.nbytes for c in self.caches)),
            "tokens_kept_layer0": int(kept),
        }


# ---- worker processes -----------------------------------------------------------------------
def _worker_main(args: argparse.Namespace) -> int:
    """Serve one arm over stdin/stdout JSON lines: {"until": n} -> {"records": [...]}."""
    _apply_quick(args)
    model, tokenizer = load_model(args.model)
    ids = text_tokens(tokenizer, args.tokens + 1, _vocab_size(model))
    runner = ArmRunner(model, args.worker, ids, args)
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        msg = json.loads(line)
        if "until" not in msg:
            break
        out.write(json.dumps({"records": runner.advance(int(msg["until"]))}) + "\n")
        out.flush()
    return 0


def _worker_argv(args: argparse.Namespace, arm: str) -> list[str]:
    argv = [sys.executable, "-m", "morphkv.bench.speed", "--worker", arm]
    for flag in (
        "tokens",
        "every",
        "budget",
        "window",
        "n_sink",
        "scoring",
        "prompt_tokens",
        "sample",
        "chunk",
    ):
        argv += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if args.model is not None:
        argv += ["--model", str(args.model)]
    return argv


class _Worker:
    def __init__(self, args: argparse.Namespace, arm: str) -> None:
        self.arm = arm
        self.proc = subprocess.Popen(
            _worker_argv(args, arm),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )
        self._expect("ready")

    def _expect(self, key: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"speed worker for arm {self.arm!r} died (exit {code})")
        msg = json.loads(line)
        if key not in msg:
            raise RuntimeError(f"speed worker for arm {self.arm!r} sent {msg!r}")
        return msg

    def advance(self, until: int) -> list[dict]:
        self.proc.stdin.write(json.dumps({"until": until}) + "\n")
        self.proc.stdin.flush()
        return self._expect("records")["records"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("{}\n")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- the length benchmark -------------------------------------------------------------------
def _limit(args: argparse.Namespace, arm: str) -> int:
    return min(args.tokens, args.full_max_tokens) if arm == "full" else args.tokens


def _progress(pos: int, total: int, latest: dict[str, dict], t0: float) -> None:
    parts = " ".join(f"{a} {r['tokens_per_s']:.1f}" for a, r in latest.items())
    sys.stderr.write(f"\r[speed] {pos}/{total} tok/s: {parts}  ({time.time() - t0:.0f}s)   ")
    sys.stderr.flush()


def _save_partial(args: argparse.Namespace, results: dict) -> None:
    """Records so far (a long run that is stopped early still leaves its figures)."""
    out = Path(args.out)
    suffix = "_quick" if args.quick else ""
    (out / f"speed{suffix}.partial.json").write_text(json.dumps({"records": results}))


def run_length(args: argparse.Namespace, model=None, tokenizer=None) -> dict:
    arms = _arms(args)
    results: dict[str, list[dict]] = {a: [] for a in arms}
    t0 = time.time()
    latest: dict[str, dict] = {}
    block = args.every
    if model is not None or args.in_process:
        mode = "in-process, arms one after another"
        if model is None:
            model, tokenizer = load_model(args.model)
        ids = text_tokens(tokenizer, args.tokens + 1, _vocab_size(model))
        for arm in arms:
            runner = ArmRunner(model, arm, ids, args)
            limit = _limit(args, arm)
            while runner.pos < limit:
                recs = runner.advance(min(limit, runner.pos + block))
                results[arm] += recs
                if recs:
                    latest[arm] = recs[-1]
                _progress(runner.pos, args.tokens, latest, t0)
                _save_partial(args, results)
            del runner
    else:
        mode = "one worker process per arm, interleaved in blocks of --every tokens"
        workers: dict[str, _Worker] = {}
        try:
            for arm in arms:
                workers[arm] = _Worker(args, arm)
            start = args.prompt_tokens
            pos = start
            b = 0
            while pos < args.tokens:
                until = min(args.tokens, (pos // block + 1) * block)
                order = arms[b % len(arms) :] + arms[: b % len(arms)]  # rotate who goes first
                for arm in order:
                    if arm not in workers:
                        continue
                    limit = _limit(args, arm)
                    recs = workers[arm].advance(min(until, limit))
                    results[arm] += recs
                    if recs:
                        latest[arm] = recs[-1]
                    if until >= limit:
                        workers.pop(arm).close()
                pos = until
                b += 1
                _progress(pos, args.tokens, latest, t0)
                _save_partial(args, results)
        finally:
            for w in workers.values():
                w.close()
    sys.stderr.write("\n")
    return {
        "mode": mode,
        "wall_s": time.time() - t0,
        "records": results,
    }


def _at(records: list[dict], position: int, field: str) -> float | None:
    """The record at ``position`` (the nearest one at or below it)."""
    best = None
    for r in records:
        if r["position"] <= position:
            best = r
    return None if best is None else best[field]


def _checkpoints(args: argparse.Namespace) -> tuple[int, int, int]:
    """(early, late, cross) positions for the targets: 2000 / 20000 / 8000 in a full run."""
    late = (args.tokens // args.every) * args.every
    early = 2000 if late >= 4000 else max(args.every, (late // 2 // args.every) * args.every)
    cross = min(8000, args.full_max_tokens, late)
    cross = max(args.every, (cross // args.every) * args.every)
    return early, late, cross


def evaluate_targets(result: dict, args: argparse.Namespace) -> list[dict]:
    recs = result["records"]
    early, late, cross = _checkpoints(args)
    out = []

    def target(name, value, ok, detail):
        out.append({"target": name, "value": value, "pass": ok, "detail": detail})

    m = recs.get("morphkv")
    if m:
        p0, p1 = _at(m, early, "peak_bytes"), _at(m, late, "peak_bytes")
        growth = p1 / p0 - 1
        detail = f"peak {p0 / 2**20:.1f} MiB @ {early} -> {p1 / 2**20:.1f} MiB @ {late}"
        if recs.get("full"):
            f = recs["full"]
            fe, fl = _at(f, early, "peak_bytes"), f[-1]["peak_bytes"]
            detail += (
                f"; full: {fe / 2**20:.1f} -> {fl / 2**20:.1f} MiB @ {f[-1]['position']} "
                f"(+{100 * (fl / fe - 1):.1f}%)"
            )
        target(f"morphkv peak memory growth {early}->{late} < 2%", growth, growth < 0.02, detail)
        t0, t1 = _at(m, early, "ms_per_token_median"), _at(m, late, "ms_per_token_median")
        target(
            f"morphkv decode ms/token @ {late} within 10% of @ {early}",
            t1 / t0,
            t1 / t0 <= 1.10,
            f"{t0:.2f} ms -> {t1:.2f} ms",
        )
    if m and recs.get("rotating"):
        rot = recs["rotating"]
        ratios = []
        for r in m:
            x = _at(rot, r["position"], "ms_per_token_median")
            if r["position"] > 2 * args.budget and x:
                ratios.append(r["ms_per_token_median"] / x)
        if ratios:
            ratio = float(np.median(ratios))
            target(
                "morphkv decode <= 1.15x RotatingKVCache",
                ratio,
                ratio <= 1.15,
                f"median over {len(ratios)} blocks past {2 * args.budget} tokens of the "
                "per-block median-ms ratio",
            )
    if m and recs.get("full"):
        f = recs["full"]
        if f[-1]["position"] >= cross:
            tm, tf = _at(m, cross, "ms_per_token_median"), _at(f, cross, "ms_per_token_median")
            target(
                f"morphkv decodes faster than full @ {cross} tokens",
                tm / tf,
                tm < tf,
                f"morphkv {tm:.2f} ms vs full {tf:.2f} ms",
            )
    return out


def _fmt_mib(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 2**20:.1f}" if x >= 2**20 else f"{x / 2**20:.3f}"


def format_table(result: dict, args: argparse.Namespace) -> str:
    recs = result["records"]
    arms = list(recs)
    positions = sorted({r["position"] for rs in recs.values() for r in rs})
    if len(positions) > 12:  # show a dozen rows, always the first and the last
        idx = np.unique(np.linspace(0, len(positions) - 1, 12).round().astype(int))
        positions = [positions[i] for i in idx]
    lines = []
    for title, field, fmt in (
        ("tokens/s over the block", "tokens_per_s", lambda v: f"{v:.2f}"),
        ("median ms/token", "ms_per_token_median", lambda v: f"{v:.1f}"),
        ("peak memory MiB", "peak_bytes", _fmt_mib),
        ("active memory MiB", "active_bytes", _fmt_mib),
        ("stored KV MiB", "kv_bytes", _fmt_mib),
    ):
        lines.append(f"\n{title}")
        lines.append(f"{'position':>9} " + " ".join(f"{a:>13}" for a in arms))
        for p in positions:
            cells = []
            for a in arms:
                r = next((r for r in recs[a] if r["position"] == p), None)
                cells.append(f"{fmt(r[field]) if r else '-':>13}")
            lines.append(f"{p:>9} " + " ".join(cells))
    return "\n".join(lines)


def plot_length(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = result["records"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for arm, rs in recs.items():
        ax.plot([r["position"] for r in rs], [r["tokens_per_s"] for r in rs], label=arm)
    ax.set_xlabel("context position (tokens)")
    ax.set_ylabel("decode tokens/s (block)")
    ax.set_title("Decode speed vs context length")
    ax.grid(alpha=0.3)
    ax.legend()
    speed_png = out / "speed_tokens_per_s.png"
    fig.savefig(speed_png, dpi=100, bbox_inches="tight")
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for ax, field, title in zip(
        axes,
        ("peak_bytes", "active_bytes", "kv_bytes"),
        ("MLX peak memory", "MLX active memory", "stored KV bytes"),
        strict=True,
    ):
        for arm, rs in recs.items():
            ax.plot([r["position"] for r in rs], [r[field] / 2**20 for r in rs], label=arm)
        ax.set_title(title)
        ax.set_xlabel("context position (tokens)")
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
    axes[0].legend()
    mem_png = out / "speed_memory.png"
    fig.savefig(mem_png, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return [str(speed_png), str(mem_png)]


# ---- entry points ---------------------------------------------------------------------------
def _meta(args: argparse.Namespace) -> dict:
    import mlx.core as mx

    return {
        "args": {k: v for k, v in vars(args).items() if k != "worker"},
        "mlx": mx.__version__,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "cpu_count": os.cpu_count(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def run(args: argparse.Namespace) -> int:
    """CLI entry point (``morphkv`` command contract): 0 on success."""
    return int(execute(args).get("exit", 0))


def execute(args: argparse.Namespace, model=None, tokenizer=None) -> dict:
    """Run the benchmark ``args`` selects; write JSON (+ PNG) under ``args.out``; return the
    result. ``model`` (and ``tokenizer``) may be passed in to skip loading."""
    if getattr(args, "worker", None):
        return {"exit": _worker_main(args)}
    _apply_quick(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    if args.micro:
        from .micro import format_micro, plot_micro, run_micro

        result = {"meta": _meta(args), **run_micro(args)}
        print(format_micro(result))
        if not args.no_plot:
            result["plots"] = [plot_micro(result, out)]
        path = out / f"micro{suffix}.json"
    else:
        result = {"meta": _meta(args), **run_length(args, model, tokenizer)}
        result["targets"] = evaluate_targets(result, args)
        print(f"speed bench: {result['mode']}; {result['wall_s']:.0f}s")
        if "full" in result["records"] and args.full_max_tokens < args.tokens:
            print(f"note: the full arm was stopped at {args.full_max_tokens} tokens")
        print(format_table(result, args))
        print()
        for t in result["targets"]:
            flag = "PASS" if t["pass"] else "MISS"
            print(f"{flag} {t['target']}: {t['value']:.3f} ({t['detail']})")
        if not args.no_plot:
            result["plots"] = plot_length(result, out)
        path = out / f"speed{suffix}.json"
    path.write_text(json.dumps(result, indent=1))
    result["json"] = str(path)
    print(f"wrote {path}" + "".join(f", {p}" for p in result.get("plots", [])))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="morphkv bench speed", description=__doc__))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
