"""``morphkv eval recall --data answers``: does a bounded cache keep what the model itself wrote?

Long single answers (``data/answer_prompts.json``: long Python modules that define names and
use them far later), written once by the full cache (greedy, repetition penalty 1.1; kept as
``answers_texts_*.json`` in the output folder). Every arm reads prompt + answer back as
generation feeds it (the prompt one prefill, pinned for ``+pin``; the answer in exact chunks),
in lockstep with the full cache. Measured where the answer re-uses a rare token it wrote far
back (a **re-mention**: identifier-like, 3+ letters or digits, no keyword or builtin, at most
``RARE`` times before, first more than two arm sizes back, not in the last half size): top-1
agreement with the full cache and the written token's NLL; over every answer token, KL to the
full cache. Intervals: 95% bootstrap over texts. ``spec@N`` runs at N tokens, ``spec@/K`` at
1/K of each text's tokens (prompt + answer: ``@/4``, a quarter of the full cache's bytes).
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import json
import keyword
import re
import time

from ..core.pins import pin
from .arms import cells
from .metrics import cluster_interval, log_probs, repetition_rate
from .models import greedy_tokens
from .runner import Evaluation, add_flags, markdown_table, out_dir, standard, write_json

DATA_FILE = "answer_prompts.json"
RARE = 3  # a re-mention's token occurred at most this many times before
PENALTY = 1.1  # the writer's repetition penalty (greedy Qwen2.5-Coder loops without it)
COMMON = set(keyword.kwlist) | set(dir(builtins)) | {"self", "cls", "def", "return"}
WORD = re.compile(r"\s?([A-Za-z_][A-Za-z0-9_]{2,}|[0-9]{3,})")


def write(model, tok, ids: list[int], caches, length: int) -> list[int]:
    """Greedy tokens after ``ids`` (repetition penalty ``PENALTY``), up to an end token."""
    ends = set(getattr(tok, "eos_token_ids", None) or [tok.eos_token_id])
    return greedy_tokens(model, caches, ids, length, penalty=PENALTY, ends=ends)


def free_repetition(model, tok, text: dict, arms, tokens: int) -> dict:
    """Per arm: the 10-gram repetition rate of ``tokens`` it writes itself after the prompt
    (the paper's degeneration measure; prompt pinned for ``+pin`` arms)."""
    out = {}
    for c in arms:
        caches = c.arm.caches(model, c.size)
        if c.pins:
            pin(caches, range(len(text["prompt_ids"])))
        ids = write(model, tok, text["prompt_ids"], caches, tokens)
        out[c.label] = {"repetition": repetition_rate(ids), "tokens": len(ids)}
    return out


def write_texts(model, tok, split: str, length: int, path, count: int,
                first: int = 0) -> list[dict]:
    """Prompts ``first`` .. ``first + count - 1``: their answers by the full cache (kept in
    ``path``; missing ones are written)."""
    from mlx_lm.models.cache import make_prompt_cache

    from .chat_items import DATA

    done = json.loads(path.read_text())["texts"] if path.exists() else []
    done = [t for t in done if t["length"] == length]
    prompts = json.loads((DATA / DATA_FILE).read_text())[split]
    if not 0 <= first < len(prompts):
        raise ValueError(f"--first {first}: the {split} split has prompts 0-{len(prompts) - 1}")
    for i, text in enumerate(prompts[first : first + count], start=first):
        if any(t["index"] == i for t in done):
            continue
        ids = list(tok.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True))
        start = time.perf_counter()
        out = write(model, tok, ids, make_prompt_cache(model), length)
        done.append({"index": i, "length": length, "prompt_ids": ids, "answer_ids": out,
                     "seconds": time.perf_counter() - start})
        write_json(path, {"split": split, "penalty": PENALTY, "texts": done})
        print(f"text {i}: {len(out)} tokens written in {time.perf_counter() - start:.0f} s",
              flush=True)
    return sorted((t for t in done if first <= t["index"] < first + count),
                  key=lambda t: t["index"])


def rementions(tok, ids: list[int], start: int, size: int) -> list[int]:
    """Positions p >= ``start`` whose token re-mentions a rare one (module docstring)."""
    first, count, out = {}, {}, []
    for p, t in enumerate(ids):
        if p >= start and t in first and count[t] <= RARE and p - first[t] > 2 * size \
                and t not in ids[max(0, p - size // 2) : p]:
            m = WORD.fullmatch(tok.decode([t]))
            if m and m.group(1) not in COMMON:
                out.append(p)
        first.setdefault(t, p)
        count[t] = count.get(t, 0) + 1
    return out


def read_back(model, text: dict, arms, chunk: int) -> dict:
    """Every arm (``arms.Cell``) and the full cache over one text, chunk by chunk: per
    arm, per answer position, (KL, agreement with the full cache's top-1, written-token top-1,
    NLL of the written token)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    ids, n0 = text["prompt_ids"] + text["answer_ids"], len(text["prompt_ids"])
    full = make_prompt_cache(model)
    caches = {}
    for c in arms:
        caches[c.label] = c.arm.caches(model, c.size)
        if c.pins:
            pin(caches[c.label], range(n0))
    x = mx.array(ids)[None]
    stats = {label: {"kl": [], "agree": [], "written": [], "nll": []} for label in caches}
    cuts = [0, n0, *range(n0 + chunk, len(ids), chunk), len(ids)]
    for s, e in zip(cuts[:-1], cuts[1:], strict=True):
        ref = log_probs(model(x[:, s:e], cache=full)[0])
        lo = max(s, n0 - 1) - s  # rows predicting an answer token
        ref, targets = ref[lo : e - s - (e == len(ids))], x[0, s + lo + 1 : e + 1]
        top = ref.argmax(axis=-1)
        for label, c in caches.items():
            lp = log_probs(model(x[:, s:e], cache=c)[0])[lo : lo + ref.shape[0]]
            arg = lp.argmax(axis=-1)
            got = {"kl": (mx.exp(ref) * (ref - lp)).sum(axis=-1), "agree": arg == top,
                   "written": arg == targets,
                   "nll": -mx.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]}
            mx.eval(list(got.values()))
            for key, value in got.items():
                stats[label][key] += value.tolist()
    for label, c in caches.items():
        stats[label]["nbytes"] = int(sum(layer.nbytes for layer in c))
    return stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        *standard("answers", "model", "first", "chunk", "out", "stem"),
        ("--split", "tune", "the prompts' split", ("tune", "test")),
        ("--arms", "kvcache@128,recommended:memory=f16+pin@128", "comma-separated arm specs, "
         "each spec[+pin][@tokens] (morphkv.eval.arms)"),
        ("--texts", 6, "answers (prompts of the split, from --first) to use"),
        ("--length", 1024, "tokens the full cache writes per answer"),
        ("--free", 0, "also let every arm write this many tokens itself and measure their "
         "10-gram repetition (0: not run)"),
    ])


class Answers(Evaluation):
    """Long answers the full cache wrote, read back by every arm."""

    name, key, command, stem_of = "answers", "texts", "morphkv eval recall", "answers_{split}"

    def arms(self) -> list:
        return cells(self.args.arms, 128, shares=True)

    def items(self, model, tok):
        a = self.args
        name = re.sub(r"[^A-Za-z0-9.]+", "-", a.model or "smollm2")
        path = out_dir(a, "answers") / f"answers_texts_{a.split}_{name}.json"
        return write_texts(model, tok, a.split, a.length, path, a.texts, a.first)

    def measure(self, model, tok, t, arms, bar) -> dict:
        rec = {"index": t["index"], "answer_tokens": len(t["answer_ids"]), "arms": {}}
        n = len(t["prompt_ids"]) + len(t["answer_ids"])
        arms = [dataclasses.replace(c, size=max(1, n // c.share)) if c.share else c
                for c in arms]  # @/K: this text's size
        sizes = {c.label: c.size for c in arms}
        for label, stats in read_back(model, t, arms, self.args.chunk).items():
            stats["remention"] = [p - len(t["prompt_ids"]) for p in rementions(
                tok, t["prompt_ids"] + t["answer_ids"], len(t["prompt_ids"]), sizes[label])]
            rec["arms"][label] = stats | {"size": sizes[label]}
        if self.args.free:
            for label, r in free_repetition(model, tok, t, arms, self.args.free).items():
                rec["arms"][label].update(free=r)
        print(f"text {t['index']}: read back by {len(arms)} arms", flush=True)
        return rec

    def report(self, records: list, arms) -> tuple:
        """Per arm: re-mention agreement / written-token top-1 (bootstrap over texts), their
        mean NLL, mean KL over every answer token, positions and texts counted; the table."""
        out = {}
        for label in [c.label for c in arms]:
            rows = [t["arms"][label] for t in records]
            at = [[r["agree"][i] for i in r["remention"]] for r in rows]
            wr = [[r["written"][i] for i in r["remention"]] for r in rows]
            nll = [r["nll"][i] for r in rows for i in r["remention"]]
            kl = [k for r in rows for k in r["kl"]]
            free = [r["free"]["repetition"] for r in rows if "free" in r]
            out[label] = {"remention_agree": cluster_interval(at), "remention_written":
                          cluster_interval(wr), "remention_nll": sum(nll) / len(nll) if nll
                          else None, "rementions": len(nll), "texts": len(rows),
                          "kl": sum(kl) / len(kl) if kl else None,
                          "repetition": sum(free) / len(free) if free else None,
                          "mib": max(r["nbytes"] for r in rows) / 2**20}

        def cell(v):
            return "-" if v is None else f"{100 * v[0]:.0f}% [{100 * v[1]:.0f}, {100 * v[2]:.0f}]"

        return out, markdown_table(
            ["arm", "MiB held", "re-mentions", "agree with full (top-1)", "written token top-1",
             "NLL", "KL, every token", "10-gram repetition, own writing"],
            [[lbl, f"{s['mib']:.2f}", s["rementions"], cell(s["remention_agree"]),
              cell(s["remention_written"]), f"{s['remention_nll']:.3f}" if s["remention_nll"]
              is not None else "-", f"{s['kl']:.4f}",
              "-" if s.get("repetition") is None else f"{s['repetition']:.3f}"]
             for lbl, s in out.items()])


EVALUATION = Answers
