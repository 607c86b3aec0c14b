"""Where a chat's user turns lie in its templated tokens: what a chat pins (``morphkv.pin``).

A chat template renders each message in order, so the tokens of ``messages[:i]`` are a prefix
of the tokens of ``messages`` (checked: a template that rewrites earlier turns is refused). A
user turn's positions are those its message adds: its role header, its text and its end marker.
The first turn starts after what the template puts before any message (a system prompt it adds
by itself, ``<bos>``): that is not the user's.
"""

from __future__ import annotations

import numpy as np


def _ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=False))


def _generated(tokenizer, message: dict) -> int:
    """How many tokens the model generates for ``message``'s text (no special tokens)."""
    return len(tokenizer.encode(str(message.get("content", "")), add_special_tokens=False))


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def user_positions(tokenizer, messages: list[dict], offset: int = 0,
                   replies: int = 0) -> np.ndarray:
    """Positions (int64, ascending) of every user turn's tokens in
    ``tokenizer.apply_chat_template(messages)``, plus ``offset`` (the tokens fed before);
    with ``replies`` > 0 also every assistant turn whose text is at most ``replies`` tokens (a
    short answer: a name, a number, a decision), counted as the cache's ``pin_replies`` counts a
    generated reply: its text's tokens, not the role markers the template adds around it."""
    full = _ids(tokenizer, messages)
    out, end = [], 0
    for i, m in enumerate(messages):
        if i == 0:  # what the template adds before the first message is not the user's
            other = _ids(tokenizer, [{**m, "content": "\u2014" + str(m.get("content", ""))}])
            start = common_prefix(_ids(tokenizer, messages[:1]), other)
        else:
            start = end
        head = _ids(tokenizer, messages[: i + 1])
        end = len(head)
        if head != full[:end]:
            raise ValueError(f"the chat template renders messages[:{i + 1}] differently inside "
                             "the whole chat: user turns cannot be located by prefix")
        if m.get("role") == "user" or (m.get("role") == "assistant" and replies
                                       and _generated(tokenizer, m) <= replies):
            out.append(np.arange(start, end))
    return np.concatenate(out) + offset if out else np.zeros(0, np.int64)
