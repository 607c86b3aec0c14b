"""The memory ``morphkv serve`` states at start: one sequence's bound and the worst case of all
the server's caches for its concurrency and prompt-cache settings."""

from __future__ import annotations

from ..runtime.cache_flags import describe


def kv_bound(served):
    """(the caches' resolved config, bytes of one sequence's caches once the budget is
    reached, bytes of one more stored token): every layer stores (budget + 1) slots per KV
    head (one awaits reuse) plus its selection state at most, block eviction's pending
    queries included (``morphkv.core.memory.bound_bytes``: probe caches of the model's real
    layer shapes run past the budget and through an eviction block; what ``--kv-memory``
    resolves with). The bounds are None for method='full' and mlx_lm's default cache."""
    import mlx.core as mx

    from ..core import quant

    caches = served.model.make_cache()
    served.model(mx.array([[0]]), cache=caches)
    config = getattr(caches[0], "config", None)
    if config is None or config.method == "full":
        return config, None, None
    ours = [c for c in caches if hasattr(c, "nbytes_bound")]
    per_token = sum(c.storage_nbytes // quant.dims(c.keys)[2] for c in ours)
    from ..core.memory import bound_bytes
    from ..mlxlm.memory import layer_shapes

    return config, bound_bytes(config, layer_shapes(served.model)), per_token


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
    return f"morphkv serve: {served.path}; KV cache {setting}; KV memory bound {memory}"


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
