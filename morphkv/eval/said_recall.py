"""``morphkv eval recall --data said``: facts the model said and facts the user said, one chat.

The chats of ``said_items`` (two names the model invented, three facts the user said, one
updated), run as ``--data chats`` runs them: every arm prefills each chat once (exact chunks
through the attention hook; ``+pin`` pins the user turns, as the memory preset's
``pin="prompt"`` does when the chat is fed turn by turn) and each question is asked from a
copy. The table splits the items by who said them: of the full cache's items, the share each
arm answers, with a 95% bootstrap interval over chats (a chat's questions are not
independent), and what ``nofact`` (no facts said, no names invented) scores: guessing.

    morphkv eval recall --data said --model qwen2.5-0.5b --split tune --chats 8 \\
        --arms "kvcache,nofact,recommended:memory=f16+pin,h2o:memory=f16:bits=8+pin"
"""

from __future__ import annotations

import argparse

from .chat_recall import Chats
from .chat_recall import add_arguments as chat_arguments
from .chat_recall import run as chat_run
from .chat_report import FULL, summarize
from .live import cluster_interval
from .output import markdown_table
from .said_items import build_said_chat, said_by

NOFACT = "nofact"
WHO = ("model", "user")


def of_full(chats: list[dict], label: str, who: str) -> dict:
    """Of the full cache's right answers to ``who``'s questions, how many ``label`` gives, per
    chat (the bootstrap's clusters); for ``nofact``: its right answers to the same items."""
    hits = []
    for c in chats:
        full, arm = c["arms"].get(FULL), c["arms"].get(label)
        if full is None or arm is None:
            continue
        hits.append([arm["correct"][i] for i, q in enumerate(c["questions"])
                     if said_by(q["kind"]) == who and full["correct"][i]])
    k, n = sum(map(sum, hits)), sum(map(len, hits))
    return {"k": int(k), "n": int(n), "chats": len(hits), "interval": cluster_interval(hits)}


def said_summary(chats: list[dict], labels: list[str]) -> dict:
    """Per arm and speaker: of the full cache's items, the share kept (``of_full``); with the
    questions asked of each speaker and how many the full cache answered (the same for every
    arm: the denominators)."""
    asked = {who: sum(said_by(q["kind"]) == who for c in chats for q in c["questions"])
             for who in WHO}
    full_right = {who: of_full(chats, FULL, who)["n"] for who in WHO}
    return {label: {**{who: of_full(chats, label, who) for who in WHO}, "asked": asked,
                    "full_right": full_right} for label in labels}


def _cell(s: dict) -> str:
    if not s["n"]:
        return "-"
    share, lo, hi = s["interval"]
    return f"{s['k']}/{s['n']} = {100 * share:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}]"


def report(chats: list[dict], labels: list[str]) -> tuple[dict, str]:
    summary = summarize(chats, labels)
    said = said_summary(chats, labels)
    summary["_said"] = said
    rows = [[label, f"{summary[label]['mib']:.2f}", _cell(said[label]["model"]),
             _cell(said[label]["user"])] for label in labels]
    text = markdown_table(["arm", "MiB held", "model-said: of the full cache's items",
                           "user-said: of the full cache's items"], rows)
    full = said.get(FULL, {}).get("full_right", {})
    asked = said[labels[0]]["asked"]
    text += (f"\n{len(chats)} chats; the full cache answered {full.get('model', 0)} of "
             f"{asked['model']} model-said and {full.get('user', 0)} of {asked['user']} "
             "user-said questions; intervals: 95% bootstrap over chats")
    return summary, text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    chat_arguments(parser)
    parser.set_defaults(split="tune", chats=8, arms=f"{FULL},{NOFACT},recommended:memory=f16+pin",
                        max_tokens=10)
    parser.add_argument("--asks", default=None, help="the split of data/said.json the invention "
                        "asks come from (default: --split's)")


class Said(Chats):
    """The chats of ``said_items``: the model's inventions woven in, written now."""

    def stem(self) -> str:
        return self.args.stem or f"said_{self.args.split}_{self.args.budget}"

    def build(self, model, tok, index: int):
        a = self.args
        return build_said_chat(model, tok, a.split, index, a.seed, asks=getattr(a, "asks", None))

    def report(self, records: list, arms) -> tuple:
        return report(records, [c.label for c in arms])


def run(args: argparse.Namespace) -> int:
    if args.live:
        raise SystemExit("morphkv: error: --data said runs prefilled chats; --live is for "
                         "--data chats")
    return chat_run(args, Said)
