"""Natural-chat recall items: several facts in passing, long natural turns, a reworded question.

A chat opens with the user mentioning two facts about themselves in passing (kinds: pet, home
town, flat number, job, sibling, dish, instrument, birthday month; each said in one of several
ways); the assistant replies with a passing comment on each ("Lima must have been an
interesting place to grow up."), as people do; then come distractor turns in which the user asks
about a topic and the assistant answers with two or three paragraphs of real reference prose; a
third fact is dropped into the first distractor question ("By the way, ...") and commented on
at the start of the answer. The chat ends with a question about one of the three facts, worded
unlike its statement ("Which city did I grow up in?" for "my childhood was spent in Lima"), and
the prompt ends in a short lead-in ("You grew up in the city of"). The fact asked for lies 3-6 token
budgets before the end (drawn per item from the seed).

Kinds, templates and module names: ``data/recall_natural.json``.
Distractor pools (no download): ``tune`` items draw the assistant's answers from Python's
language reference (``pydoc_data.topics``), ``test`` items from the standard library's module
and class docstrings: different sources, and ``tune`` / ``test`` items are disjoint by seed.
Prose paragraphs only (code, tables and short lines are left out), and none naming a value of
the chat's facts.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path

from .recall_items import Item, encode_chat, value_token_positions

SPLITS = ("tune", "test")


@dataclass(frozen=True)
class Kind:
    name: str
    values: tuple[str, ...]
    statements: tuple[str, ...]  # each with {v}
    question: str
    lead_in: str
    ack: str = ""  # the assistant's passing comment, with {v}


_DATA = json.loads((Path(__file__).with_name("data") / "recall_natural.json").read_text())
KINDS = tuple(Kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
              for d in _DATA["kinds"])
OPENERS, REPLIES, ASKS = (tuple(_DATA[k]) for k in ("openers", "replies", "asks"))
ASIDE = _DATA["aside"]
STDLIB = tuple(_DATA["stdlib"])


def _prose(text: str) -> list[str]:
    """Prose paragraphs of ``text``: joined lines, no code, tables or headings."""
    out = []
    for para in text.split("\n\n"):
        lines = [x for x in para.splitlines() if x.strip()]
        code = (" ", "\t", ">>>", "*", "-", "=", "+", "|")
        if not lines or any(x.startswith(code) for x in lines):
            continue
        joined = " ".join(x.strip() for x in lines)
        letters = sum(c.isalpha() or c == " " for c in joined)
        if len(joined) >= 160 and letters >= 0.9 * len(joined) and joined[-1] in ".:)":
            out.append(joined)
    return out


@functools.lru_cache(maxsize=2)
def pool(split: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(topic, paragraphs) per source document of ``split``'s distractor pool."""
    docs = []
    if split == "tune":
        from pydoc_data.topics import topics

        for name in sorted(topics):
            docs.append((name.replace("-", " ") if name.isascii() else name, topics[name]))
    else:
        import importlib
        import inspect
        import warnings

        for name in STDLIB:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    module = importlib.import_module(name)
            except ImportError:
                continue
            parts = [inspect.getdoc(module) or ""]
            for _, obj in sorted(vars(module).items()):
                if inspect.isclass(obj) and getattr(obj, "__module__", "") == name:
                    parts.append(inspect.getdoc(obj) or "")
            docs.append((f"the {name} module", "\n\n".join(parts)))
    out = tuple((t, tuple(p)) for t, d in docs if len(p := _prose(d)) >= 2)
    if not out:
        raise RuntimeError(f"no distractor prose found for split {split!r}")
    return out


@dataclass(frozen=True)
class Chat:
    """The facts of one chat (kind, value, statement) and which one is asked."""

    facts: tuple[tuple[Kind, str, str], ...]
    asked: int


def _facts(rng: random.Random) -> Chat:
    kinds = rng.sample(KINDS, 3)
    facts = tuple((k, v := rng.choice(k.values), rng.choice(k.statements).format(v=v))
                  for k in kinds)
    return Chat(facts, rng.randrange(3))


def build_natural_item(tok, seed: int, split: str, index: int, budget: int,
                       ratios: tuple[float, float] = (3.0, 6.0)) -> Item:
    """Item ``index`` of ``split``: the asked fact lies ``ratio x budget`` tokens before the
    end, ``ratio`` drawn in ``ratios``."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {SPLITS}")
    rng = random.Random(f"natural:{seed}:{split}:{index}")
    chat = _facts(rng)
    distance = int(rng.uniform(*ratios) * budget)
    (ka, va, sa), (kb, vb, sb), (kc, vc, sc) = chat.facts
    kind, value, _ = chat.facts[chat.asked]
    values = [w.lower() for _, v, _ in chat.facts for w in v.split()]
    docs = list(pool(split))
    rng.shuffle(docs)
    head = [{"role": "user", "content": rng.choice(OPENERS).format(a=sa, b=sb)},
            {"role": "assistant", "content": rng.choice(REPLIES).format(
                a=ka.ack.format(v=va), b=kb.ack.format(v=vb))}]
    turns: list[dict] = []
    topics: list[str] = []
    question = [{"role": "user", "content": kind.question}]
    for topic, paras in docs:
        if any(v in p.lower() for p in paras for v in values):
            continue
        ask = rng.choice(ASKS).format(t=topic)
        if not turns:
            ask = ASIDE.format(c=sc) + ask
        start = rng.randrange(len(paras))
        reply = " ".join(paras[start : start + rng.randint(2, 3)])
        if not turns:
            reply = kc.ack.format(v=vc) + " " + reply
        turns += [{"role": "user", "content": ask}, {"role": "assistant", "content": reply}]
        topics.append(topic)
        fact_turns = head if chat.asked < 2 else head + turns[:2]
        fact_ids = encode_chat(tok, fact_turns, None)
        ids = encode_chat(tok, head + turns + question, kind.lead_in)
        if len(ids) - len(fact_ids) >= distance:
            spots = tuple(p for p in value_token_positions(tok, fact_ids, value))
            return Item(index, kind.name, value, tuple(ids), len(fact_ids), len(topics),
                        spots, tuple(topics))
    raise RuntimeError(f"distractor pool {split!r} too small for distance {distance}")
