"""Conversation-memory chats: model-written turns, several facts, one updated, asked later.

A chat is assembled from data files only: the user's questions with the answers a model wrote
to them with the full cache (``data/chat_answers_<split>.json``, by ``chat_answers``) and facts
(``data/chat_facts.json``). Three facts of three kinds are said in passing, each a clause
before a real question (turn 1: A; turn 2: B; turn 3: A updated, and C); more turns follow
until the latest statement lies ``min_distance`` tokens before the end, then one question per
fact (for A the current value). The no-fact version drops every fact clause: its answers are
guesses. Tune and test share no question, answer, template, wording or value.

``build_said_chat`` (``--data said``): two more exchanges after turns 1 and 2, where the user
asks the model to invent a name (``data/said.json``) and the reply, written greedily by the
full cache during the run, is the value asked at the end (its no-fact chat drops them too).
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from .models import greedy_tokens, until_end

DATA = Path(__file__).with_name("data")
SUFFIX = " Just the answer, please."


@functools.cache
def facts(split: str) -> tuple[dict, ...]:
    return tuple(json.loads((DATA / "chat_facts.json").read_text())[split])


@functools.cache
def answers(split: str) -> tuple[tuple[str, str], ...]:
    rec = json.loads((DATA / f"chat_answers_{split}.json").read_text())
    return tuple((a["question"], a["answer"]) for a in rec["answers"] if a["answer"].strip())


@dataclass
class Question:
    kind: str
    value: str  # the current value: the only correct answer
    wrong: tuple[str, ...]  # other values of the kind (the old one included)
    text: str
    lead: str = ""  # the answer turn's opening words (no value in them)
    positions: tuple[int, ...] = ()  # their positions in the prompt
    distance: int = 0  # tokens from the value's statement to the end of the prompt
    updated: bool = False


@dataclass
class Chat:
    index: int
    split: str
    messages: list[dict]  # without the question turn
    nofact: list[dict]  # the same chat without any fact clause
    questions: list[Question] = field(default_factory=list)


def build_chat(split: str, index: int, seed: int = 0) -> Chat:
    """Chat ``index`` of ``split`` (messages only; ``tokenize`` places the facts)."""
    rng = random.Random(f"chat:{split}:{seed}:{index}")
    pool = list(answers(split))
    rng.shuffle(pool)
    (ka, a_old, a_new, sa), (kb, b, _, sb), (kc, c, _, sc) = [
        (k, *rng.sample(k["values"], 2), rng.choice(k["statements"]))
        for k in rng.sample(list(facts(split)), 3)]
    clauses = [sa.format(v=a_old), sb.format(v=b),
               ka["update"].format(old=a_old, v=a_new) + " " + sc.format(v=c)]  # fmt: skip
    messages, nofact = [], []
    for i, (q, a) in enumerate(pool):
        clause = clauses[i] + " " if i < len(clauses) else ""
        messages += [{"role": "user", "content": clause + q}, {"role": "assistant", "content": a}]
        nofact += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    chat = Chat(index, split, messages, nofact)
    for k, v, upd in ((ka, a_new, True), (kb, b, False), (kc, c, False)):
        wrong = tuple(x for x in k["values"] if x != v)
        chat.questions.append(Question(k["kind"], v, wrong, k["question"] + SUFFIX,
                                       k.get("lead", ""), updated=upd))
    return chat


def encode(tok, messages: list[dict], question=None) -> list[int]:
    """The chat's ids; with ``question`` (a ``Question``) its user turn and the answer turn's
    lead-in follow."""
    if question is None:
        return list(tok.apply_chat_template(messages, add_generation_prompt=False))
    msgs = messages + [{"role": "user", "content": question.text}]
    ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True))
    return ids + (list(tok.encode(question.lead, add_special_tokens=False)) if question.lead
                  else [])


def value_spans(tok, ids: list[int], value: str) -> list[range]:
    """Every occurrence of the value's own token sequence (`` value``, else ``value``) in
    ``ids``: never a token that merely occurs inside the value (" in" for Berlin)."""
    for text in (" " + value, value):
        sub = list(tok.encode(text, add_special_tokens=False))
        n = len(sub)
        spans = [range(s, s + n) for s in range(len(ids) - n + 1) if n and ids[s : s + n] == sub]
        if spans:
            return spans
    return []


def tokenize(tok, chat: Chat, min_distance: int, max_turns: int = 12) -> list[int]:
    """Cut the chat to the fewest turns that put every statement ``min_distance`` tokens back
    (at least 4 turns); fill in each question's positions and distance; return the shared
    prefix ids (the chat without the question turn)."""
    for turns in range(4, max_turns + 1):
        msgs = chat.messages[: 2 * turns]
        ids = encode(tok, msgs)
        full = encode(tok, msgs, chat.questions[0])
        ok = True
        for q in chat.questions:
            spans = value_spans(tok, ids, q.value)  # where the value was last stated
            q.positions = pos = tuple(spans[-1]) if spans else ()
            q.distance = len(full) - pos[0] if pos else 0
            ok &= bool(pos) and q.distance >= min_distance
        if ok or 2 * turns >= len(chat.messages):
            break
    chat.messages = msgs
    chat.nofact = chat.nofact[: len(msgs)]
    return ids


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def judge(answer: str, q: Question) -> bool:
    """Strict: the current value's words appear in order, and no other value of its kind."""
    a = words(answer)

    def has(v: str) -> bool:
        w = words(v)
        return any(a[i : i + len(w)] == w for i in range(len(a) - len(w) + 1))

    return has(q.value) and not any(has(w) for w in q.wrong)


INVENTIONS = 2  # exchanges woven in, after user turns 1 and 2
MODEL = "model:"  # a model-said question's kind starts so
REPLY_TOKENS = 16
WHO = ("model", "echo", "user")  # who said an item (``said_by``), as the tables split them
HEADS = {"model": "model-said", "echo": "model-said echoing the ask", "user": "user-said"}


@functools.cache
def _said_data() -> dict:
    return json.loads((DATA / "said.json").read_text())


@functools.cache
def kinds(split: str) -> tuple[dict, ...]:
    data = _said_data()
    if split not in data:
        raise SystemExit(f"morphkv: error: data/said.json has no {split!r} split (yet)")
    return tuple(data[split])


def name_of(reply: str) -> str:
    """The invented name in a reply: its first line (the first quoted or bold part of it when
    there is one), quotes, markup, end punctuation and a leading article gone, at most six
    words (empty when nothing is left). A first line that only leads in ("Sure, here's a name
    for your shed:", ending with ":" or ",") gives way to the next."""
    lines = [ln for ln in reply.strip().splitlines() if ln.strip()]
    while len(lines) > 1 and lines[0].rstrip().endswith((":", ",")):
        lines = lines[1:]
    line = lines[0] if lines else ""
    quoted = re.search(r"[\"\u201c*]+([^\"\u201d*\n]{2,60})(?:[\"\u201d*]+|$)", line)
    line = quoted.group(1) if quoted else line  # 'Your robot is "Echo"' -> Echo
    line = re.sub(r"^(name|suggestion|answer)\s*:\s*", "", line.strip(), flags=re.I)
    line = line.strip(" *\"'`.!").strip()
    line = re.sub(r"^(the|a|an)\s+", "", line, flags=re.I)  # "The Gull" is asked as "Gull"
    return " ".join(line.split()[:6])


_NAMED = re.compile(r"\b(?:named|called|name was|name is)\s+[\"\u201c*]*([A-Z][\w'-]+)")


def story_name(reply: str) -> str:
    """The name a story gives its character: the capitalised word after its first "named",
    "called", "name was" or "name is" ("a young wizard named Elara." -> Elara; empty if none)."""
    m = _NAMED.search(reply)
    return m.group(1) if m else ""


def value_of(kind: dict, reply: str) -> str:
    """The value an invention ask's reply gives: a story's character name for an ask with a
    ``reply_tokens`` of its own (a story), else ``name_of``."""
    return story_name(reply) if "reply_tokens" in kind else name_of(reply)


def invent(model, tok, messages: list[dict], tokens: int = REPLY_TOKENS) -> str:
    """The full cache's greedy reply to the chat so far (its last turn is the user's ask), at
    most ``tokens`` long (an ask's ``reply_tokens``: a story that names its character)."""
    from mlx_lm.models.cache import make_prompt_cache

    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True))
    return until_end(tok, greedy_tokens(model, make_prompt_cache(model), ids, tokens))


def said_asks(split: str, index: int, seed: int = 0, asks: str | None = None) -> list[dict]:
    """Chat ``index``'s invention asks (``data/said.json``), after its user turns 1 and 2."""
    rng = random.Random(f"said:{split}:{seed}:{index}")
    return rng.sample(list(kinds(asks or split)), INVENTIONS)


def said_question(kind: dict, value: str) -> Question:
    """The question asking back the name the model invented for ``kind``'s ask."""
    return Question(MODEL + kind["kind"], value, (), kind["question"] + SUFFIX,
                    kind.get("lead", ""))


def build_said_chat(model, tok, split: str, index: int, seed: int = 0,
                    asks: str | None = None):
    """Chat ``index``: the user-said chat of ``split`` with the invention exchanges woven in
    (replies written now by ``model`` with the full cache), questions for all five facts;
    ``asks``: the split of ``data/said.json`` the invention asks come from (default ``split``)."""
    chat = build_chat(split, index, seed)
    picks = said_asks(split, index, seed, asks)
    messages, asked = [], []
    user_turn = 0
    for m in chat.messages:
        messages.append(m)
        if m["role"] == "assistant":
            user_turn += 1
            if user_turn <= INVENTIONS:
                k = picks[user_turn - 1]
                messages.append({"role": "user", "content": k["ask"]})
                reply = invent(model, tok, messages, k.get("reply_tokens", REPLY_TOKENS))
                messages.append({"role": "assistant", "content": reply})
                asked.append((k, value_of(k, reply)))
    chat.messages = messages
    chat.questions += asked_back(asked, chat.questions)
    return chat


def asked_back(asked: list[tuple[dict, str]], facts) -> list[Question]:
    """The questions for the names the model gave (``(kind, value)``): none for an empty
    reply, nor for a name given twice in the chat (two stories' "Jack", or a user's fact),
    which cannot tell what was remembered (round 18)."""
    given = [v.lower() for _, v in asked] + [q.value.lower() for q in facts]
    return [said_question(k, v) for k, v in asked if v and given.count(v.lower()) == 1]


def said_by(kind: str, value: str = "") -> str:
    """Who said a question's value: ``user``; ``model`` (a name the model invented); ``echo``
    (an invented name that only repeats the ask: ``echoes``)."""
    if not kind.startswith(MODEL):
        return "user"
    return "echo" if echoes(kind[len(MODEL):], value) else "model"


@functools.cache
def _asked_words(kind: str) -> frozenset:
    """The words of every ask and question of ``kind`` in ``data/said.json`` (all splits)."""
    return frozenset(w for ks in _said_data().values() if isinstance(ks, list) for k in ks
                     if k["kind"] == kind for w in words(k["ask"] + " " + k["question"]))


def echoes(kind: str, value: str) -> bool:
    """Does an invented name repeat a word (of 3 or more letters) of its ask or question? The
    0.5B model names a sourdough bakery "Sourdough Bakery", and asked back with no chat at
    all it says the same: such an item measures the question, not the memory of the reply.
    Words run together ("VolcanicIsland") are not split: such a name counts as made up."""
    return any(len(w) > 2 and w in _asked_words(kind) for w in words(value))
