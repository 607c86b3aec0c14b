"""What the memory preset holds after a live chat (issue 41): which kinds of tokens fill it.

One test chat (default 81, already run live: nothing is chosen on it) through `mlx_lm.chat`'s
loop after `patch_model(model, recommended(memory=1.5 MiB))` (each turn templates only its new
message, so Qwen's template adds its system prompt every turn), 10 turns, 24-token greedy
replies. Then every held slot of every layer and KV head is labelled: the template's tokens
(system prompt, role markers), the user's words, the model's replies, and each fact value's
tokens, counted as kept only where every token of the value is held.

    python docs/figures/pin_kept_probe.py [chat]  ->  docs/figures/pin_kept_probe.json
    python docs/figures/pin_kept_probe.py 81 4  ->  docs/figures/pin_kept_probe_repeats4.json

    python docs/figures/pin_kept_probe.py 96 4 vote-span  ->  ..._repeats4_chat96_vote-span.json

The second argument turns ``pin_repeats`` on (round 14: a run of that many tokens heard in an
earlier prompt is not pinned). ``update_turn`` in the JSON: each token of the turn that updates a
fact (turn 3), the share of layer-heads holding it and whether it is pinned (round 14: a vote
keeps both city names and drops "moved from ... to"). The third sets ``pin_rank`` (round 15:
``vote-span``, the vote's scores pooled over neighbours).
"""

import json  # noqa: I001 (morphkv, which loads OpenBLAS, before MLX)
import sys

import morphkv  # noqa: F401 (OpenBLAS before MLX)
import numpy as np
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from morphkv import recommended
from morphkv.eval.chat_items import build_chat
from morphkv.eval.live import user_turns
from morphkv.eval.models import stored_positions
from morphkv.mlxlm.builder import patch_model
from morphkv.model import load

sys.path.insert(0, "docs/figures")  # from the checkout: python docs/figures/pin_kept_probe.py
from pin_scores_probe import value_positions  # noqa: E402

MEMORY = 1_572_864  # the float16 bytes of 128 tokens of Qwen2.5-0.5B


def find(ids, sub, start=0):
    for s in range(start, len(ids) - len(sub) + 1):
        if ids[s : s + len(sub)] == sub:
            return s
    return -1


def main(index=81, repeats=0, rank="vote"):
    out = "docs/figures/pin_kept_probe" + (f"_repeats{repeats}" if int(repeats) else "") + (
        f"_chat{index}" if int(index) != 81 else "") + (
        f"_{rank}" if rank != "vote" else "") + ".json"
    model, tok = load("qwen2.5-0.5b")
    patch_model(model, recommended(memory=MEMORY, pin_repeats=int(repeats), pin_rank=rank))
    chat, cache, ids, kind, starts = build_chat("test", int(index)), None, [], [], []
    cache = make_prompt_cache(model)
    for text in user_turns(chat, 10, False):
        starts.append(len(ids))
        prompt = list(tok.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True))
        words = tok.encode(text, add_special_tokens=False)
        at = find(prompt, words)
        kind += ["template"] * len(prompt)
        kind[len(ids) + at : len(ids) + at + len(words)] = ["user"] * len(words)
        ids += prompt
        for r in stream_generate(model, tok, prompt, max_tokens=24, sampler=make_sampler(0.0),
                                 prompt_cache=cache):
            ids.append(r.token)
            kind.append("reply")
    kind = np.array(kind)
    values = {q.value: value_positions(tok, ids, q.value) for q in chat.questions}
    counts, whole = {k: 0 for k in ("template", "user", "reply")}, dict.fromkeys(values, 0)
    cells, share = 0, np.zeros(len(ids))
    for c in cache:
        for row in stored_positions(c):
            row = row[row < len(ids)]
            cells += 1
            share[row] += 1
            for k in counts:
                counts[k] += int((kind[row] == k).sum())
            for v, pos in values.items():
                whole[v] += int(bool(pos) and np.isin(pos, row).all())
    held = sum(counts.values())
    result = {"chat": int(index), "pin_repeats": int(repeats), "tokens_seen": len(ids),
              "cells": cells,
              "held_per_cell": held / cells,
              "share": {k: n / held for k, n in counts.items()},
              "seen_share": {k: float((kind == k).mean()) for k in counts},
              "value_whole_in_cells": {v: n / cells for v, n in whole.items()},
              "update_turn": [[tok.decode([ids[p]]), round(share[p] / cells, 2),
                               bool(cache[0].pins.holds(p))] for p in range(starts[2], starts[3])]}
    print(json.dumps(result, indent=1))
    json.dump(result, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
