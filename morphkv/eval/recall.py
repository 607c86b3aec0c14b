"""``morphkv eval recall --data longchat``: recall of a fact stated early in a long chat, per arm
and budget.

Items (``morphkv.eval.recall_items``) are chats whose first turn states a fact, followed by
distractor turns and the question. Every arm (an arm spec of ``morphkv.eval.arms``: any
``KVCacheConfig`` field, presets, mlx_lm's caches) prefills the prompt through fresh caches
(exact chunks: ``KVCacheBuilder.for_model`` attaches the attention hook) and reports its
*retention*: per layer, the fraction of the fact's value tokens still stored when the question
is read (mean over KV heads). The model then answers greedily for a few tokens, the answer
counts when the fact's words appear in it, and recall is counted over the items the full cache
answers correctly (the other arms run only on those), with a 95% Wilson interval. Total bytes
(``cache.nbytes``: storage + selection state, summed over layers) stand next to every figure.
The records, summary, table and plot are those of ``--data chats`` (``chat_report``), one
question per item; an arm at budget B is labelled ``spec@B``.
"""

from __future__ import annotations

import argparse

from .arms import Cell, cells
from .asking import ask
from .chat_recall import Chats
from .chat_report import summarize, table
from .flags import add_flags, standard
from .recall_items import build_item, build_natural_item, is_correct

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


def is_full(cell) -> bool:
    return cell.arm.method in ("full", "kvcache")


class LongChats(Chats):
    """Long chats with one early fact (``recall_items``: canned or natural), per budget."""

    name, key, command = NAME, "items", "morphkv eval recall --data longchat"
    stem_of = "{name}"

    def arms(self) -> list:
        """The full cache (at the largest budget) first, then every other arm at each budget."""
        arms, budgets = _settings(self.args)
        full = next((a for a in arms if is_full(a)), None) or parse_arms("full")[0]
        return [Cell(full.label, full.arm, max(budgets))] + [
            Cell(f"{a.label}@{b}", a.arm, b) for a in arms if not is_full(a) for b in budgets]

    def items(self, model, tok):
        return range(self.args.first, self.args.first + self.args.items)

    def steps(self, arms) -> int:
        return self.args.items * len(arms)

    def measure(self, model, tok, index, cells, bar) -> dict:
        """The full cache, then (when it answers right) every other arm: a prefill of all but
        the prompt's last token, the retention, then ``--max-tokens`` greedy tokens."""
        a = self.args
        item = make_item(tok, a, index)
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


def make_item(tok, args, index: int):
    """Item ``index`` of the chosen set: ``natural`` (the asked fact 3-6 budgets back) or
    ``canned`` (at least ``--distance`` tokens back)."""
    if args.set == "natural":
        return build_natural_item(tok, args.seed, args.split, index, max(args.budgets))
    return build_item(tok, args.seed, args.split, index, args.distance)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--quick", action="store_true", help="smoke run (seconds): 2 short items")
    add_flags(parser, standard(NAME, "model", "first", "seed", "n_sink", "chunk", "out", "stem",
                               "quiet", "max_minutes"))
    add("--arms", default=DEFAULT_ARMS,
        help="comma-separated arm specs, method[:field=value]... with KVCacheConfig fields "
        f"(morphkv_ prefix optional) or presets (default {DEFAULT_ARMS})")
    add("--budgets", default="128", help="comma-separated budgets (default 128)")
    add("--items", type=int, default=48, help="items to build (default 48)")
    add("--split", choices=("tune", "test"), default="test")
    add("--set", choices=("canned", "natural"), default="canned",
        help="items (recall_items): canned (short fixed replies, one fact) or natural (long "
        "reference-prose turns, three facts in passing, a reworded question, the asked fact 3-6 "
        "budgets back) (default canned)")
    add("--distance", type=int, default=0,
        help="min tokens after the fact (0: 3 x the largest budget)")
    add("--max-tokens", type=int, default=8, help="answer tokens generated (default 8)")


def _settings(args: argparse.Namespace) -> tuple[list, list[int]]:
    """Arms and budgets checked before any work; ValueError names the problem."""
    if args.quick:
        args.arms, args.budgets, args.items = "full,streaming_llm,morphkv", "32", min(args.items, 2)
        args.distance = args.distance or 48
    try:
        budgets = [int(b) for b in str(args.budgets).strip("[]").split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--budgets: comma-separated integers, not {args.budgets!r}") from None
    if not budgets or args.items < 1 or args.first < 0:
        raise ValueError("need --budgets, --items >= 1 and --first >= 0")
    arms = parse_arms(args.arms)
    for c in (c for c in arms if not c.arm.is_baseline):
        for budget in budgets:
            try:
                c.arm.config(budget, n_sink=args.n_sink)
            except (TypeError, ValueError) as e:
                raise ValueError(f"arm {c.label!r} at budget {budget}: {e}") from None
    args.budgets = budgets
    args.distance = args.distance or 3 * max(budgets)
    return arms, budgets


EVALUATION = LongChats
