"""Models for evaluations: the embedded or a named model, a tiny random-weight llama for tests,
greedy generation through mlx_lm's own loop, and asking a prefilled cache.

Asking (``ask``, how every recall evaluation reads a chat): the chat is prefilled ONCE per arm
(exact chunks: ``KVCacheBuilder.for_model`` attaches the attention hook), up to what all its
questions share; each question is then answered greedily from a copy of the cache
(``copy.deepcopy``). *Retention*: per layer, the fraction of the asked value's own tokens still
stored when the question arrives (mean over KV heads; morphkv's caches and mlx_lm's alike).
"""

from __future__ import annotations

import copy

import numpy as np

from ..mlxlm.turns import common_prefix

RANDOM_TINY = "random-tiny"  # a tiny random-weight llama built in-process (tests, no download)


def load_model(name: str | None):
    """(model, tokenizer or None): the embedded model by default, ``random-tiny`` for tests."""
    if name == RANDOM_TINY:
        return tiny_llama(), None
    from ..model import load

    return load(name)


def tiny_llama(seed: int = 0, head_dim: int | None = None):
    """A tiny random-weight mlx_lm llama (no download), for tests and smoke runs; head_dim
    defaults to 16 (64 lets MLX quantize it in groups of 32/64)."""
    import mlx.core as mx
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(seed)
    model = Model(ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                            intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=head_dim, rms_norm_eps=1e-5, vocab_size=256))
    mx.eval(model.parameters())
    return model


def greedy_tokens(model, caches, prompt, max_tokens: int, prefill_step_size: int = 2048,
                  penalty: float | None = None, ends=()) -> list[int]:
    """Greedy token ids from mlx_lm's own ``generate_step`` with the given caches (a
    repetition ``penalty`` when given), up to and with the first of ``ends``."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    out = []
    for token, _ in generate_step(mx.array(prompt), model, prompt_cache=caches,
                                  prefill_step_size=prefill_step_size, sampler=make_sampler(0.0),
                                  max_tokens=max_tokens, logits_processors=penalty and
                                  make_logits_processors(repetition_penalty=penalty)):
        out.append(int(token))
        if out[-1] in ends:
            break
    return out


def stored_positions(cache) -> np.ndarray:
    """(KV heads, n) absolute positions a layer's cache holds (morphkv or mlx_lm's caches)."""
    if hasattr(cache, "kept_positions"):
        return cache.kept_positions[0]
    offset = int(cache.offset)
    if hasattr(cache, "max_size") and offset > cache.max_size:  # RotatingKVCache
        keep = cache.keep
        kept = np.r_[np.arange(keep), np.arange(offset - cache.max_size + keep, offset)]
    else:
        kept = np.arange(offset)
    return kept[None, :]


def retention(caches, positions: tuple[int, ...]) -> list[float] | None:
    """Per layer: the fraction of ``positions`` stored, mean over KV heads."""
    if not positions:
        return None
    want = np.asarray(positions)
    return [float(np.isin(want, p).mean(axis=-1) if p.ndim == 1 else
                  np.mean([np.isin(want, row).mean() for row in p]))
            for p in map(stored_positions, caches)]


def prefill(model, caches, ids: list[int], chunk: int) -> None:
    import mlx.core as mx

    x = mx.array(ids)[None]
    for s in range(0, len(ids), chunk):
        mx.eval(model(x[:, s : s + chunk], cache=caches))


def ask(model, caches, prompts: list[list[int]], chunk: int, max_tokens: int = 0,
        positions=None) -> dict:
    """Prefill what the prompts share (all but the last token of a lone prompt), then per
    prompt: the retention of its ``positions`` (when given) and, with ``max_tokens``, the
    greedy answer's token ids from a copy of the caches. Bytes and tokens held."""
    n = (len(prompts[0]) - 1 if len(prompts) == 1 else
         min(common_prefix(prompts[0], p) for p in prompts[1:]))
    prefill(model, caches, prompts[0][:n], chunk)
    budgets = [c.config.budget for c in caches if hasattr(c, "config")]
    out = {"nbytes": int(sum(c.nbytes for c in caches)), "prefix": n,
           "tokens": max(budgets) if budgets else None}
    if positions is not None:
        out["retention"] = [retention(caches, p) for p in positions]
    if max_tokens:
        out["answers"] = [greedy_tokens(model, copy.deepcopy(caches), p[n:], max_tokens)
                          for p in prompts]
    return out


def until_end(tok, ids: list[int]) -> str:
    """The answer's text up to its first end token, stripped."""
    eos = set(getattr(tok, "eos_token_ids", None) or [tok.eos_token_id])
    return tok.decode(ids[: next((i for i, t in enumerate(ids) if t in eos), len(ids))]).strip()
