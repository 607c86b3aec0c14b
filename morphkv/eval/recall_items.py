"""Recall items: a fact stated in a chat's first turn, distractor turns, then the question.

Each item is a chat in the model's own template: the user states a fact (a name, a number, a
place, a password, a job, a pet's name, a colour), the assistant acknowledges it, unrelated
turns of several kinds follow (advice, science, step lists, short stories, small talk; canned
replies without names, places or digits, so every arm reads the same chat), then the user asks
for the fact and the prompt ends in the answer's lead-in ("Your name is"). Items come from word
lists and a seed (no download); ``tune`` and ``test`` draw disjoint items.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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


def _fact(kind, values, statement, ack, topic, question, lead_in) -> Fact:
    return Fact(kind, tuple(values), statement, ack, topic, question, lead_in)


FACTS = (
    _fact("name", ("Alice", "Oliver", "Sophia", "Lucas", "Emma", "Noah", "Mia", "Leo", "Clara",
                   "Hugo", "Ingrid", "Tobias", "Priya", "Mateo"),
          "my name is {v}.", "Your name is {v}.", "my name", "What is my name?", "Your name is"),
    _fact("number", (str(n) for n in range(12, 99)), "my lucky number is {v}.",
          "Your lucky number is {v}.", "my lucky number", "What is my lucky number?",
          "Your lucky number is"),
    _fact("place", ("Paris", "Tokyo", "Madrid", "Berlin", "Cairo", "Lima", "Oslo", "Rome",
                    "Dublin", "Vienna", "Lisbon", "Nairobi"),
          "I live in the city of {v}.", "You live in the city of {v}.", "my city",
          "Which city do I live in?", "You live in the city of"),
    _fact("password", ("maple-river", "stone-falcon", "copper-lake", "velvet-storm",
                       "amber-wolf", "silver-garden", "frozen-comet", "paper-tiger"),
          "my password is {v}.", "Your password is {v}.", "my password",
          "What is my password?", "Your password is"),
    _fact("job", ("baker", "nurse", "pilot", "dentist", "plumber", "librarian", "chef",
                  "farmer", "architect", "carpenter"),
          "I work as a {v}.", "You work as a {v}.", "my job", "What is my job?",
          "You work as a"),
    _fact("pet", ("Biscuit", "Pepper", "Shadow", "Ziggy", "Mango", "Rocky", "Luna", "Oscar"),
          "my dog's name is {v}.", "Your dog's name is {v}.", "my dog's name",
          "What is my dog's name?", "Your dog's name is"),
    _fact("colour", ("green", "purple", "orange", "yellow", "blue", "red", "pink", "brown"),
          "my favourite colour is {v}.", "Your favourite colour is {v}.",
          "my favourite colour", "What is my favourite colour?", "Your favourite colour is"),
)

# Distractor turns by kind, with fixed replies; no names, places, digits or colours in them.
FILLERS = {
    "advice": (
        ("How do I boil an egg?", "Put the egg in boiling water, then cool it in cold water."),
        ("What should I eat for breakfast?", "Oatmeal with fruit is a healthy breakfast."),
        ("How can I sleep better?", "Go to bed at the same time every night, avoid screens."),
        ("How do I stay focused?", "Work in short blocks of time and take small breaks."),
        ("How can I save money?", "Make a budget and set aside a small amount every week."),
        ("How do I write a good email?", "Keep it short, say what you need, and be polite."),
        ("How do I keep my desk tidy?", "Put things back after use and clear it every evening."),
    ),
    "science": (
        ("Why is the sea salty?", "Rivers carry minerals from rocks into the sea, and they stay."),
        ("How do plants grow?", "Plants use sunlight, water and air to make their own food."),
        ("How do bees make honey?", "Bees collect nectar from flowers and store it in the hive."),
        ("How do fish breathe?", "Fish take oxygen from the water through their gills."),
        ("What is rain?", "Rain is water that falls from clouds when drops get heavy."),
        ("Why do leaves fall in autumn?", "Trees stop feeding their leaves to save water."),
    ),
    "steps": (
        ("How do I plant a tree?", "First dig a wide hole. Then set the tree in it. Next fill "
         "the hole with soil. Finally water it well."),
        ("How do I make tea?", "First boil the water. Then warm the pot. Next add the leaves. "
         "Finally pour and wait a few minutes."),
        ("How do I wash a car?", "First rinse it. Then scrub it with soapy water. Next rinse "
         "the soap away. Finally dry it with a soft towel."),
        ("How do I pack for a trip?", "First make a list. Then lay out your clothes. Next roll "
         "them tightly. Finally add what you need for the journey."),
    ),
    "story": (
        ("Tell me a short story.", "A small fox found a lantern in the woods. Each night it "
         "carried the light to a lost traveller, and the woods grew kinder."),
        ("Tell me a story about the sea.", "An old boat waited at the harbour. One morning the "
         "wind returned, and the boat sailed out again, happy and free."),
        ("Tell me a story about a bird.", "A young sparrow was afraid to fly. Its friends sang "
         "to it every morning until, one day, it flew over the whole valley."),
    ),
    "small talk": (
        ("Thanks, that helps a lot.", "You are welcome. I am glad it was useful."),
        ("What a busy day it has been.", "It sounds tiring. A quiet evening may help you rest."),
        ("Do you like music?", "Many people find that music lifts their mood."),
        ("I am learning to paint.", "That is wonderful. Painting often is the best teacher."),
    ),
}


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


def _encode(tok, messages: list[dict], tail: str | None) -> list[int]:
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
    head_ids = _encode(tok, head, None)
    fact_end, spots = len(head_ids), tuple(_value_positions(tok, head_ids, value))
    question = [{"role": "user", "content": ask}]
    fillers: list[dict] = []
    kinds: list[str] = []
    deck: list[tuple[str, str, str]] = []
    while True:
        ids = _encode(tok, head + fillers + question, fact.lead_in)
        if len(ids) - fact_end >= distance:
            return Item(index, fact.kind, value, tuple(ids), fact_end, len(kinds), spots,
                        tuple(kinds))
        if not deck:
            deck = [(k, u, r) for k, turns in FILLERS.items() for u, r in turns]
            rng.shuffle(deck)
        kind, user, reply = deck.pop()
        kinds.append(kind)
        fillers += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]


def _value_positions(tok, ids: list[int], value: str):
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
