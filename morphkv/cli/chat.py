"""Chat in the terminal with a constant-size KV cache: each turn prefills only its new tokens.

mlx_lm.chat's habits (its flags where they apply, ``q`` / ``r`` / ``h``) with one morphkv cache
set carrying the whole conversation, so memory stays bounded however long it gets. Replies
stream to stdout; after each reply one status line goes to stderr (turn, tokens seen and kept
per KV head, cache memory, tokens/s), as do notices and errors, with stdin a terminal or not.
With stdin not a terminal, each line is one user turn (or a command).

Ctrl-C during a reply stops it at the next token: the partial reply stays in the cache and in
the transcript, and the next turn closes it as the template does. Ctrl-C at the prompt exits
with status 130, Ctrl-D (end of input) with 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from ..runtime.argtypes import Number, UsageError, add_number, model_ref
from ..runtime.cache_flags import (
    DEFAULT_PRESET,
    OVERRIDES,
    add_cache_flags,
    config_from_flags,
    describe,
    resolve_for_model,
)
from ..runtime.program import INTERRUPTED
from .gen_stats import cache_stats, fmt_bytes, format_stats

DEFAULT_BUDGET = 512
DEFAULT_MAX_TOKENS = 256  # mlx_lm.chat's
SEED_MAX = 2**32 - 1
HELP = """commands (a line that is only the command):
  /help, h          this help
  /reset, r         start a new conversation (fresh caches)
  /quit, q          exit (also Ctrl-D; Ctrl-C at the prompt exits with status 130)
  /stats            the stats block of morphkv generate for the last turn
  /save FILE        save the session (.safetensors appended when missing)
  /load FILE        continue a saved session (same model and cache setting)
  //text            send "/text" as a message
Ctrl-C during a reply stops the reply; it stays in the conversation."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=model_ref, default=None,
        help="A .gguf file (llama, qwen2, qwen3, gemma3), gemma3-270m (Gemma 3 270M base: "
        "a plain-text User/Assistant transcript), qwen2.5-0.5b (Qwen2.5-Coder-0.5B-Instruct), "
        "an mlx_lm model folder or Hugging Face repo id; "
        "default: the embedded SmolLM2-135M-Instruct.")
    parser.add_argument("--system-prompt", default=None,
                        help="System message (default: the template's own).")
    add_number(parser, "--max-tokens", "-m", kind=Number(int, lo=1), default=DEFAULT_MAX_TOKENS,
               help="Most tokens per reply")
    add_number(parser, "--temp", kind=Number(float, lo=0), default=0.0,
               help="Sampling temperature, 0: greedy")
    add_number(parser, "--top-p", kind=Number(float, lo=0, hi=1, lo_open=True), default=1.0,
               help="Nucleus sampling threshold, 1: off")
    add_number(parser, "--seed", kind=Number(int, lo=0, hi=SEED_MAX), default=0,
               help="PRNG seed (sampling and the random rule)")
    add_number(parser, "--prefill-step-size", kind=Number(int, lo=1), default=2048,
               help="Prompt tokens per prefill chunk")
    parser.add_argument("--load", metavar="FILE", default=None,
                        help="Resume a session saved with /save (its cache setting is used "
                        "unless cache flags are given, which must then match it).")
    parser.add_argument("--no-pin", action="store_true",
                        help="Do not pin your turns (by default a bounded cache evicts the "
                        "assistant's tokens before yours: morphkv.pin); also --pin none.")
    add_cache_flags(parser, DEFAULT_BUDGET)


def _cache_flags_given(args) -> bool:
    return (args.preset != DEFAULT_PRESET or args.budget != DEFAULT_BUDGET
            or getattr(args, "kv_memory", None) is not None
            or any(getattr(args, dest) is not None for dest in OVERRIDES))


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class StopOnInterrupt:
    """While a reply streams, Ctrl-C sets ``hit`` instead of interrupting (the reply then ends
    at a token boundary, so every layer's cache has seen the same tokens)."""

    def __enter__(self):
        self.hit = False
        self.old = signal.getsignal(signal.SIGINT)
        if self.old is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.hit = True

    def __exit__(self, *exc) -> bool:
        if self.old is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, self.old)
        return False


class Chat:
    """The read-reply loop over one ``Conversation``."""

    def __init__(self, args, model, tokenizer, conv, model_name: str, fingerprint: str):
        from mlx_lm.sample_utils import make_sampler

        self.args, self.model, self.tokenizer, self.conv = args, model, tokenizer, conv
        self.model_name, self.fingerprint = model_name, fingerprint
        self.sampler = make_sampler(args.temp, args.top_p)
        self.interactive = sys.stdin.isatty()
        if not self.interactive and hasattr(sys.stdin, "reconfigure"):
            sys.stdin.reconfigure(errors="replace")  # a stray byte is U+FFFD, not a crash

    def read(self) -> str | None:
        """The next input line (None at end of input)."""
        if self.interactive:
            try:
                return input(">> ")
            except EOFError:
                print(file=sys.stderr)
                return None
        line = sys.stdin.readline()
        return None if line == "" else line.rstrip("\r\n")

    def loop(self) -> int:
        while True:
            try:
                line = self.read()
            except KeyboardInterrupt:  # in-process callers; the command exits in its handler
                print(file=sys.stderr)
                return INTERRUPTED
            if line is None:
                return 0
            text = line.strip()
            if not text:
                continue
            if text in ("h", "r", "q") or (text.startswith("/") and not text.startswith("//")):
                name, _, arg = text.lstrip("/").partition(" ")
                name = {"h": "help", "r": "reset", "q": "quit"}.get(name, name.lower())
                if name == "quit":
                    return 0
                self.command(name, arg.strip())
                continue
            self.reply(text[1:] if text.startswith("//") else line)

    def reply(self, user: str) -> None:
        start = time.perf_counter()
        with StopOnInterrupt() as ctrl_c:
            for piece in self.conv.turn(user, max_tokens=self.args.max_tokens,
                                        sampler=self.sampler,
                                        prefill_step_size=self.args.prefill_step_size,
                                        stop=lambda: ctrl_c.hit):
                print(piece, end="", flush=True)
        print(flush=True)
        _note(status_line(self.conv, time.perf_counter() - start))

    def command(self, name: str, arg: str) -> None:
        from ..chat import session

        if name == "help":
            print(HELP, flush=True)
        elif name == "reset":
            self.conv.reset()
            _note("reset: a new conversation (fresh caches)")
        elif name == "stats":
            print(self.stats(), flush=True)
        elif name in ("save", "load") and not arg:
            _note(f"/{name} needs a file name: /{name} FILE")
        elif name == "save":
            path = session.session_path(arg)
            try:
                seconds = session.save(path, self.conv, self.model_name, self.fingerprint)
            except session.SessionError as e:
                _note(f"error: {e}")
                return
            _note(f"saved turn {self.conv.turns} to {path} "
                  f"({fmt_bytes(path.stat().st_size)}, {seconds:.2f} s)")
        elif name == "load":
            try:
                loaded = session.load(session.session_path(arg), self.model, self.model_name,
                                      self.fingerprint, self.conv.config)
            except session.SessionError as e:
                _note(f"error: {e}; the current conversation goes on")
                return
            self.resume(loaded, session.session_path(arg))
        else:
            _note(f"unknown command /{name} (see /help; //text sends text starting with /)")

    def resume(self, loaded, path) -> None:
        conv = self.conv
        conv.resume(loaded)
        stats = cache_stats(_morph(conv.caches))
        _note(f"loaded {path}: {loaded.turns} turns, seen {stats.tokens_seen}, kept "
              f"{stats.tokens_kept} per KV head ({loaded.seconds:.2f} s)")

    def stats(self) -> str:
        import mlx.core as mx

        turn = self.conv.last
        if turn is None or turn.last is None:
            return f"no turn since the start, /reset or /load yet (turns so far: {self.conv.turns})"
        stats = cache_stats(_morph(self.conv.caches))
        block = format_stats(turn.last, stats, mx.get_peak_memory() / 1e9, self.conv.config)
        return f"{block}\nTurns:       {self.conv.turns}, tokens fed {self.conv.fed}"


def _morph(caches):
    from ..mlxlm.layout import morph_caches

    return morph_caches(caches)


def status_line(conv, seconds: float) -> str:
    """One line after a reply: turn, seen/kept per KV head, cache memory, speed."""
    turn, stats = conv.last, cache_stats(_morph(conv.caches))
    resp = turn.last
    held = stats.storage_bytes + stats.engine_bytes
    line = (f"[turn {turn.number}] seen {stats.tokens_seen}, kept {stats.tokens_kept} per KV "
            f"head · cache {fmt_bytes(held)} (K/V {fmt_bytes(stats.storage_bytes)} + selection "
            f"{fmt_bytes(stats.engine_bytes)}) · prompt {len(turn.prompt)} tokens")
    if resp is not None:
        line += (f" {resp.prompt_tps:.0f} tok/s · reply {len(turn.tokens)} tokens "
                 f"{resp.generation_tps:.1f} tok/s")
    line += f" · {seconds:.1f} s"
    if turn.finish == "interrupted":
        line += " · stopped by Ctrl-C (kept in the conversation)"
    elif turn.finish == "length":
        line += " · cut at --max-tokens"
    return line


def run(args) -> int:
    import mlx.core as mx

    from ..chat import session
    from ..chat.conversation import Conversation
    from ..model import DEFAULT_MODEL_NAME
    from .generate import load_model

    config = config_from_flags(args, seed=args.seed)
    if args.load is not None and not session.session_path(args.load).is_file():
        raise UsageError(f"--load {args.load}: no such file")
    mx.random.seed(args.seed)
    model, tokenizer = load_model(args.model)
    if not tokenizer.has_chat_template:
        raise UsageError(f"--model {args.model}: its tokenizer has no chat template")
    model_name = args.model or DEFAULT_MODEL_NAME
    config = resolve_for_model(model, config)
    fingerprint = session.model_fingerprint(model)
    loaded = None
    if args.load is not None:
        try:
            loaded = session.load(session.session_path(args.load), model, model_name,
                                  fingerprint, config if _cache_flags_given(args) else None)
        except session.SessionError as e:
            raise UsageError(str(e)) from None
        config = loaded.config
    conv = Conversation(model, tokenizer, config, args.system_prompt, pin_user=not args.no_pin)
    chat = Chat(args, model, tokenizer, conv, model_name, fingerprint)
    _note(f"morphkv chat: {model_name} · {describe(config)} · /help for commands")
    if loaded is not None:
        chat.resume(loaded, session.session_path(args.load))
    return chat.loop()
