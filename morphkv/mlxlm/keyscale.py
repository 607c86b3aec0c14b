"""Key smoothing for quantized storage: keys without outlier channels, attention unchanged.

A model whose key projection adds a bias (Qwen2 and Qwen2.5) makes a few key channels 12-23x
the median's (the bias's large entries). Stored at 8 bits in groups of 64, those channels set
the rounding step of every other channel of the row. Dividing each key channel by a constant
``s`` and multiplying the matching query channel by it leaves every logit ``q . k`` unchanged.
Channels a rotary pair mixes share one ``s``, so it commutes with RoPE. The stored keys then
have no outliers.

Here ``s`` is read off the weights, no data: each key channel's RMS is estimated as
``sqrt(b_c^2 + |W_c * g|^2)`` (bias, the key projection's row, the input norm's weight ``g``:
the input is RMS-normalised, so ``W_c . x`` has about that spread; it tracks each channel's
measured RMS on Qwen2.5-0.5B); per KV head, ``s`` is the larger estimate of each rotary pair
over the median pair's, at least 1, to the power ``ALPHA``: the outliers come most of the way
down to the median and no channel is scaled past it (a bias alone over-scales where it is
small next to ``W x``). It is folded into the query and key projections' weights once, so the
decode step does no extra work. Measured before it shipped: attention KL of 8-bit keys over
1,200 tokens on Qwen2.5-0.5B 0.060 -> 0.005 (``docs/figures/key_smooth_probe.py``).

``follow(model, config)`` smooths the model for a quantizing config (``kv_bits`` with
``kv_smooth``, the default), undoes it for a quantizing config with ``kv_smooth=False``, and
leaves it as it is for a float config (in float32, its logits are the same either way).
``restore(model)`` (``unpatch_model``) puts the original weights back. It acts only where the
layers' attention has float ``q_proj`` / ``k_proj`` (``nn.Linear``), a key bias, a RoPE, and
no query/key norm; anything else is left untouched. A prompt cache written with a smoothed
model holds smoothed keys, so it must be read back with the model smoothed the same way
(``patch_model`` with the same config does it).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

# s = (the pair's estimate over the median's) ** ALPHA: 0.75 of the way to the median, as
# SmoothQuant's migration strength; on the probe text (README + engine.md, Qwen2.5-0.5B) the
# attention KL of 8-bit keys was 0.0108 / 0.0051 / 0.0083 at 0.5 / 0.75 / 1 (0.060 unscaled)
ALPHA = 0.75
ORIGINAL = "_morphkv_key_scale"  # on the model: [(attn, s, q weight, q bias, k weight, k bias)]


def _attention(layer: Any) -> Any | None:
    attn = getattr(layer, "self_attn", None)
    if attn is None or any(hasattr(attn, n) for n in ("q_norm", "k_norm")):
        return None
    q, k = getattr(attn, "q_proj", None), getattr(attn, "k_proj", None)
    if type(q) is not nn.Linear or type(k) is not nn.Linear or "bias" not in k:
        return None
    rope = getattr(attn, "rope", None)
    if getattr(rope, "traditional", None) is None or not isinstance(getattr(rope, "dims", None),
                                                                    int):
        return None  # a RoPE whose pairing it cannot see: left as it is
    return attn


def channel_rms(attn: Any, norm: Any) -> mx.array:
    """(n_kv_heads * D,) float32: each key channel's RMS as the weights predict it,
    ``sqrt(b^2 + |W_c * g|^2)`` (``g``: the input norm's weight, 1 without one)."""
    w, b = attn.k_proj.weight.astype(mx.float32), attn.k_proj.bias.astype(mx.float32)
    g = getattr(norm, "weight", None)
    w = w if g is None or g.shape != (w.shape[1],) else w * g.astype(mx.float32)[None]
    return mx.sqrt(mx.sum(w * w, axis=1) + b * b)


def pair_scale(size: mx.array, heads: int, dims: int, traditional: bool) -> mx.array:
    """(heads, D) float32: per KV head, each channel's rotary pair's larger ``size`` over the
    median pair's, at least 1, to the power ``ALPHA`` (channels at or past ``dims`` are not
    rotated: their own)."""
    b = mx.abs(size.astype(mx.float32)).reshape(heads, -1)
    D, c = b.shape[1], mx.arange(b.shape[1])
    half = dims // 2
    partner = mx.where(c >= dims, c, (c ^ 1) if traditional else (c + half) % max(dims, 1))
    pair = mx.maximum(b, b[:, partner])
    median = mx.sort(pair, axis=1)[:, D // 2 : D // 2 + 1]
    return mx.maximum(pair / mx.maximum(median, 1e-6), 1.0) ** ALPHA


def _scale_rows(linear: nn.Linear, s: mx.array) -> None:
    """Multiply the output channels of ``linear`` by ``s`` (flat, one per output)."""
    linear.weight = linear.weight * s[:, None].astype(linear.weight.dtype)
    if "bias" in linear:
        linear.bias = linear.bias * s.astype(linear.bias.dtype)


def smooth(model: Any) -> int:
    """Fold the key scales into the model's projections (once); the layers smoothed."""
    if ORIGINAL in vars(model):
        return len(vars(model)[ORIGINAL])
    saved = []
    for layer in getattr(model, "layers", []):
        attn = _attention(layer)
        if attn is None:
            continue
        heads, qheads = attn.n_kv_heads, attn.n_heads
        size = channel_rms(attn, getattr(layer, "input_layernorm", None))
        s = pair_scale(size, heads, attn.rope.dims, attn.rope.traditional)
        q, k = attn.q_proj, attn.k_proj
        saved.append((attn, s, q.weight, q.get("bias"), k.weight, k.bias))
        _scale_rows(k, (1.0 / s).reshape(-1))
        _scale_rows(q, mx.repeat(s, qheads // heads, axis=0).reshape(-1))
    if saved:
        mx.eval([a for t in saved for a in (t[0].q_proj.parameters(), t[0].k_proj.parameters())])
        object.__setattr__(model, ORIGINAL, saved)  # not a child module: not a parameter
    return len(saved)


def applied(model: Any) -> list[mx.array]:
    """The (n_kv_heads, D) scales the model's smoothed layers divide their keys by."""
    return [t[1] for t in vars(model).get(ORIGINAL, [])]


def restore(model: Any) -> None:
    """Put the original projection weights back (nothing if the model is not smoothed)."""
    for attn, _, qw, qb, kw, kb in vars(model).pop(ORIGINAL, []):
        attn.q_proj.weight, attn.k_proj.weight, attn.k_proj.bias = qw, kw, kb
        if qb is not None:
            attn.q_proj.bias = qb


def follow(model: Any, config) -> None:
    """Smooth or restore ``model`` as ``config`` asks (a float config leaves it as it is)."""
    if config.kv_bits is None:
        return
    if config.kv_smooth:
        smooth(model)
    else:
        restore(model)
