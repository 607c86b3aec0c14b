"""Recall items: a fact stated in a chat's first turn, distractor turns, then the question.

``build_item`` (``--set canned``): the user states a fact (a name, a number, a place, ...), the
assistant acknowledges it, unrelated turns follow (advice, science, stories, small talk: canned
replies without names, places or digits, so every arm reads the same chat), then the question,
the prompt ending in the answer's lead-in ("Your name is"). Word lists
(``data/recall_facts.json``) and a seed, no download; ``tune`` and ``test`` are disjoint.

``build_natural_item`` (``--set natural``; ``data/recall_natural.json``): two facts said in
passing, the assistant commenting on each; in the distractor turns the assistant answers with
two or three paragraphs of real prose (``tune``: Python's language reference; ``test``: the
standard library's docstrings; none naming a value of the chat's facts); a third fact comes in
the first distractor question ("By the way, ..."). The question about one of the three is
worded unlike its statement, with a short lead-in; the asked fact lies 3-6 budgets back.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path

from .chat_items import value_spans

SPLITS = ("tune", "test")


@dataclass(frozen=True)
class Fact:
    """One kind of fact: how it is said, acknowledged, asked for and answered."""

    kind: str
    values: tuple[str, ...]
    statement: str  # after "Please remember this: "
    ack: str  # after "I will remember it. "
    topic: str  # "Earlier I asked you to remember {topic}."
    question: str
    lead_in: str  # the start of the assistant's answer, ending the prompt

    def turns(self, value: str) -> tuple[str, str, str]:
        """(statement, acknowledgement, question) for ``value``."""
        return (
            "Please remember this: " + self.statement.format(v=value),
            "I will remember it. " + self.ack.format(v=value),
            f"Earlier I asked you to remember {self.topic}. {self.question}",
        )


_DATA = json.loads((Path(__file__).with_name("data") / "recall_facts.json").read_text())
FACTS = tuple(Fact(**{**f, "values": tuple(f["values"])}) for f in _DATA["facts"])
# Distractor turns by kind, with fixed replies; no names, places, digits or colours in them.
FILLERS = {k: tuple(tuple(t) for t in turns) for k, turns in _DATA["fillers"].items()}


@dataclass(frozen=True)
class Item:
    """One chat: ``ids`` is the whole prompt (ending in the answer's lead-in)."""

    index: int
    kind: str
    value: str
    ids: tuple[int, ...]
    fact_end: int  # tokens up to the end of the assistant's acknowledgement of the fact
    turns: int  # distractor question/answer pairs
    fact_positions: tuple[int, ...] = ()  # tokens of the value in the statement and the ack
    distractors: tuple[str, ...] = ()  # the kinds of the distractor turns, in order

    @property
    def distance(self) -> int:
        """Tokens between the end of the fact's acknowledgement and the end of the prompt."""
        return len(self.ids) - self.fact_end


def encode_chat(tok, messages: list[dict], tail: str | None) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=tail is not None)
    return list(tok.encode(text + (tail or ""), add_special_tokens=False))


def build_item(tok, seed: int, split: str, index: int, distance: int) -> Item:
    """Item ``index`` of ``split``: distractor turns are added until at least ``distance``
    tokens separate the fact's acknowledgement from the end of the prompt."""
    rng = random.Random(f"recall:{seed}:{split}:{index}")
    fact = FACTS[index % len(FACTS)] if split == "test" else rng.choice(FACTS)
    value = rng.choice(fact.values)
    statement, ack, ask = fact.turns(value)
    head = [{"role": "user", "content": statement}, {"role": "assistant", "content": ack}]
    head_ids = encode_chat(tok, head, None)
    fact_end, spots = len(head_ids), value_token_positions(tok, head_ids, value)
    question = [{"role": "user", "content": ask}]
    fillers: list[dict] = []
    kinds: list[str] = []
    deck: list[tuple[str, str, str]] = []
    while True:
        ids = encode_chat(tok, head + fillers + question, fact.lead_in)
        if len(ids) - fact_end >= distance:
            return Item(index, fact.kind, value, tuple(ids), fact_end, len(kinds), spots,
                        tuple(kinds))
        if not deck:
            deck = [(k, u, r) for k, turns in FILLERS.items() for u, r in turns]
            rng.shuffle(deck)
        kind, user, reply = deck.pop()
        kinds.append(kind)
        fillers += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]


def value_token_positions(tok, ids: list[int], value: str) -> tuple[int, ...]:
    """Positions of the value's own tokens, wherever its token sequence occurs (statement and
    acknowledgement); before issue 33 any 2-letter token inside the value counted too."""
    return tuple(p for span in value_spans(tok, ids, value) for p in span)


def words(text: str) -> list[str]:
    return "".join(c.lower() if c.isalnum() else " " for c in text).split()


def is_correct(answer: str, value: str) -> bool:
    """The fact's words appear, in order and adjacent, among the answer's words."""
    a, v = words(answer), words(value)
    return any(a[i : i + len(v)] == v for i in range(len(a) - len(v) + 1))


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


def build_natural_item(tok, seed: int, split: str, index: int, budget: int,
                       ratios: tuple[float, float] = (3.0, 6.0)) -> Item:
    """Item ``index`` of ``split``: the asked fact lies ``ratio x budget`` tokens before the
    end, ``ratio`` drawn in ``ratios``."""
    rng = random.Random(f"natural:{seed}:{split}:{index}")
    facts = [(k, v := rng.choice(k.values), rng.choice(k.statements).format(v=v))
             for k in rng.sample(KINDS, 3)]  # (kind, value, statement); one of them asked:
    asked = rng.randrange(3)
    distance = int(rng.uniform(*ratios) * budget)
    (ka, va, sa), (kb, vb, sb), (kc, vc, sc) = facts
    kind, value, _ = facts[asked]
    values = [w.lower() for _, v, _ in facts for w in v.split()]
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
        fact_turns = head if asked < 2 else head + turns[:2]
        fact_ids = encode_chat(tok, fact_turns, None)
        ids = encode_chat(tok, head + turns + question, kind.lead_in)
        if len(ids) - len(fact_ids) >= distance:
            spots = value_token_positions(tok, fact_ids, value)
            return Item(index, kind.name, value, tuple(ids), len(fact_ids), len(topics),
                        spots, tuple(topics))
    raise RuntimeError(f"distractor pool {split!r} too small for distance {distance}")
