"""``morphkv eval recall --data longchat``: recall of a fact stated early in a long chat, per arm
and budget.

Items (``recall_items``): a fact in the first turn, distractor turns, the question. Every arm
reads the prompt as ``models.ask`` does (a prefill, the retention of the fact's value tokens), then
answers greedily in a few tokens; an answer counts when the fact's words appear in it. Recall
is counted over the items the full cache answers (the other arms run only on those), with a
95% Wilson interval and the bytes held. Records, summary, table and plot are those of ``--data
chats`` (``chat_recall``), one question per item; an arm at budget B is labelled ``spec@B``.
"""

from __future__ import annotations

import argparse

from .arms import Cell, cells
from .chat_recall import Chats, summarize, table
from .models import ask
from .recall_items import build_item, build_natural_item, is_correct
from .runner import add_flags, standard

NAME = "recall"
DEFAULT_ARMS = "full,streaming_llm,tuned,h2o,peak:recent=32:value=true"
FIXED = ("method", "morphkv_budget", "budget", "head_dim")  # set by the arm name / --budgets


def parse_arms(text: str) -> list:
    """``--arms`` as ``arms.cells`` (size 0: ``--budgets`` sets it), a budget in a spec named."""
    found = cells(text, 0)
    for c in found:
        for key in dict(c.arm.options):
            if key in FIXED or f"morphkv_{key}" in FIXED:
                raise ValueError(f"arm {c.label!r}: {key} is set by the command (--budgets)")
    return found


class LongChats(Chats):
    """Long chats with one early fact (``recall_items``: canned or natural), per budget."""

    name, key, command = NAME, "items", "morphkv eval recall --data longchat"
    stem_of = "{name}"

    def arms(self) -> list:
        """The full cache (at the largest budget) first, then every other arm at each budget;
        arms and budgets checked before any work (ValueError names the problem)."""
        a = self.args
        if a.quick:
            a.arms, a.budgets, a.items = "full,streaming_llm,morphkv", [32], min(a.items, 2)
            a.distance = a.distance or 48
        if not a.budgets or a.items < 1 or a.first < 0:
            raise ValueError("need --budgets, --items >= 1 and --first >= 0")
        arms, budgets = parse_arms(a.arms), a.budgets
        for c in (c for c in arms if not c.arm.is_baseline):
            for budget in budgets:
                c.arm.config(budget, n_sink=a.n_sink)  # ValueError: "arm ... at budget ..."
        a.distance = a.distance or 3 * max(budgets)
        fulls = [c for c in arms if c.arm.method in ("full", "kvcache")]
        full = (fulls or parse_arms("full"))[0]
        return [Cell(full.label, full.arm, max(budgets))] + [
            Cell(f"{c.label}@{b}", c.arm, b) for c in arms if c not in fulls for b in budgets]

    def items(self, model, tok):
        return range(self.args.first, self.args.first + self.args.items)

    def steps(self, arms) -> int:
        return self.args.items * len(arms)

    def measure(self, model, tok, index, cells, bar) -> dict:
        """The full cache, then (when it answers right) every other arm: a prefill of all but
        the prompt's last token, the retention, then ``--max-tokens`` greedy tokens."""
        a = self.args
        item = (build_natural_item(tok, a.seed, a.split, index, max(a.budgets))
                if a.set == "natural" else build_item(tok, a.seed, a.split, index, a.distance))
        rec = {"index": index, "kind": item.kind, "value": item.value, "tokens": len(item.ids),
               "turns": item.turns, "distractors": list(item.distractors), "arms": {},
               "questions": [{"kind": item.kind, "value": item.value, "updated": False,
                              "distance": item.distance,
                              "value_tokens": len(item.fact_positions)}]}
        for c in cells:
            out = ask(model, c.arm.caches(model, c.size, a.n_sink), [list(item.ids)], a.chunk,
                      a.max_tokens, [item.fact_positions])
            text = tok.decode(out.pop("answers")[0])
            out.update(answers=[text], correct=[is_correct(text, item.value)], size=c.size)
            rec["arms"][c.label] = out
            bar.update(1, f"item {index}: {c.label} {'right' if out['correct'][0] else 'wrong'}")
            if c is cells[0] and not out["correct"][0]:
                bar.total -= len(cells) - 1  # the full cache is wrong: not counted
                break
        return rec

    def report(self, records: list, cells) -> tuple:
        summary = summarize(records, [c.label for c in cells], full=cells[0].label)
        return summary, table(summary)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--quick", False, "smoke run (seconds): 2 short items"),
        *standard(NAME, "model", "first", "seed", "n_sink", "chunk", "out", "stem", "quiet",
                  "max_minutes"),
        ("--arms", DEFAULT_ARMS, "comma-separated arm specs, method[:field=value]... with "
         "KVCacheConfig fields (morphkv_ prefix optional) or presets"),
        ("--budgets", [128], "comma-separated budgets"),
        ("--items", 48, "items to build"),
        ("--split", "test", "the items' split", ("tune", "test")),
        ("--set", "canned", "items (recall_items): canned (short fixed replies, one fact) or "
         "natural (long reference-prose turns, three facts in passing, a reworded question, the "
         "asked fact 3-6 budgets back)", ("canned", "natural")),
        ("--distance", 0, "min tokens after the fact (0: 3 x the largest budget)"),
        ("--max-tokens", 8, "answer tokens generated"),
    ])


EVALUATION = LongChats
