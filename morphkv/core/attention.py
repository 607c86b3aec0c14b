"""One piece of attention on the device, computed once for the model's output and the rules.

For ``k`` new queries of one layer (B, n_heads, k, D) against the first ``n`` stored rows
(the piece's own tokens are the last ``k`` of them, query i sees the rows up to ``n - k + i``):
the float32 logits, a float32 softmax, the output ``P @ V`` (float32, returned in the
queries' dtype), and
from the same ``P`` the attention rows the rules read: summed over the query heads that share
a KV head, (B * n_kv_heads, k, n) float32. Plain or quantized storage (mlx_lm's quantized
matmuls, as its own quantized attention); an optional attention sink logit per query head
(gpt_oss) joins the softmax and is dropped afterwards. Everything stays lazy MLX.
"""

from __future__ import annotations

import mlx.core as mx

from .quant import dequantize
from .storage import fetch


def _causal(n: int, k: int) -> mx.array:
    """(k, n) bool: query i sees rows j <= n - k + i."""
    return mx.arange(n)[None, :] <= mx.arange(n - k, n)[:, None]


def _f32(x):
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def _keys_product(q, K, quant):
    if quant is None:
        return q @ _f32(K).swapaxes(-1, -2)
    return _f32(mx.quantized_matmul(q, *K, transpose=True, group_size=quant[0], bits=quant[1]))


def _values_product(probs, V, quant):
    if quant is None:
        return probs @ _f32(V)
    return mx.quantized_matmul(probs, *V, transpose=False, group_size=quant[0], bits=quant[1])


def attend(queries, keys, values, n: int, scale: float, sinks=None, quant=None, valid=None):
    """(output (B, n_heads, k, Dv), rows (B * H, k, n) float32) of ``queries`` (B, n_heads,
    k, D) over stored ``keys`` / ``values`` rows [0, n) (``quant``: (group_size, bits) of
    quantized storage; ``valid``: a (B, 1, 1, n) bool mask of the rows each batch row sees, for
    one query per row, or a (B, H, k, n) one of the rows each KV head's query i sees, in place
    of the causal mask: ``core.device_schedule``). ``keys`` / ``values`` may be lists of
    storages read one after the other (all their rows; ``n`` their total: no copy joins
    them). A KV group's G query heads x k queries are one (G * k, D) matrix, so the products
    need no broadcast copy of the keys."""
    B, n_heads, k, D = queries.shape
    sources = list(zip(keys, values, strict=True)) if isinstance(keys, list) else [
        (fetch(keys, n), fetch(values, n))]
    if quant is not None and k > 1:
        # many queries: dequantized once, then float products (on the CPU MLX's quantized
        # matmul is far slower for a chunk's queries); the same stored values
        sources = [tuple(dequantize(x, *quant, mx.float32) for x in src) for src in sources]
        quant = None
    first = sources[0][0]
    H = (first[0] if isinstance(first, tuple) else first).shape[1]
    G = n_heads // H
    q = (_f32(queries) * scale).reshape(B, H, G * k, D)
    parts = [_keys_product(q, K, quant) for K, _ in sources]
    logits = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    if valid is not None and valid.shape[2] == k > 1:  # per KV head and query
        valid = mx.tile(valid, (1, 1, G, 1))
    elif k > 1:
        logits = mx.where(mx.tile(_causal(n, k), (G, 1)), logits, -mx.inf)
    if valid is not None:
        logits = mx.where(valid, logits, -mx.inf)
    if sinks is not None:
        sink = _f32(sinks).reshape(1, H, G, 1, 1)
        sink = mx.broadcast_to(sink, (B, H, G, k, 1)).reshape(B, H, G * k, 1)
        probs = mx.softmax(mx.concatenate([logits, sink], axis=-1), axis=-1, precise=True)
        probs = probs[..., :n]
    else:
        probs = mx.softmax(logits, axis=-1, precise=True)
    out, at = None, 0
    for K, V in sources:
        width = (K[0] if isinstance(K, tuple) else K).shape[2]
        part = _values_product(probs if len(sources) == 1 else probs[..., at : at + width], V,
                               quant)
        out, at = part if out is None else out + part, at + width
    out = out.reshape(B, n_heads, k, out.shape[-1])
    out = out if out.dtype == queries.dtype else out.astype(queries.dtype)
    probs = probs.reshape(B, H, G, k, n)
    rows = probs.sum(axis=2) if G > 1 else probs[:, :, 0]
    return out, rows.reshape(B * H, k, n)


def self_rows(keys, n: int, k: int, scale: float) -> mx.array:
    """Proxy rows: the piece's own stored keys (the last k of the first n rows of float
    keys (R, N, D)) as queries, causal; (R, k, n) float32."""
    keys = keys[:, :n].astype(mx.float32)
    q = keys[:, n - k :] * scale
    logits = q @ keys.swapaxes(-1, -2)
    if k > 1:
        logits = mx.where(_causal(n, k), logits, -mx.inf)
    return mx.softmax(logits, axis=-1, precise=True)


def proxy_window(keys, positions, window: int, scale: float) -> mx.array:
    """(R, window, n) float32: the stored keys (R, n, D) of the newest ``window`` tokens as
    queries over every stored key (the proxy rule's window)."""
    keys = keys.astype(mx.float32)
    newest = mx.argsort(positions, axis=1)[:, -window:]
    q = mx.take_along_axis(keys, newest[..., None], axis=1) * scale
    logits = q @ keys.swapaxes(-1, -2)
    return mx.softmax(logits, axis=-1, precise=True)
