"""Make MLX's Linux CPU matmuls fast by preloading an optimized BLAS.

The Linux ``mlx[cpu]`` wheel links a slow reference BLAS (a 1024x1024 float32 matmul takes
~0.6 s on 2 cores). Preloading Debian's OpenBLAS (``apt-get install libopenblas0-pthread``)
through ``LD_PRELOAD`` makes MLX's matmuls ~40x faster. ``LD_PRELOAD`` only works at process
start, so the CLI re-executes itself once with it set.

A library cannot re-execute the script that imports it (someone else's process, a notebook
kernel, a server), but it can do what ``LD_PRELOAD`` does as long as MLX is not loaded yet:
``import morphkv`` loads the library with its symbols global (``load_in_process``), so MLX,
imported after it, binds its matmuls to OpenBLAS. Where MLX was imported first (its symbols
are bound by then), ``import morphkv`` warns once (``SlowBLASWarning``) with the two ways out.

Environment:
    ``MORPHKV_BLAS=/path/libblas.so.3``  use this library;
    ``MORPHKV_NO_BLAS_PRELOAD=1``       never preload / re-execute, and no warning.
"""

from __future__ import annotations

import os
import platform
import signal
import sys
import warnings
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
    # Ctrl-C during the new interpreter's start-up stays pending (a blocked signal survives
    # execve) until morphkv unblocks it with its quiet handler in place (morphkv.runtime.program).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, _command_line(), env)
    except OSError:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        return  # keep running with the slow BLAS


_loaded_in_process: str | None = None


def load_in_process() -> str | None:
    """Load the optimized BLAS into this process with global symbols, before MLX: MLX, imported
    after this, binds its BLAS calls to it (what ``LD_PRELOAD`` does, without a re-exec).
    Returns the library's path, or None (MLX already loaded, not Linux, disabled, none found,
    already preloaded, or it failed to load: then MLX keeps its own BLAS)."""
    global _loaded_in_process
    if _loaded_in_process or "mlx.core" in sys.modules:
        return _loaded_in_process
    lib = find_blas()
    if lib is None or is_preloaded(lib):
        return None
    import ctypes

    try:
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    _loaded_in_process = lib
    return lib


class SlowBLASWarning(UserWarning):
    """MLX runs on its slow reference BLAS in this process (Linux CPU, no preload)."""


def _preloads_a_blas(env: dict) -> bool:
    entries = env.get("LD_PRELOAD", "").replace(":", " ").split()
    return any(k in Path(e).name.lower() for e in entries for k in ("blas", "mkl", "blis"))


def slow_blas_advice(env: dict | None = None) -> str | None:
    """One line on how to get the fast BLAS, or None (not Linux, disabled, already preloaded)."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or _disabled(env) or _preloads_a_blas(env):
        return None
    if _loaded_in_process:
        return None
    lib = find_blas(env)
    if lib is not None:
        how = (f"import morphkv before mlx / mlx_lm (it loads OpenBLAS first), or start Python "
               f"as `LD_PRELOAD={lib} python ...`")
    else:
        arch = platform.machine() or "x86_64"
        how = (
            "install Debian's OpenBLAS (`apt-get install libopenblas0-pthread`) and start "
            f"Python as `LD_PRELOAD=/usr/lib/{arch}-linux-gnu/openblas-pthread/libblas.so.3 "
            "python ...`"
        )
    return (
        f"MLX is using its slow reference BLAS: for ~20x faster matmuls {how} (the morphkv "
        f"command does this itself; {ENV_DISABLE}=1 hides this warning)"
    )


def _first_frame_outside_morphkv() -> int:
    """The ``stacklevel`` that points a warning at the user's ``import`` line."""
    here = str(Path(__file__).resolve().parent)
    frame, level = sys._getframe(2), 2  # level 1 is warn_if_slow, 2 its caller
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back  # warnings.warn skips these frames when counting too
            continue
        if not name.startswith(here):
            return level
        frame, level = frame.f_back, level + 1
    return 1


def warn_if_slow() -> None:
    """Warn once (``SlowBLASWarning``) when MLX computes on the CPU with the reference BLAS."""
    advice = slow_blas_advice()
    if advice is None:
        return
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.cpu:
        return
    warnings.warn(advice, SlowBLASWarning, stacklevel=_first_frame_outside_morphkv())
