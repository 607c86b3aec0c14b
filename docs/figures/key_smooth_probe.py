"""Probe (not a figure; issue 41, a lead for a later round): do Qwen's key outlier channels
set the rounding of 8-bit keys, and does dividing them out first fix it?

Each key rotary pair (c, c + D/2) is divided by a per-(layer, KV head) scale before rounding
and the query multiplied by it (q . k unchanged): the scale is the pair's largest magnitude
over the median pair's, at least 1, fitted on the first ``FIT`` tokens' keys ("first") or
read off the key projection's bias ("bias": a model constant, no data), or predicted from its
weights, bias and input norm (``keyscale.channel_rms``) to the power 0.5, 0.75 or 1
("weights^a"; the shipped rule is ``keyscale.ALPHA``).

    python docs/figures/key_smooth_probe.py attention   (attention KL per format, 1,200 tokens)
    python docs/figures/key_smooth_probe.py chat --first 143 --chats 6

``attention``: Qwen2.5-0.5B over README.md + docs/engine.md with the full cache; for the last
128 queries of every layer, the softmax KL of the logits with rounded keys to the exact ones.
``chat``: mlx_lm's chat loop (10 turns, 24-token replies) on live test chats with nothing
evicted, keys and values rounded as stored (8 bits, groups of 64, float16 scales) and kept as
floats ("fake quantization"), plain or smoothed ("first" on each layer's first update).
Writes docs/figures/key_smooth_probe_<mode>.json."""

from __future__ import annotations  # noqa: I001 (morphkv, which loads OpenBLAS, before MLX)

import argparse
import copy
import json
from pathlib import Path

import morphkv  # noqa: F401
import mlx.core as mx
import mlx_lm.models.qwen2 as qwen2
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from morphkv.eval import live
from morphkv.mlxlm import keyscale
from morphkv.model import load

FIT, REPO = 32, Path(__file__).resolve().parents[2]


def rounded(x: mx.array, group: int = 64) -> mx.array:
    w, s, b = mx.quantize(x, group_size=group, bits=8)
    half = [a.astype(mx.float16).astype(x.dtype) for a in (s, b)]  # float16 scales, as stored
    return mx.dequantize(w, *half, group_size=group, bits=8).astype(x.dtype)


def pair_scale(magnitude: mx.array) -> mx.array:
    """(..., D) per-channel magnitudes -> the rotary pair's max over the median pair's, >= 1."""
    h = magnitude.shape[-1] // 2
    pair = mx.maximum(magnitude[..., :h], magnitude[..., h:])
    med = mx.sort(pair, axis=-1)[..., h // 2 : h // 2 + 1]
    return mx.maximum(mx.concatenate([pair, pair], axis=-1) / med, 1.0)


def attention_kl(q, k, kq, scale, last: int = 128) -> float:
    rep = q.shape[1] // k.shape[1]
    k, kq, n = mx.repeat(k, rep, axis=1), mx.repeat(kq, rep, axis=1), k.shape[2]
    seen = mx.arange(n)[None] <= mx.arange(n - last, n)[:, None]

    def logp(keys):
        s = mx.where(seen, (q[:, :, -last:] @ keys.swapaxes(-1, -2)) * scale, -1e9)
        return s - mx.logsumexp(s, axis=-1, keepdims=True)

    p, r = logp(k), logp(kq)
    return float(mx.mean(mx.sum(mx.exp(p) * (p - r), axis=-1)))


def attention(model, tok) -> dict:
    text = (REPO / "README.md").read_text() + (REPO / "docs/engine.md").read_text()
    ids, seen, plain = tok.encode(text)[:1200], [], qwen2.scaled_dot_product_attention

    def record(q, k, v, cache=None, scale=1.0, mask=None, **kw):
        seen.append((q.astype(mx.float32), k.astype(mx.float32), scale))
        return plain(q, k, v, cache=cache, scale=scale, mask=mask, **kw)

    qwen2.scaled_dot_product_attention = record
    try:
        model(mx.array([ids]), cache=make_prompt_cache(model))
    finally:
        qwen2.scaled_dot_product_attention = plain
    out = {"g64": [], "g32": [], "first": [], "bias": [], "weights^0.5": [], "weights^0.75": [],
           "weights^1": []}
    for layer, (q, k, scale) in zip(model.model.layers, seen, strict=True):
        rep = q.shape[1] // k.shape[1]
        out["g64"].append(attention_kl(q, k, rounded(k), scale))
        out["g32"].append(attention_kl(q, k, rounded(k, 32), scale))
        bias = layer.self_attn.k_proj.bias.astype(mx.float32).reshape(1, k.shape[1], 1, -1)
        rms = keyscale.channel_rms(layer.self_attn, layer.input_layernorm)
        rms = pair_scale(rms.reshape(1, k.shape[1], 1, -1))
        for name, s in (("first", pair_scale(mx.max(mx.abs(k[:, :, :FIT]), axis=2,
                                                     keepdims=True))),
                        ("bias", pair_scale(mx.abs(bias) + 1e-3)),
                        *((f"weights^{a}", rms ** a) for a in (0.5, 0.75, 1))):
            out[name].append(attention_kl(q * mx.repeat(s, rep, axis=1), k / s,
                                          rounded(k / s), scale))
    for name, v in out.items():
        print(f"{name:6s} attention KL, mean over {len(v)} layers {np.mean(v):.2e}, "
              f"worst layer {np.max(v):.2e}")
    return {"tokens": len(ids), "kl_per_layer": out}


def chat(model, tok, first: int, chats: int) -> dict:
    args = argparse.Namespace(turns=10, reply_tokens=24, answer_tokens=24, seed=0, data="chats")
    items = [(c, False) for c in live.held_out_chats("test", first, chats, 0)]
    out = {}
    for smooth in (False, True):
        class Rounded(KVCache):
            smoothed = smooth

            def update_and_fetch(self, k, v):
                if self.smoothed:
                    if getattr(self, "s", None) is None:
                        self.s = pair_scale(mx.max(mx.abs(k), axis=2, keepdims=True))
                    k = rounded(k / self.s) * self.s
                else:
                    k = rounded(k)
                return super().update_and_fetch(k, rounded(v))

        def say(cache, text, n):
            return "".join(r.text for r in live.loop_turn(model, tok, cache, text, n)[1]), 0.0

        rows = live.talk(items, args, say, copy.deepcopy,
                         lambda: [Rounded() for _ in model.layers])  # noqa: B023 (called now)
        name = "smoothed" if smooth else "plain"
        out[name] = [{k: r[k] for k in ("chat", "values", "right", "answers")} for r in rows]
        for r in rows:
            print(name, r["chat"], list(zip(r["values"], r["right"], strict=True)), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("attention", "chat"))
    ap.add_argument("--first", type=int, default=143)
    ap.add_argument("--chats", type=int, default=6)
    a = ap.parse_args()
    model, tok = load("qwen2.5-0.5b")
    result = attention(model, tok) if a.mode == "attention" else chat(model, tok, a.first,
                                                                       a.chats)
    path = REPO / f"docs/figures/key_smooth_probe_{a.mode}.json"
    path.write_text(json.dumps({"args": vars(a), "result": result}, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
