"""OpenAI-compatible HTTP API of the front (FastAPI on uvicorn, in the front's event loop): a request's JSON becomes
a ``GenerateCall``, its ``StreamEvent``s OpenAI's objects (docs/http-api.md). A stream's headers go out with its
first tokens, so an error before them gets its status, a later one an ``{"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from google.protobuf.json_format import MessageToDict
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.loop.embedded import encode_chat
from orchestrator.serving.admission import RETRY_AFTER_S, AdmissionRefused
from orchestrator.serving.backends import UpstreamError
from orchestrator.serving.requests import GenerateCall, RequestIdInUse, StreamEvent
from orchestrator.serving.runner import RequestRunner
from specdec.config import FrontConfig, GrpcConfig
from specdec.sampling import MAX_LOGPROBS, SamplingParams, SamplingParamsError
from specdec.security import token_accepted
from specdec.tree_spec import TreeSpecError, parse_tree_spec
from specdec.wire import stats_to_proto

log = logging.getLogger(__name__)

INT32 = 2**31
INT64 = 2**63

# OpenAI parameters this server does not implement, with the values that ask for nothing (accepted).
UNSUPPORTED: dict[str, tuple] = {
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}), "best_of": (None, 1),
    "suffix": (None, "")}

# our stop reasons (specdec.stats / orchestrator.loop.stops) -> OpenAI's finish_reason
FINISH_REASONS = {"eos": "stop", "stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length",
                  "context_limit": "length", "aborted": "abort"}


def _is_noop(value, noops: tuple) -> bool:
    return any(value is n or (type(value) is type(n) and value == n) for n in noops)  # False is not 0 here


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        """A null field takes its default (OpenAI's are nullable); a null required one is then missing."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in cls.model_fields)}
        return data


class SpecdecOptions(_Strict):  # the ``specdec`` extension field of a request
    tree: dict | None = None          # TreeSpec JSON (DESIGN.md "TreeSpec"); None = the server's
    no_spec: bool = False             # plain target decoding
    ignore_eos: bool = False          # EOS does not end generation (vLLM's ignore_eos): fixed-length runs
    return_token_ids: bool = False    # choices and chunks also carry the committed token ids


class StreamOptions(_Strict):
    include_usage: bool = False  # one more chunk, with empty choices and the usage, before [DONE]


class _GenerationParams(_Strict):  # the parameters completions and chat completions share
    model: str | None = None          # None = the served model
    max_tokens: int | None = Field(default=None, ge=1, lt=INT32)
    temperature: float = 1.0          # OpenAI's default; 0 = greedy
    top_p: float = Field(default=1.0, gt=0)   # the rest of the range is checked by SamplingParams
    top_k: int = Field(default=0, ge=-INT32, lt=INT32)   # extension; 0 = off
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None           # an end-user id (accepted, unused)
    # vLLM's extra parameters (docs/http-api.md); the bounds that need the request are checked by check_call
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, lt=INT32)
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    specdec: SpecdecOptions = SpecdecOptions()

    @model_validator(mode="before")
    @classmethod
    def _drop_noop_unsupported(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (k in UNSUPPORTED and _is_noop(v, UNSUPPORTED[k]))}
        return data

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n = 1 is supported, got {n}")
        return n

    def max_new_tokens(self) -> int:
        return self.max_tokens or 0  # 0 = front.max_new_tokens

    def top_logprobs_k(self) -> int | None:  # alternatives per generated token's logprobs; None = no logprobs
        return None


class CompletionRequest(_GenerationParams):  # POST /v1/completions: one prompt, text (no chat template) or ids
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)  # the legacy API's: top alternatives per token
    echo: bool = False  # the prompt's text (and with logprobs its tokens' logprobs) before the completion's
    max_tokens: int | None = Field(default=None, ge=0, lt=INT32)  # 0: score the prompt (echo and logprobs)

    def top_logprobs_k(self) -> int | None:
        if self.max_tokens == 0 and not (self.echo and self.logprobs is not None):
            raise ApiError(400, "max_tokens: 0 only scores the prompt: with echo and logprobs", "max_tokens")
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None           # the participant's name: passed to the chat template (as vLLM does)

    def as_template_input(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text} | ({"name": self.name} if self.name is not None else {})


class ChatCompletionRequest(_GenerationParams):  # POST /v1/chat/completions, through the target's chat template
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, lt=INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def top_logprobs_k(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self) -> int:
        if self.max_tokens and self.max_completion_tokens and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, f"max_completion_tokens: {self.max_completion_tokens} differs from max_tokens "
                                f"{self.max_tokens} (give one)", "max_completion_tokens")
        return self.max_completion_tokens or self.max_tokens or 0


class ApiError(Exception):  # an HTTP error in OpenAI's error object format
    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {401: {"WWW-Authenticate": "Bearer"}, 429: {"Retry-After": str(RETRY_AFTER_S)}}.get(self.status)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class ClientGone(Exception):
    """The HTTP client disconnected; its request was cancelled."""


UPSTREAM_STATUS = {  # a downstream gRPC status -> (HTTP status, OpenAI error type)
    "INVALID_ARGUMENT": (400, "invalid_request_error"), "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "server_error"), "DEADLINE_EXCEEDED": (504, "server_error")}


def field_error(exc: Exception, chat: bool) -> ApiError:
    """400 for a call's ``field: detail`` error, the field renamed to the request's parameter (max_new_tokens ->
    max_tokens, tree -> specdec.tree, prompt -> messages for a chat)."""
    prompt_param = "messages" if chat else "prompt"
    field, _, detail = str(exc).partition(": ")
    if isinstance(exc, TreeSpecError) or field == "tree":
        param, detail = "specdec.tree", str(exc)
    elif isinstance(exc, SamplingParamsError):
        param, detail = exc.field, exc.detail
    else:
        param = {"prompt": prompt_param, "prompt_ids": prompt_param, "max_new_tokens": "max_tokens",
                 "stop_strings": "stop"}.get(field, field)
    return ApiError(400, f"{param}: {detail}", param)


def run_error(exc: BaseException, chat: bool) -> ApiError:
    """The ApiError for an exception of a running request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ClientGone):
        return ApiError(499, str(exc), type="client_closed_request")
    if isinstance(exc, UpstreamError):
        status, kind = UPSTREAM_STATUS.get(exc.code_name, (500, "server_error"))
        return ApiError(status, exc.details or exc.code_name, type=kind, code=exc.code_name.lower())
    if isinstance(exc, RequestIdInUse):
        return ApiError(409, str(exc), code="request_id_in_use")
    if isinstance(exc, AdmissionRefused):  # over front.limits: OpenAI's rate-limit error
        return ApiError(429, str(exc), type="rate_limit_error", code="rate_limit_exceeded")
    if isinstance(exc, ValueError):
        return field_error(exc, chat)
    log.exception("HTTP request failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", type="server_error")


def validation_error(exc: RequestValidationError) -> ApiError:
    """400 naming the first bad parameter (``messages[0].content``), unknown told apart from unsupported."""
    messages, first = [], None
    for err in exc.errors():
        loc = [x for x in err["loc"] if x != "body"]
        param = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".") or None
        if err["type"] == "extra_forbidden":
            what = "not supported by this server" if len(loc) == 1 and loc[0] in UNSUPPORTED else "unknown parameter"
        elif err["type"] == "json_invalid":
            param, what = None, f"request body is not valid JSON ({err.get('ctx', {}).get('error', '')})"
        else:
            what = err["msg"].removeprefix("Value error, ")
        first = first or param
        messages.append(f"{param}: {what}" if param else what)
    return ApiError(400, "; ".join(messages), first)


class StopTrim:
    """Text deltas that end before the first stop string (OpenAI's rule), or just after it with ``include`` (vLLM's
    include_stop_str_in_output); the last ``max(len(stop)) - 1`` characters are held back until more text shows they
    start none. A stop string ending in text pushed ``early`` (before min_tokens) does not count."""

    def __init__(self, stop: tuple[str, ...], include: bool = False):
        self.stop, self.include = stop, include
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.floor = 0  # no stop string ending at or before this character counts
        self.cut: int | None = None  # where the text ends, once a stop string is found

    def push(self, delta: str, early: bool = False) -> str:
        end = self._end(delta, early)
        return self._send(end if self.cut is not None else len(self.text) - self.hold)

    def final(self, delta: str, early: bool = False) -> str:
        return self._send(self._end(delta, early))

    def _end(self, delta: str, early: bool) -> int:
        """Add delta; where the text ends: at (or with include after) the first stop string, else its length."""
        self.text += delta
        if early:
            self.floor = len(self.text)
        if self.cut is None:
            hits = [(i, i + len(s) * self.include) for s in self.stop
                    if (i := self.text.find(s, max(0, self.sent - len(s) + 1, self.floor - len(s) + 1))) >= 0]
            self.cut = min(hits)[1] if hits else None
        return len(self.text) if self.cut is None else self.cut

    def _send(self, end: int) -> str:
        out = self.text[self.sent:max(end, self.sent)]
        self.sent += len(out)
        return out


def _by_text(top, decode) -> dict[str, float]:
    """Completions' top_logprobs: token text -> logprob, likeliest first; tokens of equal text keep the likeliest."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(decode([token]), logprob)
    return out


class Output:
    """OpenAI objects (chunks, responses) of one request; chat: chat.completion, else text_completion."""

    def __init__(self, chat: bool, model: str, body: _GenerationParams, call: GenerateCall, tokenizer=None):
        self.chat = chat
        self.logprobs = call.sampling.logprobs is not None
        self.tokenizer = tokenizer  # token strings of the logprobs
        self.offset = 0  # completions' logprobs: the text offset of the next token
        self.echo = getattr(body, "echo", False)  # completions: the prompt's text and logprobs first, once
        self.echoed: tuple[str, tuple] = ("", ())
        self.id = call.request_id
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = 0  # known at the final event
        self.completion_tokens = 0
        self.token_ids = body.specdec.return_token_ids
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.trim = StopTrim(call.stop, body.include_stop_str_in_output)
        self.min_tokens = call.min_tokens
        self.prompt, self.prompt_ids = call.prompt, call.prompt_ids

    def chunks(self, event: StreamEvent) -> list[dict]:
        """One event's chunks: text (if any, or token ids asked for); at the end the finish and usage chunks."""
        self.completion_tokens += len(event.tokens)
        early = self.completion_tokens < self.min_tokens
        head, head_logprobs = "", ()
        if self.echo:  # the first event
            self.echo = False
            head, head_logprobs = self.echoed = (self.tokenizer.decode(self.prompt_ids) if self.prompt_ids
                                                 else self.prompt, event.prompt_logprobs)
        if event.stats is None:
            text = head + self.trim.push(event.text_delta, early)
            keep = text or ((self.token_ids or self.logprobs) and event.tokens)
            return [self._chunk(text, event.tokens, logprobs=head_logprobs + event.logprobs)] if keep else []
        text = head + self.trim.final(event.text_delta, early)
        self.prompt_tokens = event.prompt_tokens
        final = self._chunk(text, [], FINISH_REASONS.get(event.stats.stop_reason, "stop"), head_logprobs)
        final["specdec"] = self._stats(event.stats)
        if not self.include_usage:
            return [final]
        return [final, {**self._head(chunk=True), "choices": [], "usage": self._usage()}]

    def first_chunk(self) -> dict | None:  # chat streams open with the assistant's role
        if not self.chat:
            return None
        return {**self._head(chunk=True), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}]}

    def response(self, events: list[StreamEvent]) -> dict:
        """The non-streaming response: the text and tokens the chunks of the same events carry."""
        for event in events:
            self.chunks(event)
        stats = events[-1].stats
        text = self.echoed[0] + self.trim.text[:self.trim.sent]
        self.offset = 0
        choice = self._choice(("message", {"role": "assistant", "content": text}), text,
                              [t for e in events for t in e.tokens], FINISH_REASONS.get(stats.stop_reason, "stop"),
                              self.echoed[1] + tuple(lp for e in events for lp in e.logprobs))
        return {**self._head(chunk=False), "choices": [choice], "usage": self._usage(), "specdec": self._stats(stats)}

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, text: str, tokens: list[int], finish_reason: str | None = None, logprobs=()) -> dict:
        delta = {"content": text} if text or finish_reason is None else {}
        choice = self._choice(("delta", delta), text, tokens, finish_reason, logprobs)
        return {**self._head(chunk=True), "choices": [choice]} | ({"usage": None} if self.include_usage else {})

    def _choice(self, chat_item: tuple[str, dict], text: str, tokens: list[int], finish_reason: str | None,
                logprobs=()) -> dict:
        """A choice: ``chat_item`` (its key and value) in a chat, else the text; the token ids when asked for."""
        content = dict([chat_item]) if self.chat else {"text": text}
        choice = {"index": 0, **content, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
        return choice | ({"token_ids": tokens} if self.token_ids else {})

    def _logprobs(self, logprobs) -> dict | None:
        """OpenAI's logprobs object of these positions' ``TokenLogprob``s (None: not asked for, or no tokens)."""
        if not (self.logprobs and logprobs):
            return None
        text = self.tokenizer.decode
        if self.chat:
            def entry(token: int, logprob: float) -> dict:
                s = text([token])
                return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

            return {"content": [entry(lp.token, lp.logprob) | {"top_logprobs": [entry(*t) for t in lp.top]}
                                for lp in logprobs]}
        tokens = [text([lp.token]) for lp in logprobs]
        offsets = list(itertools.accumulate(map(len, tokens), initial=self.offset))
        self.offset = offsets.pop()
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [None if lp.logprob is None else _by_text(lp.top, text) for lp in logprobs],
                "text_offset": offsets}

    def _usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def _stats(self, stats) -> dict:
        return MessageToDict(stats_to_proto(stats, self.prompt_tokens), preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


class Run:
    """One request's StreamEvents from a task of its own, cancelled (KV freed) on disconnect or ``close``."""

    def __init__(self, events, request: Request, active: set[str], request_id: str):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.producer = asyncio.create_task(self._pump(events))
        self.watcher = asyncio.create_task(_disconnect(request))
        self.watcher.add_done_callback(lambda _: self.producer.cancel())
        active.add(request_id)
        self.producer.add_done_callback(lambda _: (self.watcher.cancel(), active.discard(request_id)))

    async def _pump(self, events) -> None:
        try:
            async for event in events:
                self.queue.put_nowait(event)
            self.queue.put_nowait(StopAsyncIteration())  # the end, raised by __anext__
        except asyncio.CancelledError:
            self.queue.put_nowait(ClientGone("the client closed the connection"))
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which maps it to a status
            self.queue.put_nowait(exc)

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamEvent:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.producer.cancel()


def _unicode(text: str, param: str) -> str:
    """text when valid Unicode (JSON's \\ud800 escapes give lone surrogates, which protobuf cannot hold); else
    ApiError 400 naming param."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{param}: not valid Unicode text (a lone surrogate at character {exc.start})",
                       param) from None
    return text


async def _disconnect(request: Request) -> None:
    """Return once the client has gone (after the body, the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _error_response(_request: Request, exc: Exception) -> JSONResponse:
    """An error outside a request's run in OpenAI's error format (Starlette's 404 / 405, validation, 500)."""
    if isinstance(exc, StarletteHTTPException):
        return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), exc.status_code, exc.headers)
    if isinstance(exc, RequestValidationError):
        return validation_error(exc).response()
    return (exc if isinstance(exc, ApiError) else ApiError(500, f"internal error: {type(exc).__name__}",
                                                           type="server_error")).response()


class Gate:
    """ASGI middleware that checks a request before any of its body is read: a ``/v1/`` request (and with
    metrics_auth ``/metrics``) without an accepted bearer token gets 401 (auth_tokens empty = no auth), a body over
    ``max_body_bytes`` (its Content-Length, or counted as it arrives) 413. The app then gets the body whole."""

    def __init__(self, app, auth_tokens: tuple[bytes, ...], max_body_bytes: int, metrics_auth: bool = False):
        self.app, self.auth_tokens, self.max_body_bytes = app, auth_tokens, max_body_bytes
        self.guarded = ("/v1/", "/metrics") if metrics_auth else ("/v1/",)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if (self.auth_tokens and scope["path"].startswith(self.guarded)
                and not token_accepted(self.auth_tokens, headers.get("authorization", ""))):
            await ApiError(401, "missing or invalid bearer token (Authorization: Bearer ...)",
                           type="authentication_error", code="invalid_api_key").response()(scope, receive, send)
            return
        too_large = ApiError(413, f"request body: over front.limits.max_body_bytes ({self.max_body_bytes} bytes)",
                             code="request_too_large")
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await too_large.response()(scope, receive, send)
            return
        parts, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_body_bytes:
                await too_large.response()(scope, receive, send)
                return
            more = message.get("more_body", False)
        body = iter([{"type": "http.request", "body": b"".join(parts), "more_body": False}])

        async def replay():  # the body, then what follows it (the disconnect, which Run watches for)
            return next(body, None) or await receive()

        await self.app(scope, replay, send)


class HttpApi:
    """The FastAPI app over a RequestRunner, behind a ``Gate`` (the runner's bearer tokens). model_name: the
    ``model`` id; registry: what /metrics serves; draining: set at shutdown (new requests get 503)."""

    def __init__(self, runner: RequestRunner, model_name: str, registry, draining: asyncio.Event,
                 max_body_bytes: int = 4 << 20, metrics_auth: bool = False):
        self.runner = runner
        self.model_name = model_name
        self.registry = registry
        self.draining = draining
        self.active: set[str] = set()  # ids of the HTTP requests running
        self.created = int(time.time())
        self.app = Gate(self._build(), runner.auth_tokens, max_body_bytes, metrics_auth)

    def _build(self) -> FastAPI:
        app = FastAPI(title="specdec", summary="OpenAI-compatible API of the speculative-decoding front",
                      docs_url=None, redoc_url=None)
        for error in (ApiError, RequestValidationError, StarletteHTTPException, Exception):
            app.add_exception_handler(error, _error_response)
        admit = [Depends(self._admit)]
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], dependencies=admit)
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"], dependencies=admit)
        app.add_api_route("/v1/models", self.models, methods=["GET"], dependencies=admit)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        return app

    async def _admit(self) -> None:  # 503 while draining (the token was checked by the Gate)
        if self.draining.is_set():
            raise ApiError(503, "the server is shutting down", type="server_error", code="draining")

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: one prompt per request, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        call = self._call(body, request, chat=False)
        if isinstance(prompt, str):
            call = dataclasses.replace(call, prompt=_unicode(prompt, "prompt"))
        else:
            call = dataclasses.replace(call, prompt_ids=tuple(prompt))
        return await self._respond(request, body, call, chat=False)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        call = self._call(body, request, chat=True)
        for i, message in enumerate(body.messages):
            for field, text in message.as_template_input().items():
                _unicode(text, f"messages[{i}].{field}")
        try:
            # tokenized off the event loop (the tokenizer releases the GIL): a huge prompt stalls no other request
            messages = [m.as_template_input() for m in body.messages]
            ids = await asyncio.to_thread(encode_chat, self.runner.tokenizer, messages)
        except ValueError as exc:
            raise field_error(exc, chat=True) from None
        except Exception as exc:  # noqa: BLE001 - a template's own error (e.g. raise_exception on the roles)
            raise ApiError(400, f"messages: the chat template refused them: {exc}", "messages") from None
        return await self._respond(request, body, dataclasses.replace(call, prompt_ids=tuple(ids)), chat=True)

    def _call(self, body: _GenerationParams, request: Request, chat: bool) -> GenerateCall:
        """The GenerateCall of a request's parameters but its prompt; ApiError 404 (model) or 400 naming the field."""
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"model: {body.model!r} is not served here (GET /v1/models lists {self.model_name!r})",
                           "model", code="model_not_found")
        stop = tuple(_unicode(s, "stop") for s in ([body.stop] if isinstance(body.stop, str) else body.stop or []))
        try:
            tree = parse_tree_spec(body.specdec.tree) if body.specdec.tree is not None else None
            logprobs = body.top_logprobs_k()
            prompt_logprobs = logprobs if getattr(body, "echo", False) else None
            sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                                      logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        except ValueError as exc:  # TreeSpecError, SamplingParamsError
            raise field_error(exc, chat) from None
        return GenerateCall(
            request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", raw=True,
            max_new_tokens=body.max_new_tokens(), stop=stop, sampling=sampling, tree=tree,
            no_spec=body.specdec.no_spec, ignore_eos=body.ignore_eos or body.specdec.ignore_eos,
            min_tokens=body.min_tokens, stop_token_ids=tuple(body.stop_token_ids),
            skip_special_tokens=body.skip_special_tokens,
            carrier={k: v for k in ("traceparent", "tracestate") if (v := request.headers.get(k))},  # W3C context
            score_only=body.max_tokens == 0,
            client=self.runner.client_of(request.headers.get("authorization", ""),
                                         request.client.host if request.client else "unknown"))

    async def _respond(self, request: Request, body: _GenerationParams, call: GenerateCall, chat: bool) -> Response:
        """Run the call; the first event is awaited here, so errors before any token get their status."""
        out = Output(chat, self.model_name, body, call, self.runner.tokenizer)
        run = Run(self.runner.run(call), request, self.active, call.request_id)
        try:
            first = await anext(run)
        except BaseException as exc:
            run.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise run_error(exc, chat) from None
        if body.stream:
            return StreamingResponse(self._sse(out, first, run), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            events = [first, *[event async for event in run]]
        except Exception as exc:  # noqa: BLE001 - mapped to its status
            raise run_error(exc, chat) from None
        finally:
            run.close()
        return JSONResponse(out.response(events))

    async def _sse(self, out: Output, first: StreamEvent, run: Run):
        """The event stream: chunks of each event, an error event if the request fails, then [DONE]."""
        try:
            if (opening := out.first_chunk()) is not None:
                yield sse(opening)
            for chunk in out.chunks(first):
                yield sse(chunk)
            async for event in run:
                for chunk in out.chunks(event):
                    yield sse(chunk)
        except ClientGone:
            return
        except Exception as exc:  # noqa: BLE001 - after the headers an error is an event
            yield sse(run_error(exc, out.chat).body())
        finally:
            run.close()
        yield "data: [DONE]\n\n"

    async def models(self) -> dict:
        info = self.runner.backend.info
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "specdec", "max_model_len": info.context_limit}]}

    async def health(self) -> Response:
        if self.draining.is_set():
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _LoopServer(uvicorn.Server):  # capturing no signals: the front's SIGTERM handling drains it
    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass
class HttpServer:
    """The HTTP API on ``sock``, served by uvicorn as a task of the running loop."""

    api: HttpApi
    sock: socket.socket
    server: _LoopServer
    task: asyncio.Task

    async def drain(self, grace_s: float) -> None:
        """Once the front drains: give running requests up to ``grace_s`` s, then stop serving."""
        deadline = time.monotonic() + grace_s
        while self.api.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.server.should_exit = True
        await self.task
        self.sock.close()


async def start_http(front: FrontConfig, grpc_cfg: GrpcConfig, runner: RequestRunner, tok_dir: str, registry,
                     draining: asyncio.Event) -> HttpServer:
    """Serve the HTTP API on front.host:http_port (HTTPS with grpc.tls_cert); prints ``http ready on HOST:PORT``.
    Raises OSError naming front.http_port when it cannot bind."""
    api = HttpApi(runner, front.served_model_name or Path(tok_dir).name, registry, draining,
                  front.limits.max_body_bytes, front.metrics_auth)
    host, port = front.host, front.http_port
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        sock = socket.create_server((host, port), family=family)
    except OSError as exc:
        raise OSError(f"front.http_port: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    server = _LoopServer(uvicorn.Config(api.app, log_config=None, access_log=False, lifespan="off",
                                        timeout_graceful_shutdown=max(grpc_cfg.shutdown_grace_s, 0.1),
                                        ssl_certfile=grpc_cfg.tls_cert, ssl_keyfile=grpc_cfg.tls_key))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise OSError(f"http server on {front.host}:{front.http_port} stopped while starting")
        await asyncio.sleep(0.01)
    print(f"http ready on {front.host}:{sock.getsockname()[1]}", flush=True)
    return HttpServer(api, sock, server, task)
