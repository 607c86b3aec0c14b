"""The README's Python example, run exactly as written (a fresh ``python`` process): it streams
its story, its cache evicts, and it finishes."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from morphkv.runtime import blas

REPO = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"seen (\d+) tokens, kept (\d+), ([\d.]+)x smaller than a full cache")


def readme_python_example() -> str:
    """The first ```python block of README.md's "## Use it from Python" section."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Use it from Python", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md has no ```python block under '## Use it from Python'"
    return match.group(1)


def test_the_example_is_valid_python_using_stream_generate():
    code = readme_python_example()
    compile(code, "README.md example", "exec")
    assert "stream_generate" in code and "flush=True" in code


def _read_timed(proc: subprocess.Popen, timeout: float) -> list[tuple[float, bytes]]:
    """stdout chunks as they arrive, with their arrival times."""
    chunks, fd, end = [], proc.stdout.fileno(), time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            data = os.read(fd, 4096)
            if not data:
                break
            chunks.append((time.monotonic(), data))
    return chunks


@pytest.mark.slow
def test_readme_example_streams_its_story_and_evicts(tmp_path):
    from smollm2_fixture import embedded_gguf_path

    embedded_gguf_path()  # fetched (or skip) before the example looks for it
    script = tmp_path / "example.py"
    script.write_text(readme_python_example())
    env = blas.blas_env()  # the LD_PRELOAD line the library advises (when OpenBLAS exists)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    chunks = _read_timed(proc, timeout=900)
    err = proc.stderr.read().decode(errors="replace")
    assert proc.wait(timeout=60) == 0, err[-3000:]
    out = b"".join(c for _, c in chunks).decode()
    story, _, tail = out.rpartition("\nseen ")
    assert len(story.split()) >= 20, out  # the story itself is printed, not just numbers
    seen, kept, ratio = SUMMARY.search("seen " + tail).groups()
    assert 64 - 16 < int(kept) <= 64 < int(seen) and float(ratio) > 1.0, out
    # streamed: the story arrived piece by piece, well before the process ended
    story_chunks = [t for t, c in chunks if b"seen " not in c]
    assert len(story_chunks) >= 5, chunks
    assert story_chunks[-1] - story_chunks[0] > 1.0, chunks
