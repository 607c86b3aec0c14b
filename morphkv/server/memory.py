"""The memory ``morphkv serve`` states at start: one sequence's bound and the worst case of all
the server's caches for its concurrency and prompt-cache settings."""

from __future__ import annotations

from ..core.config import VOTES
from ..core.rules import PIN_SPAN
from ..runtime.cache_flags import describe


def kv_bound(served):
    """(the caches' resolved config, bytes of one sequence's caches over ALL layers once the
    budget is reached, bytes of one more stored token in a prefill chunk): every morphkv layer
    stores (budget + 1) slots per KV head (one awaits reuse) plus its selection state at most,
    block eviction's pending queries included (``morphkv.core.memory.bound_bytes``: probe
    caches of the model's real layer shapes run past the budget and through an eviction
    block; what ``--kv-memory`` resolves with); the layers morphkv does not replace (Gemma 3's
    sliding-window layers) hold their window, or the budget with ``--bound-sliding``
    (``morphkv.mlxlm.memory.other_layers``). The bounds are None for method='full' and mlx_lm's
    default cache."""
    import mlx.core as mx

    from ..core import quant

    caches = served.model.make_cache()
    served.model(mx.array([[0]]), cache=caches)
    config = getattr(caches[0], "config", None)
    if config is None:
        config = next((c.config for c in caches if hasattr(c, "nbytes_bound")), None)
    if config is None or not config.rule.evicts:
        return config, None, None
    ours = [c for c in caches if hasattr(c, "nbytes_bound")]
    per_token = sum(c.storage_nbytes // quant.dims(c.keys)[2] for c in ours)
    parts = layer_parts(served.model, config)
    per_token += sum(len(o.layers) * o.per_token for o in parts[1] if o.window)
    return config, parts[0] + sum(b for _, b in parts[2]), per_token


def layer_parts(model, config):
    """(bytes of the morphkv layers, the other layers' groups, [(text, bytes) per group]):
    which layers hold how many bytes at most, for the start-up line."""
    from ..core.memory import bound_bytes
    from ..mlxlm.layout import _ranges
    from ..mlxlm.memory import bounds_sliding, layer_shapes, other_layers

    shapes = layer_shapes(model)
    morph = bound_bytes(config, shapes)
    others = other_layers(model)
    cut = config.budget if bounds_sliding(model) else None
    texts = []
    for o in others:
        if o.window:
            held = f"window {o.window}" if cut is None or cut >= o.window else (
                f"window {o.window} cut to the budget ({cut} newest tokens, --bound-sliding)")
            what = f"sliding-window layers, {held}"
        else:
            what = "fixed-size state"
        texts.append((f"{len(o.layers)} {what} (layers {_ranges(list(o.layers))}) "
                      f"{_fmt(o.nbytes(cut))}", o.nbytes(cut)))
    return morph, others, texts


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def startup_line(served, config, bound: int | None, per_token=None) -> str:
    if config is None:
        return f"morphkv serve: {served.path}; KV cache mlx_lm's default; KV memory unbounded"
    setting = f"{describe(config)} scoring={config.scoring}"
    memory = (
        "unbounded (method=full)"
        if bound is None
        else f"{_fmt(bound)} ({bound} bytes) per sequence"
    )
    if bound is not None and getattr(config, "kv_memory", None) is not None:
        memory += f" (--kv-memory {_fmt(config.kv_memory)}: {config.budget} tokens per KV head)"
    if bound is not None:
        morph, others, texts = layer_parts(served.model, config)
        if texts:
            n = sum(1 for c in served.model.make_cache() if hasattr(c, "nbytes_bound"))
            memory += (f": {n} morphkv layers {_fmt(morph)} + "
                       + " + ".join(t for t, _ in texts))
    return (f"morphkv serve: {served.path}; KV cache {setting}; {engine_and_pins(config)}; "
            f"KV memory bound {memory}")


def engine_and_pins(config) -> str:
    """Where selection runs in the server (every request runs in a batch:
    ``MorphKVCache.merge``), and what its caches pin."""
    one = config.scoring == "attention"  # ``DeviceBatchCache.accepts``
    engine = "engine mlx (batches too" + (")" if one else ", row by row)")
    repeats = (f", less runs of {config.pin_repeats} tokens an earlier prompt of the "
               "conversation held" if config.pin_repeats else "")
    pins = ("pinned: every prompt's tokens (system prompt and user turns as they arrive, with "
            f"their template tokens{repeats}; generated tokens are not)" if config.pin == "prompt"
            else "pinned: nothing (--pin prompt pins every prompt's tokens)")
    if config.pin == "prompt" and config.pin_rank in VOTES:
        from ..core.vote import per_layer

        pins += ("; past the budget each layer ranks its own (too small for one ranking)"
                 if per_layer(config) else
                 "; past the budget one ranking over all layers says which stay pinned"
                 + (f", each score pooled over {PIN_SPAN} neighbours"
                    if config.pin_rank == "vote-span" else ""))
    return f"{engine}; {pins}"


def worst_case(args, bound: int | None, per_token: int | None) -> tuple[int | None, str]:
    """(bytes, explanation): the most KV memory this server's caches can hold at once.
    Every admitted request holds at most one sequence's caches (a queued copy of its prompt
    cache entry, or its batch row); a row being prefilled holds one more chunk before it
    evicts; the prompt cache keeps at most --prompt-cache-size entries and
    --prompt-cache-bytes bytes."""
    if bound is None:
        return None, "unbounded (every sequence's cache grows with its tokens)"
    requests = args.max_requests * bound
    prefilling = min(args.prompt_concurrency, args.max_requests)
    chunks = prefilling * args.prefill_step_size * per_token
    kept = args.prompt_cache_size * bound
    if args.prompt_cache_bytes is not None:
        kept = min(kept, args.prompt_cache_bytes)
    total = requests + chunks + kept
    limit = "none" if args.prompt_cache_bytes is None else _fmt(args.prompt_cache_bytes)
    text = (
        f"{_fmt(total)} = {args.max_requests} requests (--max-requests) x {_fmt(bound)} + "
        f"prefill chunks {prefilling} x {args.prefill_step_size} tokens x {_fmt(per_token)} + "
        f"prompt cache {_fmt(kept)} ({args.prompt_cache_size} entries, --prompt-cache-bytes "
        f"{limit})"
    )
    return total, text
