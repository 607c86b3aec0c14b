"""What ``morphkv serve`` checks before mlx_lm's server sees a request.

mlx_lm's handler (``mlx_lm.server.APIHandler``) validates the sampling numbers itself, but some
malformed requests get past it: an empty message list is answered 404 naming nothing, a
``stop`` that is not a string or a ``top_k`` above the vocabulary raises inside the generation
thread (the server then answers nothing but "generation thread died"), a negative
``Content-Length`` blocks the handler forever, a body that is not UTF-8 drops the connection
with a traceback, ``stream_options`` without ``include_usage`` fails after the stream began.
``check_body`` refuses all of these with a 4xx and a message naming the field; it is pure (no
MLX, no server) so it can be tested on its own. The handler that applies it is in
``morphkv.server.handler``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
TEXT_PATHS = ("/v1/completions",)
DEFAULT_NAME = "default_model"  # mlx_lm's name for the served model; requests are normalized to it


class Refusal(Exception):
    """A request this server refuses: an HTTP status and a message naming the problem."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Limits:
    names: frozenset  # model names a request may use
    shown_name: str  # the name error messages and /v1/models show first
    max_body_bytes: int
    max_request_tokens: int  # the most a request's max_tokens may ask for
    vocab_size: int | None  # token ids (logit_bias) and top_k are checked against it


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _kind(v) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
             int: "an integer", float: "a number"}
    return names.get(type(v), "null" if v is None else f"a {type(v).__name__}")


def bad(message: str, status: int = 400) -> Refusal:
    return Refusal(status, message)


def check_length(header: str | None, limits: Limits) -> int:
    """The body's length from ``Content-Length``, or a Refusal (411, 400, 413)."""
    if header is None:
        raise bad("Content-Length header is required", 411)
    try:
        n = int(header)
    except ValueError:
        raise bad(f"Content-Length {header!r} is not a number") from None
    if n < 0:
        raise bad(f"Content-Length {n} is negative")
    if n > limits.max_body_bytes:
        raise bad(
            f"request body of {n} bytes is over this server's limit of {limits.max_body_bytes} "
            "bytes (--max-body-bytes)",
            413,
        )
    return n


def parse_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"request body is not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise bad("request body is empty: send a JSON object")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(
            f"invalid JSON in request body: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    if not isinstance(body, dict):
        raise bad(f"request body must be a JSON object, not {_kind(body)}")
    return body


def _check_messages(messages) -> None:
    if messages is None:
        raise bad("messages is required: a list of {role, content} objects")
    if not isinstance(messages, list):
        raise bad(f"messages must be a list of {{role, content}} objects, not {_kind(messages)}")
    if not messages:
        raise bad("messages is empty: send at least one message")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with role and content, not {_kind(m)}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad(f"{where}.role must be a non-empty string, not {_kind(role)}")
        content = m.get("content")
        if content is None:
            if role in ("assistant", "tool"):
                continue  # an assistant message may carry only tool calls
            raise bad(f"{where}.content is required for role {role!r}")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise bad(f"{where}.content must be a string or a list of parts, not {_kind(content)}")
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise bad(
                    f"{where}.content[{j}] must be a text part ({{type: 'text', text: ...}}); "
                    "this server serves text only"
                )
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{j}].text must be a string")


def _check_tokens(body: dict, limits: Limits) -> None:
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is None:
            continue
        if not _is_int(v):
            raise bad(f"{key} must be an integer, not {_kind(v)}")
        if v < 1:
            raise bad(f"{key} must be at least 1 (got {v})")
        if v > limits.max_request_tokens:
            raise bad(
                f"{key} {v} is over this server's limit of {limits.max_request_tokens} "
                "(--max-request-tokens)"
            )


def _check_sampling(body: dict, limits: Limits) -> None:
    """What mlx_lm checks too late (inside the generation thread) or not at all."""
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad("stop must be a non-empty string or a list of non-empty strings")
    vocab = limits.vocab_size
    top_k = body.get("top_k")
    if _is_int(top_k) and vocab is not None and top_k > vocab:
        raise bad(f"top_k {top_k} is over the vocabulary size {vocab}")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad(f"logit_bias must be an object of token id -> number, not {_kind(bias)}")
        for k, v in bias.items():
            try:
                token = int(k)
            except ValueError:
                raise bad(f"logit_bias key {k!r} is not a token id") from None
            if token < 0 or (vocab is not None and token >= vocab):
                raise bad(f"logit_bias token id {token} is outside the vocabulary [0, {vocab})")
            if not _is_number(v):
                raise bad(f"logit_bias[{k!r}] must be a number, not {_kind(v)}")
    for key in ("seed", "top_logprobs"):
        v = body.get(key)
        if v is not None and not _is_int(v):
            raise bad(f"{key} must be an integer, not {_kind(v)}")
    for key in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty"):
        v = body.get(key)
        if v is not None and not _is_number(v):
            raise bad(f"{key} must be a number, not {_kind(v)}")
    seed = body.get("seed")
    if seed is not None and not 0 <= seed < 2**63:
        raise bad(f"seed must be in [0, 2**63), got {seed}")
    n = body.get("n")
    if n is not None and n != 1:
        raise bad(f"n must be 1 (this server returns one choice), got {n!r}")


def _check_options(body: dict) -> None:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad(f"stream must be a boolean, not {_kind(stream)}")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad(f"stream_options must be an object, not {_kind(options)}")
        usage = options.get("include_usage", False)
        if not isinstance(usage, bool):
            raise bad(f"stream_options.include_usage must be a boolean, not {_kind(usage)}")
        body["stream_options"] = {**options, "include_usage": usage}
    for key, kind in (("tools", list), ("role_mapping", dict), ("chat_template_kwargs", dict)):
        v = body.get(key)
        if v is not None and not isinstance(v, kind):
            raise bad(f"{key} must be {_kind(kind())}, not {_kind(v)}")
    if body.get("adapters") is not None:
        raise bad("adapters are not supported by morphkv serve")
    if body.get("draft_model") not in (None, DEFAULT_NAME):
        raise bad("draft models are not supported by morphkv serve")


def check_body(path: str, body: dict, limits: Limits) -> dict:
    """The body to hand mlx_lm (the model name normalized to ``default_model`` so requests
    naming the model either way share one batch), or a Refusal naming the problem."""
    model = body.get("model", DEFAULT_NAME)
    if not isinstance(model, str):
        raise bad(f"model must be a string, not {_kind(model)}")
    if model not in limits.names:
        raise bad(
            f"model {model!r} is not served here; this server serves {limits.shown_name!r} "
            f"(or use {DEFAULT_NAME!r}; GET /v1/models lists the names)",
            404,
        )
    if path in CHAT_PATHS:
        _check_messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad(f"prompt must be a string, not {_kind(prompt)}")
        if not prompt:
            raise bad("prompt is empty")
    _check_tokens(body, limits)
    _check_options(body)
    _check_sampling(body, limits)
    return {**body, "model": DEFAULT_NAME}


def models_listing(limits: Limits, created: int) -> dict:
    """``GET /v1/models``: the served model's names, the shown name first."""
    names = [limits.shown_name] + sorted(n for n in limits.names if n != limits.shown_name)
    data = [{"id": n, "object": "model", "created": created, "owned_by": "morphkv"} for n in names]
    return {"object": "list", "data": data}
