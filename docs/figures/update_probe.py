"""Probe (not a figure): after a live chat through mlx_lm's loop with the memory preset, where do
the updated fact's old and new values stand? For each value: its token positions in the stream,
whether they are pinned, and in how many (layer, KV head) cells each is still held.

    python docs/figures/update_probe.py --first 136 --chats 2
    python docs/figures/update_probe.py --first 144 --chats 2 --all  (round 20b's loop losses)

Prints one block per chat; nothing is chosen from it (round 17b's losses, read once)."""

from __future__ import annotations  # noqa: I001 (morphkv, which loads OpenBLAS, before MLX)

import argparse

import morphkv  # noqa: F401
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from morphkv.eval.chat_items import build_chat, value_spans
from morphkv.eval.live import loop_turn, patch_with_flags, user_turns
from morphkv.model import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--first", type=int, default=136)
    ap.add_argument("--chats", type=int, default=2)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--all", action="store_true", help="every asked value, not only the update")
    a = ap.parse_args()
    model, tok = load("qwen2.5-0.5b")
    patch_with_flags(model, ["--kv-memory", "1572864"])
    for index in range(a.first, a.first + a.chats):
        chat = build_chat("test", index)
        cache, stream = make_prompt_cache(model), []
        for text in user_turns(chat, a.turns, False):
            prompt, replies = loop_turn(model, tok, cache, text, 24)
            stream += list(prompt)
            stream += [r.token for r in replies]
            stream.pop()  # the last generated token is not fed
        q = next(q for q in chat.questions if q.updated)
        said = " ".join(m["content"] for m in chat.messages if m["role"] == "user")
        print(f"chat {index}: seen {len(stream)}, kept {cache[0].tokens_kept}; pinned "
              f"{len(cache[0].pins.positions())} positions")
        held = [np.asarray(c.kept_positions) for c in cache]  # (B, H, n) per layer
        cells = sum(h.shape[1] for h in held)
        pinned = set(cache[0].pins.positions().tolist())
        asked = [x.value for x in chat.questions] if a.all else [q.value]
        for value in sorted({*asked, *[w for w in q.wrong if w in said]}):
            for span in value_spans(tok, stream, value):
                s, e = span.start, span.stop
                whole = sum(bool(np.isin(span, h[0, k]).all())
                            for h in held for k in range(h.shape[1]))
                label = "NEW" if value == q.value else "asked" if value in asked else "old"
                print(f"  {label} {value!r} at {s}-{e}: pinned "
                      f"{all(p in pinned for p in span)}, whole in {whole} of {cells} "
                      "cells")
        first = value_spans(tok, stream, q.value)[0].start  # the update sentence around it
        window = range(max(0, first - 14), min(len(stream), first + 6))
        cells_of = [sum(int(np.isin(p, h[0, k])) for h in held for k in range(h.shape[1]))
                    for p in window]
        shown = [f"{tok.decode([stream[p]])!r}:{n}" for p, n in zip(window, cells_of, strict=True)]
        print("  around the new value (token: cells holding it):", " ".join(shown))


if __name__ == "__main__":
    main()
