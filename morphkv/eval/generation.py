"""Free generation of long answers under each cache: degeneration, speed and memory.

Greedy decoding (``make_sampler(0.0)``) of a fixed prompt set (``GENERATION_PROMPTS``) through
``mlx_lm.stream_generate`` with each arm's caches (arm ``full``: mlx_lm's own ``KVCache``). Per
arm, budget and prompt: the 10-gram repetition rate (fraction of the answer's 10-grams already
seen earlier in it; the paper's degeneration measure, lower is better), distinct-1/-2 (unique
n-grams over all n-grams), tokens generated (stops at EOS), decode tokens/s, peak MLX memory,
KV bytes.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from . import plots
from .arms import check_specs, parse_arms
from .fidelity import ARM_DEFAULTS, N_SINK
from .flags import add_flags, csv_ints, standard
from .metrics import distinct, kv_bytes, repetition_rate
from .models import load_model
from .output import environment, finish, markdown_table
from .plots import require_matplotlib
from .progress import Progress
from .texts import GENERATION_PROMPTS, chat_prompt

NAME = "generation"
FULL = {"full": "kvcache"}  # here ``full`` is mlx_lm's KVCache
DEFAULT_ARMS = ("full", "streaming_llm", "random", "h2o:attn", "tova:attn", "morphkv:mean:8",
                "morphkv:mean:8:attn", "morphkv:max:32:attn")
COLUMNS = {  # summary column -> (row key, scale)
    "tokens": ("generated", 1),
    "10-gram rep.": ("rep10", 1),
    "distinct-1": ("distinct1", 1),
    "distinct-2": ("distinct2", 1),
    "tok/s": ("tokens_per_s", 1),
    "peak MiB": ("peak_memory", 2**-20),
    "KV kept MiB": ("kv_bytes_kept", 2**-20),
}


def generate(model, tokenizer, prompt: list[int], caches, max_tokens: int) -> dict:
    """Greedy answer: token ids, text (when a tokenizer wrapper is given), speed."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(0.0)
    tokens, text, t_first = [], "", None
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    if hasattr(tokenizer, "detokenizer") and hasattr(tokenizer, "eos_token_ids"):
        import mlx_lm

        steps = mlx_lm.stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens,
                                       prompt_cache=caches, sampler=sampler)
        for resp in steps:
            t_first = t_first or time.perf_counter()
            text += resp.text
            if resp.finish_reason != "stop" or resp.token not in tokenizer.eos_token_ids:
                tokens.append(int(resp.token))
    else:  # a bare token-id stand-in (tests): mlx_lm's generate_step, no EOS
        steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler,
                              prompt_cache=caches)
        for tok, _ in steps:
            t_first = t_first or time.perf_counter()
            tokens.append(int(tok))
    end = time.perf_counter()
    decode_s = end - (t_first or end)
    return {"tokens": tokens, "text": text, "prefill_s": (t_first or end) - t0,
            "tokens_per_s": (len(tokens) - 1) / decode_s if decode_s > 0 else float("nan"),
            "peak_memory": int(mx.get_peak_memory())}


def run_generation(model, tokenizer, prompts, arms, budgets, max_tokens: int, n_sink=N_SINK,
                   quiet=False) -> dict:
    """Core entry point: (model, tokenizer or None, prompt token ids) -> result dict."""
    arms = parse_arms(arms, FULL, **ARM_DEFAULTS)
    plan = []
    for arm in arms:
        for b in [None] if arm.method == "kvcache" else budgets:
            if b is None or b > n_sink + arm.window:
                plan.extend((arm, b, p) for p in range(len(prompts)))
    bar = Progress(len(plan) * max_tokens, NAME, quiet)
    rows = []
    t_start = time.perf_counter()
    for arm, b, p in plan:
        caches = arm.caches(model, max(b or 0, n_sink + arm.window + 1), n_sink)
        out = generate(model, tokenizer, prompts[p], caches, max_tokens)
        toks = out.pop("tokens")
        row = {"arm": "full" if arm.method == "kvcache" else arm.name, "budget": b, "prompt": p}
        row.update(prompt_tokens=len(prompts[p]), generated=len(toks))
        row.update(rep10=repetition_rate(toks, 10), distinct1=distinct(toks, 1))
        row.update(distinct2=distinct(toks, 2), sample=out.pop("text")[:600])
        rows.append({**row, **out, **kv_bytes(caches)})
        bar.update(max_tokens, f"{arm.name} b{b} p{p}")
    settings = {"arms": ["full" if a.method == "kvcache" else a.name for a in arms],
                "budgets": list(budgets), "max_tokens": max_tokens, "n_sink": n_sink,
                "prompts": len(prompts), "sampler": "greedy"}
    return {"benchmark": NAME, "settings": settings, "rows": rows,
            "elapsed_s": time.perf_counter() - t_start, "environment": environment()}


def summary(result: dict) -> tuple[list[str], list[list]]:
    """Mean over prompts per arm and budget."""
    groups: dict[tuple, list] = {}
    for r in result["rows"]:
        groups.setdefault((r["arm"], r["budget"]), []).append(r)
    body = []
    for (arm, b), rs in groups.items():
        means = [sum(r[k] for r in rs) / len(rs) * scale for k, scale in COLUMNS.values()]
        body.append([arm, b if b is not None else "-", *means])
    return ["arm", "budget", *COLUMNS], body


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--quick", False, "tiny smoke run (seconds)"),
        *standard(NAME, "model", "out", "quiet"),
        ("--budgets", [128, 256], "budgets in tokens per KV head"),
        ("--arms", list(DEFAULT_ARMS), "arm specs as in eval fidelity; full: mlx_lm's KVCache"),
        ("--max-tokens", 1000, "tokens to generate per answer"),
        ("--prompts", None, "indices into the prompt set, comma separated (default all)"),
        ("--n-sink", N_SINK, "protected first tokens"),
    ])


def execute(args: argparse.Namespace, model=None, tokenizer=None) -> dict:
    """Run with the command-line settings; ``model``/``tokenizer`` bypass loading (tests)."""
    require_matplotlib()
    if isinstance(args.prompts, str):
        args.prompts = csv_ints(args.prompts)
    if args.quick:
        args.max_tokens, args.budgets = 40, [24]
        args.arms = ["full", "streaming_llm", "morphkv:mean:8"]
        args.prompts = args.prompts or [0]
    check_specs(args.arms, FULL)
    if model is None:
        model, tokenizer = load_model(args.model)
    mx.random.seed(0)
    chosen = args.prompts if args.prompts is not None else range(len(GENERATION_PROMPTS))
    prompts = [chat_prompt(tokenizer, GENERATION_PROMPTS[i]) for i in chosen]
    result = run_generation(model, tokenizer, prompts, args.arms, args.budgets, args.max_tokens,
                            args.n_sink, args.quiet)
    result["settings"].update(quick=bool(args.quick), prompt_ids=list(chosen),
                              model=args.model or "embedded SmolLM2-135M-Instruct")
    print("10-gram rep.: fraction of the answer's 10-grams seen earlier in it (lower: less "
          "looping); distinct-n: unique n-grams / all n-grams; KV kept: bytes of kept K+V")
    finish(args, NAME, result, table=markdown_table(*summary(result)),
           plot=lambda path: plots.bars(summary(result), ["10-gram rep.", "distinct-2"], path))
    return result
