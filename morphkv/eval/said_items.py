"""Chats where the model said the facts: it invents something early, and is asked many turns later.

A chat of ``chat_items`` (three user-said facts in turns 1-3, one updated, model-written
answers) with two more exchanges woven in after turns 1 and 2: the user asks the model to
invent something (``data/said.json``: a boat's name, a cafe's, ...), and the model's reply,
written greedily with the full cache during the run, is the value. At the end each value is
asked like the user's facts, in a new user turn; the judge wants the invented name's words in
order. The no-fact chat drops the user's fact clauses and both invention exchanges: what the
model answers then is a guess (a name it would invent anyway).

Tune and test share no kind, ask or question wording (and the user-said parts keep their own
split's questions, answers, templates and values).
"""

from __future__ import annotations

import functools
import json
import random
import re

from .chat_items import DATA, SUFFIX, Question, build_chat

INVENTIONS = 2  # exchanges woven in, after user turns 1 and 2
MODEL = "model:"  # a model-said question's kind starts so
REPLY_TOKENS = 16


@functools.cache
def kinds(split: str) -> tuple[dict, ...]:
    data = json.loads((DATA / "said.json").read_text())
    if split not in data:
        raise SystemExit(f"morphkv: error: data/said.json has no {split!r} split (yet)")
    return tuple(data[split])


def name_of(reply: str) -> str:
    """The invented name in a reply: its first line (the first quoted or bold part of it when
    there is one), quotes, markup, end punctuation and a leading article gone, at most six
    words (empty when nothing is left)."""
    line = next((ln for ln in reply.strip().splitlines() if ln.strip()), "")
    quoted = re.search(r"[\"\u201c*]+([^\"\u201d*\n]{2,60})(?:[\"\u201d*]+|$)", line)
    line = quoted.group(1) if quoted else line  # 'Your robot is "Echo"' -> Echo
    line = re.sub(r"^(name|suggestion|answer)\s*:\s*", "", line.strip(), flags=re.I)
    line = line.strip(" *\"'`.!").strip()
    line = re.sub(r"^(the|a|an)\s+", "", line, flags=re.I)  # "The Gull" is asked as "Gull"
    return " ".join(line.split()[:6])


def invent(model, tok, messages: list[dict]) -> str:
    """The full cache's greedy reply to the chat so far (its last turn is the user's ask)."""
    from mlx_lm.models.cache import make_prompt_cache

    from .asking import until_end
    from .models import greedy_tokens

    ids = list(tok.apply_chat_template(messages, add_generation_prompt=True))
    return until_end(tok, greedy_tokens(model, make_prompt_cache(model), ids, REPLY_TOKENS))


def build_said_chat(model, tok, split: str, index: int, seed: int = 0,
                    asks: str | None = None):
    """Chat ``index``: the user-said chat of ``split`` with the invention exchanges woven in
    (replies written now by ``model`` with the full cache), questions for all five facts;
    ``asks``: the split of ``data/said.json`` the invention asks come from (default ``split``)."""
    chat = build_chat(split, index, seed)
    rng = random.Random(f"said:{split}:{seed}:{index}")
    picks = rng.sample(list(kinds(asks or split)), INVENTIONS)
    messages, asked = [], []
    user_turn = 0
    for m in chat.messages:
        messages.append(m)
        if m["role"] == "assistant":
            user_turn += 1
            if user_turn <= INVENTIONS:
                k = picks[user_turn - 1]
                messages.append({"role": "user", "content": k["ask"]})
                reply = invent(model, tok, messages)
                messages.append({"role": "assistant", "content": reply})
                asked.append((k, name_of(reply)))
    chat.messages = messages
    for k, value in asked:
        if value:  # an empty reply asks nothing
            chat.questions.append(Question(MODEL + k["kind"], value, (), k["question"] + SUFFIX,
                                           k.get("lead", "")))
    return chat


def said_by(kind: str) -> str:
    return "model" if kind.startswith(MODEL) else "user"
