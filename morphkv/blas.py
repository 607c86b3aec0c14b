"""Make MLX's Linux CPU matmuls fast by preloading an optimized BLAS.

The Linux ``mlx[cpu]`` wheel links a slow reference BLAS (a 1024x1024 float32 matmul takes
~0.6 s on 2 cores). Preloading Debian's OpenBLAS (``apt-get install libopenblas0-pthread``)
through ``LD_PRELOAD`` makes MLX's matmuls ~40x faster. ``LD_PRELOAD`` only works at process
start, so the CLI re-executes itself once with it set.

Environment:
    ``MORPHKV_BLAS=/path/libblas.so.3``  use this library;
    ``MORPHKV_NO_BLAS_PRELOAD=1``       never preload / re-execute.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV_BLAS = "MORPHKV_BLAS"
ENV_DISABLE = "MORPHKV_NO_BLAS_PRELOAD"
_ENV_GUARD = "MORPHKV_BLAS_REEXEC"

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def _disabled(env: dict) -> bool:
    return env.get(ENV_DISABLE, "").strip().lower() not in ("", "0", "false", "no")


def find_blas(env: dict | None = None) -> str | None:
    """Path of an optimized BLAS to preload, or None (not Linux, disabled, none found)."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or _disabled(env):
        return None
    override = env.get(ENV_BLAS)
    if override:
        return override if Path(override).is_file() else None
    for cand in CANDIDATES:
        if Path(cand).is_file():
            return cand
    return None


def is_preloaded(lib: str, env: dict | None = None) -> bool:
    env = os.environ if env is None else env
    entries = env.get("LD_PRELOAD", "").replace(":", " ").split()
    real = os.path.realpath(lib)
    return any(e == lib or os.path.realpath(e) == real for e in entries)


def blas_env(env: dict | None = None, *, enable: bool = True) -> dict:
    """A copy of ``env`` whose LD_PRELOAD includes (or, ``enable=False``, excludes) the BLAS."""
    env = dict(os.environ if env is None else env)
    lib = find_blas(env)
    if lib is None:
        return env
    entries = [e for e in env.get("LD_PRELOAD", "").replace(":", " ").split() if e]
    entries = [e for e in entries if os.path.realpath(e) != os.path.realpath(lib)]
    if enable:
        entries.insert(0, lib)
    if entries:
        env["LD_PRELOAD"] = " ".join(entries)
    else:
        env.pop("LD_PRELOAD", None)
    return env


def _command_line() -> list[str]:
    # sys.orig_argv keeps "-m morphkv" (sys.argv[0] would be the __main__.py path, which
    # cannot be run directly); the console script shows up as its script path.
    orig = getattr(sys, "orig_argv", None)
    if orig:
        return [sys.executable, *orig[1:]]
    return [sys.executable, *sys.argv]


def ensure_blas_preloaded() -> None:
    """Re-execute the current command with the optimized BLAS in LD_PRELOAD, when useful.

    Does nothing (returns) when not on Linux, disabled, no library is found, it is already
    preloaded, or a re-exec already happened. On success it does not return.
    """
    if os.environ.get(_ENV_GUARD):
        return
    lib = find_blas()
    if lib is None or is_preloaded(lib):
        return
    env = blas_env()
    env[_ENV_GUARD] = "1"
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, _command_line(), env)
    except OSError:
        return  # keep running with the slow BLAS
