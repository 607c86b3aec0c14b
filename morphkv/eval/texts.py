"""Evaluation texts as token ids, no download needed: a registry of text kinds.

``prose``: Python's own reference documentation (``pydoc_data.topics``); ``conversation``: the
multi-topic conversations of ``data/texts.json`` in the model's chat template;
``continuation``: the model's own greedy continuation of a prompt (``build_texts``).
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).with_name("data") / "texts.json"
_DATA = json.loads(DATA.read_text())
CONVERSATIONS: list[list[dict]] = _DATA["conversations"]
GENERATION_PROMPTS: list[str] = _DATA["generation_prompts"]
CONTINUATION_PROMPT: str = _DATA["continuation_prompt"]
PROSE_TOPICS: tuple[str, ...] = tuple(_DATA["prose_topics"])
MORE_TOPICS: tuple[str, ...] = tuple(_DATA["more_topics"])
TEXTS = ("prose", "conversation", "continuation")


def prose_text(topics: tuple[str, ...] = PROSE_TOPICS) -> str:
    """The named ``pydoc_data.topics`` entries joined by blank lines (the design notes' text)."""
    from pydoc_data.topics import topics as table

    return "\n\n".join(table[t].strip() for t in topics if t in table)


def prose_documents(tokenizer, n_tokens: int, n_docs: int = 1) -> list[list[int]]:
    """``n_docs`` documents of ``n_tokens`` tokens each: the first is the design notes' text
    (``PROSE_TOPICS``), the next ones continue through ``MORE_TOPICS``."""
    ids = list(tokenizer.encode(prose_text(PROSE_TOPICS + MORE_TOPICS)))
    docs = [ids[i * n_tokens : (i + 1) * n_tokens] for i in range(n_docs)]
    return [d for d in docs if len(d) == n_tokens]


def chat_tokens(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """Token ids of a conversation in the model's chat template (ChatML if it has none)."""
    if getattr(tokenizer, "chat_template", None) is not None:
        try:
            ids = tokenizer.apply_chat_template(messages, tokenize=True,
                                                add_generation_prompt=add_generation_prompt)
            return list(ids["input_ids"] if isinstance(ids, dict) else ids)
        except Exception:  # noqa: BLE001 - fall back to ChatML below
            pass
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return list(tokenizer.encode(text + ("<|im_start|>assistant\n" if add_generation_prompt
                                         else "")))


def conversation_tokens(tokenizer, index: int = 0, cut: int = 0) -> list[int]:
    """Conversation ``index`` in the chat template: its first ``cut`` tokens (0: whole)."""
    ids = chat_tokens(tokenizer, CONVERSATIONS[index])
    return ids[:cut] if cut else ids


def chat_prompt(tokenizer, user: str) -> list[int]:
    """A single-turn prompt ending where the assistant's answer starts."""
    return chat_tokens(tokenizer, [{"role": "user", "content": user}], add_generation_prompt=True)


def greedy_continuation(model, prompt: list[int], n: int) -> list[int]:
    """prompt + n greedy tokens from the full cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    cache = [KVCache() for _ in model.layers]
    logits = model(mx.array([int(t) for t in prompt])[None], cache=cache)[0, -1]
    out = list(prompt)
    for _ in range(n):
        tok = int(mx.argmax(logits).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
    return out


def split_texts(tokenizer, model, split: str, prose_tokens=1024, continuation_tokens=600,
                conversation_tokens_max=0):
    """Texts for choosing settings (``tune``) and for reporting them (``heldout``), disjoint:
    tune = prose document 0, conversation 0, the continuation of ``CONTINUATION_PROMPT``;
    heldout = prose document 1, conversations 1 and 2, the continuation of another prompt.
    ``conversation_tokens_max``: cut each conversation to its first N tokens (0: whole)."""
    if split not in ("tune", "heldout"):
        raise ValueError(f"unknown split {split!r}; valid: tune, heldout")
    tune = split == "tune"
    out = {"prose": prose_documents(tokenizer, prose_tokens, 2)[0 if tune else 1]}
    out.update((f"conversation{i}", conversation_tokens(tokenizer, i, conversation_tokens_max))
               for i in ((0,) if tune else (1, 2)))
    prompt = CONTINUATION_PROMPT if tune else GENERATION_PROMPTS[1]
    out["continuation"] = greedy_continuation(model, chat_prompt(tokenizer, prompt),
                                              continuation_tokens)
    return out


def build_texts(tokenizer, kinds, model=None, prose_tokens=1100, prose_docs=1, conversations=1,
                conversation_max=0, continuation_tokens=1000) -> dict[str, list[int]]:
    """{text name: token ids} for the named kinds (``TEXTS``), each with its sizes
    (``conversation_max``: cut each conversation to its first N tokens, 0: whole)."""
    found: dict[str, list[int]] = {}
    for kind in kinds:
        if kind == "prose":
            docs = prose_documents(tokenizer, prose_tokens, prose_docs)
            found.update((f"prose{i}", doc) for i, doc in enumerate(docs))
        elif kind == "conversation":
            found.update((f"conversation{i}", conversation_tokens(tokenizer, i, conversation_max))
                         for i in range(min(conversations, len(CONVERSATIONS))))
        elif kind == "continuation":
            prompt = chat_prompt(tokenizer, CONTINUATION_PROMPT)
            found["continuation"] = greedy_continuation(model, prompt, continuation_tokens)
        else:
            raise ValueError(f"unknown text kind {kind!r}; valid: {sorted(TEXTS)}")
    return found
