"""The servers, options and threads every ``bench serve`` scenario shares.

A ``Server`` is one child process on loopback (``server_main``), stopped by its process id,
that samples its own memory (time, RSS, MLX active, MLX peak) into a log; its kind: ``morphkv``
(morphkv serve with morphkv caches), ``kvcache`` (morphkv serve with mlx_lm's default cache)
or ``mlx_lm`` (mlx_lm's own server, ``mlx_lm.server.run``, its own handler and default cache;
only the model loader is morphkv's, to read the GGUF file).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..eval.process import free_port, stop_process, wait_healthy


def server_main(argv: list[str]) -> int:
    """Child: ``<memory log> <morphkv|kvcache|mlx_lm> <seconds> [morphkv serve flags]``."""
    import mlx.core as mx

    from ..server import app as serve
    from ..server.run import _rss_bytes

    log_path, kind, every, *flags = argv
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(flags)
    def sample():
        with open(log_path, "a") as f:
            while True:
                f.write(f"{time.time():.3f} {_rss_bytes()} {mx.get_active_memory()} "
                        f"{mx.get_peak_memory()}\n")
                f.flush()
                time.sleep(float(every))

    threading.Thread(target=sample, daemon=True).start()
    if kind != "mlx_lm":
        return serve.serve(args, serve.cache_config(args) if kind == "morphkv" else None)
    import mlx_lm.server

    served = serve.load_served(args, None)  # mlx_lm's default cache
    print(serve.startup_line(served, None, None), flush=True)
    provider_class = serve._provider_class()
    provider_class.served = served
    mlx_lm.server.run(args.host, args.port, provider_class(serve.server_args(args, served)))
    return 0


class Server:
    """One server process on loopback (``server_main``), its files in ``out``
    (``memory_<kind>.log``, ``server_<kind>.txt``); its memory sampled every 0.25 s."""

    def __init__(self, kind: str, flags: list[str], out: Path):
        from ..runtime.blas import blas_env

        self.kind, self.port = kind, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log, self.output = out / f"memory_{kind}.log", out / f"server_{kind}.txt"
        self.log.unlink(missing_ok=True)
        flags = ["--port", str(self.port), "--log-level", "WARNING", *flags]
        code = ("import sys; from morphkv.bench.servers import server_main; "
                "sys.exit(server_main(sys.argv[1:]))")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(self.log), kind, "0.25", *flags],
            stdout=self.output.open("w"), stderr=subprocess.STDOUT,
            env=blas_env(dict(os.environ)))
        try:
            wait_healthy(self.proc, self.url, f"the {kind} server")
        except SystemExit as e:
            raise RuntimeError(f"{e}:\n{self.output.read_text()}") from None

    def health(self) -> int | None:
        """/health's status (None: no answer)."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def client(self, timeout: float):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=timeout,
                             max_retries=0)

    def prompt_cache_bytes(self) -> int | None:
        try:
            with urllib.request.urlopen(f"{self.url}/morphkv/stats", timeout=5) as r:
                return json.load(r)["prompt_cache_bytes"]
        except (OSError, ValueError, KeyError):
            return None

    def memory(self) -> list[tuple[float, int, int, int]]:
        """Every sample so far: (time, RSS, MLX active, MLX peak)."""
        rows = [x.split() for x in self.log.read_text().splitlines() if x.strip()]
        return [(float(t), int(r), int(a), int(p)) for t, r, a, p in rows if p]

    def startup(self) -> list[str]:
        return [x for x in self.output.read_text().splitlines() if x.startswith("morphkv serve:")]

    def stop(self) -> int | None:
        return stop_process(self.proc, 30)


def loadavg() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def in_threads(work, users, timeout: float | None) -> None:
    """``work(user)`` for every user, each in its own thread; waits (at most ``timeout`` s
    each) for all."""
    threads = [threading.Thread(target=work, args=(u,), daemon=True) for u in users]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)


def add_server_arguments(parser, max_tokens: int, out: str) -> None:
    """The options of every ``bench serve`` scenario that starts servers."""
    a = parser.add_argument
    a("--model", default=None, help="Model to serve (default: embedded).")
    a("--budget", type=int, default=64, help="morphkv budget (tokens).")
    a("--max-tokens", type=int, default=max_tokens, help="Tokens per reply.")
    a("--servers", default="morphkv,mlx_lm", help="morphkv, mlx_lm (its own server).")
    a("--cache-flags", default="", help="More morphkv serve flags, e.g. '--method full'.")
    a("--prompt-cache-bytes", default="32M", help="Both servers' --prompt-cache-bytes.")
    a("--out", default=out, help="Output directory.")
    a("--quick", action="store_true", help="A minutes-scale smoke run.")


def server_flags(kind: str, args) -> list[str]:
    """The flags both servers get; the morphkv one also ``--cache-flags``."""
    flags = ["--budget", str(args.budget), "--max-tokens", str(args.max_tokens),
             "--prompt-cache-bytes", args.prompt_cache_bytes,
             *(["--model", args.model] if args.model else [])]
    if kind == "morphkv":
        return flags + args.cache_flags.split()
    return flags + ["--prefill-step-size", "2048"]  # mlx_lm's server as it is: its own step


def each_server(args, name: str, bench, long_prompt: str, report, plot) -> dict:
    """``bench(kind, args, out, long_prompt)`` per server of ``--servers``, one after the other;
    ``<out>/<name>[_quick].json`` (``report(results)`` with the settings and load averages) and
    ``.png`` (``plot(results, path)``)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, loads = {}, [loadavg()]
    for kind in args.servers.split(","):
        print(f"{kind} server ...", flush=True)
        results[kind] = bench(kind, args, out, long_prompt)
        loads.append(loadavg())
    name += "_quick" if args.quick else ""
    settings = {k: v for k, v in vars(args).items() if not callable(v)}
    report = {"settings": settings, "load_average": loads, **report(results)}
    (out / f"{name}.json").write_text(json.dumps(report, indent=2, default=str))
    plot(results, out / f"{name}.png")
    print(f"wrote {out / name}.json and .png ({', '.join(loads)})")
    return results
