"""The client side of ``morphkv bench serve --scenario load``: what one simulated user does, with
the official ``openai`` client (good requests) and raw HTTP (malformed ones), each request
recorded as a dict: kind, start/end (perf_counter), ok, status, tokens, prompt_tokens, ttft_s.
"""

from __future__ import annotations

import functools
import http.client
import json
import time

from ..eval.process import stream_chat

QUESTIONS = [
    "Name a color.",
    "What is two plus two?",
    "Give me a word that rhymes with cat.",
    "Name a planet.",
    "What is the opposite of hot?",
    "Say something kind.",
]
TOPICS = ["the Moon", "rivers", "bread", "volcanoes", "owls", "glass", "tea", "bridges"]
FOLLOW_UPS = [
    "Tell me about {}.",
    "What else is interesting about {}?",
    "How do people use {}?",
    "Summarize what we said about {} so far.",
    "What would a child ask about {}?",
]

# malformed requests: (name, body bytes, extra headers); every one must be answered 4xx
SAFE_BAD = [  # also sent to mlx_lm's own server during the load (none of these kill it)
    ("invalid JSON", b'{"messages": [', None),
    ("messages not a list", json.dumps({"messages": "hello"}).encode(), None),
    ("empty messages", json.dumps({"messages": []}).encode(), None),
    ("wrong field type", json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                     "temperature": "warm"}).encode(), None),
    ("negative max_tokens", json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                        "max_tokens": -3}).encode(), None),
    ("unknown model", json.dumps({"model": "gpt-imaginary", "max_tokens": 2,
                                  "messages": [{"role": "user", "content": "Hi"}]}).encode(),
     None),
]
PROBE_BAD = SAFE_BAD + [  # sent once, after the load, one at a time
    ("huge max_tokens", json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                    "max_tokens": 10**9}).encode(), None),
    ("oversized body", b"{}", {"Content-Length": str(10**12)}),
    ("stop not strings", json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                     "max_tokens": 2, "stop": [1]}).encode(), None),
    ("top_k above the vocabulary", json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                               "max_tokens": 2, "top_k": 10**7}).encode(), None),
]


@functools.cache
def long_text(tokens: int) -> str:
    """About ``tokens`` tokens of real English prose (Python's reference docs)."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in ("assignment", "exceptions", "for", "import", "with"))
    return " ".join(text.split())[: tokens * 4]


def _record(kind: str, t0: float, **kw) -> dict:
    return {"kind": kind, "start": t0, "end": time.perf_counter(), "ok": True, "status": 200,
            "tokens": 0, "prompt_tokens": 0, "ttft_s": None, **kw}


def raw_post(url: str, body: bytes, headers: dict | None, timeout: float) -> tuple[int | None, str]:
    """(status or None, text): None when the server answered nothing (reset, hang, close)."""
    host, port = url.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        c.putrequest("POST", "/v1/chat/completions")
        c.putheader("Content-Type", "application/json")
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            c.putheader(k, v)
        c.endheaders()
        c.send(body)
        r = c.getresponse()
        return r.status, r.read().decode(errors="replace")[:300]
    except (OSError, http.client.HTTPException) as e:
        return None, f"{type(e).__name__}: {e}"
    finally:
        c.close()


class User:
    """One simulated client: its own conversation that grows past the budget, and a fixed,
    bounded script of request kinds (the mixed level's 2k- and 8k-token prompts too)."""

    SCRIPT = ["chat", "stream", "completion", "turn", "long", "turn", "drop", "bad"]

    def __init__(self, client, url: str, index: int, max_tokens: int, long_prompt: str):
        self.client, self.url, self.i = client, url, index
        self.max_tokens, self.long_prompt = max_tokens, long_prompt
        self.messages: list[dict] = []
        self.turns = 0

    def step(self, n: int, kinds: list[str] | None = None) -> dict:
        script = kinds or self.SCRIPT
        kind = script[(self.i + n) % len(script)]
        return getattr(self, f"_{kind}")(n)

    def ask(self, kind: str, content: str | None = None, stream: bool = False, drop=False,
            **kw) -> dict:
        """One request of ``kind`` (a chat of ``content``, or ``kw`` as they are), recorded."""
        t0 = time.perf_counter()
        kw.setdefault("max_tokens", self.max_tokens)
        if content is not None:
            kw["messages"] = [{"role": "user", "content": content}]
        try:
            if stream:
                r = stream_chat(self.client, drop=drop, **kw)
                first = r["first"]
                return _record(kind, t0, tokens=r["tokens"], prompt_tokens=r["prompt_tokens"],
                               ttft_s=None if first is None else first - t0)
            create = self.client.completions if "prompt" in kw else self.client.chat.completions
            r = create.create(model="default_model", **kw)
            if "messages" in kw and content is None:  # a turn of the conversation
                self.messages.append({"role": "assistant",
                                      "content": r.choices[0].message.content})
            return _record(kind, t0, tokens=r.usage.completion_tokens,
                           prompt_tokens=r.usage.prompt_tokens)
        except Exception as e:  # recorded
            if kind == "turn":
                self.messages.pop()
            return _record(kind, t0, ok=False, status=getattr(e, "status_code", None),
                           error=f"{type(e).__name__}: {e}"[:300])

    def _chat(self, n: int) -> dict:
        return self.ask("chat", QUESTIONS[(self.i + n) % len(QUESTIONS)])

    def _stream(self, n: int, drop: bool = False) -> dict:
        story = "Write a story about " + TOPICS[(self.i + n) % len(TOPICS)] + "."
        return self.ask("drop" if drop else "stream", story, stream=True, drop=drop,
                        max_tokens=self.max_tokens * (8 if drop else 1))

    def _drop(self, n: int) -> dict:
        return self._stream(n, drop=True)

    def _completion(self, n: int) -> dict:
        return self.ask("completion", prompt=f"The {TOPICS[(self.i + n) % len(TOPICS)]} is")

    def _long(self, n: int) -> dict:
        return self.ask("long", self.long_prompt + "\n\nSummarize this.")

    def _turn(self, n: int) -> dict:
        topic = TOPICS[(self.i + self.turns // len(FOLLOW_UPS)) % len(TOPICS)]
        self.messages.append(
            {"role": "user", "content": FOLLOW_UPS[self.turns % len(FOLLOW_UPS)].format(topic)})
        self.turns += 1
        return self.ask("turn", messages=self.messages)

    def _long2k(self, n: int, k: int = 2) -> dict:  # streamed: its time to first token
        return self.ask(f"long{k}k", f"Document {self.i}-{n}. {long_text(k * 1000)}\n\n"
                        "Summarize this.", stream=k == 2)

    def _long8k(self, n: int) -> dict:
        return self._long2k(n, 8)

    def _bad(self, n: int) -> dict:
        name, body, headers = SAFE_BAD[(self.i + n) % len(SAFE_BAD)]
        t0 = time.perf_counter()
        status, text = raw_post(self.url, body, headers, timeout=60)
        return _record("bad", t0, ok=status is not None and 400 <= status < 500, status=status,
                       name=name, error=None if status and status < 500 else text)
