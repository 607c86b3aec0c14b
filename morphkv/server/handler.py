"""The HTTP side of ``morphkv serve``: mlx_lm's ``APIHandler``, subclassed, not copied.

What the subclass adds in front of mlx_lm's own code:

* every POST is checked first (``morphkv.server.guard``): a malformed request is a 4xx whose
  message names the problem, before mlx_lm reads it; the body mlx_lm then reads is the checked
  one (model name normalized, so requests naming the model either way batch together);
* ``GET /v1/models`` lists the served model (mlx_lm's scans a Hugging Face cache directory and
  answers an empty 200 where there is none); ``GET /morphkv/stats`` reports memory;
* a client that goes away is noticed at its next token (streamed or not) and its request is
  stopped, which frees its batch slot at the next decode step; the log gets one line;
* errors mlx_lm answers 404 whatever they are (a chat template refusing the messages, a dead
  generation thread) get a status that fits: 400, 503 or 500;
* at shutdown, in-flight responses end cleanly (the stream's last chunk and ``[DONE]``) once
  the grace period is over, and new requests get 503.
"""

from __future__ import annotations

import io
import json
import logging
import select
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from urllib.parse import unquote

from mlx_lm.server import APIHandler

from .guard import (
    CHAT_PATHS,
    TEXT_PATHS,
    Limits,
    Refusal,
    check_body,
    check_length,
    models_listing,
    parse_body,
)

CLIENT_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)
IDLE_TIMEOUT_S = 60  # a client silent this long (request, body, reading the answer) is dropped


class ClientGone(ConnectionError):
    """The client closed its connection while its request was being answered."""


class Lifecycle:
    """Requests in flight and the shutdown state, shared by the handlers and the server loop."""

    def __init__(self, max_requests: int, on_idle=None):
        self.max_requests = max_requests
        self.on_idle = on_idle  # called when the last request in flight leaves
        self._cond = threading.Condition()
        self.in_flight = 0
        self.served = 0
        self.stopping = False
        self._cut_at: float | None = None

    def enter(self) -> Refusal | None:
        with self._cond:
            if self.stopping:
                return Refusal(503, "the server is shutting down")
            if self.in_flight >= self.max_requests:
                return Refusal(
                    503, f"server busy: {self.in_flight} requests in flight (--max-requests)"
                )
            self.in_flight += 1
            return None

    def leave(self) -> None:
        with self._cond:
            self.in_flight -= 1
            self.served += 1
            idle = self.in_flight == 0
            self._cond.notify_all()
        if idle and self.on_idle is not None:
            self.on_idle()

    def begin_stop(self, grace_s: float) -> None:
        with self._cond:
            self.stopping = True
            self._cut_at = time.monotonic() + grace_s

    def cut(self) -> bool:
        """True once in-flight responses are to be ended (shutdown grace period over)."""
        return self._cut_at is not None and time.monotonic() >= self._cut_at

    def wait_idle(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.in_flight == 0, timeout=timeout_s)


def _status_of(error: BaseException) -> int:
    """The status for an error mlx_lm's handler answers 404 whatever it is."""
    if isinstance(error, RuntimeError) and "generation thread died" in str(error):
        return 503
    if isinstance(error, (ValueError, TypeError, KeyError, IndexError)):
        return 400
    if type(error).__module__.startswith("jinja2"):  # the chat template refused the messages
        return 400
    return 500


class _Watched:
    """The handler's view of mlx_lm's ResponseGenerator: its token stream checks the client
    and the shutdown state between tokens."""

    def __init__(self, inner, handler: GuardedHandler):
        self._inner, self._handler = inner, handler

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def generate(self, request, args, progress_callback=None):
        h = self._handler

        def progress(processed, total):
            h.check_client()
            if progress_callback is not None:
                progress_callback(processed, total)

        try:
            ctx, response = self._inner.generate(request, args, progress_callback=progress)
        except Exception as e:
            h.generation_error = e  # mlx_lm answers it; _set_completion_headers picks the status
            logging.warning("request failed before generation: %s: %s", type(e).__name__, e)
            raise
        return ctx, h.watch(response)


class GuardedHandler(APIHandler):
    """mlx_lm's handler with the guards of the module docstring (set up by ``handler_for``)."""

    limits: Limits
    life: Lifecycle
    stats: staticmethod
    timeout = IDLE_TIMEOUT_S

    def __init__(self, response_generator, *args, **kwargs):
        self.generation_error: BaseException | None = None
        self.headers_sent = False
        self.tokens_sent = 0
        super().__init__(_Watched(response_generator, self), *args, **kwargs)

    # ---- plumbing ------------------------------------------------------------------------
    def log_message(self, format, *args):  # noqa: A002 (BaseHTTPRequestHandler's signature)
        logging.info("%s %s", self.address_string(), format % args)

    def send_response(self, code, message=None):
        self.headers_sent = True
        super().send_response(code, message)

    def _set_completion_headers(self, status_code: int = 200):
        if status_code == 404 and self.generation_error is not None:
            status_code = _status_of(self.generation_error)
        super()._set_completion_headers(status_code)

    def send_json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        super()._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        if status >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def refuse(self, r: Refusal) -> None:
        logging.warning("refused %s %s: %d %s", self.command, self.path, r.status, r.message)
        kind = "invalid_request_error" if r.status < 500 else "server_error"
        self.send_json(r.status, {"error": {"message": r.message, "type": kind, "code": r.status}})

    def check_client(self) -> None:
        """Raise ClientGone if the client closed its connection (a readable socket with
        nothing to read is a closed one)."""
        sock = self.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable and not sock.recv(1, socket.MSG_PEEK):
                raise ClientGone("the client closed the connection")
        except ClientGone:
            raise
        except (OSError, ValueError) as e:
            raise ClientGone(str(e)) from None

    def watch(self, response):
        for item in response:
            if self.life.cut():
                logging.warning("shutting down: ended a response after %d tokens",
                                self.tokens_sent)
                return  # mlx_lm then sends the last chunk and [DONE]; ctx.stop() frees the slot
            self.check_client()
            self.tokens_sent += 1
            yield item

    def handle(self):
        try:
            super().handle()
        except CLIENT_GONE as e:
            logging.info("client %s went away: %s", self.address_string(), e)

    # ---- requests --------------------------------------------------------------------------
    def do_POST(self):
        refusal = self.life.enter()
        if refusal is not None:
            return self.refuse(refusal)
        try:
            self._post()
        except (ClientGone, *CLIENT_GONE) as e:
            self.close_connection = True
            logging.warning(
                "client %s went away during POST %s after %d tokens (%s); its request was "
                "stopped", self.address_string(), self.path, self.tokens_sent,
                type(e).__name__)
        except Exception as e:
            logging.exception("unexpected error in POST %s", self.path)
            if not self.headers_sent:
                self.refuse(Refusal(500, f"internal error: {type(e).__name__}: {e}"))
        finally:
            self.life.leave()

    def _post(self):
        if self.path not in CHAT_PATHS + TEXT_PATHS:
            return self.refuse(Refusal(
                404, f"no such endpoint: POST {self.path} (this server answers POST "
                "/v1/chat/completions and /v1/completions)"))
        try:
            n = check_length(self.headers.get("Content-Length"), self.limits)
            raw = self._read_body(n)
            body = check_body(self.path, parse_body(raw), self.limits)
        except Refusal as r:
            if r.status == 413:
                self._discard_body()
            return self.refuse(r)
        data = json.dumps(body).encode()
        del self.headers["Content-Length"]
        self.headers["Content-Length"] = str(len(data))
        real, self.rfile = self.rfile, io.BytesIO(data)  # mlx_lm reads the checked body
        try:
            super().do_POST()
        finally:
            self.rfile = real

    def _read_body(self, n: int) -> bytes:
        try:
            raw = self.rfile.read(n)
        except TimeoutError:
            raise Refusal(408, f"request body not received within {IDLE_TIMEOUT_S} s") from None
        if len(raw) < n:
            raise Refusal(400, f"request body ended after {len(raw)} of {n} bytes")
        return raw

    def _discard_body(self) -> None:
        """Read (a bounded part of) a body refused for its size, so the client gets the answer
        instead of a reset."""
        self.connection.settimeout(1.0)
        try:
            for _ in range(64):
                if not self.rfile.read1(1 << 20):
                    break
        except OSError:
            pass

    def do_GET(self):
        path = self.path.split("?")[0].rstrip("/")
        if path == "/v1/models":
            return self.send_json(200, models_listing(self.limits, self.created))
        if path.startswith("/v1/models/"):
            name = unquote(path[len("/v1/models/"):])
            listing = models_listing(self.limits, self.created)["data"]
            found = [m for m in listing if m["id"] == name]
            if found:
                return self.send_json(200, found[0])
            return self.refuse(Refusal(404, f"model {name!r} is not served here"))
        if path == "/health":
            if self.life.stopping:
                return self.send_json(503, {"status": "stopping"})
            return self.handle_health_check()
        if path == "/morphkv/stats":
            return self.send_json(200, {**self.stats(), "requests_in_flight": self.life.in_flight,
                                        "requests_served": self.life.served})
        return self.refuse(Refusal(404, f"no such endpoint: GET {self.path}"))


def handler_for(limits: Limits, life: Lifecycle, stats) -> type[GuardedHandler]:
    return type("MorphKVHandler", (GuardedHandler,),
                {"limits": limits, "life": life, "stats": staticmethod(stats)})


class Server(ThreadingHTTPServer):
    """One thread per connection (daemon threads); a deeper accept queue than the default 5,
    so a burst of clients is not refused at connect; errors are one log line."""

    daemon_threads = True
    request_queue_size = 128

    def handle_error(self, request, client_address):
        error = sys.exc_info()[1]
        if isinstance(error, CLIENT_GONE):
            logging.info("client %s went away: %s", client_address, error)
        else:
            logging.exception("unexpected error serving %s", client_address)
