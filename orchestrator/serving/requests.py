"""The front's requests, transport-neutral: what both APIs parse into, and what comes back. Errors are ValueErrors
starting with the field (``prompt: ...``): gRPC INVALID_ARGUMENT, HTTP 400 naming its parameter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.embedded import encode_prompt
from specdec.config import FrontConfig
from specdec.sampling import GREEDY, SamplingParams
from specdec.stats import GenerationStats
from specdec.tree_spec import TreeSpec

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_CHARS = 128
REQUEST_ID = re.compile(r"[A-Za-z0-9._:@+=-]+")  # echoed in every chunk and written to logs: no spaces or controls


class RequestIdInUse(Exception):
    """A request with this id is already running on this front."""


@dataclass(frozen=True)
class GenerateCall:
    """One generation request as a client sent it, sampling and tree already validated. prompt: text (chat template
    unless ``raw``), or prompt_ids; max_new_tokens: 0 = the server default; tree: None = front.tree; timeout_s: time
    left (None = no deadline); carrier: W3C trace context; client: admission key; score_only: the prompt's logprobs
    only."""

    request_id: str
    prompt: str = ""
    prompt_ids: tuple[int, ...] = ()
    raw: bool = False
    max_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = GREEDY
    tree: TreeSpec | None = None
    no_spec: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    timeout_s: float | None = None
    carrier: dict | None = None
    client: str = "local"
    score_only: bool = False


@dataclass(frozen=True)
class StreamEvent:
    """A round's tokens and text delta, or the end (``stats`` set, ``tokens`` empty) with the prompt's length;
    logprobs: a TokenLogprob per token (where asked for); prompt_logprobs: the first event's."""

    tokens: list[int]
    text_delta: str
    stats: GenerationStats | None = None
    prompt_tokens: int = 0
    logprobs: tuple = ()
    prompt_logprobs: tuple = ()


def check_call(call: GenerateCall, front: FrontConfig) -> None:
    """The checks that cost nothing, made before tokenizing or a slot; raises ValueError naming the field."""
    rid = call.request_id
    if len(rid) > MAX_REQUEST_ID_CHARS or not REQUEST_ID.fullmatch(rid):
        raise ValueError(f"request_id: 1 to {MAX_REQUEST_ID_CHARS} characters of A-Z a-z 0-9 . _ : @ + = - "
                         f"(got {len(rid)} characters)")
    limits = front.limits
    if len(call.prompt) > limits.max_prompt_bytes or len(call.prompt.encode("utf-8", "surrogatepass")) > limits.max_prompt_bytes:
        raise ValueError(f"prompt: over front.limits.max_prompt_bytes ({limits.max_prompt_bytes} bytes of UTF-8)")
    if len(call.prompt_ids) > front.max_prompt_tokens:
        raise ValueError(f"prompt_ids: {len(call.prompt_ids)} tokens exceed the limit of {front.max_prompt_tokens} tokens")
    if call.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: must be >= 0 (0 = server default), got {call.max_new_tokens}")
    if call.max_new_tokens > limits.max_new_tokens:
        raise ValueError(f"max_new_tokens: {call.max_new_tokens} exceeds front.limits.max_new_tokens "
                         f"({limits.max_new_tokens})")
    if len(call.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in call.stop):
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters")
    if any(not s for s in call.stop):
        raise ValueError("stop: an empty stop string would stop after the first token")
    if call.min_tokens < 0:
        raise ValueError(f"min_tokens: must be >= 0, got {call.min_tokens}")
    if len(call.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(call.stop_token_ids)}")


def to_generation(call: GenerateCall, tokenizer, front: FrontConfig, info) -> GenerationRequest:
    """The round loop's request of a call that passed ``check_call``; info: the target's Info. Raises ValueError
    naming the field. Tokenizes (seconds for megabytes): async callers run it in a thread."""
    ids = prompt_tokens(call, tokenizer, info.vocab_size)
    limit = min(front.max_prompt_tokens, info.context_limit - 1)
    if len(ids) > limit:
        raise ValueError(f"prompt: {len(ids)} tokens exceed the limit of {limit} tokens")
    spec = None
    if not call.no_spec and front.speculate:
        spec = call.tree if call.tree is not None else front.tree
        limit = info.max_tree_nodes or spec.num_nodes
        if spec.num_nodes > limit:
            raise ValueError(f"tree: {spec.num_nodes} nodes exceed the target's limit of {limit} (target.max_tree_nodes)")
    max_new = 0 if call.score_only else max_new_tokens(front, call.max_new_tokens, len(ids))
    if call.min_tokens > max_new:
        raise ValueError(f"min_tokens: {call.min_tokens} exceeds the request's max_new_tokens ({max_new})")
    if bad := [t for t in call.stop_token_ids if not 0 <= t < info.vocab_size]:
        raise ValueError(f"stop_token_ids: {bad[0]} outside the vocabulary [0, {info.vocab_size})")
    return GenerationRequest(ids, max_new, call.stop, spec, call.sampling, ignore_eos=call.ignore_eos,
                             min_tokens=call.min_tokens, stop_token_ids=call.stop_token_ids)


def prompt_tokens(call: GenerateCall, tokenizer, vocab_size: int) -> list[int]:
    """The prompt's token ids: prompt_ids, each inside the vocabulary, or the tokenized text."""
    if call.prompt and call.prompt_ids:
        raise ValueError("prompt: give either prompt (text) or prompt_ids, not both")
    if call.prompt_ids:
        if bad := [t for t in call.prompt_ids if not 0 <= t < vocab_size]:
            raise ValueError(f"prompt_ids: {bad[0]} outside the vocabulary [0, {vocab_size})")
        return list(call.prompt_ids)
    if call.prompt:
        return encode_prompt(tokenizer, call.prompt, call.raw)
    raise ValueError("prompt: empty prompt (set prompt or prompt_ids)")


def max_new_tokens(front: FrontConfig, asked: int, prompt_tokens: int) -> int:
    """max_new_tokens (asked 0 = front.max_new_tokens) under max_kv_tokens_per_request: the default shrinks to fit;
    an explicit value that does not fit raises ValueError naming max_new_tokens (or the prompt, filling the cap)."""
    max_new = asked or front.max_new_tokens
    cap = front.limits.max_kv_tokens_per_request
    if cap is None or prompt_tokens + max_new <= cap:
        return max_new
    if prompt_tokens >= cap:
        raise ValueError(f"prompt: {prompt_tokens} tokens leave no room for new tokens under "
                         f"front.limits.max_kv_tokens_per_request ({cap} tokens)")
    if not asked:
        return cap - prompt_tokens
    raise ValueError(f"max_new_tokens: {prompt_tokens} prompt tokens + {max_new} new tokens exceed "
                     f"front.limits.max_kv_tokens_per_request ({cap} tokens)")
