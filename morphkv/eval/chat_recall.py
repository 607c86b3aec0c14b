"""``morphkv eval recall``: does a bounded cache remember what was said in a chat?

Chats of ``chat_items`` (three facts said in passing, one updated, asked at the end). Every arm
reads each chat as ``models.ask`` does (one prefill, each question from a copy, retention of the
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
import math
import re
import time

from ..core.pins import pin
from ..mlxlm.turns import user_positions
from .arms import Arm, cells
from .chat_items import HEADS, WHO, build_chat, build_said_chat, encode, judge, said_by, tokenize
from .metrics import cluster_interval
from .models import ask, until_end
from .plots import plt, save
from .runner import Evaluation, add_flags, markdown_table, standard
from .runner import run as run_evaluation

NAME = "chatrecall"
FULL = "kvcache"
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
        """Recall of the full cache's items per arm, with its 95% interval, against bytes held."""
        fig, ax = plt().subplots(figsize=(7.5, 4.5))
        for label, s in result["summary"].items():
            if not label.startswith("_") and s["of_full"]["n"]:
                r, (lo, hi) = s["of_full"]["rate"], s["of_full"]["ci95"]
                err = [[100 * max(0.0, r - lo)], [100 * max(0.0, hi - r)]]  # rounding: never < 0
                ax.errorbar([s["mib"]], [100 * r], yerr=err, marker="o", capsize=3, label=label)
        ax.set(xlabel="bytes held over all layers (MiB)", ylim=(-5, 105),
               ylabel="recall of the full cache's items (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, path, 120)


def add_arguments(parser: argparse.ArgumentParser, live: bool = True) -> None:
    """The options; ``live``: and those of ``--live``."""
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

    prefilled = Said if getattr(args, "data", "chats") == "said" else Chats
    run_evaluation((Live if args.live else prefilled)(args))


class Said(Chats):
    """Names the model invented and facts the user said, one chat (``build_said_chat``)."""

    stem_of = "said_{split}_{budget}"

    def build(self, model, tok, index: int):
        a = self.args
        return build_said_chat(model, tok, a.split, index, a.seed, asks=getattr(a, "asks", None))

    def report(self, records: list, arms) -> tuple:
        """``summarize`` and, as ``_said``, per arm and speaker the share of the full cache's items
        kept (``of_full``), with the questions asked of each speaker and how many the full cache
        answered (the same for every arm: the denominators); the table by speaker."""
        chats, labels = records, [c.label for c in arms]
        summary, who = summarize(chats, labels), WHO
        by = [said_by(q["kind"], q["value"]) for c in chats for q in c["questions"]]
        asked = {w: by.count(w) for w in who}
        full = {w: of_full(chats, FULL, w)["n"] for w in who}
        said = summary["_said"] = {label: {**{w: of_full(chats, label, w) for w in who},
                                           "asked": asked, "full_right": full} for label in labels}
        text = markdown_table(["arm", "MiB held", *(f"{HEADS[w]}: of the full cache's items"
                                                    for w in who)],
                              [[label, f"{summary[label]['mib']:.2f}",
                                *(_pct(said[label][w]) for w in who)] for label in labels])
        full = said.get(FULL, {}).get("full_right", {})
        text += (f"\n{len(chats)} chats; the full cache answered " + ", ".join(
            f"{full.get(w, 0)} of {asked[w]} {HEADS[w]}" for w in who) + " questions; "
            "intervals: 95% bootstrap over chats")
        return summary, text

    @staticmethod
    def run(args: argparse.Namespace) -> None:
        """``--live``: the chats run live, the arm's own replies the names asked back."""
        run(args)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_arguments(parser)
        parser.set_defaults(split="tune", chats=8, max_tokens=10,
                            arms=f"{FULL},nofact,recommended:memory=f16+pin")
        add_flags(parser, [("--asks", None, "the split of data/said.json the invention asks "
                            "come from (default: --split's)")])


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """95% Wilson score interval of a binomial proportion k/n (None for n = 0)."""
    if n == 0:
        return None
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _share(k: int, n: int) -> dict:
    ci = wilson(k, n)
    return {"k": k, "n": n, "rate": k / n if n else None, "ci95": ci}


def summarize(chats: list[dict], labels: list[str], full: str = FULL) -> dict:
    """Per arm: recall over all questions; recall over the questions the full cache (arm
    ``full``) answers (the share of the full cache's items kept); mean retention of the value's
    tokens, per layer (mean over questions) and in its worst layer; bytes
    and tokens held; answers split by updated / never-updated facts; ``fragment``: of the full
    cache's items, the wrong answers that begin with the value's first 3 letters ("Ansel" for
    Anselm, "852" for 8521): the start of the value was kept, its end was not."""
    out = {}
    full_ok = {(c["index"], i) for c in chats for i, ok in
               enumerate(c["arms"].get(full, {}).get("correct", [])) if ok}  # fmt: skip
    updated = {(c["index"], i) for c in chats for i, q in enumerate(c["questions"])
               if q["updated"]}
    full_kept = full_ok - updated
    for label in labels:
        runs = [(c, c["arms"][label]) for c in chats if label in c["arms"]]
        asked = {(c["index"], i) for c, r in runs for i in range(len(r["correct"]))}
        right = {(c["index"], i) for c, r in runs for i, ok in enumerate(r["correct"]) if ok}
        ret = [sum(x) / len(x) for _, r in runs for x in r["retention"] if x]
        per = [x for _, r in runs for x in r["retention"] if x]
        layers = [sum(col) / len(col) for col in zip(*per, strict=True)]
        out[label] = {
            "all": _share(len(right), len(asked)),
            "of_full": _share(len(right & full_ok), len(full_ok)),
            "of_full_kept": _share(len(right & full_kept), len(full_kept)),
            "of_full_updated": _share(len(right & full_ok & updated), len(full_ok & updated)),
            "updated": _share(len(right & updated), len(asked & updated)),
            "retention": sum(ret) / len(ret) if ret else None,
            "layers": layers, "worst_layer": min(layers, default=None),
            "mib": max((r["nbytes"] for _, r in runs), default=0) / 2**20,
            "tokens": max((r["tokens"] or 0 for _, r in runs), default=0) or None,
            "size": max((r.get("size", 0) for _, r in runs), default=0),
            "fragment": _share(sum(fragment(r["answers"][i], c["questions"][i]["value"])
                                   for c, r in runs for i, ok in enumerate(r["correct"])
                                   if not ok and (c["index"], i) in full_ok), len(full_ok)),
        }
    dist = [q["distance"] for c in chats for q in c["questions"]]
    out["_items"] = {"chats": len(chats), "questions": len(dist),
                     "distance_min": min(dist, default=0), "distance_max": max(dist, default=0)}
    return out


def of_full(chats: list[dict], label: str, who: str) -> dict:
    """Of the full cache's right answers to ``who``'s questions (``said_by``: model, echo,
    user), how many ``label`` gives, per chat (the bootstrap's clusters); for ``nofact``: its
    right answers to the same items."""
    hits = []
    for c in chats:
        full, arm = c["arms"].get(FULL), c["arms"].get(label)
        if full is None or arm is None:
            continue
        hits.append([arm["correct"][i] for i, q in enumerate(c["questions"])
                     if said_by(q["kind"], q["value"]) == who and full["correct"][i]])
    k, n = sum(map(sum, hits)), sum(map(len, hits))
    return {"k": int(k), "n": int(n), "chats": len(hits), "interval": cluster_interval(hits)}


def fragment(answer: str, value: str) -> bool:
    """The answer's first word begins with the value's first 3 letters (the caller passes wrong
    answers only, so it is not the value itself)."""
    first = re.findall(r"[a-z0-9]+", answer.lower())[:1]
    return len(value) >= 3 and bool(first) and first[0].startswith(value.lower()[:3])


def _pct(s: dict) -> str:
    """``k/n = share% [low, high]``: a ``_share`` (Wilson) or an ``of_full`` (bootstrap)."""
    if not s["n"]:
        return "-"
    share, lo, hi = s["interval"] if "interval" in s else (s["rate"], *s["ci95"])
    return f"{s['k']}/{s['n']} = {100 * share:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}]"


def table(summary: dict) -> str:
    """One row per arm, grouped by size (the full cache and no-fact rows first)."""
    headers = ["arm", "tokens", "MiB held", "recall (all questions)",
               "of the full cache's items", "of those: kept facts", "of those: updated facts",
               "value tokens kept", "a fragment of the value"]
    rows = []
    arms = [(label, s) for label, s in summary.items() if not label.startswith("_")]
    for label, s in sorted(arms, key=lambda a: (a[0].split("@")[0] not in (FULL, "full",
                                                                            "nofact"),
                                                  a[1].get("size", 0))):
        ret = "-" if s["retention"] is None else (f"{100 * s['retention']:.0f}% (worst layer "
                                                  f"{100 * s['worst_layer']:.0f}%)")
        rows.append([f"`{label}`", s["tokens"] or "all", f"{s['mib']:.2f}",
                     *[_pct(s[k]) for k in ("all", "of_full", "of_full_kept", "of_full_updated")],
                     ret, _pct(s["fragment"])])
    items = summary.get("_items", {})
    note = (f"\n({items.get('chats')} chats, {items.get('questions')} questions; statements "
            f"{items.get('distance_min')}-{items.get('distance_max')} tokens before the end; "
            "95% Wilson intervals)")
    return markdown_table(headers, rows) + note
