"""Free generation of long answers under each cache: degeneration, speed and memory.

Greedy decoding (``make_sampler(0.0)``) of a fixed prompt set (``texts.GENERATION_PROMPTS``)
through ``mlx_lm.stream_generate`` with ``prompt_cache=KVCacheBuilder.for_model(model, cfg)``
(mlx_lm's own ``KVCache`` for the full-cache reference). Per method, budget and prompt:

- 10-gram repetition rate: fraction of the answer's 10-grams (token ids) that already occurred
  earlier in the answer (the paper's degeneration measure; lower is better);
- distinct-1 / distinct-2: unique n-grams over all n-grams of the answer;
- tokens generated (generation stops at EOS), decode tokens/s, peak MLX memory, KV bytes.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from .. import KVCacheBuilder
from . import texts as T
from ._util import (
    Progress,
    csv_ints,
    csv_strs,
    environment,
    main,
    markdown_table,
    out_dir,
    peak_memory,
    plt,
    reset_peak_memory,
    write_json,
)
from .fidelity import N_SINK, Arm, kv_bytes

NAME = "generation"
DEFAULT_ARMS = (
    "full",
    "streaming_llm",
    "random",
    "h2o:attn",
    "tova:attn",
    "morphkv:mean:8",
    "morphkv:mean:8:attn",
    "morphkv:max:32:attn",
)


def repetition_rate(tokens: list[int], n: int = 10) -> float:
    """Fraction of n-grams that already occurred earlier in the sequence."""
    seen, repeated, total = set(), 0, 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        total += 1
        repeated += gram in seen
        seen.add(gram)
    return repeated / total if total else 0.0


def distinct(tokens: list[int], n: int) -> float:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def _is_wrapper(tokenizer) -> bool:
    return hasattr(tokenizer, "detokenizer") and hasattr(tokenizer, "eos_token_ids")


def generate(model, tokenizer, prompt: list[int], caches, max_tokens: int) -> dict:
    """Greedy answer: token ids, text (when a tokenizer wrapper is given), speed."""
    from mlx_lm.sample_utils import make_sampler

    sampler = make_sampler(0.0)
    tokens, text = [], ""
    reset_peak_memory()
    t0 = time.perf_counter()
    t_first = None
    if _is_wrapper(tokenizer):
        import mlx_lm

        for resp in mlx_lm.stream_generate(
            model,
            tokenizer,
            mx.array(prompt),
            max_tokens=max_tokens,
            prompt_cache=caches,
            sampler=sampler,
        ):
            if t_first is None:
                t_first = time.perf_counter()
            text += resp.text
            if resp.finish_reason != "stop" or resp.token not in tokenizer.eos_token_ids:
                tokens.append(int(resp.token))
    else:  # a bare token-id stand-in (tests): mlx_lm's generate_step, no EOS
        from mlx_lm.generate import generate_step

        for tok, _ in generate_step(
            mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler, prompt_cache=caches
        ):
            if t_first is None:
                t_first = time.perf_counter()
            tokens.append(int(tok))
    end = time.perf_counter()
    decode_s = end - (t_first or end)
    return {
        "tokens": tokens,
        "text": text,
        "prefill_s": (t_first or end) - t0,
        "tokens_per_s": (len(tokens) - 1) / decode_s if decode_s > 0 else float("nan"),
        "peak_memory": peak_memory(),
    }


def make_caches(model, arm: Arm, budget: int, n_sink: int):
    if arm.method == "full":
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in model.layers]
    cfg = arm.config(max(budget, n_sink + arm.window + 1), n_sink)
    return KVCacheBuilder.for_model(model, cfg)


def run_generation(
    model,
    tokenizer,
    prompts: list[list[int]],
    arms,
    budgets,
    max_tokens: int,
    n_sink: int = N_SINK,
    quiet: bool = False,
) -> dict:
    """Core entry point: (model, tokenizer or None, prompt token ids) -> result dict."""
    arms = [Arm.parse(a) if isinstance(a, str) else a for a in arms]
    plan = []
    for arm in arms:
        for b in [None] if arm.method == "full" else budgets:
            if b is not None and b <= n_sink + arm.window:
                continue
            plan.extend((arm, b, p) for p in range(len(prompts)))
    bar = Progress(len(plan) * max_tokens, NAME, quiet)
    rows = []
    t_start = time.perf_counter()
    for arm, b, p in plan:
        caches = make_caches(model, arm, b or 0, n_sink)
        out = generate(model, tokenizer, prompts[p], caches, max_tokens)
        toks = out.pop("tokens")
        rows.append(
            {
                "arm": arm.name,
                "budget": b,
                "prompt": p,
                "prompt_tokens": len(prompts[p]),
                "generated": len(toks),
                "rep10": repetition_rate(toks, 10),
                "distinct1": distinct(toks, 1),
                "distinct2": distinct(toks, 2),
                "sample": out.pop("text")[:600],
                **out,
                **kv_bytes(caches),
            }
        )
        bar.update(max_tokens, f"{arm.name} b{b} p{p}")
    return {
        "benchmark": NAME,
        "settings": {
            "arms": [a.name for a in arms],
            "budgets": list(budgets),
            "max_tokens": max_tokens,
            "n_sink": n_sink,
            "prompts": len(prompts),
            "sampler": "greedy",
        },
        "rows": rows,
        "elapsed_s": time.perf_counter() - t_start,
        "environment": environment(),
    }


def summary(result: dict) -> tuple[list[str], list[list]]:
    """Mean over prompts per arm and budget."""
    keys = []
    for r in result["rows"]:
        if (r["arm"], r["budget"]) not in keys:
            keys.append((r["arm"], r["budget"]))
    body = []
    for arm, b in keys:
        rs = [r for r in result["rows"] if r["arm"] == arm and r["budget"] == b]

        def mean(k, rs=rs):
            return sum(r[k] for r in rs) / len(rs)

        body.append(
            [
                arm,
                b if b is not None else "-",
                mean("generated"),
                mean("rep10"),
                mean("distinct1"),
                mean("distinct2"),
                mean("tokens_per_s"),
                mean("peak_memory") / 2**20,
                mean("kv_bytes_kept") / 2**20,
            ]
        )
    headers = [
        "arm",
        "budget",
        "tokens",
        "10-gram rep.",
        "distinct-1",
        "distinct-2",
        "tok/s",
        "peak MiB",
        "KV kept MiB",
    ]
    return headers, body


def plot(result: dict, path) -> None:
    pyplot = plt()
    headers, body = summary(result)
    labels = [f"{r[0]} b{r[1]}" for r in body]
    fig, axes = pyplot.subplots(1, 2, figsize=(11, 4))
    axes[0].barh(labels, [r[3] for r in body])
    axes[0].set_title("10-gram repetition rate (lower is better)")
    axes[1].barh(labels, [r[5] for r in body])
    axes[1].set_title("distinct-2 (higher is more varied)")
    for ax in axes:
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    pyplot.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (seconds)")
    parser.add_argument("--out", default=None, help="output folder (default results/generation)")
    parser.add_argument(
        "--model", default=None, help="mlx_lm model or .gguf (default: embedded SmolLM2)"
    )
    parser.add_argument("--budgets", type=csv_ints, default=[128, 256])
    parser.add_argument("--arms", type=csv_strs, default=list(DEFAULT_ARMS))
    parser.add_argument("--max-tokens", type=int, default=1000)
    parser.add_argument(
        "--prompts", type=csv_ints, default=None, help="indices into the prompt set (default all)"
    )
    parser.add_argument("--n-sink", type=int, default=N_SINK)
    parser.add_argument("--quiet", action="store_true")


def run(args: argparse.Namespace) -> int:
    """CLI entry point (``morphkv`` command contract): 0 on success."""
    execute(args)
    return 0


def execute(args: argparse.Namespace, model=None, tokenizer=None) -> dict:
    """Run with the command-line settings; ``model``/``tokenizer`` bypass loading (tests)."""
    if args.quick:
        args.max_tokens, args.budgets = 40, [24]
        args.arms = ["full", "streaming_llm", "morphkv:mean:8"]
        args.prompts = args.prompts or [0]
    if model is None:
        from ..model import load

        model, tokenizer = load(args.model)
    mx.random.seed(0)
    chosen = args.prompts if args.prompts is not None else range(len(T.GENERATION_PROMPTS))
    prompts = [T.chat_prompt(tokenizer, T.GENERATION_PROMPTS[i]) for i in chosen]
    result = run_generation(
        model, tokenizer, prompts, args.arms, args.budgets, args.max_tokens, args.n_sink, args.quiet
    )
    result["settings"]["quick"] = bool(args.quick)
    result["settings"]["model"] = args.model or "embedded SmolLM2-135M-Instruct"
    result["settings"]["prompt_ids"] = list(chosen)
    folder = out_dir(args, NAME)
    write_json(folder / f"{NAME}.json", result)
    plot(result, folder / f"{NAME}.png")
    print(markdown_table(*summary(result)))
    print(f"\nwrote {folder}/{NAME}.json and {NAME}.png ({result['elapsed_s']:.0f} s)")
    return result


if __name__ == "__main__":
    raise SystemExit(main(add_arguments, run, __doc__.splitlines()[0]))
