"""``morphkv chat`` in a terminal, as a person uses it: three streamed turns, Ctrl-C during a
reply (stops it, the chat goes on), /save, Ctrl-C at the prompt (status 130); then a new
process resumes with --load (the turn count goes on, kept <= budget), refuses a truncated
session in one line and goes on, and ends on Ctrl-D (status 0)."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from interruptible import default_sigint

pty = pytest.importorskip("pty")
REPO = Path(__file__).resolve().parents[1]
BUDGET = 32
FLAGS = ["--budget", str(BUDGET), "--max-tokens", "24"]


def _command() -> list[str]:
    script = Path(sys.executable).with_name("morphkv")
    return [str(script)] if script.exists() else [sys.executable, "-m", "morphkv"]


class Terminal:
    """The chat in a pseudo-terminal (stdin, stdout and stderr all the tty)."""

    def __init__(self, *args: str):
        env = dict(os.environ, TERM="xterm", COLUMNS="200", LINES="40")
        env.pop("MORPHKV_BLAS_REEXEC", None)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen([*_command(), "chat", *FLAGS, *args], stdin=slave,
                                     stdout=slave, stderr=slave, env=env, cwd=REPO,
                                     preexec_fn=default_sigint)
        os.close(slave)
        self.chunks: list[tuple[float, bytes]] = []

    @property
    def text(self) -> str:
        return b"".join(c for _, c in self.chunks).decode(errors="replace").replace("\r", "")

    def expect(self, pattern: str, timeout: float = 300, since: int = 0) -> re.Match:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = re.compile(pattern).search(self.text, since)
            if found:
                return found
            ready, _, _ = select.select([self.master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(self.master, 4096)
                except OSError:  # EIO: the child closed the terminal
                    data = b""
                if not data:
                    break
                self.chunks.append((time.monotonic(), data))
            elif self.proc.poll() is not None:
                break
        raise AssertionError(f"no {pattern!r} in:\n{self.text[-3000:]}")

    def send(self, line: str) -> int:
        """Type a line; returns the output offset from which its effects appear."""
        self.expect(r">> $", since=len(self.text) - 3)
        mark = len(self.text)
        os.write(self.master, line.encode() + b"\n")
        return mark

    def close(self, timeout: float = 60) -> int | None:
        """The exit status (None if still running after ``timeout``), reading the output."""
        end = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < end:
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if ready:
                try:
                    self.chunks.append((time.monotonic(), os.read(self.master, 4096)))
                except OSError:
                    time.sleep(0.2)
        os.close(self.master)
        return self.proc.poll()


def _turn(term: Terminal, message: str, number: int) -> tuple[str, int, int]:
    mark = term.send(message)
    n_before = len(term.chunks)
    found = term.expect(rf"\[turn {number}\] seen (\d+), kept (\d+) per KV head[^\n]*\n",
                        since=mark)
    pieces = [c for c in term.chunks[n_before:] if c[1].strip()]
    reply = term.text[mark:found.start()]
    return reply, int(found.group(1)), int(found.group(2)), pieces


@pytest.mark.slow
def test_chat_in_a_terminal_saves_and_resumes(tmp_path):
    from smollm2_fixture import embedded_gguf_path

    embedded_gguf_path()  # fetched (or skip) before the command looks for it
    session = tmp_path / "talk.safetensors"
    term = Terminal()
    try:
        term.expect(r"morphkv chat: .*budget=32")
        seen_before = 0
        for i, message in enumerate(["What is the capital of France?", "And of Italy?",
                                     "Name a river in Italy."], start=1):
            reply, seen, kept, pieces = _turn(term, message, i)
            assert len(reply.split()) >= 2, term.text
            assert seen > seen_before and kept <= BUDGET, term.text
            seen_before = seen
        assert BUDGET - 16 < kept <= BUDGET < seen, term.text  # evicting (in blocks) by now
        # streamed: the reply arrived in several pieces spread out in time
        assert len(pieces) >= 3 and pieces[-1][0] - pieces[0][0] > 0.1, pieces

        mark = term.send("Write a long story about a dragon who learns to paint.")
        term.expect(r"\S", since=mark + 60)  # the reply has started streaming
        term.proc.send_signal(signal.SIGINT)
        term.expect(r"\[turn 4\][^\n]*stopped by Ctrl-C", since=mark)

        mark = term.send(f"/save {session}")
        term.expect(r"saved turn 4 to ", since=mark)
        assert session.is_file()
        term.expect(r">> $", since=len(term.text) - 3)
        # input() writes the prompt, then blocks in read(): a signal that lands between the
        # two waits for the next key (CPython's input()); a person cannot type that fast
        time.sleep(1.0)
        term.proc.send_signal(signal.SIGINT)  # at the prompt: exit 130, quietly
        assert term.close() == 130, term.text
        assert "Traceback" not in term.text, term.text
    finally:
        if term.proc.poll() is None:
            term.proc.kill()

    truncated = tmp_path / "cut.safetensors"
    truncated.write_bytes(session.read_bytes()[: session.stat().st_size // 2])
    term = Terminal("--load", str(session))
    try:
        term.expect(r"loaded .*: 4 turns, seen \d+, kept (1[7-9]|2\d|3[0-2]) per KV head")
        mark = term.send(f"/load {truncated}")
        found = term.expect(r"error: cannot load session [^\n]*\n", since=mark)
        assert "the current conversation goes on" in found.group(0)
        assert term.text[mark:].count("\n") <= 3, term.text[mark:]  # the line typed, the error
        reply, seen, kept, _ = _turn(term, "Thank you. What did I ask first?", 5)
        assert kept <= BUDGET < seen and len(reply.split()) >= 2, term.text
        term.expect(r">> $", since=len(term.text) - 3)
        os.write(term.master, b"\x04")  # Ctrl-D at the prompt: exit 0
        assert term.close() == 0, term.text
        assert "Traceback" not in term.text, term.text
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
