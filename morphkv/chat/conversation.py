"""One conversation carried by one morphkv cache set: each turn prefills only its new tokens.

The cache holds every token fed so far (bounded by the budget). For turn ``n + 1`` the new
tokens are the chat template of the whole conversation with the new user message, minus the
template of the conversation so far (a text prefix for the usual templates, ChatML among them),
plus whatever closed the last reply that the cache has not seen yet (for SmolLM2: the newline
after ``<|im_end|>``; the ``<|im_end|>`` itself was generated, so it is already in the cache).

mlx_lm's ``generate_step`` feeds every token it yields before yielding it, so after a reply
(stopped by end of turn, by ``max_tokens`` or by the caller at any token) the cache has seen
the prompt plus every generated token, the end-of-turn token included; ``Conversation.fed`` is
checked against the caches' own count after each turn.

Each turn's prompt tokens (the user's message with its template tokens; the system prompt in
the first) are pinned: a bounded cache evicts the assistant's tokens before the user's, so what
the user said stays longest. A config that pins prompts itself (``pin="prompt"``, the preset's)
leaves it to the caches, which do not pin a template sent again (``pin_repeats``); any other
config is pinned here (``morphkv.pin``). ``pin_user=False`` (``morphkv chat --no-pin``)
pins nothing: not the turns, and not the prompts a ``pin="prompt"`` config pins by itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from ..core.config import KVCacheConfig
from ..core.pins import pin
from ..mlxlm.builder import KVCacheBuilder
from ..mlxlm.layout import morph_caches
from ..model.tokenizer import PLAIN_TEMPLATE

PLAIN_STOP = "\n\nUser:"  # a base model continuing PLAIN_TEMPLATE's transcript starts a user turn


@dataclass
class Turn:
    """What one turn fed and produced."""

    number: int
    prompt: list[int]  # the new tokens prefilled for this turn
    tokens: list[int] = field(default_factory=list)  # generated (end-of-turn token included)
    text: str = ""  # the reply (without the end-of-turn token)
    finish: str | None = None  # "stop" (end of turn), "length" (max_tokens), "interrupted"
    last: object = None  # mlx_lm's last GenerationResponse (for the stats block)


class Conversation:
    """A chat over ``model`` whose history lives in one morphkv cache set (see module doc)."""

    def __init__(self, model, tokenizer, config: KVCacheConfig, system_prompt: str | None = None,
                 make_caches: Callable[[], list] | None = None, pin_user: bool = True):
        if not tokenizer.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; chat needs one")
        if not pin_user and config.pin != "none":  # nothing pinned: not the prompts either
            config = replace(config, pin="none")
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.system_prompt = system_prompt
        self.pin_user = pin_user
        plain = getattr(tokenizer, "chat_template", None) == PLAIN_TEMPLATE
        self.stop_text = PLAIN_STOP if plain else None  # ends a reply like an end-of-turn token
        self.make_caches = make_caches or (
            lambda: KVCacheBuilder.for_model(self.model, self.config))
        self.reset()

    def reset(self) -> None:
        """A fresh conversation with fresh caches."""
        self.caches = self.make_caches()
        self.messages: list[dict] = []
        if self.system_prompt:
            self.messages.append({"role": "system", "content": self.system_prompt})
        self.turns = 0
        self.fed = 0  # tokens the caches have seen
        self.pending = ""  # template text that closes the last reply, not yet fed
        self.ahead = ""  # template text the cache saw early (a stop text after the reply)
        self.last: Turn | None = None
        self.pinned: list[list[int]] = []  # [start, end) token ranges pinned so far

    def copy(self) -> Conversation:
        """An independent copy (caches deep-copied through their ``state``): a snapshot to
        come back to."""
        import copy

        other = copy.copy(self)
        other.caches = copy.deepcopy(self.caches)
        other.messages = [dict(m) for m in self.messages]
        other.pinned = [list(r) for r in self.pinned]
        return other

    # ---- the tokens of a turn ----------------------------------------------------------------
    def _template(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def new_tokens(self, user: str) -> list[int]:
        """The tokens turn ``turns + 1`` must prefill for the user message ``user``."""
        messages = [*self.messages, {"role": "user", "content": user}]
        if self.fed == 0:  # exactly what ``morphkv generate`` prefills for one message
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        before = self._template(self.messages, False)
        after = self._template(messages, True)
        ahead, self.ahead = self.ahead, ""
        if after.startswith(before):
            text = self.pending + after[len(before):]
            return self._encode(text[len(ahead):] if text.startswith(ahead) else text)
        # a template that rewrites history: template the new message alone (mlx_lm.chat's way)
        alone = self._template([{"role": "user", "content": user}], True)
        return self._encode(self.pending + alone)

    def _closing(self, prompt_text: str, turn: Turn) -> str:
        """Template text after the reply that the cache has not seen (see module doc)."""
        eos = turn.finish == "stop" and turn.tokens[-1] in self.tokenizer.eos_token_ids
        done = self._template(self.messages, False)
        head = prompt_text + turn.text
        if done.startswith(head):
            closing = done[len(head):]
            eos_text = self.tokenizer.decode(turn.tokens[-1:]) if eos else ""
            if eos_text and closing.startswith(eos_text):
                closing = closing[len(eos_text):]
            return closing
        return "" if eos else (self.tokenizer.eos_token or "")

    # ---- a turn --------------------------------------------------------------------------------
    def turn(self, user: str, *, max_tokens: int, sampler=None, prefill_step_size: int = 2048,
             stop: Callable[[], bool] | None = None, **generate_kwargs) -> Iterator[str]:
        """Run one turn, yielding the reply's text as it streams; ``stop()`` true after a
        token ends the reply there (it stays in the cache and the transcript). The finished
        turn is ``self.last``."""
        import mlx_lm

        prompt_text = self._template([*self.messages, {"role": "user", "content": user}], True)
        prompt = self.new_tokens(user)
        turn = Turn(self.turns + 1, prompt)
        if self.pin_user and self.config.pin != "prompt":  # else the caches pin it themselves
            self.pin_range(self.fed, self.fed + len(prompt))
        resp = None
        interrupted = ended = False
        held = ""  # streamed text held back while it may begin the stop text
        try:
            for resp in mlx_lm.stream_generate(
                self.model, self.tokenizer, prompt, max_tokens=max_tokens, sampler=sampler,
                prompt_cache=self.caches, prefill_step_size=prefill_step_size,
                **generate_kwargs,
            ):
                turn.tokens.append(int(resp.token))
                held += resp.text
                if self.stop_text and self.stop_text in held:
                    held, ended = held[: held.index(self.stop_text)], True
                    break
                keep = _prefix_tail(held, self.stop_text)
                if len(held) > keep:
                    yield held[: len(held) - keep]
                    held = held[len(held) - keep :]
                if stop is not None and stop() and resp.finish_reason is None:
                    interrupted = True
                    break
            if held:
                yield held
        finally:
            self._finish(user, prompt_text, turn, resp, interrupted, ended)

    def _finish(self, user, prompt_text, turn: Turn, resp, interrupted: bool,
                ended: bool = False) -> None:
        if resp is None:  # nothing generated (interrupted during the prefill): undo nothing
            self.fed = self.seen()
            return
        eos_ids = set(self.tokenizer.eos_token_ids)
        turn.finish = "interrupted" if interrupted else resp.finish_reason
        if interrupted and turn.tokens[-1] in eos_ids:
            turn.finish = "stop"
        if turn.finish == "stop" and turn.tokens[-1] not in eos_ids and not ended:
            turn.finish = "length"  # a stop word that is not an end-of-turn token
        body = [t for t in turn.tokens if t not in eos_ids]
        turn.text = self.tokenizer.decode(body)
        if ended:  # the stop text and what came with it: fed, kept out of the reply
            turn.finish = "stop"
            turn.text, self.ahead = turn.text.split(self.stop_text, 1)[0], turn.text
            self.ahead = self.ahead[len(turn.text):]
        turn.last = resp
        content = turn.text  # PLAIN_TEMPLATE writes "Assistant: " + content; the reply's space
        if self.stop_text and content.startswith(" "):  # came from the model
            content = content[1:]
        self.messages += [{"role": "user", "content": user},
                          {"role": "assistant", "content": content}]
        self.pending = self._closing(prompt_text, turn)
        self.turns = turn.number
        self.fed += len(turn.prompt) + len(turn.tokens)
        self.last = turn
        seen = self.seen()
        if seen is not None and seen != self.fed:
            raise RuntimeError(f"the caches saw {seen} tokens, the conversation fed {self.fed}")

    def resume(self, loaded) -> None:
        """Continue a saved session (``morphkv.chat.session.Loaded``): its caches, transcript
        and pins."""
        self.config, self.system_prompt = loaded.config, loaded.system_prompt
        self.caches, self.messages, self.turns = loaded.caches, loaded.messages, loaded.turns
        self.fed, self.pending, self.last, self.pinned = loaded.fed, loaded.pending, None, []
        for start, end in loaded.pins:
            self.pin_range(start, end)

    def pin_range(self, start: int, end: int) -> None:
        """Pin token positions [start, end) in the caches (a turn's prompt; a loaded session's
        pins)."""
        pin(self.caches, range(start, end))
        self.pinned.append([start, end])

    # ---- what the cache holds ------------------------------------------------------------------
    def seen(self) -> int | None:
        """Tokens the caches have seen (their own count; None when there is no morphkv
        layer)."""
        caches = morph_caches(self.caches) or self.caches
        counts = {int(getattr(c, "offset", 0)) for c in caches}
        if len(counts) > 1:
            raise RuntimeError(f"layers disagree on tokens seen: {sorted(counts)}")
        return counts.pop() if counts else None

    def cache_bytes(self) -> int:
        """Every byte the caches hold (morphkv: K/V storage + selection state)."""
        return sum(int(getattr(c, "nbytes", 0)) for c in self.caches)


def _prefix_tail(text: str, stop: str | None) -> int:
    """Length of the longest end of ``text`` that begins ``stop`` (held back from the stream)."""
    if not stop:
        return 0
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0
