"""Free generation of long answers under each cache: degeneration, speed and memory.

Greedy decoding of a fixed prompt set (``GENERATION_PROMPTS``) through
``mlx_lm.stream_generate`` with each arm's caches (``full``: mlx_lm's ``KVCache``). Per arm,
budget and prompt: the 10-gram repetition rate (the paper's degeneration measure, lower is
better), distinct-1/-2, tokens generated (to EOS), decode tokens/s, peak MLX memory, KV bytes.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from . import plots
from .arms import parse_arms
from .fidelity import ARM_DEFAULTS, N_SINK
from .metrics import distinct, kv_bytes, repetition_rate
from .runner import Evaluation, add_flags, csv_ints, markdown_table, standard
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


class Generation(Evaluation):
    """Prompts x arms x budgets: each arm writes its own answer to each prompt."""

    name, key = NAME, "rows"

    def arms(self) -> list:
        a = self.args
        if isinstance(a.prompts, str):
            a.prompts = csv_ints(a.prompts)
        if a.quick:
            a.max_tokens, a.budgets = 40, [24]
            a.arms = ["full", "streaming_llm", "morphkv:mean:8"]
            a.prompts = a.prompts or [0]
        self.picked = a.prompts if a.prompts is not None else range(len(GENERATION_PROMPTS))
        self.found = parse_arms(a.arms, FULL, **ARM_DEFAULTS)
        return [(arm, b) for arm in self.found
                for b in ([None] if arm.method == "kvcache" else a.budgets)
                if b is None or b > a.n_sink + arm.window]

    def items(self, model, tok):
        a = self.args
        mx.random.seed(0)
        self.info["settings"] = {
            "arms": [_label(arm) for arm in self.found],
            "budgets": list(a.budgets), "max_tokens": a.max_tokens, "n_sink": a.n_sink,
            "prompts": len(self.picked), "sampler": "greedy", "quick": bool(a.quick),
            "prompt_ids": list(self.picked), "model": a.model or "embedded SmolLM2-135M-Instruct"}
        return [(p, chat_prompt(tok, GENERATION_PROMPTS[i])) for p, i in enumerate(self.picked)]

    def steps(self, arms) -> int:
        return len(arms) * len(self.picked) * self.args.max_tokens

    def measure(self, model, tok, item, arms, bar) -> list:
        (p, prompt), a, rows = item, self.args, []
        for arm, b in arms:
            caches = arm.caches(model, max(b or 0, a.n_sink + arm.window + 1), a.n_sink)
            out = generate(model, tok, prompt, caches, a.max_tokens)
            toks = out.pop("tokens")
            row = {"arm": _label(arm), "budget": b, "prompt": p, "prompt_tokens": len(prompt),
                   "generated": len(toks), "rep10": repetition_rate(toks, 10),
                   "distinct1": distinct(toks, 1), "distinct2": distinct(toks, 2),
                   "sample": out.pop("text")[:600]}
            rows.append({**row, **out, **kv_bytes(caches)})
            bar.update(a.max_tokens, f"{arm.name} b{b} p{p}")
        return rows

    def report(self, rows: list, arms) -> tuple:
        headers, body = summary({"rows": rows})
        return {"headers": headers, "body": body}, (
            "10-gram rep.: fraction of the answer's 10-grams seen earlier in it (lower: less "
            "looping); distinct-n: unique n-grams / all n-grams; KV kept: bytes of kept K+V\n"
            + markdown_table(headers, body))

    def plot(self, result: dict, path) -> None:
        """One horizontal bar panel per column; one bar per arm and budget."""
        headers, body = summary(result)
        fig, axes = plots.panels(2, 5.5, 4)
        for ax, col in zip(axes[0], ["10-gram rep.", "distinct-2"], strict=True):
            ax.barh([f"{r[0]} b{r[1]}" for r in body], [r[headers.index(col)] for r in body])
            ax.set_title(col)
            ax.tick_params(labelsize=7)
        plots.save(fig, path)


def _label(arm) -> str:
    return "full" if arm.method == "kvcache" else arm.name


def summary(result: dict) -> tuple[list[str], list[list]]:
    """Mean over prompts per arm and budget."""
    groups: dict[tuple, list] = {}
    for r in result["rows"]:
        groups.setdefault((r["arm"], r["budget"]), []).append(r)
    body = [[arm, b if b is not None else "-", *[sum(r[k] for r in rs) / len(rs) * scale
                                                  for k, scale in COLUMNS.values()]]
            for (arm, b), rs in groups.items()]
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


EVALUATION = Generation
