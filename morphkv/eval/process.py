"""Process helpers: a free loopback port, stopping a child process."""

from __future__ import annotations


def stop_process(proc, timeout: float = 20) -> int:
    """Stop a child by its process id: SIGTERM, then SIGKILL after ``timeout`` s. Its status."""
    import os
    import signal
    import subprocess

    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)
    return proc.returncode


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server a benchmark starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
