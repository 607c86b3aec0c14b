"""What the cache costs inside a real model: prefill and decode time per arm.

Arms are interleaved and repeated so machine noise hits all of them alike (default: mlx_lm's
``KVCache`` and ``RotatingKVCache(budget, keep=4)``, MorphKV with real queries and with keys as
proxy queries). Prefill: a prompt of Python-docs prose of each of ``--contexts`` tokens in
chunks of ``--prefill-step``; decode: ``--decode`` greedy tokens after it, per-token median.
One table with the ratios the speed targets name (prefill and decode vs ``rotating``, decode vs
``kvcache``), each figure also in CPU time (``process_time``: far less moved by other
processes' load); memory per context: MLX peak and the bytes the caches hold at the end
(``--contexts 2000,8000,20000``: the removed ``--mode length``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from ..eval import plots
from ..eval.arms import parse_arms
from ..eval.models import RANDOM_TINY
from ..eval.runner import Evaluation, add_flags, markdown_table, standard
from ..eval.texts import PROSE_TOPICS, prose_text

NAME = "overhead"
ALIASES = {"morphkv": "morphkv:attn", "proxy": "morphkv:proxy"}  # the old script's arm names


KEYS = ("prefill_s", "decode_ms", "prefill_cpu_s", "decode_cpu_ms", "peak_mib", "kv_mib")


def run_arm(arm, model, prompt: mx.array, args) -> dict[str, float]:
    caches = arm.caches(model, args.budget, 4)
    mx.reset_peak_memory()
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, prompt.size, args.prefill_step):
        logits = model(prompt[None, i : i + args.prefill_step], cache=caches)
        mx.eval(logits)
    prefill, prefill_cpu = time.perf_counter() - start, time.process_time() - cpu
    token = mx.argmax(logits[:, -1], axis=-1)
    times, cpus = [], []
    for _ in range(args.decode):
        start, cpu = time.perf_counter(), time.process_time()
        logits = model(token[None], cache=caches)
        token = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(token)
        times.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return {"prefill_s": prefill, "decode_ms": statistics.median(times) * 1e3,
            "prefill_cpu_s": prefill_cpu, "decode_cpu_ms": statistics.median(cpus) * 1e3,
            "peak_mib": mx.get_peak_memory() / 2**20,
            "kv_mib": sum(c.nbytes for c in caches) / 2**20}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        *standard(NAME, "model", "out", "no_plot"),
        ("--budget", 512, "tokens kept per KV head"),
        ("--contexts", [2048], "prompt lengths to measure in turn, e.g. 1024,4096,8192"),
        ("--prefill-step", 2048, "prefill chunk"),
        ("--decode", 48, "decode steps"),
        ("--repeats", 2, "interleaved repeats"),
        ("--arms", ["kvcache", "rotating", "morphkv", "proxy"], "kvcache, rotating, morphkv "
         "(real queries), proxy (keys as queries), or arm specs"),
        ("--quick", False, "tiny run on a random-weight model for tests/CI"),
    ])


class Overhead(Evaluation):
    """Contexts x arms, the arms interleaved ``--repeats`` times at each context."""

    name, key, stem_of = NAME, "contexts", "overhead{_quick}"

    def arms(self) -> list:
        a = self.args
        if a.quick:
            a.model = a.model or RANDOM_TINY
            a.budget, a.prefill_step, a.decode, a.repeats = 32, 64, 8, 1
            a.contexts = [128] if a.contexts == [2048] else a.contexts
        return list(zip(a.arms, parse_arms([ALIASES.get(x, x) for x in a.arms]), strict=True))

    def items(self, model, tok):
        text = prose_text(PROSE_TOPICS)
        self.ids = tok.encode(text) if tok is not None else [b % 256 for b in text.encode()]
        while len(self.ids) < max(self.args.contexts):  # long contexts: the prose again
            self.ids = self.ids + self.ids
        return self.args.contexts

    def steps(self, arms) -> int:
        return self.args.repeats * len(arms) * len(self.args.contexts)

    def measure(self, model, tok, context, arms, bar) -> dict:
        prompt, runs = mx.array(self.ids[:context]), {name: [] for name, _ in arms}
        for _ in range(self.args.repeats):
            for name, arm in arms:
                runs[name].append(r := run_arm(arm, model, prompt, self.args))
                bar.update(1, f"{context} {name}: prefill {r['prefill_s']:.2f} s, decode "
                              f"{r['decode_ms']:.1f} ms")
        return {"context": context, "runs": runs,
                "median": {name: {k: statistics.median(r[k] for r in rs) for k in KEYS}
                           for name, rs in runs.items()}}

    def report(self, records: list, arms) -> tuple:
        """One row per (context, arm): wall and CPU figures and the ratios the targets name."""
        by_context, rows = {r["context"]: r["median"] for r in records}, []
        for context, median in by_context.items():
            def ratio(m, arm, key, median=median):
                base = median.get(arm, {}).get(key)
                return m[key] / base if base else float("nan")

            for name, m in median.items():
                rows.append([context, name, m["prefill_s"], ratio(m, "rotating", "prefill_s"),
                             m["decode_ms"], ratio(m, "rotating", "decode_ms"),
                             ratio(m, "kvcache", "decode_ms"), m["prefill_cpu_s"],
                             m["decode_cpu_ms"], m["peak_mib"], m["kv_mib"]])
        return by_context, markdown_table(
            ["context", "cache", "prefill s", "prefill vs rotating", "decode ms/token",
             "decode vs rotating", "decode vs kvcache", "prefill cpu s", "decode cpu ms",
             "peak MiB", "KV MiB"], rows)

    def plot(self, result: dict, path) -> None:
        median = result["contexts"][0]["median"]
        fig, axes = plots.panels(2, 5, 4)
        for ax, key in zip(axes[0], ("prefill_s", "decode_ms"), strict=True):
            plots.grouped_bars(ax, list(median), {key: [m[key] for m in median.values()]}, key)
        plots.save(fig, path)


EVALUATION = Overhead
