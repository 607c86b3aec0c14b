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


def _import_morphkv(env: dict) -> str:
    code = "import morphkv\nimport morphkv.core.cache\nfrom morphkv import KVCacheConfig\n"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux only")
def test_plain_python_is_told_once_how_to_get_openblas():
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("MLX computes on a GPU here")
    err = _import_morphkv(_plain_env())
    assert err.count("SlowBLASWarning") == 1, err
    lib = blas.find_blas(_plain_env())
    if lib is not None:
        assert f"LD_PRELOAD={lib} python" in err, err
    else:
        assert "apt-get install libopenblas0-pthread" in err and "LD_PRELOAD=" in err, err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD is Linux only")
def test_no_warning_when_preloaded_or_disabled_or_the_command():
    assert "SlowBLASWarning" not in _import_morphkv(_plain_env(MORPHKV_NO_BLAS_PRELOAD="1"))
    lib = blas.find_blas(_plain_env())
    if lib is not None:
        assert "SlowBLASWarning" not in _import_morphkv(_plain_env(LD_PRELOAD=lib))
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
        [sys.executable, "-m", "morphkv", "bench", "mechanism", "--quick", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert last.startswith("morphkv: error:") and "pip install -e '.[bench]'" in last, last
