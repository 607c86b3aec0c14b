"""Teacher-forced fidelity of each eviction rule against the full cache.

Every text is fed through every arm and budget (``metrics.evaluate``: exact chunks through the
attention hook). Per arm and budget, over the positions whose context exceeds the budget: mean
KL(full || method) per token (nats), top-1 agreement, perplexity ratio; the KV bytes kept and
held; peak MLX memory and decode tokens/s. ``--equal-bytes ARM`` gives every arm, at each
budget, the budget at which it holds as many bytes as ARM (measured: ``measure_bytes`` counts
all the caches hold, selection state included). A ``full`` arm checks the pipeline itself.
``--split tune`` / ``heldout``: the disjoint texts for choosing / reporting settings
(``texts.split_texts``); ``--grid`` adds every combination of ``key=v1/v2`` over ``--grid-base``.
"""

from __future__ import annotations

import argparse
import sys
from functools import cache

import mlx.core as mx

from . import plots
from .arms import Arm, grid_arms, parse_arms
from .metrics import evaluate, held_bytes, reference_logprobs
from .runner import Evaluation, add_flags, markdown_table, pivot, standard
from .texts import build_texts, split_texts

NAME = "fidelity"
N_SINK = 4
ARM_DEFAULTS = dict(window=8, fusion="mean", scoring="proxy")  # what a bare method means here
DEFAULT_ARMS = ("streaming_llm", "random", "h2o", "tova", "morphkv:mean:8", "morphkv:mean:32",
                "h2o:attn", "tova:attn", "morphkv:mean:8:attn", "morphkv:mean:32:attn")
METRICS = {"kl": "Mean KL(full || method), nats/token (lower is better)",
           "top1": "Top-1 agreement with the full cache",
           "ppl_ratio": "Perplexity ratio, method / full"}
MIB_KEYS = {"kv_bytes_kept": "kept", "kv_bytes_held": "held"}
MAX_BUDGET = 1 << 16


def measure_bytes(model, arm: Arm, budget: int, n_sink: int = 4, extra: int = 16) -> int:
    """Bytes held by all of ``arm``'s caches for ``model`` after ``budget + window + extra``
    random tokens (one prefill chunk, then one decode step)."""
    caches = arm.caches(model, budget, n_sink)
    n = budget + arm.window + extra
    vocab = int(model.args.vocab_size)
    ids = mx.random.randint(0, vocab, (1, n + 1), key=mx.random.key(budget))
    mx.eval(model(ids[:, :n], cache=caches))
    mx.eval(model(ids[:, n:], cache=caches))
    return sum(held_bytes(c) for c in caches)


def budget_for_bytes(model, arm: Arm, target: int, n_sink: int = 4) -> tuple[int, int]:
    """(budget, bytes): the largest budget whose measured bytes do not exceed ``target``."""
    if arm.method == "kvcache":
        raise ValueError("arm kvcache grows with the text: no budget bounds its bytes")

    @cache
    def size(b: int) -> int:
        return measure_bytes(model, arm, b, n_sink)

    lo = n_sink + arm.window + 1
    while not arm.is_baseline:  # a recency floor (recent > window) needs more
        try:
            arm.config(lo, n_sink=n_sink)
            break
        except ValueError:
            lo += 1
        if lo > MAX_BUDGET:
            raise ValueError(f"arm {arm.name} has no valid budget up to {MAX_BUDGET}")
    if size(lo) > target:
        raise ValueError(
            f"arm {arm.name} holds {size(lo)} bytes at its smallest budget {lo}: more than "
            f"the target {target}"
        )
    hi = lo
    while size(hi) <= target:  # grow until over the target
        lo, hi = hi, hi * 2
        if hi > MAX_BUDGET:
            raise ValueError(f"arm {arm.name} stays under {target} bytes up to {MAX_BUDGET}")
    while hi - lo > 1:  # size(lo) <= target < size(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= target else (lo, mid)
    return lo, size(lo)


def arms_of(specs) -> list[Arm]:
    return parse_arms(specs, **ARM_DEFAULTS)


def _plan(token_texts, arms, budgets, n_sink, include_full, sized):
    """[(text, arm, budget, arm budget)] to run, and the skipped combinations with reasons."""
    plan, skipped = [], []
    for name, toks in token_texts.items():
        if include_full:
            plan.append((name, arms_of(["full"])[0], 0, 0))
        for b in budgets:
            for arm in arms:
                own = sized.get((arm.name, b), (b,))[0]
                if own <= n_sink + arm.window:
                    skipped.append(f"{name} {arm.name} budget {own}: <= sinks + window")
                elif own >= len(toks) - 1:
                    skipped.append(f"{name} budget {own}: text of {len(toks)} tokens never exceeds")
                else:
                    plan.append((name, arm, b, own))
    return plan, skipped


class Fidelity(Evaluation):
    """Texts x arms x budgets, teacher-forced against the full cache (see the module doc)."""

    name, key, command = NAME, "rows", "morphkv eval fidelity"

    def arms(self) -> list:
        a = self.args
        if a.quick:  # a tiny smoke run
            a.budgets, a.arms = [32], ["streaming_llm", "h2o", "morphkv:mean:8"]
            a.prose_tokens = a.conversation_tokens = 96
            a.continuation_tokens = 40
            a.texts = [t for t in a.texts if t != "continuation"] or ["prose"]
        a.arms = list(dict.fromkeys([*a.arms, *grid_arms(a.grid_base, a.grid)]))
        self.reference = arms_of([a.equal_bytes])[0] if a.equal_bytes else None
        self.found = arms_of(a.arms)
        return self.found

    def items(self, model, tok):
        """The texts; with ``--equal-bytes`` each arm's budgets are measured first."""
        a = self.args
        mx.random.seed(0)
        if a.split != "none":
            texts = split_texts(tok, model, a.split, a.prose_tokens, a.continuation_tokens,
                                a.conversation_tokens)
            texts = {k: v[:96] for k, v in list(texts.items())[:2]} if a.quick else texts
        else:
            texts = build_texts(tok, a.texts, model, prose_tokens=a.prose_tokens,
                                prose_docs=a.prose_docs, conversations=a.conversations,
                                conversation_max=a.conversation_tokens,
                                continuation_tokens=a.continuation_tokens)
        self.sized = {}  # (arm, budget): (its budget, bytes, the bytes the reference holds)
        for b in a.budgets if self.reference else ():
            target = measure_bytes(model, self.reference, b, a.n_sink)
            self.sized.update({(arm.name, b): (*budget_for_bytes(model, arm, target, a.n_sink),
                                               target) for arm in self.found})
        self.plan, skipped = _plan(texts, self.found, a.budgets, a.n_sink, not a.no_full_arm,
                                   self.sized)
        for note in skipped:
            print("note:", note, file=sys.stderr)
        self.info.update(skipped=skipped, settings={
            "budgets": list(a.budgets), "arms": [x.name for x in self.found],
            "n_sink": a.n_sink, "chunk": a.chunk, "quick": bool(a.quick),
            "texts": {k: len(v) for k, v in texts.items()},
            "model": a.model or "embedded SmolLM2-135M-Instruct",
            **({"equal_bytes": self.reference.name} if self.reference else {})})
        return texts.items()

    def steps(self, arms) -> int:
        texts = self.info["settings"]["texts"]
        return sum(texts[n] - own for n, _, _, own in self.plan)

    def measure(self, model, tok, text, arms, bar) -> list:
        name, toks = text
        a, rows = self.args, []
        ref = reference_logprobs(model, toks)
        for n, arm, b, own in self.plan:
            if n != name:
                continue
            cfg = arm.config(max(own, a.n_sink + arm.window + 1), n_sink=a.n_sink)
            row = {"text": name, "tokens": len(toks), "arm": arm.name, "method": arm.method,
                   "window": arm.window, "fusion": arm.fusion, "scoring": arm.scoring,
                   "budget": b if arm.method != "full" else None}
            if self.reference is not None and arm.method != "full":
                row["arm_budget"], row["bytes_measured"], row["bytes_target"] = \
                    self.sized[(arm.name, b)]
            rows.append({**row, **evaluate(model, toks, ref, cfg, a.chunk, bar)})
        return rows

    def report(self, rows: list, arms) -> tuple:
        result = {"settings": self.info["settings"], "rows": rows}
        return {m: summary(result, m)[1] for m in METRICS}, "\n".join(tables(result))

    def plot(self, result: dict, path) -> None:
        """Mean KL and top-1 agreement per arm against the budget."""
        budgets = result["settings"]["budgets"]
        fig, axes = plots.plt().subplots(1, 2, figsize=(11, 4))
        for metric, ax, title in (("kl", axes[0], "mean KL(full || method)"),
                                  ("top1", axes[1], "top-1 agreement")):
            for line in summary(result, metric)[1]:
                ax.plot(budgets, line[1:], marker="o", label=line[0])
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.set_xlabel("budget (tokens per KV head)")
            ax.set_title(title)
        full = [r for r in result["rows"] if r["arm"] == "full"]
        if full:
            axes[0].axhline(sum(r["kl"] for r in full) / len(full), color="k", ls=":",
                            label="full (ref)")
        axes[0].legend(fontsize=7)
        plots.save(fig, path)


def summary(result: dict, metric: str = "kl") -> tuple[list[str], list[list]]:
    """Per arm x budget, the metric averaged over texts (weighted by positions)."""
    budgets, body = result["settings"]["budgets"], []
    for arm in result["settings"]["arms"]:
        line = [arm]
        for b in budgets:
            rs = [r for r in result["rows"] if r["arm"] == arm and r["budget"] == b]
            w = sum(r["positions"] for r in rs)
            line.append(sum(r[metric] * r["positions"] for r in rs) / w if w else float("nan"))
        body.append(line)
    return ["arm"] + [f"budget {b}" for b in budgets], body


def tables(result: dict) -> list[str]:
    """The tables of the command and of the report's section: the metrics per arm and budget,
    KL per text, the MiB the caches keep and hold at the end of the first text."""
    body, rows = [], result["rows"]
    for metric, label in METRICS.items():
        body += [f"### {label}", "", markdown_table(*summary(result, metric)), ""]
    scored = [r for r in rows if r["budget"] is not None]
    body += ["### KL per text", "", markdown_table(*pivot(scored, ["text", "arm"], "budget", "kl"))]
    first = [{**r, "budget": r["budget"] or "-"} for r in rows if r["text"] == rows[0]["text"]]
    mib = [{**r, "KV": w, "MiB": r[k] / 2**20}
           for r in first for k, w in MIB_KEYS.items() if k in r]
    return body + ["", f"KV MiB at the end of {rows[0]['text']} (all layers; kept: the keys and "
                   "values kept; held: everything the caches hold, storage and selection state):",
                   "", markdown_table(*pivot(mib, ["arm", "KV"], "budget", "MiB")), ""]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--quick", False, "tiny smoke run (seconds)"),
        *standard(NAME, "model", "out", "quiet"),
        ("--budgets", [64, 128, 256], "budgets in tokens per KV head"),
        ("--arms", list(DEFAULT_ARMS), "arm specs: method[:fusion][:window][:attn] or "
         "method:field=value:... for any KVCacheConfig field, e.g. morphkv:window=32:attn"),
        ("--texts", ["prose", "conversation"], "text kinds: prose, conversation, continuation"),
        ("--split", "none", "tune: the texts for choosing settings, heldout: those for "
         "reporting them (instead of --texts)", ["none", "tune", "heldout"]),
        ("--grid", [], "options key=v1/v2 (comma between keys): every combination is an arm "
         "(default: none)"),
        ("--grid-base", "morphkv:attn", "the arm the --grid options apply to"),
        ("--prose-tokens", 1100, "tokens per prose document"),
        ("--prose-docs", 1, "prose documents"),
        ("--conversations", 1, "conversations"),
        ("--conversation-tokens", 0, "tokens per conversation, 0: whole"),
        ("--continuation-tokens", 1000, "tokens of the model's own continuation"),
        ("--n-sink", N_SINK, "protected first tokens"),
        ("--equal-bytes", None, "compare at equal total bytes: at each budget every arm gets the "
         "budget at which its caches hold what this arm's hold (measured), e.g. streaming_llm"),
        ("--chunk", 256, "chunk of the teacher-forced feed (exact chunks through the attention "
         "hook)"),
        ("--no-full-arm", False, "skip the full-cache check arm"),
    ])


EVALUATION = Fidelity
