"""The length run behind ``morphkv bench speed``: feed each arm's caches along a long text and
record decode time and memory every ``--every`` tokens.

Arms run in separate worker processes (so each one's memory figures are its own), driven in
turn one block of tokens at a time, so machine noise hits all arms alike; with ``--in-process``
(or a model object passed in) they run in this process, one after another.
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

from ..eval.arms import parse_arms
from ..eval.models import load_model
from ..eval.progress import Progress
from ..eval.texts import topic_tokens

FULL = {"full": "kvcache"}  # here ``full`` is mlx_lm's KVCache
WORKER_FLAGS = ("tokens", "every", "budget", "window", "n_sink", "scoring", "prompt_tokens",
                "sample", "chunk")


def arm_of(spec: str, args: argparse.Namespace):
    return parse_arms([spec], FULL, window=args.window, scoring=args.scoring)[0]


def _vocab_size(model) -> int | None:
    return getattr(getattr(model, "args", None), "vocab_size", None)


class ArmRunner:
    """Feeds one arm's caches through the stream and records every ``every`` tokens."""

    def __init__(self, model, arm: str, ids: list[int], args: argparse.Namespace) -> None:
        import mlx.core as mx

        self.mx, self.model, self.ids, self.args = mx, model, ids, args
        mx.clear_cache()
        self.caches = arm_of(arm, args).caches(model, args.budget, args.n_sink)
        mx.reset_peak_memory()
        mx.eval(model(mx.array([ids[: args.prompt_tokens]]), cache=self.caches))
        self.pos = args.prompt_tokens

    def _forward(self, tokens: list[int]) -> None:
        self.mx.eval(self.model(self.mx.array([tokens]), cache=self.caches))

    def advance(self, until: int) -> list[dict]:
        """Feed tokens up to position ``until``; return the records made on the way."""
        args, records, times = self.args, [], []
        while self.pos < until:
            end = min(until, (self.pos // args.every + 1) * args.every)
            if args.sample and end - self.pos > args.sample:  # untimed fast-forward
                stop = end - args.sample
                while self.pos < stop:
                    n = min(args.chunk, stop - self.pos)
                    self._forward(self.ids[self.pos : self.pos + n])
                    self.pos += n
                self.mx.reset_peak_memory()
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
        return {"position": self.pos, "timed_tokens": len(times),
                "tokens_per_s": len(times) / sum(times),
                "ms_per_token_median": 1e3 * float(np.median(times)),
                "ms_per_token_mean": 1e3 * float(np.mean(times)),
                "active_bytes": int(mx.get_active_memory()),
                "peak_bytes": int(mx.get_peak_memory()),
                "kv_bytes": int(sum(c.nbytes for c in self.caches)),
                "tokens_kept_layer0": int(kept if kept is not None else self.caches[0].size())}


def worker_main(args: argparse.Namespace) -> int:
    """Serve one arm over stdin/stdout JSON lines: {"until": n} -> {"records": [...]}."""
    model, tokenizer = load_model(args.model)
    runner = ArmRunner(model, args.worker,
                       topic_tokens(tokenizer, args.tokens + 1, _vocab_size(model)), args)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if "until" not in msg:
            break
        print(json.dumps({"records": runner.advance(int(msg["until"]))}), flush=True)
    return 0


class Worker:
    """One arm in its own process (``python -m morphkv.bench.speed --worker ARM``)."""

    def __init__(self, args: argparse.Namespace, arm: str) -> None:
        argv = [sys.executable, "-m", "morphkv.bench.speed", "--worker", arm]
        for flag in WORKER_FLAGS:
            argv += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
        argv += ["--model", str(args.model)] if args.model is not None else []
        self.arm = arm
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=os.environ.copy())
        self._expect("ready")

    def _expect(self, key: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"speed worker for arm {self.arm!r} died (exit {self.proc.wait()})")
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
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _limit(args: argparse.Namespace, arm: str) -> int:
    return min(args.tokens, args.full_max_tokens) if arm == "full" else args.tokens


def run_length(args: argparse.Namespace, arms: list[str], model=None, tokenizer=None) -> dict:
    """{"mode", "wall_s", "records": {arm: [record, ...]}}; partial JSON saved as it goes."""
    results: dict[str, list[dict]] = {a: [] for a in arms}
    t0, block = time.time(), args.every
    bar = Progress(sum(_limit(args, a) - args.prompt_tokens for a in arms), "speed")
    partial = Path(args.out) / f"speed{'_quick' if args.quick else ''}.partial.json"

    def take(arm, recs, fed):
        results[arm] += recs
        last = f"{arm} {recs[-1]['ms_per_token_median']:.1f} ms/token" if recs else arm
        bar.update(fed, last)
        partial.write_text(json.dumps({"records": results}))

    if model is not None or args.in_process:
        mode = "in-process, arms one after another"
        if model is None:
            model, tokenizer = load_model(args.model)
        ids = topic_tokens(tokenizer, args.tokens + 1, _vocab_size(model))
        for arm in arms:
            runner = ArmRunner(model, arm, ids, args)
            while runner.pos < _limit(args, arm):
                start = runner.pos
                take(arm, runner.advance(min(_limit(args, arm), start + block)), runner.pos - start)
            del runner
    else:
        mode = "one worker process per arm, interleaved in blocks of --every tokens"
        workers: dict[str, Worker] = {}
        try:
            for arm in arms:
                workers[arm] = Worker(args, arm)
            pos, b = args.prompt_tokens, 0
            while pos < args.tokens:
                until = min(args.tokens, (pos // block + 1) * block)
                for arm in arms[b % len(arms) :] + arms[: b % len(arms)]:  # rotate who goes first
                    if arm in workers:
                        stop = min(until, _limit(args, arm))
                        take(arm, workers[arm].advance(stop), stop - pos)
                        if until >= _limit(args, arm):
                            workers.pop(arm).close()
                pos, b = until, b + 1
        finally:
            for w in workers.values():
                w.close()
    return {"mode": mode, "wall_s": time.time() - t0, "records": results}
