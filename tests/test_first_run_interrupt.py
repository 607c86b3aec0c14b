"""Ctrl-C at any point of ``morphkv generate`` (imports, model load, generation): exit status
130, nothing on stderr but a newline, no traceback. SIGINT is sent to a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from interruptible import popen

REPO = Path(__file__).resolve().parents[1]


def _start(*extra: str, preload: bool = False) -> subprocess.Popen:
    from morphkv.runtime.blas import blas_env

    env = blas_env(enable=False)  # LD_PRELOAD without OpenBLAS: the command re-executes
    env.pop("MORPHKV_BLAS_REEXEC", None)
    if not preload:
        env["MORPHKV_NO_BLAS_PRELOAD"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "morphkv", "generate", "--prompt", "Tell a long story.", *extra]
    return popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
    )


def _interrupt(proc: subprocess.Popen) -> tuple[int, str, str]:
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def _wait_for_mapping(pid: int, name: str, timeout: float = 120) -> bool:
    """Wait until the process has ``name`` mapped (Linux), i.e. it is importing it."""
    maps = Path(f"/proc/{pid}/maps")
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if name in maps.read_text():
                return True
        except OSError:
            return False
        time.sleep(0.01)
    return False


LINUX_PROC = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")


@LINUX_PROC
@pytest.mark.parametrize("delay", [0.0, 0.5, 1.5, "model"])
def test_ctrl_c_during_start_up(delay):
    """From the moment morphkv's code runs (MLX being imported) through the model load
    ("model": once the model file is mapped, i.e. being read; a fixed delay would reach the
    generation on a fast machine and see its output)."""
    proc = _start()
    assert _wait_for_mapping(proc.pid, "libmlx"), "mlx never loaded"
    if delay == "model":
        if not _wait_for_mapping(proc.pid, ".gguf"):
            proc.kill()
            proc.communicate()
            pytest.skip("the embedded model file was never mapped (not fetched here)")
    else:
        time.sleep(delay)
    rc, out, err = _interrupt(proc)
    assert rc == 130, (rc, err[-2000:])
    assert err.strip() == "" and out == "", err[-2000:]


@LINUX_PROC
def test_ctrl_c_while_the_command_re_executes_with_openblas():
    """SIGINT right as the re-executed interpreter starts (before Python is up): it waits,
    blocked, until morphkv's quiet handler is in place."""
    from morphkv.runtime.blas import find_blas

    lib = find_blas()
    if lib is None:
        pytest.skip("no OpenBLAS to preload: the command does not re-execute")
    proc = _start(preload=True)
    assert _wait_for_mapping(proc.pid, Path(lib).name, timeout=120), "never re-executed"
    rc, out, err = _interrupt(proc)
    assert rc == 130, (rc, err[-2000:])
    assert err.strip() == "" and out == "", err[-2000:]


@pytest.mark.slow
def test_ctrl_c_during_generation():
    from smollm2_fixture import embedded_gguf_path

    embedded_gguf_path()  # fetched (or skip) before the child looks for it
    proc = _start("--max-tokens", "500", "--no-stats")
    first = proc.stdout.read(1)  # the first streamed byte: generation is under way
    assert first, proc.stderr.read().decode()[-2000:]
    rc, out, err = _interrupt(proc)
    assert rc == 130, (rc, err[-2000:])
    assert "Traceback" not in err and err.strip() == "", err[-2000:]
    assert "==========" not in out  # stopped before the stats


def test_in_process_keyboard_interrupt_returns_130(monkeypatch, capsys):
    """``main()`` called from Python: a KeyboardInterrupt becomes status 130, no traceback."""
    import morphkv.cli.generate as gen
    from morphkv.cli import main

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(gen, "read_prompt", interrupted)
    assert main(["generate", "--prompt", "x"]) == 130
    assert capsys.readouterr().err.strip() == ""
