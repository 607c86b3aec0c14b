"""Would one KeyDiff ranking shared by a layer's KV heads keep whole fact values more often
than each head's own? Tune chats 0-2, Qwen2.5-0.5B, teacher-forced, nothing evicted; a value
counts as kept in a (layer, head) when all its tokens rank in the top `keep` share of the
user-turn tokens (keep = 1/overflow).

    python docs/figures/pin_heads_probe.py  ->  docs/figures/pin_heads_probe.json
"""
import json  # noqa: I001 (morphkv, which loads OpenBLAS, before MLX)
import sys

import morphkv  # noqa: F401
import mlx.core as mx
import numpy as np

from morphkv.eval.chat_items import build_chat
from morphkv.mlxlm.turns import user_positions
from morphkv.model import load

sys.path.insert(0, "docs/figures")  # from the checkout: python docs/figures/pin_heads_probe.py
from pin_scores_probe import head_scores, percentile, value_positions  # noqa: E402

model, tok = load("qwen2.5-0.5b")
out = []
for idx in range(3):
    chat = build_chat("tune", idx)
    ids = list(tok.apply_chat_template(chat.messages, add_generation_prompt=False))
    user = user_positions(tok, chat.messages)
    L = head_scores(model, mx.array(ids)[None], user, "keydiff")  # (layers, heads, user)
    where = {int(p): i for i, p in enumerate(user)}
    for q in chat.questions:
        vp = [where[p] for p in value_positions(tok, ids, q.value) if p in where]
        row = {"chat": idx, "value": q.value, "tokens": len(vp), "user_tokens": len(user)}
        for keep in (0.5, 0.4, 0.3):
            thr = 1 - keep
            own = [[percentile(h)[vp].min() >= thr for h in layer] for layer in L]
            shared = [percentile(layer.mean(0))[vp].min() >= thr for layer in L]
            one = percentile(L.reshape(-1, L.shape[-1]).mean(0))[vp].min() >= thr
            row[f"keep{keep}"] = {"own_heads": float(np.mean(own)),
                                  "shared_by_layer": float(np.mean(shared)),
                                  "one_ranking": bool(one)}
        out.append(row)
        print(row, flush=True)
json.dump(out, open("docs/figures/pin_heads_probe.json", "w"), indent=1)
for keep in (0.5, 0.4, 0.3):
    k = f"keep{keep}"
    print(keep, {m: np.mean([r[k][m] for r in out])
                 for m in ("own_heads", "shared_by_layer", "one_ranking")})
