"""Pipelining (DESIGN.md "Pipelining"): the draft drafts round r+1 from round r's best path and its
own guess of the bonus token while the target verifies round r.

Runtime: ``propose_ahead`` + adopt = commit + propose; ``propose_ahead`` + discard + commit +
propose = the same without the ahead; caches equal a fresh prefill; a sampled session's random
state after a discard equals the state before. Round loop and services: further below."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draft_service.runtime import DraftRuntime
from specdec.interfaces import DraftWorker, SessionStateError
from specdec.sampling import GREEDY, SamplingParams
from specdec.tree import ROOT
from specdec.tree_spec import TreeSpec
from tests.conftest import assert_kv_equal, cache_kv, prefill_kv, random_prompt, tiny_model

SPEC = TreeSpec(gamma=3, topKSpec=[[3], [2, 1], [1, 1]], topHead=[1, 2, 2])
SAMPLED_SPEC = TreeSpec(gamma=3, topKSpec=[[3], [2, 1], [1, 1]], topHead=[1, 2, 2], treeType=1)
SAMPLED = SamplingParams(temperature=0.9, top_k=20, seed=123)
STD = 0.2  # keeps float32 round-off between tree forwards and a fresh prefill well inside 1e-5


def best_path(tree, depth: int | None = None) -> list[int]:
    """The chain of highest draft log-prob children from the root (``depth`` nodes at most)."""
    path, node = [], ROOT
    while depth is None or len(path) < depth:
        kids = [i for i, p in enumerate(tree.parents) if p == node]
        if not kids:
            break
        node = max(kids, key=lambda i: tree.draft_logprobs[i])
        path.append(node)
    return path


def assert_same_tree(actual, expected):
    assert actual.tokens == expected.tokens
    assert actual.parents == expected.parents
    np.testing.assert_allclose(actual.draft_logprobs, expected.draft_logprobs, atol=1e-5)


def assert_fresh(runtime: DraftRuntime, model, sid: str):
    s = runtime.sessions[sid]
    assert_kv_equal(cache_kv(s.cache), prefill_kv(model, s.tokens[: s.cached_len]), what="draft cache")


def _pair(sampling=GREEDY, seed=3):
    model = tiny_model("qwen2", seed=seed, init_std=STD)
    prompt = random_prompt(seed=11, length=9)
    runtimes = DraftRuntime(model), DraftRuntime(model)
    for r in runtimes:
        r.start("s", prompt, sampling)
    return model, runtimes


@pytest.mark.parametrize("sampling,spec", [(GREEDY, SPEC), (SAMPLED, SAMPLED_SPEC), (SAMPLED, SPEC)])
@pytest.mark.parametrize("depth", [1, 2, 3])  # path ends at a fed node (1, 2) or at a leaf (3)
def test_ahead_adopt_equals_commit_then_propose(sampling, spec, depth):
    model, (ahead, plain) = _pair(sampling)
    tree = ahead.propose("s", spec, 3)
    assert_same_tree(plain.propose("s", spec, 3), tree)
    path = best_path(tree, depth)
    guess, next_tree = ahead.propose_ahead("s", path, spec, 3)
    ahead.resolve_ahead("s", adopt=True)
    plain.commit("s", [tree.tokens[n] for n in path] + [guess], path)
    assert_same_tree(next_tree, plain.propose("s", spec, 3))
    assert guess == int(torch.argmax(_logits_after(model, plain.sessions["s"].tokens[:-1])))
    for runtime in (ahead, plain):  # the next round goes on identically
        runtime.commit("s", [next_tree.tokens[0], 7], [0])
        assert_fresh(runtime, model, "s")
    assert_same_tree(ahead.propose("s", spec, 2), plain.propose("s", spec, 2))


def _logits_after(model, ids):
    return model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()


@pytest.mark.parametrize("sampling,spec", [(GREEDY, SPEC), (SAMPLED, SAMPLED_SPEC)])
@pytest.mark.parametrize("accepted", [0, 1, 2])
def test_ahead_discard_then_commit_equals_no_ahead(sampling, spec, accepted):
    model, (ahead, plain) = _pair(sampling)
    tree = ahead.propose("s", spec, 3)
    plain.propose("s", spec, 3)
    s = ahead.sessions["s"]
    before = (list(s.tokens), s.cached_len, cache_kv(s.cache), s.rng.bit_generator.state if s.rng else None)
    ahead.propose_ahead("s", best_path(tree), spec, 3)
    ahead.resolve_ahead("s", adopt=False)
    assert (s.tokens, s.cached_len) == (before[0], before[1])
    # the committed slots are back as they were; the tree's slots are dropped (commit keeps no node KV)
    kept = [(k[:, :, : s.cached_len], v[:, :, : s.cached_len]) for k, v in before[2]]
    assert_kv_equal(cache_kv(s.cache), kept, what="draft cache after discard", atol=0, rtol=0)
    if s.rng is not None:
        assert s.rng.bit_generator.state == before[3]
    path = best_path(tree, accepted)
    committed = [tree.tokens[n] for n in path] + [5]
    for runtime in (ahead, plain):
        runtime.commit("s", committed, path)
        assert_fresh(runtime, model, "s")
    assert_same_tree(ahead.propose("s", spec, 3), plain.propose("s", spec, 3))


def test_ahead_kv_after_adopt_equals_fresh_prefill():
    model, (ahead, _) = _pair()
    tree = ahead.propose("s", SPEC, 3)
    guess, _tree = ahead.propose_ahead("s", best_path(tree), SPEC, 3)
    ahead.resolve_ahead("s", adopt=True)
    s = ahead.sessions["s"]
    assert s.tokens[-1] == guess
    # the cache holds the committed tokens (guess included: the ahead tree's step 0 fed it) and the tree slots
    s_len = s.cached_len
    assert s_len == len(s.tokens)
    got = [(k[:, :, :s_len], v[:, :, :s_len]) for k, v in cache_kv(s.cache)]
    assert_kv_equal(got, prefill_kv(model, s.tokens), what="draft cache after adopt")


def test_ahead_errors_name_the_field():
    _, (runtime, _) = _pair()
    with pytest.raises(SessionStateError, match="path_nodes"):
        runtime.propose_ahead("s", [0], SPEC, 3)  # no tree proposed yet
    tree = runtime.propose("s", SPEC, 3)
    leaf = next(i for i, p in enumerate(tree.parents) if p != ROOT)
    with pytest.raises(ValueError, match=r"path_nodes\[0\]"):
        runtime.propose_ahead("s", [leaf], SPEC, 3)
    with pytest.raises(ValueError, match=r"path_nodes\[0\] = 99"):
        runtime.propose_ahead("s", [99], SPEC, 3)
    with pytest.raises(SessionStateError, match="adopt"):
        runtime.resolve_ahead("s", adopt=True)
    runtime.propose_ahead("s", [0], SPEC, 3)
    with pytest.raises(SessionStateError, match="ahead"):
        runtime.propose_ahead("s", [0], SPEC, 3)
    with pytest.raises(SessionStateError, match="resolve_ahead"):
        runtime.propose("s", SPEC, 3)
    with pytest.raises(SessionStateError, match="resolve_ahead"):
        runtime.commit("s", [1], [])
    runtime.resolve_ahead("s", adopt=False)
    runtime.commit("s", [tree.tokens[0], 4], [0])


def test_ahead_merges_with_other_sessions_proposes():
    """An ahead item and a plain item in one propose_batch give what each gets alone."""
    model = tiny_model("qwen2", seed=3, init_std=STD)
    batch, solo = DraftRuntime(model), DraftRuntime(model)
    for r in (batch, solo):
        r.start("a", random_prompt(seed=1, length=7))
        r.start("b", random_prompt(seed=2, length=12))
    tree_a = batch.propose("a", SPEC, 3)
    solo.propose("a", SPEC, 3)
    path = best_path(tree_a)
    out = batch.propose_batch([("a", SPEC, 3, path), ("b", SPEC, 2)])
    assert out[0].guess == solo.propose_ahead("a", path, SPEC, 3).guess
    solo_a = solo.sessions["a"].last_tree
    assert_same_tree(out[0].tree, solo_a)
    assert_same_tree(out[1], solo.propose("b", SPEC, 2))



@pytest.mark.parametrize("where", ["before", "mid-forward"])
def test_failed_shared_forward_rolls_the_ahead_back_so_a_retry_alone_succeeds(monkeypatch, where):
    """A shared draft forward that fails raises out of propose_batch; SessionBatcher then retries
    each item alone. The ahead item must be back at its state before the ahead (no unresolved ahead
    left), so its solo retry gives the tree and guess an untroubled run gives. "mid-forward": the
    packed forward fails in layer 1, after layer 0 appended the rows' KV to both caches (layers of
    uneven length: the rollback and the next round's start must cut every layer)."""
    model = tiny_model("qwen2", seed=3, init_std=STD)
    batch, solo = DraftRuntime(model), DraftRuntime(model)
    for r in (batch, solo):
        r.start("a", random_prompt(seed=1, length=7))
        r.start("b", random_prompt(seed=2, length=12))
        r.propose("a", SPEC, 3)
    path = best_path(batch.sessions["a"].last_tree)
    real = DraftRuntime._forward_together

    def fail_once(self, rows):
        monkeypatch.setattr(DraftRuntime, "_forward_together", real)
        raise RuntimeError("out of memory in the stacked batch")

    def fail_in_layer_1(module, args, kwargs):  # only in a packed (shared) forward, once
        if kwargs.get("packed_rows") is not None:
            hook.remove()
            raise RuntimeError("out of memory in layer 1 of the packed forward")

    if where == "before":
        monkeypatch.setattr(DraftRuntime, "_forward_together", fail_once)
    else:
        assert batch.packed
        hook = model.model.layers[1].register_forward_pre_hook(fail_in_layer_1, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            batch.propose_batch([("a", SPEC, 3, path), ("b", SPEC, 2)])
    finally:
        if where != "before":
            hook.remove()
    if where != "before":  # layer 0 holds rows that layer 1 does not: the caches are uneven until rolled back
        layers = batch.sessions["b"].cache.layers  # b was never prefilled: layer 1 is still empty
        assert layers[0].keys.shape[2] > (0 if layers[1].keys is None else layers[1].keys.shape[2])
    assert batch.sessions["a"].ahead is None
    retried = batch.propose_ahead("a", path, SPEC, 3)  # before the fix: SessionStateError (unresolved ahead)
    expected = solo.propose_ahead("a", path, SPEC, 3)
    assert retried.guess == expected.guess
    assert_same_tree(retried.tree, expected.tree)
    assert_same_tree(batch.propose("b", SPEC, 2), solo.propose("b", SPEC, 2))
    for r in (batch, solo):
        r.resolve_ahead("a", adopt=True)
        r.commit("a", [expected.tree.tokens[0], 7], [0])
        assert_fresh(r, model, "a")
    assert batch.sessions["a"].tokens == solo.sessions["a"].tokens

# ------------------------------------------------------------------------------------------------
# The round loop (embedded: real tiny runtimes, in-process)
# ------------------------------------------------------------------------------------------------

from orchestrator.loop.controller import GenerationRequest  # noqa: E402
from orchestrator.loop.engine import SpeculativeEngine  # noqa: E402
from specdec.kv_cache import cache_length  # noqa: E402
from target_service.runtime import TargetRuntime  # noqa: E402
from tests.conftest import RecordingTarget, hf_greedy, perturbed_copy  # noqa: E402

CHAIN_SPEC = TreeSpec(gamma=3, topKSpec=[[2], [1, 1], [1, 1]], topHead=[1, 2, 2])


class AheadDraft(DraftWorker):
    """A DraftRuntime with the pipelining methods, a script for the guesses it reports, and cache
    checks after every commit and every resolve.

    script(i) for the i-th ahead: "real" reports the runtime's own guess; "wrong" reports another
    token, so the round loop sees a bonus token that differs from the guess (the runtime's tentative
    state is then discarded like any miss). Each resolve is logged in ``resolved`` (True = adopted).
    """

    drafts_ahead = True

    def __init__(self, runtime: DraftRuntime, model, script=lambda i: "real"):
        self.runtime = runtime
        self.model = model
        self.script = script
        self.aheads = 0
        self.resolved: list[bool] = []
        self.checks = 0

    def start(self, session_id, prompt_ids, sampling=GREEDY):
        self.runtime.start(session_id, prompt_ids, sampling)

    def propose(self, session_id, spec, max_depth):
        return self.runtime.propose(session_id, spec, max_depth)

    def propose_ahead(self, session_id, path_nodes, spec, max_depth):
        guess, tree = self.runtime.propose_ahead(session_id, path_nodes, spec, max_depth)
        kind = self.script(self.aheads)
        self.aheads += 1
        return (guess if kind == "real" else (guess + 1) % self.model.config.vocab_size), tree

    def resolve_ahead(self, session_id, adopt):
        self.runtime.resolve_ahead(session_id, adopt)
        self.resolved.append(adopt)
        self._check(session_id)

    def commit(self, session_id, tokens, accepted_nodes):
        self.runtime.commit(session_id, tokens, accepted_nodes)
        self._check(session_id)

    def _check(self, session_id):
        """The committed slots equal a fresh prefill (after an adopt the ahead tree's slots follow them)."""
        s = self.runtime.sessions[session_id]
        assert cache_length(s.cache) >= s.cached_len
        kv = [(k[:, :, : s.cached_len], v[:, :, : s.cached_len]) if k.numel() else (k, v) for k, v in cache_kv(s.cache)]
        assert_kv_equal(kv, prefill_kv(self.model, s.tokens[: s.cached_len]), what="draft cache")
        self.checks += 1

    def release(self, session_id):
        self.runtime.release(session_id)


def _target_checker(model):
    def check(runtime, session_id, committed):
        s = runtime.sessions[session_id]
        assert_kv_equal(cache_kv(s.cache), prefill_kv(model, committed[:-1]), what="target cache")
    return check


def _pipelined_run(target_model, draft_model, prompt, spec, n, script=lambda i: "real", pipeline=True,
                   sampling=GREEDY):
    target = RecordingTarget(TargetRuntime(target_model), check_after_commit=_target_checker(target_model))
    draft = AheadDraft(DraftRuntime(draft_model), draft_model, script)
    engine = SpeculativeEngine(target, draft, eos_token_ids=[], context_limit=512, pipeline=pipeline)
    rounds = []
    engine.controller.on_round = rounds.append
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=n, spec=spec, sampling=sampling))
    assert target.committed == prompt + out.tokens
    return out, rounds, draft


def test_greedy_pipelined_equals_target_alone_with_guesses_forced_right_and_wrong():
    """Draft = target: every best path is fully accepted; the reported guess is right in even aheads
    and wrong in odd ones, so hits and misses alternate."""
    model = tiny_model("qwen2", seed=5, init_std=STD)
    prompt = random_prompt(seed=21, length=8)
    out, rounds, draft = _pipelined_run(model, model, prompt, CHAIN_SPEC, 40,
                                        script=lambda i: "real" if i % 2 == 0 else "wrong")
    assert out.tokens == hf_greedy(model, prompt, 40)
    assert out.stats.pipeline_ahead_hits > 0 and out.stats.pipeline_ahead_misses > 0
    assert out.stats.pipeline_ahead_hits == sum(r.ahead == "hit" for r in rounds) == sum(draft.resolved)
    assert out.stats.pipeline_ahead_misses == sum(r.ahead == "miss" for r in rounds)
    assert [r.pipelined for r in rounds[1:]] == [r.ahead == "hit" for r in rounds[:-1]]
    assert all(r.draft_s == 0.0 for r in rounds if r.pipelined)
    assert draft.checks == len(draft.resolved) + sum(not a for a in draft.resolved) + sum(r.ahead is None for r in rounds)


@pytest.mark.parametrize("noise", [0.03, 0.1])
@pytest.mark.parametrize("spec", [CHAIN_SPEC, TreeSpec.chain(4)], ids=["tree", "chain4"])
def test_greedy_pipelined_partial_acceptance(noise, spec):
    """A perturbed draft: paths break off at several depths; output = target alone, caches checked."""
    model = tiny_model("qwen2", seed=6, init_std=STD)
    draft_model = perturbed_copy(model, seed=2, scale=noise)
    prompt = random_prompt(seed=22, length=10)
    out, rounds, _ = _pipelined_run(model, draft_model, prompt, spec, 40)
    assert out.tokens == hf_greedy(model, prompt, 40)
    accepted = {r.accepted for r in rounds if r.proposed}
    assert {0, 1, 2} <= accepted, f"partial acceptance not at depths 0, 1 and 2: {accepted}"
    assert out.stats.pipeline_ahead_hits + out.stats.pipeline_ahead_misses == sum(r.ahead is not None for r in rounds) > 0


def test_greedy_pipelined_hits_with_a_perturbed_draft():
    model = tiny_model("qwen2", seed=6, init_std=STD)
    draft_model = perturbed_copy(model, seed=2, scale=0.01)
    prompt = random_prompt(seed=23, length=10)
    out, rounds, _ = _pipelined_run(model, draft_model, prompt, CHAIN_SPEC, 40)
    assert out.tokens == hf_greedy(model, prompt, 40)
    assert out.stats.pipeline_ahead_hits > 0


@pytest.mark.parametrize("spec", [CHAIN_SPEC, SAMPLED_SPEC], ids=["treeType0", "treeType1"])
def test_seeded_sampled_pipelined_equals_not_pipelined(spec):
    model = tiny_model("qwen2", seed=7, init_std=STD)
    draft_model = perturbed_copy(model, seed=3, scale=0.01)
    prompt = random_prompt(seed=24, length=9)
    sampling = SamplingParams(temperature=0.3, top_k=30, seed=99)
    on, rounds_on, _ = _pipelined_run(model, draft_model, prompt, spec, 40, sampling=sampling)
    off, rounds_off, _ = _pipelined_run(model, draft_model, prompt, spec, 40, sampling=sampling, pipeline=False)
    assert on.tokens == off.tokens
    assert [(r.tokens, r.proposed, r.accepted) for r in rounds_on] == [(r.tokens, r.proposed, r.accepted) for r in rounds_off]
    assert on.stats.pipeline_ahead_hits > 0 and off.stats.pipeline_ahead_hits == off.stats.pipeline_ahead_misses == 0


def test_ahead_failure_is_a_draft_failure_and_output_is_unchanged():
    model = tiny_model("qwen2", seed=5, init_std=STD)
    prompt = random_prompt(seed=25, length=8)

    class Failing(AheadDraft):
        def propose_ahead(self, *args):
            raise RuntimeError("draft crashed")

    target = TargetRuntime(model)
    draft = Failing(DraftRuntime(model), model)
    engine = SpeculativeEngine(target, draft, eos_token_ids=[], context_limit=512, pipeline=True)
    rounds = []
    engine.controller.on_round = rounds.append
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=20, spec=CHAIN_SPEC))
    assert out.tokens == hf_greedy(model, prompt, 20)
    assert rounds[0].ahead == "failed" and out.stats.pipeline_ahead_misses >= 1


@pytest.mark.parametrize("failure", ["deadline", "crash"])
def test_an_ahead_past_its_deadline_tells_the_control_the_deadline(failure):
    """An ahead that times out is a lower bound on the draft's reply time, as an in-line propose
    that times out is: the control's ``draft_timed_out`` gets the base deadline (0.1 s) once per such
    ahead. An ahead that crashes says nothing about the draft's speed: no call. Output unchanged."""
    import asyncio

    from orchestrator.planning.control import FixedControl
    from orchestrator.loop.controller import RoundController, sync_worker

    model = tiny_model("qwen2", seed=5, init_std=STD)
    prompt = random_prompt(seed=26, length=8)
    timeouts: list[float] = []

    class Recording(FixedControl):
        def draft_timed_out(self, waited_s):
            timeouts.append(waited_s)

    class SlowAhead:
        def __init__(self):
            self.inner = sync_worker(DraftRuntime(model))
            self.aheads = 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        async def propose_ahead(self, *args):
            self.aheads += 1
            if failure == "crash":
                raise RuntimeError("draft crashed")
            await asyncio.sleep(0.3)
            return await self.inner.propose_ahead(*args)

    draft = SlowAhead()
    ctl = RoundController(sync_worker(TargetRuntime(model)), draft, [], 512, control_factory=Recording,
                          draft_deadline_s=0.1, pipeline=True)
    rounds = []
    out = asyncio.run(ctl.generate(GenerationRequest(prompt, max_new_tokens=20, spec=CHAIN_SPEC), on_round=rounds.append))
    assert out.tokens == hf_greedy(model, prompt, 20)
    failed = sum(r.ahead == "failed" for r in rounds)
    assert failed == draft.aheads >= 1
    assert timeouts == ([0.1] * failed if failure == "deadline" else [])


# ------------------------------------------------------------------------------------------------
# Services: real draft and target servers on loopback, the round loop over the gRPC clients
# ------------------------------------------------------------------------------------------------

import asyncio  # noqa: E402

import grpc  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from orchestrator.loop.clients import DraftClient, TargetClient  # noqa: E402
from orchestrator.loop.controller import RoundController  # noqa: E402
from specdec.harness.servers import draft_and_target  # noqa: E402
from specdec.telemetry import setup_tracing  # noqa: E402
from specdec.v1 import draft_pb2, draft_pb2_grpc  # noqa: E402
from specdec.wire import spec_to_proto  # noqa: E402
from specdec.harness.tiny_pair import save_tiny_pair, write_config  # noqa: E402


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    pair = save_tiny_pair(tmp_path_factory.mktemp("models"), max_pos=512, noise=0.01)  # a close draft: aheads hit
    config = write_config(tmp_path_factory.mktemp("cfg") / "serve.yaml", pair, draft={"max_sessions": 4})
    with draft_and_target(config) as addresses:
        yield addresses


def _over_grpc(draft_address, target_address, prompt, n, pipeline, speculate=True):
    """One greedy request through RoundController over DraftClient / TargetClient; (result, records)."""
    async def run():
        async with grpc.aio.insecure_channel(target_address) as tc, grpc.aio.insecure_channel(draft_address) as dc:
            target = TargetClient(tc)
            info = await target.info()
            draft = DraftClient(dc, info.vocab_size) if speculate else None
            controller = RoundController(target, draft, [], info.context_limit, pipeline=pipeline)
            records = []
            result = await controller.generate(GenerationRequest(prompt, n, spec=CHAIN_SPEC if speculate else None),
                                               on_round=records.append)
            return result, records
    return asyncio.run(run())


def test_pipelined_request_over_services_equals_target_alone_and_overlaps_verify(services):
    exporter = InMemorySpanExporter()
    setup_tracing("specdec-test", exporter=exporter, simple=True)
    prompt = random_prompt(seed=31, length=12)
    alone, _ = _over_grpc(*services, prompt, 40, pipeline=False, speculate=False)
    exporter.clear()
    result, records = _over_grpc(*services, prompt, 40, pipeline=True)
    assert result.tokens == alone.tokens
    assert result.stats.pipeline_ahead_hits > 0
    assert result.stats.pipeline_ahead_hits == sum(r.pipelined for r in records) == sum(r.ahead == "hit" for r in records)
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    aheads = [s for s in spans if s.name == "draft.ahead"]
    assert aheads
    overlapping = 0
    for ahead in aheads:
        parent = by_id[ahead.parent.span_id]
        assert parent.name == "round"
        verify = next(s for s in spans if s.name == "verify" and s.parent.span_id == parent.context.span_id)
        overlapping += ahead.start_time < verify.end_time and verify.start_time < ahead.end_time
        assert "ahead.outcome" in parent.attributes
    assert overlapping == len(aheads)  # each ahead ran while its round's verify did
    assert any(by_id[s.context.span_id].attributes.get("pipelined") for s in spans if s.name == "round")


class _Stream:
    """One DraftService.Session stream driven step by step (requests through a queue)."""

    def __init__(self, address):
        import queue

        self.channel = grpc.insecure_channel(address)
        self.requests = queue.Queue()
        self.replies = draft_pb2_grpc.DraftServiceStub(self.channel).Session(iter(self.requests.get, None), timeout=30)

    def send(self, **kind):
        self.requests.put(draft_pb2.DraftRequest(**kind))

    def reply(self):
        return next(self.replies)

    def error(self) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as info:
            while True:
                next(self.replies)
        return info.value

    def close(self):
        self.requests.put(None)
        self.channel.close()


def _stream_with_tree(address) -> tuple[_Stream, draft_pb2.DraftTreeReply]:
    stream = _Stream(address)
    stream.send(start=draft_pb2.DraftStart(session_id="bad", prompt_ids=random_prompt(seed=3, length=6)))
    stream.reply()
    stream.send(propose=draft_pb2.TreeRequest(spec=spec_to_proto(CHAIN_SPEC), max_depth=3, round=1))
    return stream, stream.reply().tree


def _ahead(path, max_depth=3):
    return draft_pb2.AheadRequest(path_nodes=path, spec=spec_to_proto(CHAIN_SPEC), max_depth=max_depth, round=2)


def test_ahead_and_resolve_on_the_stream(services):
    stream, reply = _stream_with_tree(services[0])
    stream.send(ahead=_ahead([0]))
    ahead = stream.reply().tree
    assert ahead.ahead and ahead.round == 2 and len(ahead.tree.tokens) > 0 and ahead.guess_token >= 0
    stream.send(resolve=draft_pb2.AheadResolve(adopt=True))
    # the ahead tree is now the last tree: a commit against its nodes is accepted, then a propose
    stream.send(commit=draft_pb2.DraftCommit(tokens=[ahead.tree.tokens[0], 1], accepted_nodes=[0]))
    stream.send(propose=draft_pb2.TreeRequest(spec=spec_to_proto(CHAIN_SPEC), max_depth=3, round=3))
    assert stream.reply().tree.round == 3
    stream.close()


@pytest.mark.parametrize("steps,field", [
    ([("ahead", [5000])], "ahead.path_nodes[0] = 5000"),
    ([("commit", None), ("ahead", [0])], "ahead.path_nodes: no proposed tree since the last commit"),
    ([("ahead", "child")], "ahead.path_nodes[0]"),  # a depth-2 node first: not a root path
    ([("ahead", [0]), ("ahead", [0])], "ahead: an earlier ahead is unresolved"),
    ([("ahead", [0]), ("propose", None)], "propose: an ahead is unresolved"),
    ([("ahead", [0]), ("commit", None)], "commit: an ahead is unresolved"),
    ([("resolve", None)], "resolve: no unresolved ahead"),
    ([("ahead0", [0])], "ahead.max_depth"),
])
def test_bad_ahead_input_is_invalid_argument_naming_the_field(services, steps, field):
    stream, reply = _stream_with_tree(services[0])
    child = next(i for i, p in enumerate(reply.tree.parents) if p >= 0)
    for kind, arg in steps:
        if kind.startswith("ahead"):
            path = [child] if arg == "child" else arg
            stream.send(ahead=_ahead(path, max_depth=0 if kind == "ahead0" else 3))
            if kind == "ahead" and steps[-1] != (kind, arg):
                stream.reply()
        elif kind == "propose":
            stream.send(propose=draft_pb2.TreeRequest(spec=spec_to_proto(CHAIN_SPEC), max_depth=3, round=3))
        elif kind == "commit":
            stream.send(commit=draft_pb2.DraftCommit(tokens=[1], accepted_nodes=[]))
        else:
            stream.send(resolve=draft_pb2.AheadResolve(adopt=False))
    err = stream.error()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details(), err.details()
    stream.close()


def test_front_pipeline_config_and_final_stats():
    from specdec.config import ConfigError, load_config
    from specdec.stats import GenerationStats
    from specdec.wire import stats_to_proto

    assert load_config(None, {}).front.pipeline is False
    assert load_config(None, {"front.pipeline": True}).front.pipeline is True
    with pytest.raises((ConfigError, ValueError), match="pipeline"):
        load_config(None, {"front.pipeline": "sometimes"})
    msg = stats_to_proto(GenerationStats(pipeline_ahead_hits=3, pipeline_ahead_misses=2), prompt_tokens=4)
    assert (msg.pipeline_ahead_hits, msg.pipeline_ahead_misses) == (3, 2)


def test_cost_aware_control_pipelined_is_exact_and_learns_no_draft_cost_from_aheads():
    """The default (cost-aware) control with pipelining: greedy = target alone, and the rounds whose
    tree came from an ahead reach ``observe`` with draft_s None (no D(p) sample)."""
    from orchestrator.loop.embedded import make_control

    model = tiny_model("qwen2", seed=6, init_std=STD)
    draft_model = perturbed_copy(model, seed=2, scale=0.01)
    prompt = random_prompt(seed=26, length=10)
    target_rt, draft_rt = TargetRuntime(model), DraftRuntime(draft_model)
    factory, _ = make_control("cost-aware", target_rt, draft_rt, measure_costs=False)
    observed = []

    def spying(spec):
        control = factory(spec)
        observe = control.observe

        def spy(obs):
            observed.append(obs.draft_s)
            return observe(obs)
        control.observe = spy
        return control

    engine = SpeculativeEngine(target_rt, AheadDraft(draft_rt, draft_model), eos_token_ids=[], context_limit=512,
                               control_factory=spying, pipeline=True)
    rounds = []
    engine.controller.on_round = rounds.append
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=40, spec=CHAIN_SPEC))
    assert out.tokens == hf_greedy(model, prompt, 40)
    assert out.stats.pipeline_ahead_hits > 0
    assert [d for d, r in zip(observed, rounds) if r.pipelined] == [None] * out.stats.pipeline_ahead_hits
    assert any(d for d, r in zip(observed, rounds) if not r.pipelined and r.drafted)


def test_in_process_ahead_runs_after_the_verify_so_verify_time_stays_its_own():
    """In-process (sync workers) the ahead cannot run beside the verify; it runs after it, so a slow
    ahead (0.3 s here) never enters the round's verify time, which the cost model learns V(n) from.
    Before, the ahead ran inside the verify's yield and every such round's verify_s held it."""
    import time as _time

    class SlowAheadDraft(AheadDraft):
        def propose_ahead(self, *args):
            _time.sleep(0.3)
            return super().propose_ahead(*args)

    model = tiny_model("qwen2", seed=5, init_std=STD)
    prompt = random_prompt(seed=21, length=8)
    target = RecordingTarget(TargetRuntime(model))
    engine = SpeculativeEngine(target, SlowAheadDraft(DraftRuntime(model), model), eos_token_ids=[],
                               context_limit=512, pipeline=True)
    rounds = []
    engine.controller.on_round = rounds.append
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=16, spec=CHAIN_SPEC))
    assert out.tokens == hf_greedy(model, prompt, 16)
    with_ahead = [r for r in rounds if r.ahead is not None]
    assert with_ahead and all(r.ahead_s >= 0.3 for r in with_ahead if r.ahead != "failed")
    assert all(r.verify_s < 0.25 for r in with_ahead), [round(r.verify_s, 3) for r in with_ahead]
