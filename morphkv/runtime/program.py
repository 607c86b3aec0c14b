"""Start-up of the ``morphkv`` command itself (never of a script that imports the library).

Runs first thing in ``morphkv/__init__.py``, before MLX is imported, when this process is
``morphkv ...`` or ``python -m morphkv ...``:

* Ctrl-C anywhere (imports, model load, generation) exits with status 130 and no traceback;
* on Linux the command re-executes itself once with OpenBLAS preloaded
  (see ``morphkv.runtime.blas``), before the heavy imports, so they are not paid twice.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

VERSION = "0.1.0"  # the package version (morphkv.__version__)
INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


def invoked_as_program() -> bool:
    """True when this process is ``morphkv ...`` or ``python -m morphkv ...``."""
    orig = list(getattr(sys, "orig_argv", None) or [])
    if len(orig) >= 3 and orig[1] == "-m" and orig[2] == "morphkv":
        return True
    p = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    console_script = p.stem == "morphkv" and p.suffix in ("", ".exe")  # not a morphkv.py script
    return console_script or (p.name == "__main__.py" and p.parent.name == "morphkv")


def _quiet_exit(signum, frame) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.write("\n")
        sys.stderr.flush()
    except (OSError, RuntimeError, ValueError):
        pass  # a closed pipe or a re-entrant write: exit anyway
    # os._exit, not SystemExit: a library's bare ``except:`` around an import (seen during
    # start-up under load) would swallow SystemExit and the command would run on
    os._exit(INTERRUPTED)


def install_quiet_interrupt() -> None:
    """Ctrl-C ends the command at once with status 130, no traceback (output is flushed)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _quiet_exit)


def start() -> None:
    if not invoked_as_program():
        return
    install_quiet_interrupt()
    # after the OpenBLAS re-exec SIGINT arrives blocked (see morphkv.runtime.blas): deliver it now
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if os.environ.get("MORPHKV_BLAS_REEXEC") is None:
        from .blas import ensure_blas_preloaded

        ensure_blas_preloaded()  # re-executes (does not return) when OpenBLAS can be preloaded
