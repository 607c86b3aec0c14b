"""``morphkv serve`` end to end: the real server on loopback, the official ``openai`` client.

One server (embedded model, budget 32) for the module; every request is bounded (a few tokens,
client timeouts) and the server is stopped by its process id at teardown.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.smollm2_fixture import embedded_gguf_path

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_bad_cache_settings_fail_before_loading(capsys):
    from morphkv.cli import main

    assert main(["serve", "--budget", "8", "--window", "8"]) == 2
    assert "--budget must exceed" in capsys.readouterr().err
    assert main(["serve", "--max-tokens", "0"]) == 2


def test_mlx_lm_server_reads_only_flags_it_is_given():
    """Every ``cli_args.<flag>`` mlx_lm.server reads exists in the namespace serve hands it."""
    import re

    import mlx_lm.server

    from morphkv.cli.commands import build_parser
    from morphkv.server.app import ServedModel, server_args

    args = build_parser().parse_args(["serve"])
    served = ServedModel(None, None, {}, "/m.gguf", frozenset())
    namespace = server_args(args, served)
    read = set(re.findall(r"cli_args\.(\w+)", Path(mlx_lm.server.__file__).read_text()))
    assert read and not read - set(vars(namespace))
    assert namespace.model == "/m.gguf" and namespace.host == "127.0.0.1"


@pytest.fixture(scope="module")
def server():
    embedded_gguf_path()  # skips (or fails in CI) when the model cannot be had
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "morphkv",
        "serve",
        "--port",
        str(port),
        "--preset",  # MorphKV: the bound below counts its selection state
        "tuned",
        "--budget",
        str(BUDGET),
        "--window",
        "4",
        "--sinks",
        "4",
        "--max-tokens",
        "8",
        "--log-level",
        "WARNING",
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _healthy(url):
            assert proc.poll() is None, "server exited:\n" + "".join(lines)
            assert time.monotonic() < deadline, "server did not start:\n" + "".join(lines)
            time.sleep(0.5)
        yield url, lines
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", timeout=120, max_retries=0)


def chat(client, text, **kw):
    return client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": text}], **kw
    )


@pytest.mark.slow
def test_startup_line_states_cache_and_bound(server):
    _, lines = server
    line = next(x for x in lines if x.startswith("morphkv serve:"))
    # storage: 30 layers x 3 KV heads x (32 + 1) slots x (64 + 64) x 4 bytes (float32 keys);
    # selection state per layer and KV head (tuned preset, --window 4, block
    # min(16, 32 - 4 - 16) = 12, the MLX engine: fixed arrays, no pending queries): per slot an
    # int32 position, a float16 peak, a float16 value norm and the window's 4 float16 rows
    storage = 30 * 3 * 33 * 128 * 4
    engine = 30 * 3 * 33 * (4 + 2 + 2 + 4 * 2)
    setting = f"method=morphkv budget={BUDGET} sinks=4 window=4 recent=16 value-weighted"
    assert f"{setting} peak=0.02 block=12" in line
    assert "scoring=attention" in line
    assert "KV memory bound" in line and f"({storage + engine} bytes) per sequence" in line
    assert "engine mlx (batches too)" in line and "pinned: nothing (--pin prompt pins" in line


@pytest.mark.slow
def test_chat_and_streamed_chat_agree(client):
    r = chat(client, "Name a color.", max_tokens=6)
    text = r.choices[0].message.content
    assert text and r.usage.completion_tokens <= 6
    assert r.choices[0].finish_reason in ("stop", "length")
    parts = [
        c.choices[0].delta.content or ""
        for c in chat(client, "Name a color.", max_tokens=6, stream=True)
        if c.choices
    ]
    assert "".join(parts) == text  # greedy: the same tokens either way


@pytest.mark.slow
def test_text_completion(client):
    r = client.completions.create(
        model="default_model", prompt="The capital of France is", max_tokens=5
    )
    assert r.choices[0].text.strip() and r.usage.completion_tokens <= 5


@pytest.mark.slow
def test_multi_turn_reuses_the_prompt_cache(client):
    messages = [{"role": "user", "content": "Tell me one fact about the Moon."}]
    first = client.chat.completions.create(model="default_model", messages=messages, max_tokens=8)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And one about Mars?"},
    ]
    second = client.chat.completions.create(model="default_model", messages=messages, max_tokens=8)
    assert second.choices[0].message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens > BUDGET
    assert second.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.slow
def test_three_concurrent_requests(client):
    results, errors = {}, []

    def ask(i):
        try:
            results[i] = chat(client, f"Count from {i} to {i + 3}.", max_tokens=8)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    assert not errors and sorted(results) == [0, 1, 2]
    assert all(r.choices[0].message.content for r in results.values())


@pytest.mark.slow
def test_errors_are_clean_http_errors_and_serving_goes_on(client):
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, "Hi", max_tokens=-1)
    assert "max_tokens" in bad.value.response.text
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(
            model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
    assert "not served" in unknown.value.response.text
    assert chat(client, "Say hi.", max_tokens=4).choices[0].message.content
