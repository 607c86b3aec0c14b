"""Serve a model over mlx_lm's OpenAI-compatible HTTP API with a constant-size KV cache.

This is mlx_lm's own server (``mlx_lm.server``: its HTTP handler, continuous batching through
``BatchGenerator``, prompt cache) with morphkv caches installed on the model it loads
(``morphkv.patch_model``), so every sequence's KV memory is bounded by the budget. Concurrent
requests are batched (``MorphKVCache.merge``, see ``morphkv.core.batch``). In front of mlx_lm's
handler: request checks, ``/v1/models``, quiet disconnects (``morphkv.server.handler``); the
serving loop keeps the prompt cache to its byte limit and shuts down cleanly
(``morphkv.server.run``). See docs/serving.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runtime.cache_flags import add_cache_flags, config_from_flags
from .memory import kv_bound, startup_line, worst_case

# mlx_lm.server reads these too; morphkv serve keeps them fixed at mlx_lm's defaults: adapters
# and draft models (a draft model turns batching off), --kv-bits (quantized caches turn batching
# off and do not combine with a morphkv cache), --pipeline (distributed runs).
_FIXED = dict(
    adapter_path=None,
    draft_model=None,
    num_draft_tokens=3,
    kv_bits=None,
    kv_group_size=64,
    pipeline=False,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mlx_lm.utils import _parse_size

    a = parser.add_argument
    a(
        "--model",
        default=None,
        help="A .gguf file (llama, qwen2, qwen3, gemma3), gemma3-270m (Gemma 3 270M base, "
        "chat as a plain-text transcript), an mlx_lm model path / Hugging Face repo, or "
        "nothing for the embedded SmolLM2-135M-Instruct.",
    )
    a("--host", default="127.0.0.1", help="Address to listen on (default: 127.0.0.1).")
    a("--port", type=int, default=8080, help="Port (default: 8080).")
    a("--allowed-origins", type=lambda x: x.split(","), default="*", help="CORS origins.")
    a("--trust-remote-code", action="store_true", help="Trust remote code (tokenizer).")
    a("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    a("--chat-template", default="", help="A chat template for the tokenizer.")
    a("--use-default-chat-template", action="store_true", help="Use the default chat template.")
    a(
        "--chat-template-args",
        type=json.loads,
        default="{}",
        help="JSON arguments for apply_chat_template, e.g. '{\"enable_thinking\":false}'.",
    )
    a("--temp", type=float, default=0.0, help="Default sampling temperature.")
    a("--top-p", type=float, default=1.0, help="Default nucleus sampling top-p.")
    a("--top-k", type=int, default=0, help="Default top-k (0: off).")
    a("--min-p", type=float, default=0.0, help="Default min-p (0: off).")
    a("--max-tokens", type=int, default=512, help="Default tokens to generate per request.")
    a("--decode-concurrency", type=int, default=32, help="Requests decoded in one batch.")
    a("--prompt-concurrency", type=int, default=8, help="Prompts prefilled in one batch.")
    a("--prefill-step-size", type=int, default=256,
      help="Prompt tokens per prefill piece (default: 256; mlx_lm's: 2048): a long prompt is "
      "prefilled in pieces, interleaved with other requests' prefill and decoding.")
    a("--batching", choices=["fair", "mlx_lm"], default="fair",
      help="fair (default): prompts grouped by length, long prompts prefilled in pieces, "
      "shortest first, prefill and decoding sharing the time; mlx_lm: mlx_lm's BatchGenerator "
      "(every prompt in a prefill batch padded to the longest). See docs/serving.md.")
    a("--prompt-cache-size", type=int, default=10, help="Most KV caches kept for reuse.")
    a(
        "--prompt-cache-bytes",
        type=_parse_size,
        default=None,
        help="Most bytes of KV caches kept for reuse (e.g. 500M, 2G).",
    )
    a("--max-requests", type=int, default=64,
      help="Most requests in flight (queued or generating); more get 503 (default: 64).")
    a("--max-request-tokens", type=int, default=16384,
      help="The most max_tokens a request may ask for; more get 400 (default: 16384).")
    a("--max-body-bytes", type=_parse_size, default="16M",
      help="Largest request body; larger get 413 (default: 16M).")
    a("--shutdown-grace", type=float, default=2.0,
      help="Seconds in-flight requests get to finish at SIGTERM / Ctrl-C (default: 2).")
    a("--bound-sliding", action="store_true",
      help="Cut sliding-window layers (Gemma 3: 15 of 18, window 512) to the budget's newest "
      "tokens too (default: they keep their window and --kv-memory counts their bytes; "
      "measured: cutting them costs ~10x the KL, docs/families.md).")
    add_cache_flags(parser, budget=512)
    a("--seed", type=int, default=0, help="Seed of the 'random' rule.")


@dataclass
class ServedModel:
    """The one model this server serves, loaded once, with morphkv caches installed."""

    model: Any
    tokenizer: Any
    config: dict  # the model's config (mlx_lm), {} for GGUF files
    path: str  # what mlx_lm's ModelProvider asks the loader for
    names: frozenset  # model names a request may use


def cache_config(args):
    return config_from_flags(args, seed=args.seed)


def load_served(args, config) -> ServedModel:
    """Load ``--model`` (or the embedded model) and install morphkv caches on it (``config``
    None: keep mlx_lm's default cache, for comparisons)."""
    from ..model import (
        DEFAULT_MODEL_NAME,
        load_gguf_model,
        resolve_default_gguf,
        resolve_embedded,
    )

    name = args.model
    tokenizer_config = {"trust_remote_code": args.trust_remote_code}
    if args.chat_template:
        tokenizer_config["chat_template"] = args.chat_template
    embedded = resolve_embedded(name) if name is not None else None
    if name is None or embedded is not None or str(name).lower().endswith(".gguf"):
        path = str(embedded or (Path(name).resolve() if name else resolve_default_gguf()))
        if not Path(path).is_file():
            raise FileNotFoundError(f"GGUF file not found: {name}")
        model, tokenizer = load_gguf_model(path)
        if args.chat_template:
            tokenizer.chat_template = args.chat_template
        model_config = {}
    else:
        from mlx_lm.utils import load

        path = str(name)
        model, tokenizer, model_config = load(
            path,
            tokenizer_config=tokenizer_config,
            return_config=True,
            trust_remote_code=args.trust_remote_code,
        )
    if config is not None:
        install_caches(model, config, getattr(args, "bound_sliding", False))
    model.make_cache()  # raises now for models morphkv cannot serve (sliding-window layers)
    names = {"default_model", path, DEFAULT_MODEL_NAME if name is None else str(name)}
    return ServedModel(model, tokenizer, model_config, path, frozenset(names))


def install_caches(model, config, bound_sliding: bool = False):
    """Install morphkv caches on ``model`` (``--kv-memory`` resolved over all its layers, a
    one-line error when too small); ``bound_sliding``: its sliding-window layers are cut to
    the budget too. Returns the resolved config."""
    from ..mlxlm.builder import patch_model
    from ..mlxlm.layout import install_cut_sliding
    from ..runtime.cache_flags import resolve_for_model

    if bound_sliding:
        model.morphkv_bound_sliding = True  # --kv-memory counts them cut to the budget
    config = resolve_for_model(model, config)
    patch_model(model, config)
    if bound_sliding and config.rule.evicts:
        install_cut_sliding(model, config.budget)
    return config


def _provider_class():
    import mlx_lm.server as server

    if not callable(getattr(server, "load", None)) or not hasattr(server.ModelProvider, "_load"):
        raise RuntimeError(
            "this mlx_lm version's server no longer loads models through mlx_lm.server.load "
            "and ModelProvider._load; morphkv serve supports mlx-lm 0.32"
        )

    class MorphKVModelProvider(server.ModelProvider):
        """mlx_lm's ModelProvider serving one preloaded, morphkv-patched model.

        The hook: ``ModelProvider._load`` calls the module-level name ``mlx_lm.server.load``
        (mlx_lm.utils.load's public signature) and then does everything else itself (chat
        template default, processor, the batchability check, bookkeeping). Rebinding that one
        name, only for the duration of ``_load``, keeps all of mlx_lm's logic, where
        overriding ``_load`` would copy it. ``load`` first refuses names of models this
        server does not serve, before mlx_lm drops the current model."""

        served: ServedModel

        def load(self, model_path, adapter_path=None, draft_model_path=None):
            if model_path not in self.served.names:
                raise ValueError(
                    f"model {model_path!r} is not served here; this server serves "
                    f"{self.served.path!r} (or use 'default_model')"
                )
            if adapter_path is not None or draft_model_path not in (None, "default_model"):
                raise ValueError("morphkv serve does not load adapters or draft models")
            return super().load(self.served.path, None, None)

        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            with _rebound(server, "load", self._loader):
                super()._load(model_path, adapter_path, draft_model_path)

        def _loader(self, path, *args, return_config=False, **kwargs):
            served = self.served
            if path != served.path:
                raise ValueError(f"model {path!r} is not served here")
            if return_config:
                return served.model, served.tokenizer, served.config
            return served.model, served.tokenizer

    return MorphKVModelProvider


@contextlib.contextmanager
def _rebound(module, name: str, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def server_args(args, served: ServedModel) -> argparse.Namespace:
    """The namespace mlx_lm.server's classes read (``cli_args``)."""
    values = {
        k: v
        for k, v in vars(args).items()
        if k not in {"method", "budget", "window", "sinks", "fusion", "scoring", "seed"}
    }
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

    values.update(_FIXED, quantized_kv_start=DEFAULT_QUANTIZED_KV_START, model=served.path)
    return argparse.Namespace(**values)


__all__ = ["add_arguments", "run", "serve", "load_served", "kv_bound", "startup_line",
           "worst_case", "server_args", "ServedModel"]


def run(args) -> int:
    try:
        config = cache_config(args)
    except ValueError as e:
        print(f"morphkv: error: {e}", file=sys.stderr)
        return 2
    for flag in ("max_tokens", "decode_concurrency", "prompt_concurrency", "prefill_step_size",
                 "max_requests", "max_request_tokens", "max_body_bytes", "prompt_cache_size"):
        if getattr(args, flag) < 1:
            print(f"morphkv: error: --{flag.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.max_tokens > args.max_request_tokens:
        print("morphkv: error: --max-tokens is above --max-request-tokens", file=sys.stderr)
        return 2
    if args.shutdown_grace < 0:
        print("morphkv: error: --shutdown-grace must be >= 0", file=sys.stderr)
        return 2
    return serve(args, config)


def _signals_while_loading() -> None:
    """Until the server listens: Ctrl-C exits 130, SIGTERM exits 0, at once (nothing is in
    flight), whatever the signals were inherited as (background jobs ignore SIGINT)."""
    import signal

    from ..runtime.program import _quiet_exit

    signal.signal(signal.SIGINT, _quiet_exit)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))


def serve(args, config) -> int:
    """Load the model, say the cache setting and bound, serve until SIGTERM (0) or Ctrl-C
    (130). ``config`` None serves mlx_lm's default cache (what the benchmarks compare with)."""
    from .guard import Limits
    from .run import run as run_server

    logging.basicConfig(
        level=getattr(logging, args.log_level), format="%(asctime)s - %(levelname)s - %(message)s"
    )
    _signals_while_loading()
    try:
        served = load_served(args, config)
    except (ValueError, FileNotFoundError) as e:
        print(f"morphkv: error: {e}", file=sys.stderr)
        return 2
    config, bound, per_token = kv_bound(served)
    print(startup_line(served, config, bound), flush=True)
    print(f"morphkv serve: worst-case KV memory of the caches: "
          f"{worst_case(args, bound, per_token)[1]}", flush=True)
    provider_class = _provider_class()
    provider_class.served = served
    provider = provider_class(server_args(args, served))
    shown = str(args.model) if args.model else DEFAULT_SHOWN
    limits = Limits(
        names=served.names | {shown},
        shown_name=shown,
        max_body_bytes=args.max_body_bytes,
        max_request_tokens=args.max_request_tokens,
        vocab_size=_vocab_size(served),
    )

    def listening():
        print(f"morphkv serve: listening on http://{args.host}:{args.port}/v1", flush=True)

    status = run_server(args.host, args.port, provider, limits, args.max_requests,
                        args.shutdown_grace, on_listening=listening,
                        fair=args.batching == "fair")
    # Everything is stopped and joined by now. Exit without running C++ static destructors:
    # MLX's worker threads can still be joinable then, and the process would abort
    # ("terminate called without an active exception", status -6) instead of exiting 0 / 130.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


DEFAULT_SHOWN = "smollm2-135m-instruct"  # the embedded model's name in /v1/models


def _vocab_size(served: ServedModel) -> int | None:
    size = getattr(getattr(served.model, "args", None), "vocab_size", None)
    return size if isinstance(size, int) else None
