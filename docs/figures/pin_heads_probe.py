"""Would one KeyDiff ranking shared by a layer's KV heads keep whole fact values more often
than each head's own? Tune chats 0-2, Qwen2.5-0.5B, teacher-forced, nothing evicted; a value
counts as kept in a (layer, head) when all its tokens rank in the top `keep` share of the
user-turn tokens (keep = 1/overflow).

    python docs/figures/pin_heads_probe.py  ->  docs/figures/pin_heads_probe.json
"""
import json, sys
sys.path.insert(0, "docs/figures")  # from the checkout: python docs/figures/pin_heads_probe.py
import morphkv  # noqa
import mlx.core as mx
import numpy as np
from morphkv import KVCacheBuilder, KVCacheConfig
from morphkv.eval.chat_items import build_chat
from morphkv.mlxlm.turns import user_positions
from morphkv.model import load
from pin_scores_probe import percentile, value_positions

model, tok = load("qwen2.5-0.5b")
out = []
for idx in range(3):
    chat = build_chat("tune", idx)
    ids = list(tok.apply_chat_template(chat.messages, add_generation_prompt=False))
    user = user_positions(tok, chat.messages)
    x = mx.array(ids)[None]
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="keydiff", morphkv_budget=4096))
    for s in range(0, len(ids), 256):
        model(x[:, s:s + 256], cache=caches)
        mx.eval([c.state for c in caches])
    layers = []
    for c in caches:
        e = c.engine
        sc = np.array(e.rule.score(e).astype(mx.float32))
        pos = np.array(e.positions[:, :e.slots])
        heads = []
        for r in range(sc.shape[0]):
            s = np.full(len(ids), np.nan); s[pos[r]] = sc[r]; heads.append(s[user])
        layers.append(np.array(heads))
    L = np.array(layers)  # (layers, heads, user tokens)
    where = {int(p): i for i, p in enumerate(user)}
    for q in chat.questions:
        vp = [where[p] for p in value_positions(tok, ids, q.value) if p in where]
        row = {"chat": idx, "value": q.value, "tokens": len(vp), "user_tokens": len(user)}
        for keep in (0.5, 0.4, 0.3):
            thr = 1 - keep
            own = np.array([[percentile(L[l, h])[vp].min() >= thr for h in range(L.shape[1])]
                            for l in range(L.shape[0])])
            shared = np.array([percentile(L[l].mean(0))[vp].min() >= thr for l in range(L.shape[0])])
            glob = percentile(L.reshape(-1, L.shape[-1]).mean(0))[vp].min() >= thr
            row[f"keep{keep}"] = {"own_heads": float(own.mean()), "shared_by_layer": float(shared.mean()),
                                  "one_ranking": bool(glob)}
        out.append(row); print(row, flush=True)
json.dump(out, open("docs/figures/pin_heads_probe.json", "w"), indent=1)
for keep in (0.5, 0.4, 0.3):
    k = f"keep{keep}"
    print(keep, {m: np.mean([r[k][m] for r in out]) for m in ("own_heads", "shared_by_layer", "one_ranking")})
