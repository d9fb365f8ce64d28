"""Issue 57, items 2 and 3: the front bounds a request before it costs anything, and keeps clients apart.

Unit tests, no servers: ``check_call`` (request_id, prompt bytes, max_new_tokens, stop strings), the
RequestRunner over a fake backend (ids scoped per client, Abort by another client, the server-side deadline)
and the HTTP ``Gate`` as a bare ASGI app (token and size checked before any body byte is read). The same over
real servers: tests/test_client_limits.py.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from orchestrator.serving.backends import Backend
from orchestrator.serving.http_api import Gate
from orchestrator.serving.requests import GenerateCall, RequestIdInUse, check_call
from orchestrator.serving.runner import RequestRunner, TextDeltas
from specdec.config import ClientLimitsConfig, FrontConfig
from specdec.stats import GenerationStats


def front(**limits) -> FrontConfig:
    return FrontConfig(use_ray=False, limits=ClientLimitsConfig(**limits))


@pytest.mark.parametrize("fields, needle", [
    ({"request_id": "r" * 129}, "request_id: 1 to 128 characters"),
    ({"request_id": "job\n1"}, "request_id: 1 to 128 characters"),
    ({"request_id": "job 1"}, "request_id:"),
    ({"request_id": "a/b"}, "request_id:"),
    ({"request_id": ""}, "request_id:"),
    ({"prompt": "é" * 600}, "prompt: over front.limits.max_prompt_bytes (1000 bytes"),  # 600 characters, 1200 bytes
    ({"prompt_ids": (1,) * 8193}, "prompt_ids: 8193 tokens exceed the limit of 8192"),
    ({"max_new_tokens": 8193}, "max_new_tokens: 8193 exceeds front.limits.max_new_tokens (8192)"),
    ({"max_new_tokens": -1}, "max_new_tokens: must be >= 0"),
    ({"stop": ("x",) * 17}, "stop: at most 16 stop strings"),
    ({"stop": ("",)}, "stop: an empty stop string"),
    ({"min_tokens": -1}, "min_tokens: must be >= 0"),
    ({"stop_token_ids": (1,) * 65}, "stop_token_ids: at most 64 ids"),
])
def test_check_call_names_the_field_over_each_bound(fields, needle):
    call = GenerateCall(**({"request_id": "ok-1", "prompt_ids": (1, 2)} | fields))
    with pytest.raises(ValueError) as info:
        check_call(call, front(max_prompt_bytes=1000))
    assert str(info.value).startswith(needle), str(info.value)


def test_check_call_accepts_what_is_inside_every_bound():
    check_call(GenerateCall(request_id="a" * 128, prompt="é" * 500, max_new_tokens=8192, stop=("s" * 256,) * 16,
                            min_tokens=8192, stop_token_ids=(1,) * 64), front(max_prompt_bytes=1000))
    check_call(GenerateCall(request_id="tenant:job-1.2@x+y=z_", prompt_ids=(1,) * 8192), front())


class Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


class Info:
    vocab_size, context_limit, max_tree_nodes = 100, 100_000, 64


class SlowBackend(Backend):
    """One token every 10 ms until aborted or 1,000 tokens; records what each stream was given."""

    info = Info()

    def __init__(self):
        self.streams: dict[str, float | None] = {}  # backend id -> timeout_s
        self.aborted: set[str] = set()

    async def start(self):
        pass

    def cost(self):
        return None

    async def stream(self, request, request_id, timeout_s, carrier):
        self.streams[request_id] = timeout_s
        for _ in range(1000):
            if request_id in self.aborted:
                yield [], None, GenerationStats(stop_reason="aborted")
                return
            await asyncio.sleep(0.01)
            yield [7], None, None
        yield [], None, GenerationStats(stop_reason="max_new_tokens")

    async def abort(self, request_id):
        known = request_id in self.streams and request_id not in self.aborted
        self.aborted.add(request_id)
        return known

    async def close(self):
        pass


def runner(**limits) -> tuple[RequestRunner, SlowBackend]:
    backend = SlowBackend()
    return RequestRunner(front(**limits), backend, Tokenizer()), backend


async def first_event(events):
    await anext(events)
    return events


def test_request_ids_are_scoped_per_client_and_abort_touches_only_the_callers():
    async def scenario():
        run, backend = runner()
        call = GenerateCall(request_id="job-1", prompt_ids=(1, 2), max_new_tokens=1000)
        mine = await first_event(run.run(replace(call, client="token 1")))
        theirs = await first_event(run.run(replace(call, client="token 2")))
        assert len(backend.streams) == 2 and all(k.startswith("job-1~") for k in backend.streams)
        with pytest.raises(RequestIdInUse):  # the same client may not reuse a running id
            await anext(run.run(replace(call, client="token 1")))
        assert await run.abort("token 3", "job-1") is False  # no request of token 3 has this id
        assert not backend.aborted
        assert await run.abort("token 2", "job-1") is True
        assert [e async for e in theirs][-1].stats.stop_reason == "aborted"
        assert (await anext(mine)).tokens == [7]  # token 1's request runs on
        assert await run.abort("token 2", "job-1") is False  # over: no longer known
        assert await run.abort("token 1", "job-1") is True
        assert [e async for e in mine][-1].stats.stop_reason == "aborted"
        assert run.running == {}

    asyncio.run(scenario())


@pytest.mark.parametrize("client_s, cap_s, expected", [(None, 600.0, 600.0), (5.0, 600.0, 5.0), (900.0, 600.0, 600.0),
                                                       (None, None, None), (7.0, None, 7.0)])
def test_every_request_gets_the_shorter_of_the_clients_and_the_servers_deadline(client_s, cap_s, expected):
    async def scenario():
        run, backend = runner(request_timeout_s=cap_s)
        events = run.run(GenerateCall(request_id="t", prompt_ids=(1,), max_new_tokens=1, timeout_s=client_s))
        await anext(events)
        await events.aclose()
        (given,) = backend.streams.values()
        return given

    given = asyncio.run(scenario())
    assert given == pytest.approx(expected, abs=0.5) if expected is not None else given is None


class ByteTokenizer:
    """Byte-level ids (as Qwen's BPE at its finest): a character of 2-4 bytes spans tokens."""

    def __init__(self):
        self.lengths = []

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_deltas_hold_split_characters_and_decode_only_the_recent_tokens():
    text = "héllo wörld ✓ 𝄞 " * 300  # 1-, 2-, 3- and 4-byte characters
    data = text.encode()
    tokenizer = ByteTokenizer()
    deltas = TextDeltas(tokenizer)
    out, pos = [], 0
    for size in [1, 2, 3, 1, 5] * (len(data) // 12 + 1):  # rounds of 1-5 tokens, splitting characters
        if pos >= len(data):
            break
        delta = deltas.push(list(data[pos:pos + size]))
        assert "\ufffd" not in delta  # a split character is held back, never sent half
        out.append(delta)
        pos += size
    out.append(deltas.final())
    assert "".join(out) == text
    assert max(tokenizer.lengths) <= 20  # two rounds and a held character, never the whole output


# --------------------------------------------------------------------------- the HTTP gate


async def through_gate(headers: dict[str, str], chunks: list[bytes], tokens=(b"secret",), max_body_bytes=1024):
    """(status, body, bytes the gate read, what the app got) of one POST /v1/completions through a Gate."""
    reached = []

    async def app(scope, receive, send):
        message = await receive()
        reached.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    read = []
    queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        message = queue.pop(0)
        read.append(len(message["body"]))
        return message

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    await Gate(app, tokens, max_body_bytes)(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body), sum(read), reached


def test_gate_refuses_a_missing_token_before_reading_any_body():
    status, body, read, reached = asyncio.run(through_gate({"content-length": str(300 << 20)}, [b"x" * 1000]))
    assert (status, body["error"]["code"], read, reached) == (401, "invalid_api_key", 0, [])


def test_gate_refuses_an_oversize_content_length_before_reading_it():
    headers = {"authorization": "Bearer secret", "content-length": "1025"}
    status, body, read, reached = asyncio.run(through_gate(headers, [b"x" * 1025]))
    assert (status, read, reached) == (413, 0, [])
    assert body["error"]["message"] == "request body: over front.limits.max_body_bytes (1024 bytes)"


def test_gate_stops_reading_an_unannounced_body_at_the_limit():
    status, _, read, reached = asyncio.run(through_gate({"authorization": "Bearer secret"}, [b"x" * 600] * 5))
    assert (status, read, reached) == (413, 1200, [])  # the third chunk is never read


def test_gate_guards_metrics_only_with_metrics_auth():
    async def get(metrics_auth: bool, headers: dict) -> int:
        sent = []

        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": "/metrics", "query_string": b"",
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
        await Gate(app, (b"secret",), 1024, metrics_auth)(scope, receive, send)
        return sent[0]["status"]

    assert asyncio.run(get(False, {})) == 200  # open for scrapes by default
    assert asyncio.run(get(True, {})) == 401
    assert asyncio.run(get(True, {"authorization": "Bearer secret"})) == 200


def test_gate_hands_a_body_inside_the_limit_to_the_app_whole():
    status, _, read, reached = asyncio.run(through_gate({"authorization": "Bearer secret"}, [b"a" * 512, b"b" * 512]))
    assert (status, read, reached) == (200, 1024, [b"a" * 512 + b"b" * 512])
    status, _, _, reached = asyncio.run(through_gate({}, [b"{}"], tokens=()))  # no tokens configured: no auth
    assert (status, reached) == (200, [b"{}"])
