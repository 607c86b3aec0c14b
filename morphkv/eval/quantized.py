"""Quantized storage at equal bytes: KL against the full cache for float, 8-bit and 4-bit
storage, each given the tokens that fit in the bytes of a float16 budget-128 cache.

On a float16 model with head_dim 64 and groups of 64, one K (or V) row costs 128 bytes as
float16, 68 at 8 bits, 36 at 4 bits: a float16 budget of 128 buys 241 tokens at 8 bits and 455
at 4. The embedded model runs float32 on the CPU, so float arms store float32 (float16 storage
changes nothing measurable) and the budgets are those of the float16 model. KL is averaged over
the SAME positions for every arm (from the first position a float16 budget-128 cache lacks a
token), so the arms compare on equal terms; mlx_lm's QuantizedKVCache (unbounded) is the
reference for quantization alone. The morphkv arm is ``morphkv:recent=0.5:value=true:attn``.
"""

from __future__ import annotations

import argparse

from mlx_lm.models.cache import QuantizedKVCache

from ..core.config import KVCacheConfig
from ..mlxlm.builder import KVCacheBuilder
from .flags import add_flags, standard
from .models import load_model
from .output import finish, markdown_table
from .plots import require_matplotlib
from .runner import position_kl, reference_logprobs
from .texts import conversation_tokens, prose_documents

NAME = "quantized"
ROW_F16 = {None: 128, 8: 68, 4: 36}  # bytes per K (or V) row on a float16 head_dim-64 model
ARMS = (  # method, bits; budgets scale with the bytes
    ("streaming_llm", None), ("streaming_llm", 8), ("streaming_llm", 4),
    ("morphkv", None), ("morphkv", 8), ("morphkv", 4), ("mlx_q", 8), ("mlx_q", 4),
)


def budget_at(bytes_budget: int, bits) -> int:
    """Tokens in the bytes of a float16 cache of ``bytes_budget`` tokens (nearest: 241 at 8
    bits for 128, 0.02% over)."""
    return round(bytes_budget * ROW_F16[None] / ROW_F16[bits])


def config(method: str, budget: int, bits) -> KVCacheConfig:
    extra = {}
    if method == "morphkv":
        extra = dict(morphkv_recent=budget // 2, morphkv_value=True, scoring="attention")
    return KVCacheConfig(method=method, morphkv_budget=budget, morphkv_n_sink=4, kv_bits=bits,
                         **extra)


def kl_of(model, tokens, ref, method, budget, bits, first) -> tuple[float, float, int]:
    """Mean KL(full || arm) and top-1 agreement over positions ``first``..end-2, and their
    count; mlx_q: mlx_lm's QuantizedKVCache, fed in chunks of 256 from the start."""
    if method == "mlx_q":
        caches = [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]
        prefill = 256
    else:
        caches, prefill = KVCacheBuilder.for_model(model, config(method, budget, bits)), first - 1
    kl, agree, total = position_kl(model, caches, tokens, ref, first, prefill, 256)
    n = max(kl.size, 1)
    return total / n, float(agree.sum()) / n, int(kl.size)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, [
        ("--bytes-budget", 128, "the float16 budget whose bytes every arm gets"),
        ("--prose-tokens", 1024, "tokens of the prose text"),
        *standard(NAME, "model", "out"),
        ("--quick", False, "tiny smoke run"),
    ])


def execute(args: argparse.Namespace, model=None, tokenizer=None) -> dict:
    require_matplotlib()
    if model is None:
        model, tokenizer = load_model(args.model)
    B = 16 if args.quick else args.bytes_budget
    texts = {"prose": prose_documents(tokenizer, 96 if args.quick else args.prose_tokens)[0]}
    if not args.quick:
        texts["conversation"] = conversation_tokens(tokenizer, 0)
    rows = []
    for text, tokens in texts.items():
        ref = reference_logprobs(model, tokens)
        for method, bits in ARMS:
            budget = None if method == "mlx_q" else budget_at(B, bits)
            kl, top1, n = kl_of(model, tokens, ref, method, budget, bits, B + 1)
            rows.append(dict(text=text, tokens=len(tokens), method=method, bits=bits,
                             budget=budget, kl=kl, top1=top1, positions=n))
            print(f"{text} {method} {bits or 'float'} x{budget or 'all'}: KL {kl:.4f}", flush=True)
    result = {"benchmark": NAME, "bytes_budget": B, "rows": rows}
    print("KL: mean KL(full || arm) over the same positions for every arm (lower is better)")
    headers = ["text", "method", "bits", "budget", "kl", "top1"]
    finish(args, NAME, result, f"{NAME}{'_quick' if args.quick else ''}",
           table=markdown_table(headers, [[r[h] if r[h] is not None else "-" for h in headers]
                                          for r in rows]))
    return result
