"""Issue 15: the front's OpenAI-compatible HTTP API, driven by the official ``openai`` client.

Draft, target and front are real server processes on loopback ports (tiny seeded models, float32,
the front without Ray and with ``--http-port 0``); the target's tokenizer is given a small chat
template. Greedy output over HTTP (chat and completion, streamed and not) must equal target-only
greedy decoding (HF ``generate``) token for token; streamed text must concatenate to the
non-streamed text; usage must count the streamed tokens; stop strings and max_tokens must give
their finish reasons; bad parameters must give 400 naming them; a client that disconnects must
free its sessions on the draft and the target; concurrent streams must each get their solo output; aiperf (a
maintained load tester, in a venv of its own) must get fixed-length streams with ``ignore_eos`` (skipped where it is
not installed).
A second front (bearer tokens, a target with a tiny KV budget) checks 401 and 429; the last test
drains the first front (SIGTERM) and checks 503 while its running stream finishes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.harness.servers import launch_service, stop_service, wait_address, wait_for_exit, wait_ready
from tests.conftest import causal_logits, hf_greedy
from tests.test_generation_service import assert_draft_session_free, prompt_ids, target_info, wait_sessions
from specdec.harness.tiny_pair import save_tiny_pair, write_config

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}{% if m.name %} ({{ m.name }}){% endif %}: "
                 "{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
EOS = 0  # the tiny models' EOS id (specdec/harness/tiny_pair.py)
TOKEN_IDS = {"specdec": {"return_token_ids": True}}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    pair = save_tiny_pair(tmp_path_factory.mktemp("models"), noise=0.03)
    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(pair.target)
    return pair


@pytest.fixture(scope="module")
def servers(pair, tmp_path_factory):
    """Every server of this module, launched together so that their start-ups overlap:
    "main": draft (one session at a time: a leaked one shows), target and front with HTTP on;
    "guarded": a second front with bearer tokens, over its own target with a KV budget of 64 slots
    (and the main draft, unused: it does not speculate). Yields {name: (draft, target, front, http)}."""
    root = tmp_path_factory.mktemp("cfg")
    config = write_config(root / "serve.yaml", pair, draft={"max_sessions": 1},
                          front={"port": 0, "http_port": 0, "cost_aware": {"enabled": False},
                                 "limits": {"max_prompt_bytes": 4 << 20, "max_body_bytes": 8 << 20}},
                          target={"max_tree_nodes": 64})
    (root / "tokens.txt").write_text("first-token\n\nsecond-token\n")
    guarded_config = write_config(root / "guarded.yaml", pair, target={"max_kv_tokens": 64},
                                  front={"port": 0, "http_port": 0, "speculate": False,
                                         "auth_token_file": str(root / "tokens.txt")})
    draft, target = launch_service("draft", config), launch_service("target", config)
    guarded_target = launch_service("target", guarded_config)
    wait_ready(draft), wait_ready(target), wait_ready(guarded_target)
    front = launch_service("front", config, draft_address=draft.address, target_address=target.address, no_ray=True)
    guarded_front = launch_service("front", guarded_config, draft_address=draft.address,
                                   target_address=guarded_target.address, no_ray=True)
    wait_ready(front), wait_ready(guarded_front)
    yield {"main": (draft, target, front, wait_address(front, "http")),
           "guarded": (draft, guarded_target, guarded_front, wait_address(guarded_front, "http"))}
    for service in (front, guarded_front, draft, target, guarded_target):
        stop_service(service)


@pytest.fixture(scope="module")
def stack(servers):
    return servers["main"]


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"http://{stack[3]}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(pair):
    return AutoTokenizer.from_pretrained(pair.target)


@pytest.fixture(scope="module")
def target_model(pair):
    return AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()


def until_eos(tokens: list[int]) -> list[int]:
    """What the front commits of a target-only run: up to and including the first EOS."""
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def extra(obj, name):
    """An extension field of an openai response object (kept by its pydantic models)."""
    return (obj.model_extra or {}).get(name)


def call(client, chat: bool, prompt, **params):
    """One request, chat (prompt: messages) or completion; stream=True returns the chunk list."""
    if chat:
        return client.chat.completions.create(model=params.pop("model", "target"), messages=prompt, **params)
    return client.completions.create(model=params.pop("model", "target"), prompt=prompt, **params)


def streamed(client, chat: bool, prompt, **params):
    """(text, token ids, finish_reason, usage, specdec stats, chunks) of a streamed request."""
    chunks = list(call(client, chat, prompt, stream=True, stream_options={"include_usage": True}, **params))
    text, tokens, finish, stats = "", [], None, None
    for chunk in chunks[:-1]:
        choice = chunk.choices[0]
        text += (choice.delta.content or "") if chat else choice.text
        tokens += extra(choice, "token_ids") or []
        finish = choice.finish_reason or finish
        stats = extra(chunk, "specdec") or stats
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # include_usage: the last chunk
    return text, tokens, finish, chunks[-1].usage, stats, chunks


def content(response, chat: bool) -> str:
    return response.choices[0].message.content if chat else response.choices[0].text


def metric(http: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{http}/metrics", timeout=10).read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def long_greedy_prompt(client, n: int) -> str:
    """A prompt whose greedy continuation runs n tokens without EOS (found by asking the server)."""
    for word in ("the lazy dog", "hello world", "def add", "quick brown", "jumps over", "return a"):
        response = client.completions.create(model="target", prompt=word, max_tokens=n, temperature=0)
        if response.choices[0].finish_reason == "length":
            return word
    pytest.fail(f"no prompt ran {n} greedy tokens without EOS")


@pytest.fixture(scope="module")
def long_prompt(target_model) -> list[int]:
    """Prompt token ids whose greedy continuation runs 240 tokens without EOS (a request that stays running)."""
    for seed in range(40):
        if EOS not in hf_greedy(target_model, ids := prompt_ids(seed, 6), 240):
            return ids
    pytest.fail("no prompt runs 240 greedy tokens without EOS")


# --------------------------------------------------------------------------- without servers


@pytest.mark.parametrize("deltas,stop,sent", [
    (["ab", "c s", "top", "xyz"], ("stop",), ["", "ab", "c ", ""]),   # spans deltas: the tail is held back
    (["ab", "c stopxyz"], ("stop", "zz"), ["", "abc "]),              # complete in one delta
    (["ab", "c stopxyz", "w"], ("stop",), ["", "abc ", ""]),          # ... before the end is known
    (["hello", " world"], (), ["hello", " world"]),                   # no stop strings: nothing held
    (["xx s", "to"], ("stop",), ["x", "x sto"]),                      # ended without one: the rest flushed
])
def test_stop_trim_never_sends_the_stop_string(deltas, stop, sent):
    from orchestrator.serving.http_api import StopTrim

    trim = StopTrim(stop)
    assert [trim.push(d) for d in deltas[:-1]] + [trim.final(deltas[-1])] == sent


def test_stop_trim_include_and_early():
    """include (vLLM's include_stop_str_in_output) sends the stop string too; one ending in early text (before
    min_tokens) is no stop."""
    from orchestrator.serving.http_api import StopTrim

    trim = StopTrim(("stop",), include=True)
    assert [trim.push("ab sto"), trim.push("p and"), trim.final(" more")] == ["ab ", "stop", ""]
    trim = StopTrim(("stop",))
    assert [trim.push("a stop", early=True), trim.push(" b stop c"), trim.final("")] == ["a s", "top b ", ""]


def test_unknown_paths_and_internal_errors_use_the_error_object():
    """Starlette's 404 / 405 and an unexpected exception (here from a broken runner) answer in
    OpenAI's error format, not plain text."""
    from orchestrator.serving.http_api import HttpApi

    class Broken:
        tokenizer = None
        auth_tokens = ()

        def client_of(self, authorization, host):
            return "local"

        async def run(self, call):
            raise RuntimeError("broken")
            yield

    app = HttpApi(Broken(), "m", None, asyncio.Event()).app

    async def call_app(method: str, path: str, body: bytes = b"") -> tuple[int, dict]:
        sent, messages = [], [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 80)}
        with contextlib.suppress(RuntimeError):  # Starlette re-raises a 500's exception after answering
            await app(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        return start["status"], json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))

    for method, path, body, status in [("GET", "/v1/nope", b"", 404), ("GET", "/v1/completions", b"", 405),
                                       ("POST", "/v1/completions", b'{"prompt": "hi"}', 500)]:
        code, out = asyncio.run(call_app(method, path, body))
        assert code == status and set(out["error"]) == {"message", "type", "param", "code"}, (path, out)
    assert out["error"]["type"] == "server_error"


def test_http_config_fields_and_their_errors(pair, capsys):
    from orchestrator.serving.front import run
    from specdec.config import ConfigError, load_config

    assert load_config().front.http_port is None  # HTTP is off unless asked for
    assert load_config(None, {"front.http_port": 0, "front.metrics_port": 0}).front.http_port == 0
    with pytest.raises(ConfigError, match="http_port: 50060 is already front.port"):
        load_config(None, {"front.http_port": 50060})
    code = run(None, {"models.target": str(pair.target), "front.http_port": 0, "front.auth_token_file": "/no/such/file"})
    assert code == 2 and "front.auth_token_file: cannot read /no/such/file" in capsys.readouterr().err


# --------------------------------------------------------------------------- the tests


def test_models_health_and_metrics(stack, client):
    http = stack[3]
    models = client.models.list().data
    assert [m.id for m in models] == ["target"]  # the target model directory's name
    assert extra(models[0], "max_model_len") == target_info(stack[1].address).context_limit
    assert json.loads(urllib.request.urlopen(f"http://{http}/health", timeout=10).read()) == {"status": "ok"}
    before = metric(http, "specdec_committed_tokens_total")
    requests_before = metric(http, "specdec_request_latency_seconds_count")
    ttft_before = metric(http, "specdec_time_to_first_token_seconds_count")
    response = client.completions.create(model="target", prompt="hello", max_tokens=7, temperature=0)
    # /metrics serves the registry the round loop feeds, HTTP requests included
    assert metric(http, "specdec_committed_tokens_total") - before == response.usage.completion_tokens
    # the request series of every front request: one latency and one TTFT observation, none running after
    assert metric(http, "specdec_request_latency_seconds_count") - requests_before == 1
    assert metric(http, "specdec_time_to_first_token_seconds_count") - ttft_before == 1
    assert metric(http, "specdec_requests_running") == 0


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_greedy_stream_and_response_equal_target_only(client, tokenizer, target_model, chat):
    if chat:
        prompt = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
        ids = chat_ids(tokenizer, prompt)
    else:
        prompt = "the quick brown fox"
        ids = tokenizer(prompt)["input_ids"]
    expected = until_eos(hf_greedy(target_model, ids, 24))
    response = call(client, chat, prompt, max_tokens=24, temperature=0, extra_body=TOKEN_IDS)
    text, tokens, finish, usage, stats, chunks = streamed(client, chat, prompt, max_tokens=24, temperature=0,
                                                         extra_body=TOKEN_IDS)
    assert len(chunks) >= 4  # streamed round by round, not in one piece
    assert tokens == expected == extra(response.choices[0], "token_ids")
    assert text == content(response, chat) == tokenizer.decode(expected, skip_special_tokens=True)
    assert usage.completion_tokens == len(tokens) == response.usage.completion_tokens
    assert usage.prompt_tokens == len(ids) == response.usage.prompt_tokens
    assert usage.total_tokens == len(ids) + len(tokens)
    assert finish == response.choices[0].finish_reason == ("length" if len(expected) == 24 else "stop")
    assert stats["new_tokens"] == len(tokens) and stats["stop_reason"] in ("max_new_tokens", "eos")
    assert extra(response, "specdec")["rounds"] >= 1


@pytest.mark.parametrize("chat,params", [(True, dict(temperature=0, logprobs=True, top_logprobs=3)),
                                         (False, dict(temperature=0.9, seed=7, logprobs=3))],
                         ids=["chat", "completion"])
def test_logprobs_are_the_targets_in_chunks_and_response(client, tokenizer, target_model, chat, params):
    """Each generated token's logprob and top 3 (OpenAI's shapes) equal a plain target forward over the output."""
    prompt = [{"role": "user", "content": "def add(a, b):"}] if chat else "the quick brown fox"
    ids = chat_ids(tokenizer, prompt) if chat else tokenizer(prompt)["input_ids"]
    response = call(client, chat, prompt, max_tokens=16, extra_body=TOKEN_IDS, **params)
    *_, chunks = streamed(client, chat, prompt, max_tokens=16, extra_body=TOKEN_IDS, **params)
    tokens = extra(response.choices[0], "token_ids")
    ref = torch.log_softmax(causal_logits(target_model, ids + tokens), dim=-1)[len(ids) - 1:-1]
    top3 = [[(v, tokenizer.decode([i])) for v, i in zip(*map(torch.Tensor.tolist, row.topk(3)))] for row in ref]
    lps = [c.choices[0].logprobs for c in chunks[:-1] if c.choices[0].logprobs]
    if chat:
        entries = [e for lp in [response.choices[0].logprobs] + lps for e in lp.content]
        assert entries[:len(tokens)] == entries[len(tokens):]  # streamed = response
        chosen = [(e.token, e.logprob) for e in entries[:len(tokens)]]
        top = [[(t.logprob, t.token) for t in e.top_logprobs] for e in entries[:len(tokens)]]
        assert all(e.bytes == list(e.token.encode()) for e in entries)
    else:
        full = response.choices[0].logprobs
        assert [sum((getattr(lp, k) for lp in lps), []) for k in ("tokens", "token_logprobs")] == [
            full.tokens, full.token_logprobs]  # streamed = response
        chosen = list(zip(full.tokens, full.token_logprobs))
        top = [[(v, t) for t, v in d.items()] for d in full.top_logprobs]
        top3 = [[(v, t) for i, (v, t) in enumerate(row) if t not in [u for _, u in row[:i]]]
                for row in top3]  # a dict by text: equal texts keep the likeliest
        assert full.text_offset == [sum(map(len, full.tokens[:i])) for i in range(len(tokens))]
    assert [t for t, _ in chosen] == [tokenizer.decode([t]) for t in tokens]
    for row, token, (_, logprob), got, want in zip(ref, tokens, chosen, top, top3):
        assert logprob == pytest.approx(row[token].item(), abs=1e-5)
        assert [t for _, t in got] == [t for _, t in want]
        assert [v for v, _ in got] == pytest.approx([v for v, _ in want], abs=1e-5)


def test_echo_returns_the_prompt_and_its_logprobs(client, tokenizer, target_model):
    """echo + logprobs: the prompt's text and its tokens' logprobs (the first null) before the completion's, equal
    to a plain target forward; max_tokens 0 only scores the prompt; streamed = response."""
    prompt = "the quick brown fox"
    ids = tokenizer(prompt)["input_ids"]
    ref = torch.log_softmax(causal_logits(target_model, ids), dim=-1)
    scored = call(client, False, prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert lp.tokens == [tokenizer.decode([t]) for t in ids] and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[1:] == pytest.approx([ref[i, t].item() for i, t in enumerate(ids[1:])], abs=1e-5)
    response = call(client, False, prompt, max_tokens=4, echo=True, logprobs=1, temperature=0)
    *_, chunks = streamed(client, False, prompt, max_tokens=4, echo=True, logprobs=1, temperature=0)
    assert response.choices[0].text == "".join(c.choices[0].text for c in chunks[:-1])
    assert response.choices[0].text.startswith(prompt)
    full = response.choices[0].logprobs
    assert full.token_logprobs[:len(ids)] == lp.token_logprobs and len(full.tokens) == len(ids) + 4
    assert sum((c.choices[0].logprobs.tokens for c in chunks[:-1] if c.choices[0].logprobs), []) == full.tokens
    with pytest.raises(openai.BadRequestError) as info:
        call(client, False, prompt, max_tokens=0, logprobs=2)
    assert info.value.param == "max_tokens"


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_stop_string_ends_the_text_before_it(client, chat):
    for word in ("hello world", "the quick brown fox", "def add", "jumps over"):
        prompt = [{"role": "user", "content": word}] if chat else word
        full = content(call(client, chat, prompt, max_tokens=40, temperature=0), chat)
        # a printable ASCII stop string past the start (random weights also emit partial UTF-8 sequences)
        stop = next((w for i in range(len(full) // 3, len(full) - 3) if (w := full[i:i + 3]).isascii()
                     and w.isprintable() and full.find(w) > 0), None)
        if stop is not None:
            break
    assert stop is not None, "no greedy output with a printable stop string to cut at"
    response = call(client, chat, prompt, max_tokens=40, temperature=0, stop=["never appears", stop])
    text, _, finish, usage, _, _ = streamed(client, chat, prompt, max_tokens=40, temperature=0, stop=stop)
    assert content(response, chat) == text == full[: full.find(stop)]
    assert finish == response.choices[0].finish_reason == "stop"
    assert usage.completion_tokens == response.usage.completion_tokens < 40
    kept = {"include_stop_str_in_output": True}
    response = call(client, chat, prompt, max_tokens=40, temperature=0, stop=stop, extra_body=kept)
    text = streamed(client, chat, prompt, max_tokens=40, temperature=0, stop=stop, extra_body=kept)[0]
    assert content(response, chat) == text == full[: full.find(stop) + len(stop)]


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_max_tokens_gives_length_and_exactly_that_many_tokens(client, tokenizer, target_model, chat):
    word = long_greedy_prompt(client, 20)
    prompt = [{"role": "user", "content": word}] if chat else word
    ids = chat_ids(tokenizer, prompt) if chat else tokenizer(word)["input_ids"]
    reference = hf_greedy(target_model, ids, 13)
    limit = {"max_completion_tokens": 13} if chat else {"max_tokens": 13}
    response = call(client, chat, prompt, temperature=0, extra_body=TOKEN_IDS, **limit)
    text, tokens, finish, usage, _, _ = streamed(client, chat, prompt, temperature=0, extra_body=TOKEN_IDS, **limit)
    if EOS in reference:
        pytest.skip("the chat prompt's greedy continuation meets EOS within 13 tokens")
    assert tokens == reference == extra(response.choices[0], "token_ids")
    assert finish == response.choices[0].finish_reason == "length"
    assert usage.completion_tokens == response.usage.completion_tokens == 13
    assert text == content(response, chat)


def greedy_ids(client, prompt: list[int], no_spec: bool, max_tokens: int = 12, **params):
    """(token ids, text, finish_reason) of a greedy completion; params: top-level (vLLM's) parameters."""
    body = {**params, "specdec": {"return_token_ids": True, "no_spec": no_spec}}
    response = client.completions.create(model="target", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         extra_body=body)
    choice = response.choices[0]
    return extra(choice, "token_ids"), choice.text, choice.finish_reason


@pytest.fixture(scope="module")
def eos_prompt(client) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) where the greedy continuation ends with EOS as its 3rd to 8th token."""
    for seed in range(100):
        tokens, _, finish = greedy_ids(client, prompt_ids(seed, 6), no_spec=True, max_tokens=8)
        if finish == "stop" and len(tokens) >= 3:
            return prompt_ids(seed, 6), tokens
    pytest.fail("no prompt meets EOS within 3 to 8 greedy tokens")


def test_vllm_stop_parameters_speculative_equal_no_spec(client, tokenizer, eos_prompt):
    """ignore_eos, min_tokens, stop_token_ids, skip_special_tokens at the top level (vLLM's): each speculative
    output equals the no_spec (target-only) one; ignore_eos runs past the EOS to max_tokens, min_tokens cuts that
    output at its first EOS from the min_tokens-th token on, a stop token ends it (kept, finish "stop")."""
    prompt, base = eos_prompt

    def run(**params):
        spec = greedy_ids(client, prompt, no_spec=False, **params)
        assert spec == greedy_ids(client, prompt, no_spec=True, **params)
        return spec

    assert run() == (base, tokenizer.decode(base, skip_special_tokens=True), "stop") and base[-1] == EOS
    tokens, text, finish = full = run(ignore_eos=True)
    assert len(tokens) == 12 and tokens[:len(base)] == base and finish == "length"
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert run(ignore_eos=True, skip_special_tokens=False)[1] == tokenizer.decode(tokens) != text
    assert run(min_tokens=12) == full
    for least in (len(base), len(base) + 1):
        end = next((i + 1 for i, t in enumerate(tokens) if t == EOS and i + 1 >= least), None)
        assert run(min_tokens=least)[::2] == (tokens[:end], "length" if end is None else "stop")
    k = max(i for i, t in enumerate(tokens) if tokens.index(t) == i)  # the last first occurrence
    assert run(ignore_eos=True, stop_token_ids=[tokens[k]])[::2] == (tokens[:k + 1], "stop")


MESSAGES = [{"role": "user", "content": "hi"}]
BAD_PARAMS = [  # (chat, parameters, the parameter the error must name)
    (True, dict(top_logprobs=2), "top_logprobs"),  # without logprobs: true
    (True, dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (False, dict(logprobs=6), "logprobs"),
    (True, dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),
    (True, dict(tool_choice="auto"), "tool_choice"),
    (True, dict(frequency_penalty=0.5), "frequency_penalty"),
    (False, dict(presence_penalty=1.0), "presence_penalty"),
    (True, dict(logit_bias={"5": 10}), "logit_bias"),
    (True, dict(response_format={"type": "json_object"}), "response_format"),
    (False, dict(extra_body={"foo": 1}), "foo"),
    (True, dict(extra_body={"specdec": {"colour": "red"}}), "specdec.colour"),
    (True, dict(temperature=-1), "temperature"),
    (False, dict(top_p=1.5), "top_p"),
    (False, dict(top_p=0), "top_p"),
    (False, dict(seed=-3), "seed"),
    (True, dict(n=2), "n"),
    (True, dict(max_tokens=0), "max_tokens"),
    (False, dict(max_tokens=-5), "max_tokens"),
    (True, dict(max_completion_tokens=0), "max_completion_tokens"),
    (True, dict(max_tokens=5, max_completion_tokens=6), "max_completion_tokens"),
    (False, dict(stop=[""]), "stop"),
    (False, dict(extra_body={"min_tokens": -1}), "min_tokens"),
    (True, dict(extra_body={"min_tokens": 5}), "min_tokens"),  # over max_tokens (4)
    (False, dict(extra_body={"stop_token_ids": [300000]}), "stop_token_ids"),  # outside the vocabulary
    (True, dict(extra_body={"stop_token_ids": [-1]}), "stop_token_ids"),
    (False, dict(extra_body={"stop_token_ids": list(range(65))}), "stop_token_ids"),
    (False, dict(extra_body={"ignore_eos": "maybe"}), "ignore_eos"),
    (True, dict(extra_body={"skip_special_tokens": [1]}), "skip_special_tokens"),
    (False, dict(extra_body={"include_stop_str_in_output": "x"}), "include_stop_str_in_output"),
    (False, dict(extra_body={"specdec": {"tree": {"gamma": 2, "topKSpec": [[1]], "topHead": [1, 1]}}}), "specdec.tree"),
    (True, dict(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]), "messages[0].role"),
    (False, dict(prompt=list(range(1, 301))), "prompt"),  # over the context limit
    (False, dict(prompt=["two", "prompts"]), "prompt"),
    (True, dict(messages=[{"role": "user", "content": "the quick brown fox " * 40}]), "messages"),
]


@pytest.mark.parametrize("chat,params,param", BAD_PARAMS, ids=[f"{p}-{i}" for i, (_, _, p) in enumerate(BAD_PARAMS)])
def test_bad_parameters_are_400_naming_them(client, chat, params, param):
    prompt = params.pop("messages" if chat else "prompt", MESSAGES if chat else "hi")
    with pytest.raises(openai.BadRequestError) as info:
        call(client, chat, prompt, max_tokens=params.pop("max_tokens", 4), **params)
    assert info.value.status_code == 400
    assert info.value.param == param and info.value.body["message"].startswith(f"{param}: ")
    assert info.value.type == "invalid_request_error"


def post(http: str, path: str, body: bytes) -> tuple[int, dict]:
    """(status, JSON body) of a raw POST: bodies the openai client would not send as they are."""
    request = urllib.request.Request(f"http://{http}{path}", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", rb'{"prompt": [2147483648], "max_tokens": 2}', "prompt"),  # past int32 (protobuf)
    ("/v1/completions", rb'{"prompt": "a\ud800b", "max_tokens": 2}', "prompt"),  # a lone surrogate
    ("/v1/completions", rb'{"prompt": "ab", "max_tokens": 2, "stop": ["x", "\udc00"]}', "stop"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "a\ud800"}], "max_tokens": 2}',
     "messages[0].content"),
])
def test_values_protobuf_cannot_hold_are_400_naming_them(stack, path, body, param):
    status, out = post(stack[3], path, body)
    assert status == 400 and out["error"]["param"] == param and out["error"]["message"].startswith(f"{param}: ")


def test_tokenizing_a_huge_prompt_does_not_stall_the_front(stack):
    """A multi-megabyte prompt (under front.limits.max_prompt_bytes, raised here; tokenized, then refused as
    over the token limit) is tokenized off the event loop: meanwhile the front still answers (here /health)."""
    http = stack[3]
    body = json.dumps({"prompt": "hello world " * 300_000, "max_tokens": 2}).encode()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        big = pool.submit(post, http, "/v1/completions", body)
        time.sleep(0.3)  # the body is in; its tokenization runs
        asked = time.monotonic()
        urllib.request.urlopen(f"http://{http}/health", timeout=60).read()
        health_s = time.monotonic() - asked
        status, out = big.result()
        big_s = time.monotonic() - started
    assert status == 400 and out["error"]["param"] == "prompt"
    assert big_s > 1.0, "the huge prompt was tokenized too fast to tell"
    assert health_s < 0.25 * big_s, f"/health took {health_s:.2f} s while a {big_s:.2f} s prompt was tokenized"


def test_a_prompt_over_max_prompt_bytes_is_refused_before_it_is_tokenized(stack):
    """The same prompt past max_prompt_bytes (4 MiB here) is refused at once: nothing tokenizes it."""
    started = time.monotonic()
    status, out = post(stack[3], "/v1/completions", json.dumps({"prompt": "hello world " * 360_000}).encode())
    assert status == 400 and out["error"]["param"] == "prompt", out
    assert out["error"]["message"].startswith("prompt: over front.limits.max_prompt_bytes (4194304 bytes")
    assert time.monotonic() - started < 1.0

def test_a_message_name_reaches_the_chat_template(client, tokenizer):
    named = [{"role": "user", "content": "hi", "name": "ann"}]
    response = client.chat.completions.create(model="target", messages=named, max_tokens=1, temperature=0)
    assert response.usage.prompt_tokens == len(chat_ids(tokenizer, named)) > len(chat_ids(tokenizer, MESSAGES))


def test_null_parameters_take_their_defaults(stack):
    """OpenAI's parameters are nullable ("temperature": null = 1); clients send null for unset ones."""
    nulls = dict.fromkeys(["model", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop",
                           "seed", "user", "specdec", "logprobs"])
    status, out = post(stack[3], "/v1/completions", json.dumps({"prompt": "hello", "max_tokens": 3, **nulls}).encode())
    assert status == 200, out
    assert out["object"] == "text_completion" and 1 <= out["usage"]["completion_tokens"] <= 3
    chat = {"messages": [{"role": "user", "content": "hi", "name": None}], "max_tokens": None,
            "max_completion_tokens": 2, **nulls, "specdec": {"tree": None, "no_spec": None}}
    status, out = post(stack[3], "/v1/chat/completions", json.dumps(chat).encode())
    assert status == 200, out
    assert out["object"] == "chat.completion" and 1 <= out["usage"]["completion_tokens"] <= 2
    status, out = post(stack[3], "/v1/chat/completions", json.dumps({"messages": None}).encode())
    assert status == 400 and out["error"]["param"] == "messages"  # a required one is then missing


def test_no_op_values_of_unsupported_parameters_and_unknown_model(client):
    response = client.chat.completions.create(model="target", messages=MESSAGES, max_tokens=3, temperature=0,
                                              logprobs=False, top_logprobs=0, frequency_penalty=0, presence_penalty=0.0,
                                              n=1)
    assert response.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=3)
    assert info.value.param == "model" and info.value.code == "model_not_found"


def test_client_disconnect_mid_stream_frees_draft_and_target_sessions(stack, client, long_prompt):
    draft, target, front, http = stack
    word = long_prompt
    before = metric(http, "specdec_committed_tokens_total")
    stream = client.completions.create(model="target", prompt=word, max_tokens=240, temperature=0, stream=True)
    first = next(iter(stream))
    assert first.choices[0].text or first.choices[0].finish_reason is None
    assert target_info(target.address).sessions == 1  # the request is running
    stream.close()  # the client goes away mid-stream
    assert wait_sessions(target.address, 0) == 0, "the target session of a disconnected client was not released"
    assert metric(http, "specdec_committed_tokens_total") - before < 240  # it was cut short, not run to the end
    assert_draft_session_free(front.address)  # the draft admits one session: the request's was released


def test_ten_concurrent_streams_each_get_their_solo_output(client, target_model, stack):
    prompts = [prompt_ids(300 + i, 4 + i) for i in range(10)]
    expected = [until_eos(hf_greedy(target_model, ids, 16)) for ids in prompts]
    http = stack[3]

    async def one(aclient, ids):
        stream = await aclient.completions.create(model="target", prompt=ids, max_tokens=16, temperature=0,
                                                  stream=True, extra_body=TOKEN_IDS)
        tokens = []
        async for chunk in stream:
            tokens += extra(chunk.choices[0], "token_ids") or [] if chunk.choices else []
        return tokens

    async def run():
        aclient = openai.AsyncOpenAI(base_url=f"http://{http}/v1", api_key="unused", max_retries=0, timeout=60)
        return await asyncio.gather(*[one(aclient, ids) for ids in prompts])

    outputs = asyncio.run(run())
    assert outputs == expected


# aiperf (PyPI; a maintained OpenAI load tester): its pins (psutil, rich, pillow, ...) clash with the project's, so it
# lives in an environment of its own, as checkov does (.ci/run makes it). Its path: $SPECDEC_AIPERF, else `aiperf` on
# PATH, else /opt/aiperf.
AIPERF_INSTALL = "python -m venv /opt/aiperf && /opt/aiperf/bin/pip install aiperf==0.13.0"


def aiperf_path() -> str | None:
    venv = Path("/opt/aiperf/bin/aiperf")
    return os.environ.get("SPECDEC_AIPERF") or shutil.which("aiperf") or (str(venv) if venv.exists() else None)


def test_aiperf_fixed_length_streams_with_ignore_eos(client, stack, pair, tmp_path):
    """aiperf runs 4 streaming chat requests (2 concurrent) with vLLM's top-level ``ignore_eos`` and a fixed output
    length of 12 over prompts whose greedy continuation meets EOS within 8 tokens: its own output files must show
    every request completed, without errors, with exactly 12 output tokens (the server's usage), and the text of
    each equal to a non-streamed target-only request's."""
    path = aiperf_path()
    if path is None:
        pytest.skip(f"aiperf not found ($SPECDEC_AIPERF, `aiperf` on PATH, /opt/aiperf); install: {AIPERF_INSTALL}")
    words = "the quick brown fox jumps over lazy dog hello world".split()

    def target_only(text, **params):
        return client.chat.completions.create(model="target", messages=[{"role": "user", "content": text}],
                                              temperature=0, extra_body={**params, "specdec": {"no_spec": True}})

    meets_eos = (text for text in (f"{a} {b}" for a in words for b in words)
                 if target_only(text, max_tokens=8).choices[0].finish_reason == "stop")
    prompts = list(itertools.islice(meets_eos, 4))
    assert len(prompts) == 4, prompts
    expected = [target_only(text, max_tokens=12, ignore_eos=True).choices[0].message.content for text in prompts]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in prompts))
    out = tmp_path / "aiperf"
    command = [path, "profile", "--model", "target", "--url", f"http://{stack[3]}", "--endpoint-type", "chat",
               "--streaming", "--tokenizer", str(pair.target), "--input-file", str(tmp_path / "prompts.jsonl"),
               "--custom-dataset-type", "single_turn", "--dataset-sampling-strategy", "sequential",
               "--output-tokens-mean", "12", "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
               "--use-server-token-count", "--request-count", "4", "--concurrency", "2", "--random-seed", "0",
               "--artifact-dir", str(out), "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry",
               "--workers-max", "1", "--record-processors", "1", "--export-outputs-json"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    assert summary["completed_request_count"]["avg"] == 4 and summary["error_summary"] == [], summary["error_summary"]
    assert summary["osl_mismatch_count"]["avg"] == 0
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all("error" not in r or r["error"] is None for r in records)
    assert [r["metrics"]["output_sequence_length"]["value"] for r in records] == [12] * 4
    outputs = {o["conversation_id"]: o for o in json.loads((out / "outputs.json").read_text())["data"]}
    assert [outputs[f"session_{i:06d}"]["response_text"] for i in range(4)] == expected


@pytest.fixture(scope="module")
def guarded(servers):
    return servers["guarded"][3]


def test_bearer_token_and_kv_limit(guarded):
    def client(key):
        return openai.OpenAI(base_url=f"http://{guarded}/v1", api_key=key, max_retries=0, timeout=60)

    with pytest.raises(openai.AuthenticationError) as info:
        client("wrong-token").completions.create(model="target", prompt="hi", max_tokens=3)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    request = urllib.request.Request(f"http://{guarded}/v1/models")  # no Authorization header at all
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 401 and json.loads(refused.value.read())["error"]["type"] == "authentication_error"
    for key in ("first-token", "second-token"):
        assert client(key).completions.create(model="target", prompt="hi", max_tokens=3).usage.completion_tokens >= 1
    assert urllib.request.urlopen(f"http://{guarded}/health", timeout=10).status == 200  # probes need no token
    with pytest.raises(openai.RateLimitError) as info:  # a 100-token prompt needs more KV than the target has
        client("first-token").completions.create(model="target", prompt=list(range(1, 101)), max_tokens=3, stream=True)
    assert info.value.status_code == 429 and "max_kv_tokens" in info.value.message


def test_draining_front_refuses_new_requests_with_503_and_finishes_streams(stack, client, long_prompt):
    """Runs last: it stops the module's front."""
    _, _, front, http = stack
    word = long_prompt
    stream = client.completions.create(model="target", prompt=word, max_tokens=240, temperature=0, stream=True)
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    front.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while True:
        try:
            urllib.request.urlopen(f"http://{http}/health", timeout=5)
        except urllib.error.HTTPError as exc:
            assert exc.code == 503
            break
        assert time.monotonic() < deadline, "/health never answered 503 while draining"
        time.sleep(0.01)
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="target", prompt="hi", max_tokens=3)
    assert info.value.status_code == 503 and info.value.code == "draining"
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"  # the running stream was allowed to finish
    assert len(text + "".join(c.choices[0].text for c in rest)) > 0
    assert wait_for_exit(front, 30)[0] == 0
