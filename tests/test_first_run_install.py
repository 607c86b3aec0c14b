"""What a plain ``python`` script gets after the README's install: the real package (even next
to a clone folder named ``morphkv``), and one clear line on how to get the OpenBLAS speed-up."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from morphkv.runtime import blas

REPO = Path(__file__).resolve().parents[1]


def _installed_from() -> Path | None:
    """The folder morphkv was pip-installed from (editable or not), or None."""
    for dist in importlib.metadata.distributions(name="morphkv"):  # skips a stray egg-info
        text = dist.read_text("direct_url.json")
        if text:
            url = urlparse(json.loads(text).get("url", ""))
            return Path(unquote(url.path)).resolve() if url.scheme == "file" else None
    return None


def _plain_env(**extra: str) -> dict:
    env = blas.blas_env(enable=False)  # no OpenBLAS in LD_PRELOAD
    for name in ("PYTHONPATH", "MORPHKV_BLAS_REEXEC", "MORPHKV_NO_BLAS_PRELOAD"):
        env.pop(name, None)
    env.update(extra)
    return env


def test_a_clone_folder_beside_the_script_does_not_shadow_the_package(tmp_path):
    """The README's install, then a script saved in the clone's parent folder: ``import
    morphkv`` must find the package, not the clone folder as a namespace package."""
    source = _installed_from()
    if source is None:
        pytest.skip("morphkv is not pip-installed in this environment")
    if source != REPO:
        pytest.skip(f"morphkv is installed from {source}, not from this checkout")
    clone = tmp_path / "morphkv"  # `git clone .../morphkv` made this folder
    (clone / "morphkv").mkdir(parents=True)
    (clone / "README.md").write_text("# morphkv\n")
    script = tmp_path / "story.py"
    script.write_text(
        "from morphkv import KVCacheConfig\nimport morphkv\nprint(morphkv.__file__)\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=_plain_env(MORPHKV_NO_BLAS_PRELOAD="1"),
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = Path(proc.stdout.strip())
    assert found.name == "__init__.py" and tmp_path not in found.parents, found


def _import_morphkv(env: dict, mlx_first: bool = False) -> subprocess.CompletedProcess:
    code = ("import mlx.core\n" if mlx_first else "") + (
        "import morphkv\nimport morphkv.core.cache\nfrom morphkv import KVCacheConfig\n"
        "import mlx.core as mx\nmx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))\n"
        "print(open('/proc/self/maps').read())\n")
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def _cpu_only() -> None:
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("MLX computes on a GPU here")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux only")
def test_plain_python_importing_morphkv_first_gets_openblas():
    """``import morphkv`` before MLX loads OpenBLAS into the process (no re-exec, no warning)."""
    _cpu_only()
    lib = blas.find_blas(_plain_env())
    if lib is None:
        pytest.skip("no OpenBLAS on this machine")
    proc = _import_morphkv(_plain_env())
    assert "SlowBLASWarning" not in proc.stderr, proc.stderr
    assert os.path.realpath(lib) in proc.stdout or lib in proc.stdout  # mapped in the process


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux only")
def test_plain_python_that_imported_mlx_first_is_told_once_how_to_get_openblas():
    _cpu_only()
    env = _plain_env()
    proc = _import_morphkv(env, mlx_first=True)
    err = proc.stderr
    assert err.count("SlowBLASWarning") == 1, err
    lib = blas.find_blas(env)
    if lib is not None:
        assert f"LD_PRELOAD={lib} python" in err and "import morphkv before mlx" in err, err
        assert os.path.realpath(lib) not in proc.stdout
    else:
        assert "apt-get install libopenblas0-pthread" in err and "LD_PRELOAD=" in err, err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux only")
def test_no_warning_when_preloaded_or_disabled_or_the_command():
    off = _import_morphkv(_plain_env(MORPHKV_NO_BLAS_PRELOAD="1"), mlx_first=True)
    assert "SlowBLASWarning" not in off.stderr
    lib = blas.find_blas(_plain_env())
    if lib is not None:
        assert "SlowBLASWarning" not in off.stdout + off.stderr
        assert os.path.realpath(lib) not in off.stdout  # disabled: not loaded either
        pre = _import_morphkv(_plain_env(LD_PRELOAD=lib), mlx_first=True)
        assert "SlowBLASWarning" not in pre.stderr
    proc = subprocess.run(  # the command arranges the preload itself (or reports it in stats)
        [sys.executable, "-m", "morphkv", "--version"], env=_plain_env(), cwd=REPO,
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0 and "SlowBLASWarning" not in proc.stderr, proc.stderr


def test_a_missing_optional_dependency_is_one_line(tmp_path):
    """``morphkv bench ...`` without matplotlib (the ``bench`` extra): one line naming the
    extra, exit 2. matplotlib is made unimportable exactly as Python reports a missing one."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n"
    )
    env = _plain_env(MORPHKV_NO_BLAS_PRELOAD="1")
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), str(REPO)])
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "morphkv", "bench", "speed", "--quick", "--model", "random-tiny",
         "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.startswith("morphkv: error:") and "pip install -e '.[bench]'" in last, last
