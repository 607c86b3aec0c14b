"""``morphkv serve`` under faults: a real server subprocess on 127.0.0.1, the official ``openai``
client and raw HTTP. Malformed requests get a 4xx naming the problem, a dropped client is one
log line and frees its slot, the prompt cache keeps to its byte limit, SIGTERM / SIGINT end
in-flight streams cleanly with exit status 0 / 130. Bounded: short generations, timeouts
everywhere, every server stopped by its process id.
"""

from __future__ import annotations

import http.client
import json
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

from morphkv.eval.process import stop_process
from tests.smollm2_fixture import embedded_gguf_path

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
CACHE_LIMIT = 4_000_000  # --prompt-cache-bytes: room for two budget-32 conversations


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """``morphkv serve`` in a subprocess; stopped by its process id."""

    def __init__(self, tmp: Path, *flags: str):
        embedded_gguf_path()  # skips (or fails in CI) when the model cannot be had
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # no Hugging Face cache on this "machine": mlx_lm's /v1/models failed there
        env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HOME=str(tmp / "no-hf-cache"))
        cmd = [sys.executable, "-m", "morphkv", "serve", "--port", str(self.port),
               "--budget", "32", "--window", "4", "--sinks", "4", "--max-tokens", "8",
               "--log-level", "INFO", *flags]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + 180
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail("server did not start:\n" + self.log())
            time.sleep(0.3)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", timeout=60,
                                    max_retries=0)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log(self) -> str:
        return "".join(self.lines)

    def stats(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/morphkv/stats", timeout=10) as r:
            return json.load(r)

    def stop(self) -> int:
        return stop_process(self.proc, 20)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("serve"), "--prompt-cache-bytes", str(CACHE_LIMIT),
               "--max-body-bytes", "1M", "--max-request-tokens", "256")
    try:
        yield s
    finally:
        s.stop()


def post(url: str, body, headers: dict | None = None, path="/v1/chat/completions"):
    host, port = url.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        c.putrequest("POST", path)
        c.putheader("Content-Type", "application/json")
        headers = {"Content-Length": str(len(data)), **(headers or {})}
        for k, v in headers.items():
            c.putheader(k, v)
        c.endheaders()
        c.send(data)
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def _chat(**kw):
    return {"model": "default_model", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, **kw}


BAD = [  # (name, body, headers, status, words the message names)
    ("invalid JSON", b"{not json", None, 400, "invalid JSON"),
    ("not UTF-8", b"\xff\xfe\x00", None, 400, "UTF-8"),
    ("body not an object", b"[1, 2]", None, 400, "JSON object"),
    ("messages not a list", {"messages": "Hi"}, None, 400, "messages must be a list"),
    ("empty messages", {"messages": []}, None, 400, "messages is empty"),
    ("missing messages", {"prompt": "Hi"}, None, 400, "messages is required"),
    ("message not an object", {"messages": ["Hi"]}, None, 400, "messages[0]"),
    ("content of a wrong type", {"messages": [{"role": "user", "content": 3}]}, None, 400,
     "messages[0].content"),
    ("negative max_tokens", _chat(max_tokens=-1), None, 400, "max_tokens must be at least 1"),
    ("huge max_tokens", _chat(max_tokens=10**9), None, 400, "--max-request-tokens"),
    ("max_tokens a string", _chat(max_tokens="8"), None, 400, "max_tokens must be an integer"),
    ("temperature a string", _chat(temperature="hot"), None, 400, "temperature"),
    ("stream not a boolean", _chat(stream="yes"), None, 400, "stream must be a boolean"),
    ("stop not strings", _chat(stop=[1, 2]), None, 400, "stop must be"),
    ("top_k above the vocabulary", _chat(top_k=10**7), None, 400, "top_k"),
    ("logit_bias outside the vocabulary", _chat(logit_bias={"99999999": 1.0}), None, 400,
     "logit_bias"),
    ("unknown model", _chat(model="gpt-imaginary"), None, 404, "not served here"),
    ("oversized body", b"{}", {"Content-Length": str(10**12)}, 413, "--max-body-bytes"),
    ("negative Content-Length", b"", {"Content-Length": "-4"}, 400, "negative"),
]


def _short_body(url: str) -> str:
    """A client that sends less than its Content-Length and closes its side."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 400\r\n\r\n{\"messages\"")
        sock.shutdown(socket.SHUT_WR)
        return sock.makefile("rb").read().decode()


@pytest.mark.slow
def test_models_list_and_health_without_a_hugging_face_cache(server):
    ids = [m.id for m in server.client.models.list()]
    assert ids[0] == "smollm2-135m-instruct" and "default_model" in ids
    assert server.client.models.retrieve("default_model").id == "default_model"
    with urllib.request.urlopen(f"{server.url}/health", timeout=5) as r:
        assert json.load(r) == {"status": "ok"}
    # the name /v1/models lists is one a request may use
    r = server.client.chat.completions.create(
        model=ids[0], messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.choices[0].message.content is not None


@pytest.mark.slow
def test_every_malformed_request_gets_a_4xx_naming_the_problem(server):
    for name, body, headers, status, words in BAD:
        got, text = post(server.url, body, headers)
        assert got == status, f"{name}: {got} {text}"
        assert words in text, f"{name}: {text}"
    got, text = post(server.url, {"prompt": ""}, path="/v1/completions")
    assert got == 400 and "prompt is empty" in text
    got, text = post(server.url, {"prompt": 5}, path="/v1/completions")
    assert got == 400 and "prompt must be a string" in text
    reply = _short_body(server.url)
    assert reply.startswith("HTTP/1.0 400") and "ended after 11 of 400 bytes" in reply
    got, text = post(server.url, _chat(), path="/v1/nowhere")
    assert got == 404 and "no such endpoint" in text
    # the server answers normally afterwards, and its generation thread is alive
    ok = server.client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4)
    assert ok.choices[0].message.content
    assert "Traceback" not in server.log()


@pytest.mark.slow
def test_a_dropped_stream_is_one_log_line_and_frees_its_slot(server):
    before = server.log().count("went away")
    stream = server.client.chat.completions.create(
        model="default_model", max_tokens=256, stream=True,
        messages=[{"role": "user", "content": "Write a very long story about the sea."}])
    next(iter(stream))
    stream.close()
    # a non-streamed request whose client gives up (timeout) is stopped too
    impatient = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=0.5,
                              max_retries=0)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(
            model="default_model", max_tokens=256,
            messages=[{"role": "user", "content": "Write another very long story."}])
    t0 = time.monotonic()
    while server.log().count("went away") < before + 2 and time.monotonic() - t0 < 30:
        time.sleep(0.2)
    assert server.log().count("went away") == before + 2
    assert server.stats()["requests_in_flight"] == 0  # both requests are over
    # the next request is not slowed by 2 x 256 tokens still being generated
    t0 = time.monotonic()
    r = server.client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": "Say yes."}], max_tokens=4)
    assert r.choices[0].message.content is not None and time.monotonic() - t0 < 20
    assert "Traceback" not in server.log() and "BrokenPipe" not in server.log()


@pytest.mark.slow
def test_concurrent_mixed_clients_and_the_prompt_cache_limit(server):
    errors, samples, done = [], [], threading.Event()

    def sample():
        while not done.is_set():
            samples.append(server.stats()["prompt_cache_bytes"])
            time.sleep(0.1)

    def client(i):
        try:
            c = server.client
            messages = [{"role": "user", "content": f"Tell me about the number {i}."}]
            for _ in range(2):  # a conversation past the budget (32 tokens)
                r = c.chat.completions.create(model="default_model", messages=messages,
                                              max_tokens=6)
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": "And then? " * 10}]
            parts = c.chat.completions.create(model="default_model", messages=messages,
                                              max_tokens=6, stream=True)
            assert any(p.choices and p.choices[0].delta.content for p in parts)
            assert c.completions.create(model="default_model", prompt="word " * 320,
                                        max_tokens=4).choices[0].text is not None
            status, _ = post(server.url, {"messages": []})
            assert status == 400
        except Exception as e:  # reported below
            errors.append(f"client {i}: {type(e).__name__}: {e}")

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    done.set()
    sampler.join(timeout=15)
    assert not errors, errors
    assert samples and max(samples) <= CACHE_LIMIT
    assert max(samples) > 0  # the cache was used, and kept to its limit
    assert "Traceback" not in server.log()


@pytest.mark.slow
def test_startup_states_the_worst_case_memory(server):
    line = next(x for x in server.lines if "worst-case KV memory" in x)
    assert "64 requests (--max-requests)" in line and "--prompt-cache-bytes 3.8 MiB" in line


def _stream_then_signal(s: Served, sig: int) -> tuple[int, str | None, float]:
    stream = s.client.chat.completions.create(
        model="default_model", max_tokens=256, stream=True,
        messages=[{"role": "user", "content": "Write a very long story about a mountain."}])
    chunks, finish, t0 = 0, None, None
    for chunk in stream:  # ends with the last chunk and [DONE], not a reset
        chunks += 1
        if chunks == 2:
            os.kill(s.proc.pid, sig)
            t0 = time.monotonic()
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return chunks, finish, time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_a_signal_ends_in_flight_streams_cleanly(tmp_path, sig, status):
    s = Served(tmp_path, "--shutdown-grace", "1")
    try:
        chunks, finish, after = _stream_then_signal(s, sig)
        assert finish in ("stop", "length") and chunks >= 2 and after < 15
        assert s.proc.wait(timeout=20) == status, s.log()
    finally:
        s.stop()
    assert "Traceback" not in s.log()
