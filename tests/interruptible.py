"""Children that a test interrupts with SIGINT, whatever the test run inherited.

A process started from a background job or under ``nohup`` inherits SIGINT *ignored*, and
Python (like morphkv's command, which follows the POSIX convention) keeps it ignored: a child
started from there would never see the Ctrl-C the test sends. Children made here restore the
default SIGINT disposition before they exec, so the test behaves as in a terminal.
"""

from __future__ import annotations

import signal
import subprocess


def default_sigint() -> None:
    """``preexec_fn``: SIGINT back to its default in the child (before exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def popen(argv, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` of a child that Ctrl-C (SIGINT) reaches."""
    return subprocess.Popen(argv, preexec_fn=default_sigint, **kwargs)
