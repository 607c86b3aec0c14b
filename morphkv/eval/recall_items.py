"""Recall items: a fact stated in a chat's first turn, distractor turns, then the question.

Each item is a chat in the model's own template: the user states a fact (a name, a number, a
place, a password, a job, a pet's name, a colour), the assistant acknowledges it, unrelated
turns of several kinds follow (advice, science, step lists, short stories, small talk; canned
replies without names, places or digits, so every arm reads the same chat), then the user asks
for the fact and the prompt ends in the answer's lead-in ("Your name is"). Items come from word
lists (``data/recall_facts.json``) and a seed (no download); ``tune`` and ``test`` draw disjoint
items.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

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
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {SPLITS}")
    rng = random.Random(f"recall:{seed}:{split}:{index}")
    fact = FACTS[index % len(FACTS)] if split == "test" else rng.choice(FACTS)
    value = rng.choice(fact.values)
    statement, ack, ask = fact.turns(value)
    head = [{"role": "user", "content": statement}, {"role": "assistant", "content": ack}]
    head_ids = encode_chat(tok, head, None)
    fact_end, spots = len(head_ids), tuple(value_token_positions(tok, head_ids, value))
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


def value_token_positions(tok, ids: list[int], value: str):
    """Positions of the value's own tokens, wherever its token sequence occurs (statement and
    acknowledgement); before issue 33 any 2-letter token inside the value counted too."""
    from .chat_items import value_spans

    for span in value_spans(tok, ids, value):
        yield from span


def words(text: str) -> list[str]:
    return "".join(c.lower() if c.isalnum() else " " for c in text).split()


def is_correct(answer: str, value: str) -> bool:
    """The fact's words appear, in order and adjacent, among the answer's words."""
    a, v = words(answer), words(value)
    return any(a[i : i + len(v)] == v for i in range(len(a) - len(v) + 1))
