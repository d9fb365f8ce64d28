"""Fail-over of a request whose orchestrator actor dies mid-stream (orchestrator.serving.failover, RayBackend).

Unit tests (in-process models, scripted fake actors): the continuation request (prompt + streamed
tokens, the rest of max_new_tokens and of the deadline, a derived seed, resumed_tokens) for an actor
dying before the first token, mid-stream and after the last round; stop strings spanning the
hand-over stop where an uninterrupted request stops; the fail-over limit; Abort of a request
failing over. End to end (real local Ray, real draft and target gRPC services, tiny seeded models):
the actor running a greedy request is killed mid-stream and the client gets the target-only greedy
output, with a stop string spanning the kill point honoured, and the front's fail-over counter moves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import time

import pytest
import torch
from ray.exceptions import ActorDiedError
from transformers import AutoModelForCausalLM, AutoTokenizer

from draft_service.runtime import DraftRuntime
from orchestrator.serving.actors import RayBackend
from orchestrator.serving.backends import UpstreamError
from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.engine import SpeculativeEngine
from orchestrator.serving.failover import Resumption
from orchestrator.serving.requests import GenerateCall
from orchestrator.loop.stops import StopChecker
from specdec.sampling import SamplingParams, derive_seed
from specdec.stats import GenerationStats, RoundRecord
from specdec.tree_spec import DEFAULT_SPEC, TreeSpec
from specdec.wire import stats_to_proto
from target_service.runtime import TargetRuntime
from tests.conftest import char_decode, hf_greedy, random_prompt, tiny_model

# ------------------------------------------------------------------------------------------------
# Stop strings across the hand-over (in-process engine, real tiny model)
# ------------------------------------------------------------------------------------------------


def test_stop_checker_sees_streamed_tokens_but_not_old_matches():
    pieces = {0: "ab", 1: "c", 2: "de", 4: "q"}

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    spanning = StopChecker(prompt_len=5, max_new_tokens=10, context_limit=100, stop_strings=("bcd",),
                           decode=decode, streamed=(4, 0))
    assert not spanning.push(1) and spanning.push(2) and spanning.reason == "stop_string"  # "ab" | "c" "de"
    old = StopChecker(prompt_len=5, max_new_tokens=10, context_limit=100, stop_strings=("ab",), decode=decode,
                      streamed=(0,))
    assert not old.push(4)  # a match wholly inside the streamed part was the earlier part's to see


def test_continuation_stops_where_an_uninterrupted_request_stops():
    """Stop string = text of greedy tokens 5..7; the request hands over after j tokens for every j up
    to the stop: streamed + continuation = the uninterrupted output, stopped by the stop string."""
    model = tiny_model("qwen2", seed=0)
    for seed in range(200):
        prompt = random_prompt(seed=9500 + seed, length=6)
        reference = hf_greedy(model, prompt, 30)
        text = char_decode(reference)
        stop = text[5:8]
        if text.find(stop) == 5:
            break
    else:
        raise AssertionError("no prompt found")
    engine = SpeculativeEngine(TargetRuntime(model), DraftRuntime(model), eos_token_ids=(), context_limit=512,
                               decode=char_decode)
    request = GenerationRequest(prompt, max_new_tokens=30, stop_strings=(stop,), spec=TreeSpec.chain(3))
    for j in range(0, 8):
        progress = Resumption(request, timeout_s=None, max_failovers=1)
        progress.record(reference[:j], None)
        out = engine.generate(progress.next_part())
        assert reference[:j] + out.tokens == reference[:8], j
        assert out.stats.stop_reason == "stop_string", j


def test_continuation_owes_what_is_left_of_min_tokens():
    request = GenerationRequest([1, 2], max_new_tokens=10, min_tokens=6, stop_token_ids=(9,))
    owed = []
    for streamed in ([3, 4, 5, 6], [3, 4, 5, 6, 7, 8, 10, 11]):
        progress = Resumption(request, timeout_s=None, max_failovers=1)
        progress.record(streamed, None)
        owed.append((progress.next_part().min_tokens, progress.next_part().stop_token_ids))
    assert owed == [(2, (9,)), (0, (9,))]


# ------------------------------------------------------------------------------------------------
# RayBackend with scripted actors
# ------------------------------------------------------------------------------------------------

PROMPT = [5, 6, 7]
FULL = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # what any actor generates: 2 tokens a round


async def _ready(value):
    return value


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def options(self, **_):
        return self

    def remote(self, *args):
        return self.fn(*args)


class FakeActor:
    """An orchestrator actor that continues FULL from the request's resumed tokens, two tokens a
    round (the last round carries its stop reason, then the stats), and dies (ActorDiedError) once
    it has streamed ``die_after`` tokens of a part (None = never)."""

    def __init__(self, die_after: int | None = None, abort_dies: bool = False, die_after_stats: bool = False,
                 restart_s: float = 0.05):
        self.die_after = die_after
        self.abort_dies = abort_dies
        self.die_after_stats = die_after_stats  # dies just after sending a part's final stats
        self.restart_s = restart_s
        self.requests: list[tuple[GenerationRequest, float | None]] = []
        self.aborts: list[str] = []
        self.stream = _Method(self._stream)
        self.abort = _Method(self._abort)
        self.ready = _Method(self._ready)

    async def _ready(self):  # restarted after restart_s
        await asyncio.sleep(self.restart_s)
        return 64

    async def _stream(self, request, request_id, timeout_s, carrier):
        self.requests.append((request, timeout_s))
        todo = FULL[request.resumed_tokens:][: request.max_new_tokens]
        sent = 0
        for i in range(0, len(todo), 2):
            self._maybe_die(sent)
            tokens = todo[i:i + 2]
            sent += len(tokens)
            stop = "max_new_tokens" if sent == len(todo) else None
            record = RoundRecord(tuple(tokens), proposed=3, accepted=1, depth=3, fallback=None, gamma=3, draft_s=0.0,
                                 verify_s=0.0, commit_s=0.0, stop_reason=stop)
            yield _ready((tokens, record, None))
        self._maybe_die(sent)
        yield _ready(([], None, GenerationStats(new_tokens=sent, rounds=len(todo) // 2, stop_reason="max_new_tokens",
                                                draft_link_rtt_ms=2.0, target_link_rtt_ms=1.0)))
        if self.die_after_stats:
            raise ActorDiedError()

    def _maybe_die(self, sent: int) -> None:
        if self.die_after is not None and sent >= self.die_after:
            raise ActorDiedError()

    async def _abort(self, request_id):
        self.aborts.append(request_id)
        if self.abort_dies:
            raise ActorDiedError()
        return True


@pytest.fixture(autouse=True)
def cancels(request, monkeypatch):
    """The scripted-actor tests: ray.cancel records what it was asked to cancel (the real one would
    start a local Ray for these fake streams)."""
    if "ray_front" in request.fixturenames:
        return None
    import ray

    cancelled = []
    monkeypatch.setattr(ray, "cancel", cancelled.append)
    return cancelled


def fake_backend(*actors) -> RayBackend:
    backend = RayBackend(front=None, grpc_cfg=None, tok_dir=None)
    backend.actors = list(actors)
    backend.inflight = {i: 0 for i in range(len(actors))}
    return backend


async def collect(stream, on_chunk=None):
    tokens, final = [], None
    async for chunk_tokens, _, stats in stream:
        tokens += chunk_tokens
        if on_chunk is not None:
            await on_chunk(tokens)
        final = stats or final
    return tokens, final


SAMPLED = SamplingParams(temperature=0.8, seed=7)


@pytest.mark.parametrize("k", [0, 4, len(FULL)])
def test_actor_dying_after_k_tokens(k, cancels):
    """k = 0: resent unchanged; k = 4: continued from the 4 streamed tokens; k = all: died after its
    last round, before its stats: nothing to continue, the stats are completed from the stream (no link round
    trips then; else the last part's)."""
    first, second = FakeActor(die_after=k), FakeActor()
    backend = fake_backend(first, second)
    request = GenerationRequest(PROMPT, max_new_tokens=len(FULL), stop_strings=("zz",), spec=DEFAULT_SPEC,
                                sampling=SAMPLED)
    tokens, stats = asyncio.run(collect(backend.stream(request, "r1", 30.0, {})))
    assert tokens == FULL
    assert (stats.new_tokens, stats.rounds, stats.stop_reason) == (len(FULL), len(FULL) // 2, "max_new_tokens")
    assert stats.failovers == (0 if k == len(FULL) else 1)
    links = (None, None) if k == len(FULL) else (2.0, 1.0)  # the last part's, when it sent its stats
    assert (stats.draft_link_rtt_ms, stats.target_link_rtt_ms) == links
    assert backend.owner == {} and backend.inflight == {0: 0, 1: 0}
    assert len(cancels) == 1  # the dead part's stream; the finished one is not cancelled
    if k == len(FULL):
        assert second.requests == []
        return
    [(part, timeout_s)] = second.requests
    assert 29.0 < timeout_s < 30.0  # what is left of the deadline
    if k == 0:
        assert part is request  # nothing streamed: the same request, the same random stream
        return
    assert part.prompt_ids == PROMPT + FULL[:k] and part.resumed_tokens == k
    assert part.max_new_tokens == len(FULL) - k
    assert (part.stop_strings, part.spec, part.ignore_eos) == (request.stop_strings, request.spec, request.ignore_eos)
    assert part.sampling == dataclasses.replace(SAMPLED, seed=derive_seed(7, f"resume/{k}"))


def test_more_failovers_than_actors_end_unavailable():
    actors = [FakeActor(die_after=2), FakeActor(die_after=2)]
    backend = fake_backend(*actors)
    streamed = []

    async def run():
        async for tokens, _, _ in backend.stream(GenerationRequest(PROMPT, max_new_tokens=len(FULL)), "r2", None, {}):
            streamed.extend(tokens)

    with pytest.raises(UpstreamError) as info:
        asyncio.run(run())
    assert info.value.code_name == "UNAVAILABLE"
    assert streamed == FULL[:6]  # 2 tokens on each of 3 parts: the first run + 2 fail-overs
    assert sum(len(a.requests) for a in actors) == 3


def test_past_the_deadline_at_a_failover_ends_deadline_exceeded():
    backend = fake_backend(FakeActor(die_after=2), FakeActor())

    async def run():
        async def slow(_):
            await asyncio.sleep(0.2)
        await collect(backend.stream(GenerationRequest(PROMPT, max_new_tokens=len(FULL)), "r3", 0.1, {}), slow)

    with pytest.raises(UpstreamError) as info:
        asyncio.run(run())
    assert info.value.code_name == "DEADLINE_EXCEEDED"


def test_abort_reaches_the_new_actor_or_ends_a_request_failing_over():
    # after the fail-over, Abort goes to the actor now running the request
    first, second = FakeActor(die_after=4), FakeActor()
    backend = fake_backend(first, second)
    seen_owner = []

    async def on_chunk(tokens):
        if len(tokens) == 6:
            seen_owner.append(backend.owner["r4"])
            assert await backend.abort("r4")

    asyncio.run(collect(backend.stream(GenerationRequest(PROMPT, max_new_tokens=len(FULL)), "r4", None, {}), on_chunk))
    assert seen_owner == [second] and second.aborts == ["r4"] and first.aborts == []

    # an abort that meets the dying actor ends the request before any other actor runs it
    first, second = FakeActor(die_after=4, abort_dies=True), FakeActor()
    backend = fake_backend(first, second)

    async def abort_early(tokens):
        if len(tokens) == 2:
            assert await backend.abort("r5")

    tokens, stats = asyncio.run(collect(backend.stream(GenerationRequest(PROMPT, max_new_tokens=len(FULL)), "r5", None, {}),
                                        abort_early))
    assert tokens == FULL[:4] and stats.stop_reason == "aborted" and stats.new_tokens == 4
    assert first.aborts == ["r5"] and second.requests == []
    assert asyncio.run(backend.abort("r5")) is False  # over: unknown


def test_an_actor_dying_after_its_final_stats_starts_no_other_part():
    """Found by review: the backend read on after the final chunk, so an actor dying then started a
    continuation (a request ended by deadline or abort streamed on) or a second final chunk."""
    first, second = FakeActor(die_after_stats=True), FakeActor()
    backend = fake_backend(first, second)
    finals = []

    async def run():
        async for tokens, _, stats in backend.stream(GenerationRequest(PROMPT, max_new_tokens=len(FULL)), "r6", None, {}):
            if stats is not None:
                finals.append(stats)

    asyncio.run(run())
    assert len(finals) == 1 and finals[0].stop_reason == "max_new_tokens"
    assert second.requests == [] and backend.owner == {}


def test_an_abort_while_waiting_for_a_restarting_actor_ends_the_request():
    """Found by review: with every actor failed the request waits for one to come back; an Abort in
    that wait answered True but the request then ran on to max_new_tokens."""
    only = FakeActor(die_after=2, restart_s=5.0)  # one actor (front.workers: 1), slow to come back
    backend = fake_backend(only)

    async def run():
        async def abort_soon():
            await asyncio.sleep(0.3)  # the actor died at 2 tokens; the request waits in _pick
            return await backend.abort("r7")

        aborter = asyncio.ensure_future(abort_soon())
        started = time.monotonic()
        tokens, stats = await collect(backend.stream(GenerationRequest(PROMPT, max_new_tokens=len(FULL)), "r7", None, {}))
        return tokens, stats, await aborter, time.monotonic() - started

    tokens, stats, aborted, took_s = asyncio.run(run())
    assert aborted is True and stats.stop_reason == "aborted" and tokens == FULL[:2]
    assert len(only.requests) == 1 and took_s < 2.0  # no second part; the wait ended at the abort


# ------------------------------------------------------------------------------------------------
# End to end: real local Ray, real draft and target services
# ------------------------------------------------------------------------------------------------

N = 400  # long enough that the kill (asynchronous) lands while the request still streams


@pytest.fixture(scope="module")
def ray_front(tmp_path_factory):
    """Draft and target services (subprocesses) and, in this process, a Ray backend (2 actors) under the
    front's runner; yields (runner, target model, tokenizer, event loop)."""
    from orchestrator.serving.runner import RequestRunner
    from orchestrator.loop.metrics import SpecMetrics
    from specdec.config import load_config
    from specdec.harness.servers import launch_service, stop_service, wait_ready
    from specdec.harness.tiny_pair import save_tiny_pair, write_config

    pair = save_tiny_pair(tmp_path_factory.mktemp("models"), max_pos=1024, noise=0.03)
    path = write_config(tmp_path_factory.mktemp("cfg") / "serve.yaml", pair,
                        front={"workers": 2, "ray_num_cpus": 2, "cost_aware": {"enabled": False}})
    draft, target = launch_service("draft", path), launch_service("target", path)
    loop = asyncio.new_event_loop()
    backend = None
    environ = dict(os.environ)  # ray.init in this process sets RAY_* variables later tests' subprocesses inherit
    try:
        wait_ready(draft), wait_ready(target)
        config = load_config(path, {"front.draft_address": draft.address, "front.target_address": target.address})
        backend = RayBackend(config.front, config.grpc, str(pair.target))
        loop.run_until_complete(backend.start())
        tokenizer = AutoTokenizer.from_pretrained(pair.target)
        model = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
        yield RequestRunner(config.front, backend, tokenizer, metrics=SpecMetrics()), model, tokenizer, loop
    finally:
        if backend is not None and backend.actors:
            loop.run_until_complete(backend.close())
        loop.close()
        stop_service(draft), stop_service(target)
        os.environ.clear()
        os.environ.update(environ)


async def _actor_ready(actor, timeout_s: float = 120.0) -> None:
    """Wait for an actor, also one still restarting (Ray answers ActorUnavailableError until it is back)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await actor.ready.remote()
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def run_killing(servicer, loop, request: GenerationRequest, request_id: str, kill_after: int | None):
    """Run a request through the front; once ``kill_after`` tokens arrived, kill the actor running it
    (Ray restarts it). Returns (tokens, final stats)."""
    import ray

    async def run():
        nonlocal kill_after
        # every actor up (one killed by an earlier test may still be restarting): the fail-over has
        # somewhere to go at once
        await asyncio.gather(*(_actor_ready(actor) for actor in servicer.backend.actors))
        tokens, stats = [], None
        call = GenerateCall(request_id, prompt_ids=tuple(request.prompt_ids), max_new_tokens=request.max_new_tokens,
                            stop=request.stop_strings, tree=request.spec, ignore_eos=request.ignore_eos)
        async for event in servicer.run(call):
            tokens += event.tokens
            if kill_after is not None and len(tokens) >= kill_after:
                (inside,) = [k for k in servicer.backend.owner if k.startswith(f"{request_id}~")]  # the front's name
                ray.kill(servicer.backend.owner[inside], no_restart=False)
                kill_after = None
            stats = event.stats or stats
        return tokens, stats

    return loop.run_until_complete(run())


def failover_point(caplog, request_id: str) -> int:
    """The streamed tokens at the fail-over of request_id, from the backend's warning."""
    [message] = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"request {request_id}~")
                 and "continuing on another actor" in r.getMessage()]
    return int(re.search(r"after (\d+) streamed tokens", message).group(1))


def test_greedy_request_whose_actor_is_killed_mid_stream_is_unchanged(ray_front, caplog):
    servicer, model, tokenizer, loop = ray_front
    caplog.set_level(logging.WARNING, logger="orchestrator.serving.actors")
    prompt = random_prompt(seed=77, length=9, vocab=250)
    reference = hf_greedy(model, prompt, N)
    tokens, stats = run_killing(servicer, loop, GenerationRequest(prompt, N, spec=DEFAULT_SPEC, ignore_eos=True),
                                "kill-greedy", kill_after=2)
    assert tokens == reference
    assert (stats.new_tokens, stats.stop_reason, stats.failovers) == (N, "max_new_tokens", 1)
    assert stats_to_proto(stats, len(prompt)).failovers == 1  # what a gRPC client's FinalStats says
    assert servicer.metrics.registry.get_sample_value("specdec_failovers_total") == 1
    assert 2 <= failover_point(caplog, "kill-greedy") < N


def test_stop_string_spanning_the_kill_point_is_honoured(ray_front, caplog):
    """Stop string = the text of greedy tokens 1..99: any kill point in (1, 99) lies inside it; the
    killed request stops where the uninterrupted one does."""
    servicer, model, tokenizer, loop = ray_front
    caplog.set_level(logging.WARNING, logger="orchestrator.serving.actors")
    prompt = random_prompt(seed=78, length=7, vocab=250)
    reference = hf_greedy(model, prompt, N)
    stop = tokenizer.decode(reference[1:100], skip_special_tokens=False)
    request = GenerationRequest(prompt, N, stop_strings=(stop,), spec=DEFAULT_SPEC, ignore_eos=True)
    whole, whole_stats = run_killing(servicer, loop, request, "stop-whole", kill_after=None)
    assert whole_stats.stop_reason == "stop_string" and len(whole) < N and whole_stats.failovers == 0
    tokens, stats = run_killing(servicer, loop, request, "stop-killed", kill_after=2)
    assert 1 < failover_point(caplog, "stop-killed") < 99, "the kill did not land inside the stop string"
    assert tokens == whole and stats.stop_reason == "stop_string" and stats.failovers == 1
