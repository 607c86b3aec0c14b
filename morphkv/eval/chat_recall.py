"""``morphkv eval recall``: does a bounded cache remember what was said in a chat?

Chats of ``chat_items`` (three facts said in passing, one updated, asked at the end). Every arm
reads each chat as ``asking`` does (one prefill, each question from a copy, retention of the
value's tokens); the answers are judged strictly (``chat_items.judge``). ``nofact`` is the full
cache on the chat without its fact clauses: how often the model guesses. Every figure comes
with its item count and Wilson 95% interval; partial results are saved after every chat.
``spec+pin[N]`` and ``spec@N`` are ``arms.cells``' (an arm at N tokens runs on the same chats,
cut by ``--min-distance`` budgets of ``--budget``: each question's distance is in the JSON).

``--data said`` (``Said``): the chats of ``chat_items.build_said_chat`` (two names the model
invented, three facts the user said), run the same way; the table splits the items by who said
them: of the full cache's items, the share each arm answers, with a 95% bootstrap interval over
chats (a chat's questions are not independent).
"""

from __future__ import annotations

import argparse
import time

from ..core.pins import pin
from ..mlxlm.turns import user_positions
from .arms import Arm, cells
from .asking import ask, until_end
from .chat_items import build_chat, build_said_chat, encode, judge, tokenize
from .chat_report import FULL, plot, said_report, summarize, table
from .runner import Evaluation, add_flags, standard
from .runner import run as run_evaluation

NAME = "chatrecall"
LIVE_MEM = 1572864  # the float16 bytes of 128 tokens on Qwen2.5-0.5B (24 layers x 2 KV heads x 64)
DEFAULT_ARMS = ("kvcache,nofact,recommended:memory=f16,h2o,streaming_llm,"
                "streaming_llm:memory=f16:bits=8")


class Chats(Evaluation):
    """Chats of ``chat_items``, three questions each, every arm prefilled once per chat."""

    name, key, command = NAME, "chats", "morphkv eval recall"
    stem_of = "{name}_{split}_{budget}"

    def arms(self) -> list:
        found = cells(self.args.arms, self.args.budget, nofact=True)
        for c in found:
            if c.arm is not None and not c.arm.is_baseline:
                c.arm.config(c.size, n_sink=self.args.n_sink)
        return found

    def build(self, model, tok, index: int):
        return build_chat(self.args.split, index, self.args.seed)

    def items(self, model, tok):
        a = self.args
        return (self.build(model, tok, i) for i in range(a.first, a.first + a.chats))

    def steps(self, arms) -> int:
        return self.args.chats * len(arms)

    def measure(self, model, tok, chat, arms, bar) -> dict:
        """Every arm on one chat: one prefill, then each question from a copy of the cache."""
        a = self.args
        tokenize(tok, chat, a.min_distance * a.budget)
        rec = {"index": chat.index, "turns": len(chat.messages) // 2, "arms": {},
               "questions": [{"kind": q.kind, "value": q.value, "updated": q.updated,
                              "distance": q.distance, "value_tokens": len(q.positions)}
                             for q in chat.questions]}  # fmt: skip
        for c in arms:
            msgs = chat.nofact if c.arm is None else chat.messages
            caches = (c.arm or Arm.parse("kvcache")).caches(model, c.size, a.n_sink)
            if c.pins:  # the chat's user turns are evicted last (morphkv.pin)
                pin(caches, user_positions(tok, msgs, replies=c.replies))
            t0 = time.perf_counter()
            qs = chat.questions
            out = ask(model, caches, [encode(tok, msgs, q) for q in qs], a.chunk, a.max_tokens,
                      None if c.arm is None else [q.positions for q in qs])
            texts = [until_end(tok, ids) for ids in out.pop("answers")]
            out.update(answers=texts, correct=[judge(t, q) for t, q in zip(texts, qs, strict=True)],
                       retention=out.get("retention", []), seconds=time.perf_counter() - t0,
                       size=c.size)
            rec["arms"][c.label] = out
            bar.update(1, f"chat {chat.index}: {c.label} {sum(out['correct'])}/{len(texts)}")
        return rec

    def report(self, records: list, arms) -> tuple:
        summary = summarize(records, [c.label for c in arms])
        return summary, table(summary)

    def plot(self, result: dict, path) -> None:
        plot(result["summary"], path)


def add_arguments(parser: argparse.ArgumentParser, live: bool = True) -> None:
    """The options; ``live``: and those of ``--live`` (``--data chats`` only)."""
    add_flags(parser, [
        *standard(NAME, "model", "first", "seed", "n_sink", "chunk", "out", "stem", "quiet"),
        ("--split", "test", "the chats' split", ("tune", "test")),
        ("--arms", DEFAULT_ARMS, "comma-separated arm specs (morphkv.eval.arms; memory=f16: the "
         "bytes of a float16 cache of --budget tokens) and 'nofact'"),
        ("--budget", 128, "token count of the arms"),
        ("--chats", 14, "chats, three questions each"),
        ("--min-distance", 3.0, "statements at least this many budgets back"),
        ("--max-tokens", 6, "answer tokens"),
    ])
    if not live:
        return
    add_flags(parser.add_argument_group("live conversations (morphkv.eval.live)"), [
        ("--live", None, "run the chats live through morphkv serve + the openai client, or "
         "mlx_lm's chat loop after patch_model, replies generated", ("serve", "mlx_lm")),
        ("--live-arms", f"full=--method full;memory=--kv-memory {LIVE_MEM}", "';'-separated "
         "name=cache flags (a name ending ':nofact': the chats without their facts; flags "
         "'mlx_lm': mlx_lm's own cache with --live mlx_lm)"),
        ("--turns", 11, "user turns before the questions, facts in the first three"),
        ("--reply-tokens", 48, "tokens per live reply"),
        ("--answer-tokens", 12, "tokens per answer"),
        ("--verbose", False, "show the server's log"),
    ])


def run(args: argparse.Namespace) -> None:
    from .live import Live  # --live: the chats run live (morphkv.eval.live)

    run_evaluation((Live if args.live else Chats)(args))


class Said(Chats):
    """Names the model invented and facts the user said, one chat (``build_said_chat``)."""

    stem_of = "said_{split}_{budget}"

    def build(self, model, tok, index: int):
        a = self.args
        return build_said_chat(model, tok, a.split, index, a.seed, asks=getattr(a, "asks", None))

    def report(self, records: list, arms) -> tuple:
        return said_report(records, [c.label for c in arms])

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_arguments(parser, live=False)  # prefilled chats only
        parser.set_defaults(split="tune", chats=8, max_tokens=10,
                            arms=f"{FULL},nofact,recommended:memory=f16+pin")
        add_flags(parser, [("--asks", None, "the split of data/said.json the invention asks "
                            "come from (default: --split's)")])
