"""Generate text with a constant-size KV cache and report what the cache kept."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

DEFAULT_MAX_TOKENS = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .config import SCORINGS
    from .rules import METHODS

    parser.add_argument(
        "--prompt", "-p", default=None, help="Prompt text; read from stdin when absent or '-'."
    )
    parser.add_argument(
        "--model",
        default=None,
        help="A .gguf file (Llama family), an mlx_lm model path / Hugging Face repo, "
        "or nothing for the embedded SmolLM2-135M-Instruct.",
    )
    parser.add_argument("--method", default="morphkv", choices=sorted(METHODS))
    parser.add_argument(
        "--budget", type=int, default=512, help="Tokens kept per sequence and KV head."
    )
    parser.add_argument(
        "--window", type=int, default=8, help="Recent tokens protected / scoring queries."
    )
    parser.add_argument("--sinks", type=int, default=4, help="First tokens never evicted.")
    parser.add_argument("--fusion", default="mean", choices=["mean", "max"])
    parser.add_argument("--scoring", default="auto", choices=list(SCORINGS))
    parser.add_argument(
        "--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS, help="Tokens to generate."
    )
    parser.add_argument("--temp", type=float, default=0.0, help="Sampling temperature (0: greedy).")
    parser.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling threshold.")
    parser.add_argument("--top-k", type=int, default=0, help="Top-k sampling (0: off).")
    parser.add_argument("--min-p", type=float, default=0.0, help="Min-p sampling (0: off).")
    parser.add_argument("--seed", type=int, default=None, help="PRNG seed (sampling, 'random').")
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Wrap the prompt in the chat template (default: when the tokenizer has one).",
    )
    parser.add_argument(
        "--ignore-chat-template",
        dest="chat",
        action="store_false",
        help="Same as --no-chat (mlx_lm.generate's flag).",
    )
    parser.add_argument("--system-prompt", default=None, help="System message (chat mode).")
    parser.add_argument(
        "--prefill-step-size", type=int, default=2048, help="Prompt tokens per prefill chunk."
    )
    parser.add_argument("--no-stats", action="store_true", help="Do not print the stats block.")


@dataclass
class CacheStats:
    layers: int
    batch: int
    kv_heads: int
    tokens_seen: int  # per sequence and KV head
    tokens_kept: int  # per sequence and KV head (mean over layers)
    kept_bytes: int  # K+V bytes kept, summed over layers, batch and KV heads
    full_bytes: int  # K+V bytes a full cache would hold, same sum
    storage_bytes: int  # allocated K/V storage (nbytes), summed over layers

    @property
    def compression_ratio(self) -> float:
        return self.full_bytes / self.kept_bytes if self.kept_bytes else 1.0


def cache_stats(caches) -> CacheStats:
    """Totals over the per-layer caches (their counters are per sequence per KV head)."""
    kept_bytes = full_bytes = storage = kept_sum = 0
    seen = batch = heads = 0
    for c in caches:
        keys = getattr(c, "keys", None)
        b, h = (keys.shape[0], keys.shape[1]) if keys is not None else (0, 0)
        batch, heads = max(batch, b), max(heads, h)
        kept_bytes += c.morphkv_kept_bytes * b * h
        full_bytes += c.full_seq_bytes * b * h
        storage += c.nbytes
        kept_sum += c.tokens_kept
        seen = max(seen, c.tokens_seen)
    n = len(caches)
    return CacheStats(
        layers=n,
        batch=batch,
        kv_heads=heads,
        tokens_seen=seen,
        tokens_kept=round(kept_sum / n) if n else 0,
        kept_bytes=kept_bytes,
        full_bytes=full_bytes,
        storage_bytes=storage,
    )


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def format_stats(resp, stats: CacheStats, peak_gb: float, method: str, budget: int) -> str:
    lines = [
        "==========",
        f"Prompt:      {resp.prompt_tokens} tokens, {resp.prompt_tps:.3f} tokens-per-sec",
        f"Generation:  {resp.generation_tokens} tokens, {resp.generation_tps:.3f} tokens-per-sec",
        f"KV cache:    method={method} budget={budget if method != 'full' else 'none'} "
        f"({stats.layers} layers x batch {stats.batch} x {stats.kv_heads} KV heads)",
        f"Tokens:      seen {stats.tokens_seen}, kept {stats.tokens_kept} "
        "(per sequence per KV head)",
        f"KV bytes:    kept {_fmt_bytes(stats.kept_bytes)} vs full cache "
        f"{_fmt_bytes(stats.full_bytes)} (K+V, summed over layers, batch and KV heads)",
        f"Compression: {stats.compression_ratio:.2f}x",
        f"Peak memory: {peak_gb:.3f} GB",
    ]
    return "\n".join(lines)


def blas_status() -> str:
    """Whether MLX runs with the preloaded OpenBLAS (Linux CPU) in this process."""
    from .blas import find_blas, is_preloaded

    if not sys.platform.startswith("linux"):
        return "platform default"
    lib = find_blas()
    if lib is None:
        return "MLX default (no OpenBLAS found or preload disabled; see morphkv.blas)"
    return f"preloaded {lib}" if is_preloaded(lib) else f"not preloaded ({lib} available)"


def _read_prompt(args) -> str:
    if args.prompt is None or args.prompt == "-":
        if args.prompt is None and sys.stdin.isatty():
            print("morphkv: reading the prompt from stdin (end with Ctrl-D)", file=sys.stderr)
        return sys.stdin.read()
    return args.prompt.replace("\\n", "\n").replace("\\t", "\t")


def build_prompt(tokenizer, text: str, chat: bool | None, system_prompt: str | None = None):
    """Token ids for ``text``; chat template applied when ``chat`` (None: when available)."""
    use_chat = tokenizer.has_chat_template if chat is None else chat
    if use_chat:
        if not tokenizer.has_chat_template:
            raise SystemExit("morphkv: error: --chat given but the tokenizer has no chat template")
        messages = []
        if system_prompt:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": text})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return tokenizer.encode(text)


def run(args) -> int:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from .builder import KVCacheBuilder
    from .config import KVCacheConfig
    from .model import load

    config = KVCacheConfig(
        method=args.method,
        morphkv_budget=args.budget,
        morphkv_n_sink=args.sinks,
        morphkv_window=args.window,
        morphkv_fusion=args.fusion,
        scoring=args.scoring,
        seed=args.seed if args.seed is not None else 0,
    )
    try:
        config.validate()
    except ValueError as e:
        print(f"morphkv: error: {e}", file=sys.stderr)
        return 2
    if args.max_tokens == 0:
        print("morphkv: error: --max-tokens must be non-zero", file=sys.stderr)
        return 2

    text = _read_prompt(args)
    if args.seed is not None:
        mx.random.seed(args.seed)

    t0 = time.perf_counter()
    model, tokenizer = load(args.model)
    from .shard import shard_if_launched  # under mlx.launch: tensor-parallel, rank 0 prints

    shard_if_launched(model)
    load_s = time.perf_counter() - t0
    prompt = build_prompt(tokenizer, text, args.chat, args.system_prompt)
    if not prompt:
        print("morphkv: error: the prompt is empty", file=sys.stderr)
        return 2

    caches = KVCacheBuilder.for_model(model, config)
    sampler = make_sampler(args.temp, args.top_p, args.min_p, top_k=args.top_k)
    mx.reset_peak_memory()
    resp = None
    for resp in mlx_lm.stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=args.max_tokens,
        sampler=sampler,
        prompt_cache=caches,
        prefill_step_size=args.prefill_step_size,
    ):
        print(resp.text, end="", flush=True)
    print(flush=True)
    if resp is not None and not args.no_stats:
        stats = cache_stats(caches)
        peak = mx.get_peak_memory() / 1e9
        print(format_stats(resp, stats, peak, args.method, args.budget))
        print(f"Load:        {load_s:.2f} s")
        print(f"BLAS:        {blas_status()}")
    return 0
