"""Careless and hostile command-line input: one line on stderr, exit status 2, no traceback.

Each case runs ``python -m morphkv`` as a real process (the cases run side by side). None of
them needs the model: every value is rejected before anything is loaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# (extra arguments, stdin bytes, a fragment the one error line must contain)
CASES = [
    (["--seed", "-1"], None, "--seed: must be an integer in [0, 4294967295], got -1"),
    (["--prefill-step-size", "0"], None, "--prefill-step-size: must be an integer >= 1"),
    (["--min-p", "3"], None, "--min-p: must be a number in [0, 1], got 3"),
    (["--temp", "-1"], None, "--temp: must be a number >= 0, got -1"),
    (["--temp", "nan"], None, "--temp: must be a number >= 0"),
    (["--max-tokens", "-5"], None, "--max-tokens/-m: must be an integer >= 1, got -5"),
    (["--max-tokens", "0"], None, "--max-tokens/-m: must be an integer >= 1, got 0"),
    (["--top-p", "5"], None, "--top-p: must be a number in (0, 1], got 5"),
    (["--top-k", "-3"], None, "--top-k: must be an integer >= 0, got -3"),
    (["--budget", "1"], None, "--budget: must be an integer >= 2, got 1"),
    (["--budget", "many"], None, "--budget: must be an integer >= 2, got 'many'"),
    (["--window", "0"], None, "--window: must be an integer >= 1, got 0"),
    (["--sinks", "-1"], None, "--sinks: must be an integer >= 0, got -1"),
    (["--budget", "10"], None, "--budget must exceed --sinks + --window = 4 + 8 = 12, got 10"),
    (["--budget", "8", "--sinks", "2", "--window", "6"], None, "--budget must exceed --sinks"),
    (["--method", "lru"], None, "--method: invalid choice: 'lru'"),
    (["--model", "/no/such/model.gguf"], None, "--model: no such file or directory"),
    (["--model", "no-such-folder"], None, "--model: no such file or directory"),
    (["--prompt", ""], None, "the prompt is empty (--prompt)"),
    (["--prompt", "-"], b"", "the prompt is empty (stdin)"),
    ([], b"  \n\t\n", "the prompt is empty (stdin)"),
    ([], b"caf\xe9 \xff\xfe", "stdin is not UTF-8 text (byte 0xe9 at offset 3)"),
]


def _env() -> dict:
    env = dict(os.environ, MORPHKV_NO_BLAS_PRELOAD="1")  # no re-exec: faster, same parsing
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def results():
    """Every case's (returncode, stdout, stderr), the processes started side by side."""
    procs = []
    for extra, stdin, _ in CASES:
        argv = [sys.executable, "-m", "morphkv", "generate", *extra]
        if not any(a in ("--prompt", "-p") for a in extra) and stdin is None:
            argv += ["--prompt", "Hello"]
        p = subprocess.Popen(
            argv, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        procs.append((p, stdin))
    out = []
    for p, stdin in procs:
        o, e = p.communicate(stdin or b"", timeout=300)
        out.append((p.returncode, o.decode(), e.decode()))
    return out


@pytest.mark.parametrize("i", range(len(CASES)), ids=[" ".join(c[0]) or "stdin" for c in CASES])
def test_bad_value_is_one_line_exit_2(results, i):
    rc, out, err = results[i]
    fragment = CASES[i][2]
    lines = err.strip().splitlines()
    assert rc == 2, (rc, err[-2000:])
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert lines[0].startswith("morphkv") and "error:" in lines[0]
    assert fragment in lines[0], lines[0]
    assert out == ""  # nothing generated


def test_allow_empty_prompt_passes_the_check(monkeypatch):
    """``--allow-empty-prompt`` lets an empty prompt through the reader (no model needed)."""
    from morphkv.cli.commands import build_parser
    from morphkv.cli.generate import read_prompt

    args = build_parser().parse_args(["generate", "--prompt", "", "--allow-empty-prompt"])
    assert read_prompt(args) == ""


def _bad_models(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    folder = tmp_path / "folder"  # a folder without an mlx_lm config
    folder.mkdir()
    yield junk
    yield folder
    import importlib.util

    # a crafted header needs the GGUF header validation (issue 13); before it, MLX segfaults
    if importlib.util.find_spec("morphkv.model.gguf_header") is not None:
        crafted = tmp_path / "crafted.gguf"
        crafted.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(range(256)) * 4)
        yield crafted


def test_bad_model_file_is_one_line_exit_2(tmp_path):
    """Files that are not a usable model: one line naming the file, exit 2, no traceback."""
    for model in _bad_models(tmp_path):
        proc = subprocess.run(
            [sys.executable, "-m", "morphkv", "generate", "-p", "hi", "--model", str(model)],
            env=_env(), capture_output=True, text=True, timeout=300,
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (model, proc.returncode, proc.stderr[-2000:])
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert lines[0].startswith("morphkv: error: cannot load --model") and str(model) in lines[0]
