"""Probe (issue 41): would a content score keep the user's facts once pins overflow?

For tune chats 0-2 (``--data chats``, model-written replies, Qwen2.5-0.5B, teacher-forced,
nothing evicted), every user-turn token is scored four ways: the model's surprise at it (NLL of
the token, max-pooled over its neighbours), the largest attention it ever received (``peak``),
the attention it accumulated (``h2o``) and KeyDiff's key geometry (``keydiff``; what
``pin_rank`` uses). Per layer and KV head the user tokens are ranked; a fact value's
percentile (1 = kept first, 0 = evicted first; its tokens' mean) is averaged over layers and
heads. A score that knows the facts puts them near 1; chance is 0.5.

    python docs/figures/pin_scores_probe.py  ->  docs/figures/pin_scores_probe.json
"""

import json  # noqa: I001 (morphkv, which loads OpenBLAS, before MLX)
import sys

import morphkv  # noqa: F401 (OpenBLAS before MLX)
import mlx.core as mx
import numpy as np

from morphkv import KVCacheBuilder, KVCacheConfig
from morphkv.eval.chat_items import build_chat
from morphkv.mlxlm.turns import user_positions
from morphkv.model import load


def percentile(score: np.ndarray) -> np.ndarray:
    """1 for the highest of ``score``, 0 for the lowest."""
    return np.argsort(np.argsort(score)) / max(1, score.size - 1)


def value_positions(tok, ids, value):
    for pre in (" ", ""):
        vt = tok.encode(pre + value, add_special_tokens=False)
        for s in range(len(ids) - len(vt) + 1):
            if ids[s:s + len(vt)] == vt:
                return list(range(s, s + len(vt)))
    return []


def head_scores(model, x, user, method) -> np.ndarray:
    """(layers, KV heads, user tokens): ``method``'s score of each user-turn token, nothing
    evicted (teacher-forced in chunks of 256)."""
    n = x.shape[1]
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, morphkv_budget=4096))
    for s in range(0, n, 256):
        model(x[:, s:s + 256], cache=caches)
        mx.eval([c.state for c in caches])
    layers = []
    for c in caches:
        e = c.engine
        sc = np.array(e.rule.score(e).astype(mx.float32))
        pos = np.array(e.positions[:, :e.slots])
        heads = np.full((sc.shape[0], n), np.nan)
        for r in range(sc.shape[0]):
            heads[r, pos[r]] = sc[r]
        layers.append(heads[:, user])
    return np.array(layers)


def main(out="docs/figures/pin_scores_probe.json", chats=3):
    model, tok = load("qwen2.5-0.5b")
    rows = []
    for idx in range(chats):
        chat = build_chat("tune", idx)
        ids = list(tok.apply_chat_template(chat.messages, add_generation_prompt=False))
        user = user_positions(tok, chat.messages)
        x = mx.array(ids)[None]
        logits = model(x)[0].astype(mx.float32)
        nll = np.r_[0.0, np.array(mx.logsumexp(logits[:-1], axis=-1) - mx.take_along_axis(
            logits[:-1], x[0, 1:, None], axis=-1)[:, 0])]
        pooled = np.maximum(nll, np.maximum(np.r_[nll[1:], 0.0], np.r_[0.0, nll[:-1]]))
        share = {"surprise": percentile(pooled[user])[None]}
        for method in ("peak", "h2o", "keydiff"):
            scores = head_scores(model, x, user, method)
            share[method] = np.array([percentile(h) for h in scores.reshape(-1, len(user))])
        where = {int(p): i for i, p in enumerate(user)}
        for q in chat.questions:
            vp = [where[p] for p in value_positions(tok, ids, q.value) if p in where]
            rows.append({"chat": idx, "value": q.value, "tokens": len(vp), **{
                m: float(v[:, vp].mean()) if vp else None for m, v in share.items()}})
            print(rows[-1], flush=True)
    summary = {m: float(np.mean([r[m] for r in rows if r[m] is not None]))
               for m in ("surprise", "peak", "h2o", "keydiff")}
    print("mean percentile of the fact values (chance 0.5):", summary)
    json.dump({"rows": rows, "summary": summary, "chance": 0.5}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:2])
