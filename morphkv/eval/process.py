"""Process helpers: a free loopback port, waiting for a server child, stopping a child, a
streamed chat with it."""

from __future__ import annotations

import time


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


def wait_healthy(proc, url: str, what: str, seconds: float = 600) -> None:
    """Wait until the server child ``proc`` answers ``url``/health with 200; when it exits or
    ``seconds`` pass, stop it and raise SystemExit naming ``what`` and its status."""
    import urllib.request

    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:  # not up yet (refused, or a non-200 status)
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"morphkv: error: {what} did not start (status "
                             f"{stop_process(proc)})")
        time.sleep(0.5)


def stream_chat(client, messages: list[dict], max_tokens: int, drop: bool = False, **kw) -> dict:
    """One streamed chat of an openai ``client``: first-content time (perf_counter, None if
    none), completion and prompt tokens (usage), content chunks, the text; ``drop`` closes the
    stream at the first content."""
    first, tokens, prompt, chunks, text = None, 0, 0, 0, []
    stream = client.chat.completions.create(
        model="default_model", messages=messages, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, **kw)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            text.append(chunk.choices[0].delta.content)
            if first is None:
                first = time.perf_counter()
                if drop:
                    stream.close()
                    break
        if chunk.usage is not None:
            tokens, prompt = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
    return {"first": first, "tokens": tokens, "prompt_tokens": prompt, "chunks": chunks,
            "text": "".join(text)}
