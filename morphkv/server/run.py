"""The serving loop of ``morphkv serve``: mlx_lm's ResponseGenerator (continuous batching) behind
the guarded handler, a prompt cache that keeps to its byte limit, and a clean shutdown.

``mlx_lm.server.run`` is not used as such: it builds its prompt cache without the byte limit
(``--prompt-cache-bytes`` is applied only when a request joins a batch, so the caches of
finished requests pile up above it until the next one), and it does not hand its handler class
to the HTTP server. Everything else is mlx_lm's: ``ResponseGenerator``, ``LRUPromptCache``,
``BatchGenerator``.

Shutdown: SIGTERM or SIGINT (Ctrl-C) stops accepting connections; requests in flight get
``--shutdown-grace`` seconds to finish, then each ends at its next token with a proper last
chunk (the client sees the stream close, not a reset); the generation thread is stopped and
joined; the exit status is 0 (SIGTERM) or 130 (SIGINT). A second signal exits at once.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import socket
import sys
import threading

from ..runtime.program import INTERRUPTED
from .guard import Limits
from .handler import Lifecycle, Server, handler_for


def bounded_prompt_cache(max_size: int, max_bytes: int | None):
    """mlx_lm's LRUPromptCache whose byte count never exceeds ``max_bytes``, not even while a
    cache is added: room is made first, and a cache larger than the whole limit is not kept."""
    from mlx_lm.models.cache import LRUPromptCache

    class BoundedPromptCache(LRUPromptCache):
        def insert_cache(self, model, tokens, prompt_cache, *, cache_type="assistant"):
            n = sum(c.nbytes for c in prompt_cache)
            if self.max_bytes is not None:
                if n > self.max_bytes:
                    logging.info("prompt cache: a %d-byte cache is over the limit; not kept", n)
                    return
                self.trim_to(n_bytes=self.max_bytes - n)
            super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)

    if max_bytes is None:
        return BoundedPromptCache(max_size)
    return BoundedPromptCache(max_size, max_bytes)


def release_host_memory() -> None:
    """Called when the server has no request in flight: collect Python's cyclic garbage (a
    dropped client's exception keeps its frames, and the arrays they reference, until the
    cycle collector runs), then hand freed heap pages back to the system (glibc
    ``malloc_trim``; nothing elsewhere: glibc keeps the pages of freed host arrays)."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: the peak is what there is
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def stats_of(prompt_cache, limit_bytes: int | None):
    """``GET /morphkv/stats``: the process's memory and the prompt cache's bytes, now."""
    import mlx.core as mx

    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB

    def stats() -> dict:
        return {
            "rss_bytes": _rss_bytes(),
            "rss_peak_bytes": max(peak_kib, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
            * scale,
            "mlx_active_bytes": mx.get_active_memory(),
            "mlx_peak_bytes": mx.get_peak_memory(),
            "prompt_cache_bytes": prompt_cache.nbytes,
            "prompt_cache_sequences": len(prompt_cache),
            "prompt_cache_limit_bytes": limit_bytes,
        }

    return stats


def _bind(host: str, port: int, handler_class, generator):
    from mlx_lm.server import get_system_fingerprint

    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    fingerprint = get_system_fingerprint()
    server_class = type("MorphKVServer", (Server,), {"address_family": family})
    return server_class(
        address,
        lambda *a, **kw: handler_class(generator, *a, system_fingerprint=fingerprint, **kw),
    )


def run(host: str, port: int, provider, limits: Limits, max_requests: int, grace_s: float,
        on_listening=None, fair: bool = True) -> int:
    """Serve until SIGTERM (returns 0) or SIGINT (returns 130). ``fair``: batch with
    ``morphkv.server.fair.FairBatchGenerator`` instead of mlx_lm's BatchGenerator."""
    import mlx_lm.server

    from .fair import install

    undo = install(mlx_lm.server, fair)
    try:
        return _run(host, port, provider, limits, max_requests, grace_s, on_listening)
    finally:
        undo()


def _run(host, port, provider, limits, max_requests, grace_s, on_listening) -> int:
    import mlx.core as mx
    from mlx_lm.server import ResponseGenerator

    args = provider.cli_args
    prompt_cache = bounded_prompt_cache(args.prompt_cache_size, args.prompt_cache_bytes)
    generator = ResponseGenerator(provider, prompt_cache)
    if mx.distributed.init().rank() != 0:  # other ranks follow rank 0's generation
        generator.join()
        return 0
    life = Lifecycle(max_requests, on_idle=release_host_memory)
    handler = handler_for(limits, life, stats_of(prompt_cache, args.prompt_cache_bytes))
    try:
        httpd = _bind(host, port, handler, generator)
    except OSError as e:
        generator.stop_and_join()
        raise SystemExit(f"morphkv: error: cannot listen on {host}:{port}: {e.strerror}") from None
    status: list[int] = []

    def on_signal(signum, frame):
        if status:  # a second signal: at once
            os._exit(status[0])
        status.append(0 if signum == signal.SIGTERM else INTERRUPTED)
        print(f"morphkv serve: {signal.Signals(signum).name}: stopping (in-flight requests get "
              f"{grace_s:g} s)", file=sys.stderr, flush=True)
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    # installed whatever SIGINT was inherited as (a background job starts with it ignored)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if on_listening is not None:
        on_listening()
    try:
        httpd.serve_forever(poll_interval=0.2)
    finally:
        life.begin_stop(grace_s)
        httpd.server_close()  # new connections are refused from here
        if not life.wait_idle(grace_s + 10):
            logging.warning("%d requests still in flight at exit", life.in_flight)
        generator.stop_and_join()
    return status[0] if status else 0
