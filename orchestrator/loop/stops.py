"""Stop conditions on committed tokens, one at a time. As transformers ``generate``: the token that triggers a stop
is kept; nothing after it is emitted, counted or cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StopChecker:
    """Feed generated tokens with ``push``; it says when to stop and why (``reason``). context_limit: max total
    length, prompt included; decode: ids -> text (for stop strings only); streamed: the prompt's tail an earlier
    part of this request generated (fail-over), seen by stop strings, counted in neither budget; min_tokens and
    stop_token_ids (reason "stop_token", even with ignore_eos): vLLM's."""

    prompt_len: int
    max_new_tokens: int
    context_limit: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    decode: object = None
    streamed: tuple[int, ...] = ()
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    generated: list[int] = field(default_factory=list)
    reason: str | None = None
    _window: int = 0

    def __post_init__(self):
        # a stop string of L characters spans at most 4L UTF-8 bytes, so at most 4L tokens, plus a few whose
        # partial characters decode as U+FFFD at the window's start
        self._window = 4 * max((len(s) for s in self.stop_strings), default=0) + 8

    def push(self, token: int) -> bool:
        """Record one committed token; True if generation stops after it."""
        assert self.reason is None, "push after stop"
        self.generated.append(token)
        stoppable = len(self.generated) >= self.min_tokens
        if stoppable and token in self.eos_token_ids:
            self.reason = "eos"
        elif stoppable and token in self.stop_token_ids:
            self.reason = "stop_token"
        elif stoppable and self._hits_stop_string():
            self.reason = "stop_string"
        elif len(self.generated) >= self.max_new_tokens:
            self.reason = "max_new_tokens"
        elif self.prompt_len + len(self.generated) >= self.context_limit:
            self.reason = "context_limit"
        return self.reason is not None

    def _hits_stop_string(self) -> bool:
        if not self.stop_strings:
            return False
        # the last tokens (the streamed tail too) with and without the new one, decoded from the same token on
        tail = [*self.streamed[-self._window:], *self.generated][-self._window - 1:]
        before, text = self.decode(tail[:-1]), self.decode(tail)
        # only a match ending inside the changed part is new; it starts where old and new text first differ (a
        # multi-byte character split across tokens decodes as U+FFFD first and changes in place once complete)
        same = next((i for i, (a, b) in enumerate(zip(before, text)) if a != b), min(len(before), len(text)))
        return any(text.find(s, max(0, same - len(s) + 1)) >= 0 for s in self.stop_strings)

    def budget(self) -> int:
        """How many more tokens may still be committed (>= 1 while not stopped)."""
        total = self.prompt_len + len(self.generated)
        return min(self.max_new_tokens - len(self.generated), self.context_limit - total)
