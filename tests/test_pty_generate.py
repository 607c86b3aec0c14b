"""``morphkv generate`` in a terminal, as a person runs it: the console command in a pseudo-
terminal (stdin, stdout and stderr all a tty), the answer streams token by token, then the
stats block."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

pty = pytest.importorskip("pty")
REPO = Path(__file__).resolve().parents[1]
RULE = b"=========="


def _command() -> list[str]:
    script = Path(sys.executable).with_name("morphkv")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "morphkv"]


def _run_in_pty(argv: list[str], env: dict, timeout: float) -> tuple[int, list]:
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=REPO)
    os.close(slave)
    chunks, end = [], time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append((time.monotonic(), data))
    finally:
        os.close(master)
    return proc.wait(timeout=60), chunks


@pytest.mark.slow
def test_generate_streams_tokens_before_the_stats_in_a_terminal():
    from smollm2_fixture import embedded_gguf_path

    embedded_gguf_path()  # fetched (or skip) before the command looks for it
    env = dict(os.environ, TERM="xterm", COLUMNS="100", LINES="40")
    env.pop("MORPHKV_BLAS_REEXEC", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])  # this checkout
    argv = [*_command(), "generate", "--prompt", "Name the planets of the solar system.",
            "--max-tokens", "40", "--budget", "32", "--window", "4"]
    rc, chunks = _run_in_pty(argv, env, timeout=600)
    text = b"".join(c for _, c in chunks)
    assert rc == 0, text.decode(errors="replace")[-3000:]
    assert RULE in text, text
    rule_at = next(t for t, _ in _cumulative(chunks) if RULE in _)
    before = [(t, c) for t, c in chunks if t < rule_at and c.strip()]
    # tokens arrived in several pieces, spread out in time, before the stats block
    assert len(before) >= 3, chunks
    assert before[-1][0] - before[0][0] > 0.2, chunks
    answer = text.split(RULE)[0].decode(errors="replace")
    assert len(answer.split()) >= 5, answer
    stats = text.split(RULE)[1].decode(errors="replace")
    seen, kept = map(int, re.search(r"seen (\d+), kept (\d+)", stats).groups())
    assert 32 - 16 < kept <= 32 < seen, stats  # blocks of up to 16
    assert "Traceback" not in text.decode(errors="replace")


def _cumulative(chunks):
    """(time, all output so far) after each chunk."""
    acc = b""
    for t, c in chunks:
        acc += c
        yield t, acc
