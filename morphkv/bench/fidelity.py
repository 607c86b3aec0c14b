"""Teacher-forced fidelity of each eviction rule against the full cache.

For every text, the full-cache next-token distributions are computed once (mlx_lm's
``KVCache``, chunked prefill: exact up to float rounding, which the ``full`` arm measures).
Every arm then decodes the same tokens one at a time through ``model(x, cache=caches)``,
which is exactly what generation sees (a chunked multi-token update would let a chunk's
queries read tokens that token-by-token decoding has already evicted). When the exact chunked
mode ``morphkv.attach`` exists, ``--feed auto`` uses it instead (chunks of ``--chunk``).
The first ``budget`` tokens cause no eviction, so they are prefilled in one chunk either way.

Per arm and budget, over the positions whose context exceeds the budget (the first position
that reads a set with an evicted token onward):

- mean KL(full || method) per token (nats), top-1 agreement, perplexity ratio
  exp(mean NLL_method - mean NLL_full);
- measured KV bytes: storage (sum of ``cache.nbytes``) and kept tokens
  (sum of ``morphkv_kept_bytes`` x KV heads), next to the full cache's bytes at the end;
- peak MLX memory and decode tokens/s.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

import morphkv

from .. import KVCacheBuilder, KVCacheConfig
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

NAME = "fidelity"
N_SINK = 4
DEFAULT_ARMS = (
    "streaming_llm",
    "random",
    "h2o",
    "tova",
    "morphkv:mean:8",
    "morphkv:mean:32",
    "h2o:attn",
    "tova:attn",
    "morphkv:mean:8:attn",
    "morphkv:mean:32:attn",
)


@dataclass(frozen=True)
class Arm:
    """One cache setting, budget aside."""

    method: str
    window: int = 8
    fusion: str = "mean"
    scoring: str = "proxy"

    @classmethod
    def parse(cls, text: str) -> Arm:
        """``method[:fusion][:window][:attn]``, e.g. ``morphkv:max:32``, ``h2o:8``."""
        method, *parts = text.split(":")
        kw = {}
        for p in parts:
            if p.isdigit():
                kw["window"] = int(p)
            elif p in ("attn", "attention"):
                kw["scoring"] = "attention"
            elif p in ("mean", "max"):
                kw["fusion"] = p
            else:
                raise ValueError(f"cannot parse arm part {p!r} in {text!r}")
        return cls(method, **kw)

    @property
    def name(self) -> str:
        if self.method == "full":
            return "full"
        name = self.method
        if self.method == "morphkv":
            name += f"_{self.fusion}"
        name += f"_w{self.window}"
        if self.scoring != "proxy":
            name += "_attn"
        return name

    def config(self, budget: int, n_sink: int = N_SINK, seed: int = 0) -> KVCacheConfig:
        return KVCacheConfig(
            method=self.method,
            morphkv_budget=budget,
            morphkv_n_sink=n_sink,
            morphkv_window=self.window,
            morphkv_fusion=self.fusion,
            scoring=self.scoring,
            seed=seed,
        )


# ---- feeding -------------------------------------------------------------------------------


def reference_logprobs(model, tokens: list[int], chunk: int = 256) -> mx.array:
    """Full-cache log-probabilities (T, V) float32 for every position: mlx_lm's ``KVCache``,
    chunked prefill (never ``model.make_cache``, which ``patch_model`` may have replaced)."""
    from mlx_lm.models.cache import KVCache

    cache = [KVCache() for _ in model.layers]
    out = []
    ids = mx.array([int(t) for t in tokens])
    for s in range(0, len(tokens), chunk):
        logits = model(ids[None, s : s + chunk], cache=cache)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(lp)
        out.append(lp)
    return mx.concatenate(out, axis=0)


class StackedCache:
    """Several single-sequence caches (one per arm, possibly different budgets) stacked on the
    batch axis, so one forward pass decodes the same token for every arm.

    Row i is exactly its own cache: it receives row i of the keys and values and returns its
    own kept set; shorter rows are zero-padded at the end and masked out. Every layer of an
    arm keeps the same number of tokens, so the one mask mlx_lm builds from layer 0 is right
    for every layer."""

    def __init__(self, caches: list) -> None:
        self.caches = caches

    @property
    def offset(self) -> int:
        return self.caches[0].offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        outs = [
            c.update_and_fetch(keys[i : i + 1], values[i : i + 1])
            for i, c in enumerate(self.caches)
        ]
        L = max(k.shape[2] for k, _ in outs)
        if all(k.shape[2] == L for k, _ in outs):
            return (mx.concatenate([k for k, _ in outs]), mx.concatenate([v for _, v in outs]))

        def pad(x):
            extra = L - x.shape[2]
            if extra == 0:
                return x
            return mx.concatenate([x, mx.zeros((*x.shape[:2], extra, x.shape[3]), x.dtype)], 2)

        return (
            mx.concatenate([pad(k) for k, _ in outs]),
            mx.concatenate([pad(v) for _, v in outs]),
        )

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        lens = np.array([_kept(c) + N for c in self.caches])
        L = int(lens.max())
        if N == 1 and (lens == L).all():
            return None
        j = np.arange(L)[None, None, :]
        q = np.arange(N)[None, :, None]
        allowed = j <= (lens[:, None, None] - N + q)
        return mx.array(allowed[:, None])  # (B, 1, N, L)

    @property
    def state(self):
        return []


def _kept(cache) -> int:
    if hasattr(cache, "tokens_kept"):
        return int(cache.tokens_kept)
    return int(cache.offset)


@dataclass
class Feeder:
    """Feeds one token stream through the caches of several arms; yields log-probabilities.

    ``mode``:
    - ``"chunked"`` (``auto`` when ``morphkv.attach`` exists): chunks of ``chunk`` tokens, one
      arm at a time, through the attention hook's exact chunked mode (every query of a chunk
      reads exactly what token-by-token decoding would read);
    - ``"stacked"`` (``auto`` otherwise): one token per forward, all proxy arms stacked on the
      batch axis (``StackedCache``); real-query arms go one at a time;
    - ``"step"``: one token per forward, one arm at a time (the plain reference).
    Switching feeding mode is this one class."""

    mode: str = "auto"
    chunk: int = 256
    notes: list = field(default_factory=list)

    def resolve(self) -> str:
        if self.mode == "auto":
            return "chunked" if hasattr(morphkv, "attach") else "stacked"
        return self.mode

    def groups(self, cfgs: list) -> list[list[int]]:
        """Indices of the configs fed together."""
        if self.resolve() != "stacked":
            return [[i] for i in range(len(cfgs))]
        together = [i for i, c in enumerate(cfgs) if c.scoring == "proxy" or c.method == "full"]
        alone = [[i] for i in range(len(cfgs)) if i not in together]
        return ([together] if together else []) + alone

    def run(self, model, cfgs: list, tokens: list[int], prefill: int):
        """Yield (s, logprobs (len(cfgs), n, V), per-arm caches) blocks covering positions
        prefill..T-1; the first ``prefill`` tokens go in one chunk (callers make sure none of
        them is evicted, so this is exact in every mode)."""
        mode = self.resolve()
        if mode == "stacked" and len(cfgs) == 1:
            mode = "step"
        per_arm = [KVCacheBuilder.for_model(model, c) for c in cfgs]  # attaches the hook
        if len(cfgs) > 1:
            caches = [StackedCache([arm[i] for arm in per_arm]) for i in range(len(per_arm[0]))]
        else:
            caches = per_arm[0]
        ids = mx.array([int(t) for t in tokens])[None]
        ids = mx.repeat(ids, len(cfgs), axis=0) if len(cfgs) > 1 else ids
        if prefill > 0:
            mx.eval(model(ids[:, :prefill], cache=caches))
        step = self.chunk if mode == "chunked" else 1
        for s in range(prefill, len(tokens), step):
            logits = model(ids[:, s : s + step], cache=caches).astype(mx.float32)
            yield s, logits - mx.logsumexp(logits, axis=-1, keepdims=True), per_arm


def kv_bytes(caches) -> dict:
    storage = sum(int(getattr(c, "nbytes", 0)) for c in caches)
    kept = 0
    for c in caches:
        if hasattr(c, "morphkv_kept_bytes") and c.keys is not None:
            kept += int(c.morphkv_kept_bytes) * int(c.keys.shape[0] * c.keys.shape[1])
        else:
            kept += int(getattr(c, "nbytes", 0))
    return {"kv_bytes_storage": storage, "kv_bytes_kept": kept}


def _first(cfg) -> int:
    """First position whose read set lacks an evicted token (0 for the full cache)."""
    return 0 if cfg.method == "full" else cfg.budget + 1


def evaluate_arms(model, tokens, ref_lp: mx.array, cfgs: list, feeder: Feeder, bar=None):
    """Teacher-forced metrics of several cache configs on one token stream (list of dicts)."""
    results = [None] * len(cfgs)
    for group in feeder.groups(cfgs):
        sub = [cfgs[i] for i in group]
        for i, res in zip(
            group, _evaluate_group(model, tokens, ref_lp, sub, feeder, bar), strict=True
        ):
            results[i] = res
    return results


def _evaluate_group(model, tokens, ref_lp, cfgs, feeder, bar):
    T_len = len(tokens)
    firsts = [_first(c) for c in cfgs]
    prefill = max(0, min(min(firsts) - 1, T_len))
    targets = mx.array([int(t) for t in tokens[1:]] + [0])
    sums = np.zeros((len(cfgs), 5))  # kl, agree, nll_m, nll_f, n
    reset_peak_memory()
    t0 = time.perf_counter()
    fed = 0
    per_arm = None
    for s, lp, arm_caches in feeder.run(model, cfgs, tokens, prefill):
        per_arm = arm_caches
        m = lp.shape[1]
        fed += m
        hi = min(s + m, T_len - 1)  # the last position has no target
        stats = []
        for b, first in enumerate(firsts):
            lo = max(s, first)
            if hi <= lo:
                stats.append(mx.zeros((5,)))
                continue
            a, r = lp[b, lo - s : hi - s], ref_lp[lo:hi]
            tgt = targets[lo:hi]
            kl = (mx.exp(r) * (r - a)).sum(axis=-1)
            ag = (a.argmax(axis=-1) == r.argmax(axis=-1)).astype(mx.float32)
            nm = -mx.take_along_axis(a, tgt[:, None], axis=-1)[:, 0]
            nf = -mx.take_along_axis(r, tgt[:, None], axis=-1)[:, 0]
            stats.append(
                mx.stack([kl.sum(), ag.sum(), nm.sum(), nf.sum(), mx.array(float(hi - lo))])
            )
        sums += np.array(mx.stack(stats))
        if bar is not None:
            bar.update(m * len(cfgs))
    elapsed = time.perf_counter() - t0
    peak = peak_memory()
    out = []
    for b, _cfg in enumerate(cfgs):
        kl, ag, nm, nf, n = sums[b]
        n = max(n, 1)
        res = {
            "kl": kl / n,
            "top1": ag / n,
            "ppl_ratio": math.exp((nm - nf) / n),
            "nll": nm / n,
            "nll_full": nf / n,
            "positions": int(n),
            "peak_memory": peak,
            "arms_in_pass": len(cfgs),
            "tokens_per_s": fed / elapsed if elapsed > 0 else float("nan"),
            "seconds": elapsed,
        }
        res.update(kv_bytes(per_arm[b] if per_arm else []))
        out.append(res)
    return out


# ---- texts ---------------------------------------------------------------------------------


def greedy_continuation(model, prompt: list[int], n: int) -> list[int]:
    """prompt + n greedy tokens from the full cache."""
    from mlx_lm.models.cache import KVCache

    cache = [KVCache() for _ in model.layers]
    logits = model(mx.array([int(t) for t in prompt])[None], cache=cache)[0, -1]
    out = list(prompt)
    for _ in range(n):
        tok = int(mx.argmax(logits).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
    return out


def build_texts(
    tokenizer, kinds, prose_tokens, n_prose, n_conv, conv_tokens, cont_tokens, model=None
) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for kind in kinds:
        if kind == "prose":
            for i, doc in enumerate(T.prose_documents(tokenizer, prose_tokens, n_prose)):
                found[f"prose{i}"] = doc
        elif kind == "conversation":
            for i in range(min(n_conv, len(T.CONVERSATIONS))):
                ids = T.conversation_tokens(tokenizer, i)
                found[f"conversation{i}"] = ids[:conv_tokens] if conv_tokens else ids
        elif kind == "continuation":
            prompt = T.chat_prompt(tokenizer, T.CONTINUATION_PROMPT)
            found["continuation"] = greedy_continuation(model, prompt, cont_tokens)
        else:
            raise ValueError(f"unknown text kind {kind!r}")
    return found


# ---- benchmark -----------------------------------------------------------------------------


def run_fidelity(
    model,
    token_texts: dict[str, list[int]],
    arms,
    budgets,
    n_sink=N_SINK,
    feeder: Feeder | None = None,
    quiet=False,
    include_full=True,
    on_text=None,
) -> dict:
    """Core entry point: (model, {text name: token ids}) -> result dict."""
    feeder = feeder or Feeder()
    arms = [Arm.parse(a) if isinstance(a, str) else a for a in arms]
    plan = []
    for name, toks in token_texts.items():
        if include_full:
            plan.append((name, Arm("full"), 0))
        for b in budgets:
            for arm in arms:
                if b <= n_sink + arm.window or b >= len(toks) - 1:
                    continue
                plan.append((name, arm, b))
    total = sum(len(token_texts[n]) - b for n, _, b in plan)  # arm-tokens decoded, about
    bar = Progress(total, NAME, quiet)
    rows, skipped = [], []
    t_start = time.perf_counter()
    for name, toks in token_texts.items():
        for b in budgets:
            for arm in arms:
                if b <= n_sink + arm.window:
                    skipped.append(f"{name} {arm.name} budget {b}: <= sinks + window")
                elif b >= len(toks) - 1:
                    skipped.append(f"{name} budget {b}: text of {len(toks)} tokens never exceeds")
    for name, toks in token_texts.items():
        items = [(arm, b) for n, arm, b in plan if n == name]
        if not items:
            continue
        ref = reference_logprobs(model, toks)
        cfgs = [arm.config(max(b, n_sink + arm.window + 1), n_sink) for arm, b in items]
        results = evaluate_arms(model, toks, ref, cfgs, feeder, bar)
        for (arm, b), res in zip(items, results, strict=True):
            rows.append(
                {
                    "text": name,
                    "tokens": len(toks),
                    "arm": arm.name,
                    "method": arm.method,
                    "window": arm.window,
                    "fusion": arm.fusion,
                    "scoring": arm.scoring,
                    "budget": b if arm.method != "full" else None,
                    **res,
                }
            )
        del ref
        if on_text is not None:
            on_text(rows)
    return {
        "benchmark": NAME,
        "settings": {
            "budgets": list(budgets),
            "arms": [a.name for a in arms],
            "n_sink": n_sink,
            "feed": feeder.resolve(),
            "chunk": feeder.chunk,
            "texts": {k: len(v) for k, v in token_texts.items()},
        },
        "notes": feeder.notes,
        "skipped": skipped,
        "rows": rows,
        "elapsed_s": time.perf_counter() - t_start,
        "environment": environment(),
    }


def summary(result: dict, metric: str = "kl") -> tuple[list[str], list[list]]:
    """Per arm x budget, the metric averaged over texts (weighted by positions)."""
    budgets = result["settings"]["budgets"]
    arms = result["settings"]["arms"]
    body = []
    for arm in arms:
        line = [arm]
        for b in budgets:
            rs = [r for r in result["rows"] if r["arm"] == arm and r["budget"] == b]
            w = sum(r["positions"] for r in rs)
            line.append(sum(r[metric] * r["positions"] for r in rs) / w if w else float("nan"))
        body.append(line)
    return ["arm"] + [f"budget {b}" for b in budgets], body


def tables(result: dict) -> str:
    parts = []
    for metric, label in (
        ("kl", "mean KL(full || method), nats/token"),
        ("top1", "top-1 agreement with the full cache"),
        ("ppl_ratio", "perplexity ratio (method / full)"),
    ):
        headers, body = summary(result, metric)
        parts.append(f"### {label}\n\n" + markdown_table(headers, body))
    per_text = [
        [
            r["text"],
            r["arm"],
            r["budget"] if r["budget"] is not None else "-",
            r["kl"],
            r["top1"],
            r["ppl_ratio"],
            r["kv_bytes_kept"],
            r["kv_bytes_storage"],
            r["peak_memory"] / 2**20,
            r["tokens_per_s"],
        ]
        for r in result["rows"]
    ]
    parts.append(
        "### per text\n\n"
        + markdown_table(
            [
                "text",
                "arm",
                "budget",
                "KL",
                "top1",
                "ppl ratio",
                "KV kept B",
                "KV storage B",
                "peak MiB",
                "tok/s",
            ],
            per_text,
        )
    )
    return "\n\n".join(parts)


def plot(result: dict, path) -> None:
    pyplot = plt()
    budgets = result["settings"]["budgets"]
    fig, axes = pyplot.subplots(1, 2, figsize=(11, 4))
    for metric, ax, title in (
        (("kl"), axes[0], "mean KL(full || method)"),
        (("top1"), axes[1], "top-1 agreement"),
    ):
        headers, body = summary(result, metric)
        for line in body:
            ax.plot(budgets, line[1:], marker="o", label=line[0])
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("budget (tokens per KV head)")
        ax.set_title(title)
    full = [r for r in result["rows"] if r["arm"] == "full"]
    if full:
        axes[0].axhline(np.mean([r["kl"] for r in full]), color="k", ls=":", label="full (ref)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    pyplot.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (seconds)")
    parser.add_argument(
        "--full",
        action="store_true",
        help="wide run: 2 prose documents of 3,000 tokens, all conversations, the model's own "
        "1,000-token continuation, budgets 64-512 (hours on a 2-core CPU)",
    )
    parser.add_argument("--out", default=None, help="output folder (default results/fidelity)")
    parser.add_argument(
        "--model",
        default=None,
        help="mlx_lm model path/repo or .gguf (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--budgets", type=csv_ints, default=[64, 128, 256])
    parser.add_argument(
        "--arms",
        type=csv_strs,
        default=list(DEFAULT_ARMS),
        help="method[:fusion][:window][:attn], comma separated",
    )
    parser.add_argument(
        "--texts",
        type=csv_strs,
        default=["prose", "conversation"],
        help="prose, conversation, continuation",
    )
    parser.add_argument("--prose-tokens", type=int, default=1100)
    parser.add_argument("--prose-docs", type=int, default=1)
    parser.add_argument("--conversations", type=int, default=1)
    parser.add_argument("--conversation-tokens", type=int, default=0, help="0: whole")
    parser.add_argument("--continuation-tokens", type=int, default=1000)
    parser.add_argument("--n-sink", type=int, default=N_SINK)
    parser.add_argument(
        "--feed",
        choices=["auto", "stacked", "step", "chunked"],
        default="auto",
        help="auto: exact chunks with morphkv.attach, else stacked token-by-token",
    )
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument(
        "--no-full-arm", action="store_true", help="skip the token-by-token full-cache check arm"
    )
    parser.add_argument("--quiet", action="store_true")


def load_model(name):
    from ..model import load

    return load(name)


def run(args: argparse.Namespace) -> int:
    """CLI entry point (``morphkv`` command contract): 0 on success."""
    execute(args)
    return 0


def execute(args: argparse.Namespace, model=None, tokenizer=None) -> dict:
    """Run with the command-line settings; ``model``/``tokenizer`` bypass loading (tests)."""
    if args.quick:
        args.budgets = [32]
        args.arms = ["streaming_llm", "h2o", "morphkv:mean:8"]
        args.prose_tokens, args.conversation_tokens = 96, 96
        args.continuation_tokens = 40
        args.texts = [t for t in args.texts if t != "continuation"] or ["prose"]
    if getattr(args, "full", False) and not args.quick:
        args.budgets = [64, 128, 256, 512]
        args.texts = ["prose", "conversation", "continuation"]
        args.prose_tokens, args.prose_docs = 3000, 2
        args.conversations, args.conversation_tokens = len(T.CONVERSATIONS), 0
    if model is None:
        model, tokenizer = load_model(args.model)
    mx.random.seed(0)
    texts = build_texts(
        tokenizer,
        args.texts,
        args.prose_tokens,
        args.prose_docs,
        args.conversations,
        args.conversation_tokens,
        args.continuation_tokens,
        model,
    )
    folder = out_dir(args, NAME)
    model_name = args.model or "embedded SmolLM2-135M-Instruct"

    def partial(rows):  # keep what is done if a long run is interrupted
        write_json(folder / f"{NAME}.partial.json", {"model": model_name, "rows": rows})

    result = run_fidelity(
        model,
        texts,
        args.arms,
        args.budgets,
        args.n_sink,
        Feeder(args.feed, args.chunk),
        args.quiet,
        include_full=not args.no_full_arm,
        on_text=partial,
    )
    result["settings"]["quick"] = bool(args.quick)
    result["settings"]["model"] = model_name
    write_json(folder / f"{NAME}.json", result)
    plot(result, folder / f"{NAME}.png")
    print(tables(result))
    for note in result["notes"] + result["skipped"]:
        print("note:", note, file=sys.stderr)
    print(f"\nwrote {folder}/{NAME}.json and {NAME}.png ({result['elapsed_s']:.0f} s)")
    return result


if __name__ == "__main__":
    raise SystemExit(main(add_arguments, run, __doc__.splitlines()[0]))
