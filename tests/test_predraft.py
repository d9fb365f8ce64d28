"""Pre-drafting (docs/control.md "Pipelining"; SSD, "speculative speculative decoding"): while round r
verifies, the draft drafts the next tree for several outcomes of round r (the best path all accepted +
the guess, and early rejections with the draft's likeliest replacement); the front takes the one the
commit matches without a draft round trip.

Runtime: adopting any candidate = commit + propose; a miss = no ahead; the cache equals a fresh
prefill after every outcome. Round loop: greedy = target alone with non-first candidates adopted, a
miss falls back, sampled requests keep the target's law (chi-square). Control: ``predraft_pays``.
Services: the candidates through the real draft gRPC service."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from draft_service.runtime import DraftRuntime
from orchestrator.loop.controller import GenerationRequest, _candidates
from orchestrator.loop.engine import SpeculativeEngine
from orchestrator.planning.shaping import ShapedTree
from specdec.interfaces import AheadCandidate, DraftWorker
from specdec.sampling import GREEDY, SamplingParams
from specdec.tree import ROOT, DraftTree
from specdec.tree_spec import TreeSpec
from target_service.runtime import TargetRuntime
from tests.conftest import (
    RecordingTarget, assert_kv_equal, cache_kv, hf_greedy, perturbed_copy, prefill_kv, random_prompt, tiny_model,
)
from tests.test_pipeline import SAMPLED, SAMPLED_SPEC, SPEC, STD, assert_fresh, assert_same_tree, best_path

CHAIN_SPEC = TreeSpec(gamma=3, topKSpec=[[2], [1, 1], [1, 1]], topHead=[1, 2, 2])


def _candidate_set(tree, path):
    """All three kinds: the whole path, rejected at its last node, rejected at the root (excluding the
    tree's children there)."""
    kids = lambda node: tuple(t for t, p in zip(tree.tokens, tree.parents) if p == node)  # noqa: E731
    return [AheadCandidate(tuple(path), 3),
            AheadCandidate(tuple(path[:-1]), 3, kids(path[-2] if len(path) > 1 else ROOT)),
            AheadCandidate((), 3, kids(ROOT))]


def _pair(sampling=GREEDY):
    model = tiny_model("qwen2", seed=3, init_std=STD)
    prompt = random_prompt(seed=11, length=9)
    runtimes = DraftRuntime(model), DraftRuntime(model)
    for r in runtimes:
        r.start("s", prompt, sampling)
    return model, runtimes


def _assert_follows(ahead, plain, next_tree, spec, model):
    """After an outcome: the pre-drafting runtime holds the tokens and gives the next tree of the one that
    committed and proposed in line, and both go on to a KV equal to a fresh prefill's."""
    assert ahead.sessions["s"].tokens == plain.sessions["s"].tokens
    assert_same_tree(next_tree, plain.propose("s", spec, 3))
    for runtime in (ahead, plain):
        runtime.commit("s", [next_tree.tokens[0], 7], [0])
        assert_fresh(runtime, model, "s")
    assert_same_tree(ahead.propose("s", spec, 2), plain.propose("s", spec, 2))


@pytest.mark.parametrize("sampling,spec", [(GREEDY, SPEC), (SAMPLED, SAMPLED_SPEC), (SAMPLED, SPEC)])
@pytest.mark.parametrize("adopt", [0, 1, 2, None])
def test_adopting_any_candidate_equals_commit_then_propose(sampling, spec, adopt):
    """Each candidate's tree is the one an in-line propose after its outcome grows (a seeded session draws
    the same); after adopting it (or a miss, then commit) the cache equals a fresh prefill and the next
    rounds go on identically."""
    model, (ahead, plain) = _pair(sampling)
    tree = ahead.propose("s", spec, 3)
    assert_same_tree(plain.propose("s", spec, 3), tree)
    candidates = _candidate_set(tree, best_path(tree))
    out = ahead.propose_candidates("s", candidates, spec)
    assert len(out) == 3 and all(token not in c.exclude for c, (token, _) in zip(candidates, out))
    if adopt is None:  # a miss: the round commits its own outcome (here rejected at the first path node)
        ahead.resolve_ahead("s", adopt=False)
        committed, accepted, next_tree = [5], [], None
    else:
        ahead.resolve_ahead("s", True, adopt)
        c = candidates[adopt]
        committed, accepted = [tree.tokens[n] for n in c.path_nodes] + [out[adopt][0]], list(c.path_nodes)
        next_tree = out[adopt][1]
    plain.commit("s", committed, accepted)
    if adopt is None:
        ahead.commit("s", committed, accepted)
        next_tree = ahead.propose("s", spec, 3)
    _assert_follows(ahead, plain, next_tree, spec, model)


def test_candidates_leave_the_first_ones_state_as_propose_ahead_does():
    """The other candidates are grown first and put back bitwise: candidate 0's tree, guess and cache equal
    a lone ``propose_ahead``'s; a fresh draft prefilled with the adopted tokens holds the same KV."""
    model, (many, one) = _pair()
    tree = many.propose("s", SPEC, 3)
    one.propose("s", SPEC, 3)
    path = best_path(tree)
    out = many.propose_candidates("s", _candidate_set(tree, path), SPEC)
    guess, lone = one.propose_ahead("s", path, SPEC, 3)
    assert out[0][0] == guess
    assert_same_tree(out[0][1], lone)
    assert_kv_equal(cache_kv(many.sessions["s"].cache), cache_kv(one.sessions["s"].cache), atol=0, rtol=0)
    many.resolve_ahead("s", True, 1)
    fresh = DraftRuntime(model)
    fresh.start("f", many.sessions["s"].tokens)
    fresh.prefill("f")
    s, f = many.sessions["s"], fresh.sessions["f"]
    assert_kv_equal([(k[:, :, : s.cached_len], v[:, :, : s.cached_len]) for k, v in cache_kv(s.cache)],
                    [(k[:, :, : s.cached_len], v[:, :, : s.cached_len]) for k, v in cache_kv(f.cache)], what="vs fresh")


def test_candidate_errors_name_the_field():
    _, (runtime, _) = _pair()
    tree = runtime.propose("s", SPEC, 3)
    with pytest.raises(ValueError, match="candidates: 5 given"):
        runtime.propose_candidates("s", [AheadCandidate((0,), 3)] * 5, SPEC)
    with pytest.raises(ValueError, match=r"path_nodes\[0\] = 99"):
        runtime.propose_candidates("s", [AheadCandidate((0,), 3), AheadCandidate((99,), 3)], SPEC)
    assert runtime.sessions["s"].ahead is None  # a failed alternative left nothing unresolved
    runtime.propose_candidates("s", _candidate_set(tree, best_path(tree)), SPEC)
    with pytest.raises(ValueError, match="candidate: 3 is not one of the 3"):
        runtime.resolve_ahead("s", True, 3)
    runtime.resolve_ahead("s", True, 2)


def test_candidates_rank_early_rejections_by_the_drafts_chances():
    """Path chances q = (0.9, 0.6, 0.5): rejected at the path's second node (0.9 * 0.4 = 0.36), at its third
    (0.9 * 0.6 * 0.5 = 0.27), at the root (0.1); each excludes the verified children there."""
    import math

    lp = [math.log(x) for x in (0.9, 0.05, 0.6, 0.5)]
    tree = DraftTree((10, 11, 12, 13), (ROOT, ROOT, 0, 2), tuple(lp))
    got = _candidates(tree, ShapedTree.of(tree), [0, 2, 3], max_depth=6, count=4)
    assert got == [AheadCandidate((0, 2, 3), 2, ()), AheadCandidate((0,), 4, (12,)),
                   AheadCandidate((0, 2), 3, (13,)), AheadCandidate((), 5, (10, 11))]
    assert _candidates(tree, ShapedTree.of(tree), [0, 2, 3], 6, 1) == got[:1]


# ------------------------------------------------------------------------------------------------
# The round loop (in-process)
# ------------------------------------------------------------------------------------------------

class CandidateDraft(DraftWorker):
    """A DraftRuntime checked after every commit and resolve: its tokens are the target's committed
    ones and its committed KV equals a fresh prefill. ``wrong``: every reported token is a negative id, so
    no candidate can match (misses)."""

    drafts_ahead = True

    def __init__(self, runtime: DraftRuntime, model, target: RecordingTarget, wrong: bool = False):
        self.runtime, self.model, self.target, self.wrong = runtime, model, target, wrong
        self.resolved: list[int | None] = []

    def start(self, session_id, prompt_ids, sampling=GREEDY):
        self.runtime.start(session_id, prompt_ids, sampling)

    def propose(self, session_id, spec, max_depth):
        return self.runtime.propose(session_id, spec, max_depth)

    def propose_candidates(self, session_id, candidates, spec):
        out = self.runtime.propose_candidates(session_id, candidates, spec)
        return [(-1 - t if self.wrong else t, tree) for t, tree in out]

    def resolve_ahead(self, session_id, adopt, candidate=0):
        self.runtime.resolve_ahead(session_id, adopt, candidate)
        self.resolved.append(candidate if adopt else None)
        if adopt:
            self._check(session_id)

    def commit(self, session_id, tokens, accepted_nodes):
        self.runtime.commit(session_id, tokens, accepted_nodes)
        self._check(session_id)

    def _check(self, session_id):
        s = self.runtime.sessions[session_id]
        assert s.tokens == self.target.committed
        kv = [(k[:, :, : s.cached_len], v[:, :, : s.cached_len]) for k, v in cache_kv(s.cache)]
        assert_kv_equal(kv, prefill_kv(self.model, s.tokens[: s.cached_len]), what="draft cache")

    def release(self, session_id):
        self.runtime.release(session_id)


def _run(target_model, draft_model, prompt, n, candidates=4, wrong=False, pipeline=True, spec=CHAIN_SPEC,
         sampling=GREEDY):
    target = RecordingTarget(TargetRuntime(target_model))
    draft = CandidateDraft(DraftRuntime(draft_model), draft_model, target, wrong)
    engine = SpeculativeEngine(target, draft, eos_token_ids=[], context_limit=512, pipeline=pipeline,
                               ahead_candidates=candidates)
    rounds = []
    engine.controller.on_round = rounds.append
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=n, spec=spec, sampling=sampling))
    assert target.committed == prompt + out.tokens
    return out, rounds, draft


@pytest.mark.parametrize("noise", [0.05, 0.1])
def test_greedy_predrafted_equals_target_alone(noise):
    """A perturbed draft: rejections at several depths; non-first candidates are adopted (pre-drafted
    rounds), the output is the target's own, the draft's KV fresh after every outcome."""
    model = tiny_model("qwen2", seed=6, init_std=STD)
    draft_model = perturbed_copy(model, seed=2, scale=noise)
    prompt = random_prompt(seed=23, length=10)
    out, rounds, draft = _run(model, draft_model, prompt, 60)
    assert out.tokens == hf_greedy(model, prompt, 60)
    stats = out.stats
    assert stats.predraft_hits > 0 and stats.predraft_hits == sum(r.predrafted for r in rounds)
    assert stats.predraft_hits == sum(1 for c in draft.resolved if c)
    assert stats.pipeline_ahead_hits == draft.resolved.count(0)
    assert [r.kind for r in rounds[1:]] == [{"hit": "pipelined", "predraft": "predrafted"}.get(r.ahead, "in_line")
                                            for r in rounds[:-1]]
    accepted_depths = {r.accepted for r in rounds if r.ahead is not None}
    assert len(accepted_depths) >= 2  # rejections at several depths
    assert all(r.draft_s == 0.0 for r in rounds if r.predrafted)
    shares = stats.round_shares
    assert shares["predrafted"] == stats.predrafted_rounds / stats.rounds > 0
    assert sum(shares.values()) == pytest.approx(1.0)
    resolved = stats.pipeline_ahead_hits + stats.predraft_hits + stats.pipeline_ahead_misses
    assert stats.ahead_hit_rate == pytest.approx((stats.pipeline_ahead_hits + stats.predraft_hits) / resolved)


def test_greedy_predrafted_misses_fall_back():
    """No candidate can match (tokens reported off by one): every ahead is a miss, each round commits
    in line after the rollback, the output is unchanged."""
    model = tiny_model("qwen2", seed=6, init_std=STD)
    draft_model = perturbed_copy(model, seed=2, scale=0.05)
    prompt = random_prompt(seed=24, length=10)
    out, rounds, draft = _run(model, draft_model, prompt, 40, wrong=True)
    assert out.tokens == hf_greedy(model, prompt, 40)
    assert out.stats.pipeline_ahead_misses == len(draft.resolved) > 0 and set(draft.resolved) == {None}
    assert out.stats.predraft_hits == out.stats.pipeline_ahead_hits == 0
    assert all(r.kind == "in_line" for r in rounds)


@pytest.mark.parametrize("spec", [CHAIN_SPEC, SAMPLED_SPEC], ids=["treeType0", "treeType1"])
def test_seeded_sampled_predrafted_equals_in_line(spec):
    """Each candidate is drawn from the session's random state as it is: a seeded request gives the tokens
    (and rounds) of in-line drafting, pre-drafted rounds included."""
    model = tiny_model("qwen2", seed=7, init_std=STD)
    draft_model = perturbed_copy(model, seed=3, scale=0.05)
    prompt = random_prompt(seed=24, length=9)
    sampling = SamplingParams(temperature=0.3, top_k=30, seed=99)
    on, rounds_on, _ = _run(model, draft_model, prompt, 50, spec=spec, sampling=sampling)
    off, rounds_off, _ = _run(model, draft_model, prompt, 50, spec=spec, sampling=sampling, pipeline=False)
    assert on.tokens == off.tokens
    summary = lambda rounds: [(r.tokens, r.proposed, r.accepted) for r in rounds]  # noqa: E731
    assert summary(rounds_on) == summary(rounds_off)
    assert on.stats.predraft_hits > 0


# chi-square: the harness of tests/test_sampled_distribution.py with a chain tree (one child per level),
# so round 1 often commits one token and round 2's tree is then the pre-drafted root-rejection candidate

def test_sampled_distribution_with_predrafting():
    from tests.conftest import chi2_pvalue
    from tests.test_sampled_distribution import (
        N, P_MIN, PROMPT, draft_model as sampled_draft, exact_law, next_token_logits, target_model, total_variation,
    )
    from specdec.sampling import processed_probs

    torch.set_num_threads(1)
    samples, params = 1500, SamplingParams(temperature=1.0)
    target = target_model()
    engine = SpeculativeEngine(TargetRuntime(target), DraftRuntime(sampled_draft("close")), eos_token_ids=[],
                               context_limit=64, pipeline=True, ahead_candidates=3)
    spec = TreeSpec(gamma=2, topKSpec=[[1], [1]], topHead=[1, 1], treeType=1)
    counts: Counter = Counter()
    predrafted = 0
    for first in range(0, samples, 250):
        requests = [GenerationRequest(PROMPT, max_new_tokens=5, spec=spec,
                                      sampling=SamplingParams(params.temperature, seed=seed))
                    for seed in range(first, first + 250)]
        for result in engine.generate_batch(requests):
            counts[tuple(result.tokens[:N])] += 1
            predrafted += result.stats.predrafted_rounds
    law = exact_law(processed_probs(next_token_logits(target), params))
    pvalue = chi2_pvalue(counts, law, samples)
    assert pvalue > P_MIN, f"chi-square p = {pvalue:.2e}, total variation {total_variation(counts, law, samples):.4f}"
    assert predrafted > samples // 20


# ------------------------------------------------------------------------------------------------
# The control's choice (front.pipeline: auto)
# ------------------------------------------------------------------------------------------------

def test_predraft_pays_on_a_slow_link_or_separate_compute_not_on_a_fast_shared_one():
    from orchestrator.planning.cost_model import predraft_pays

    assert predraft_pays(0.3, draft_ms=40.0, shared_compute=False, candidates=2)  # slow link, own compute
    assert predraft_pays(None, draft_ms=40.0, shared_compute=False, candidates=2)  # own compute, link unknown
    assert not predraft_pays(0.001, draft_ms=40.0, shared_compute=True, candidates=2)  # fast link, shared
    assert not predraft_pays(None, draft_ms=40.0, shared_compute=True, candidates=2)
    assert predraft_pays(0.1, draft_ms=40.0, shared_compute=True, candidates=2)  # 100 ms >= 2 x 40 ms
    assert not predraft_pays(0.1, draft_ms=40.0, shared_compute=True, candidates=3)


def _auto_run(rtt_s, shared_compute):
    """One greedy request, pipeline "auto", the cost-aware control with scripted costs (V 100 ms, D 5 ms per
    step, alpha 0: never learnt),
    a draft that reports ``rtt_s`` as its link's round trip and counts as beside the front."""
    from orchestrator.planning.cost_aware import CostAwareFactory, SharedState
    from orchestrator.planning.cost_model import CostModel
    from orchestrator.loop.controller import RoundController, sync_worker
    from specdec.config import CostAwareConfig, FallbackConfig

    class Remote(sync_worker):
        in_process = False  # as a draft service beside the front

        @property
        def link_rtt_s(self):
            return rtt_s

    model = tiny_model("qwen2", seed=6, init_std=STD)
    draft_model = perturbed_copy(model, seed=2, scale=0.05)
    prompt = random_prompt(seed=25, length=10)
    cost = CostModel({1: 100.0, 8: 110.0, 32: 130.0}, {1: 5.0, 8: 6.0}, alpha=0.0, source="configured")
    shared = SharedState(cost=cost, shared_compute=shared_compute)
    factory = CostAwareFactory(CostAwareConfig(first_round_plain=False), FallbackConfig(), shared)
    controller = RoundController(sync_worker(TargetRuntime(model)), Remote(DraftRuntime(draft_model)), [], 512,
                                 control_factory=factory, pipeline="auto", ahead_candidates=2)
    rounds = []
    out = asyncio.run(controller.generate(GenerationRequest(prompt, 40, spec=CHAIN_SPEC), on_round=rounds.append))
    assert out.tokens == hf_greedy(model, prompt, 40)
    return rounds


@pytest.mark.parametrize("rtt_s,shared_compute,predrafts", [(0.3, False, True), (0.3, True, True),
                                                            (0.00001, True, False), (None, True, False)])
def test_auto_pipeline_predrafts_on_a_slow_link_and_in_line_on_a_fast_shared_one(rtt_s, shared_compute, predrafts):
    rounds = _auto_run(rtt_s, shared_compute)
    drafted = [r for r in rounds if r.drafted]
    assert drafted
    assert any(r.ahead is not None for r in rounds) == predrafts
    if not predrafts:
        assert all(r.kind == "in_line" for r in rounds)


def test_front_config_pipeline_auto_and_candidates():
    from specdec.config import ConfigError, load_config
    from specdec.stats import GenerationStats
    from specdec.wire import stats_to_proto

    front = load_config(None, {}).front
    assert (front.pipeline, front.ahead_candidates) == (False, 2)
    assert load_config(None, {"front.pipeline": "auto"}).front.pipeline == "auto"
    for bad in (0, 5):
        with pytest.raises((ConfigError, ValueError), match="ahead_candidates"):
            load_config(None, {"front.ahead_candidates": bad})
    stats = GenerationStats(rounds=10, pipeline_ahead_hits=3, predraft_hits=2, pipeline_ahead_misses=5,
                            pipelined_rounds=3, predrafted_rounds=2)
    msg = stats_to_proto(stats, prompt_tokens=4)
    assert (msg.predraft_hits, msg.pipelined_rounds, msg.predrafted_rounds) == (2, 3, 2)
    assert (msg.ahead_hit_rate, msg.in_line_share, msg.pipelined_share, msg.predrafted_share) == \
        pytest.approx((0.5, 0.5, 0.3, 0.2))


def test_metrics_count_rounds_by_kind_and_predraft_outcomes():
    from orchestrator.loop.metrics import SpecMetrics
    from specdec.stats import RoundRecord

    metrics = SpecMetrics()
    base = dict(tokens=(1, 2), proposed=2, accepted=1, depth=2, fallback=None, gamma=2, draft_s=0.0,
                verify_s=0.1, commit_s=0.0)
    for extra in ({"ahead": "predraft"}, {"predrafted": True, "ahead": "hit"}, {"pipelined": True}):
        metrics.observe_round(RoundRecord(**base, **extra))
    value = lambda name, **labels: metrics.registry.get_sample_value(name, labels)  # noqa: E731
    assert value("specdec_pipeline_ahead_total", outcome="predraft") == 1
    assert value("specdec_pipeline_ahead_total", outcome="hit") == 1
    assert [value("specdec_round_kind_total", kind=k) for k in ("in_line", "pipelined", "predrafted")] == [1, 1, 1]


# ------------------------------------------------------------------------------------------------
# Services: the real draft gRPC service and target service, the round loop over the clients
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def services(tmp_path_factory):
    from specdec.harness.servers import draft_and_target
    from specdec.harness.tiny_pair import save_tiny_pair, write_config

    pair = save_tiny_pair(tmp_path_factory.mktemp("models"), max_pos=512, noise=0.05)  # rejections at several depths
    config = write_config(tmp_path_factory.mktemp("cfg") / "serve.yaml", pair, draft={"max_sessions": 4})
    with draft_and_target(config) as addresses:
        yield addresses


def _over_grpc(draft_address, target_address, prompt, n, pipeline, candidates=4, speculate=True):
    import grpc

    from orchestrator.loop.clients import DraftClient, TargetClient
    from orchestrator.loop.controller import RoundController

    async def run():
        async with grpc.aio.insecure_channel(target_address) as tc, grpc.aio.insecure_channel(draft_address) as dc:
            target = TargetClient(tc)
            info = await target.info()
            draft = DraftClient(dc, info.vocab_size) if speculate else None
            controller = RoundController(target, draft, [], info.context_limit, pipeline=pipeline,
                                         ahead_candidates=candidates)
            records = []
            result = await controller.generate(GenerationRequest(prompt, n, spec=CHAIN_SPEC if speculate else None),
                                               on_round=records.append)
            info = await draft.info() if draft is not None else None
            return result, records, info
    return asyncio.run(run())


def test_predrafted_request_over_services_equals_target_alone(services):
    prompt = random_prompt(seed=31, length=12)
    alone, _, _ = _over_grpc(*services, prompt, 60, pipeline=False, speculate=False)
    result, records, info = _over_grpc(*services, prompt, 60, pipeline=True)
    assert result.tokens == alone.tokens
    stats = result.stats
    assert stats.predraft_hits > 0 and stats.predraft_hits == sum(r.predrafted for r in records)
    assert stats.pipeline_ahead_hits == sum(r.pipelined for r in records)
    assert info.cached_sessions == 0  # released


def test_bad_alternatives_are_invalid_argument_naming_the_field(services):
    import grpc

    from specdec.v1 import draft_pb2
    from specdec.wire import spec_to_proto
    from tests.test_pipeline import _Stream

    cases = [([draft_pb2.AheadAlternative(path_nodes=[77], max_depth=2)], "ahead.alternatives[0].path_nodes[0] = 77"),
             ([draft_pb2.AheadAlternative(max_depth=0)], "ahead.alternatives[0].max_depth"),
             ([draft_pb2.AheadAlternative(max_depth=2, exclude=[-1])], "ahead.alternatives[0].exclude[0] = -1"),
             ([draft_pb2.AheadAlternative(max_depth=2)] * 4, "ahead.alternatives: 4 given"),
             ("resolve", "resolve.candidate: 2 is not one of the 2")]
    for alternatives, field in cases:
        stream = _Stream(services[0])
        stream.send(start=draft_pb2.DraftStart(session_id="bad", prompt_ids=random_prompt(seed=3, length=6)))
        stream.reply()
        stream.send(propose=draft_pb2.TreeRequest(spec=spec_to_proto(CHAIN_SPEC), max_depth=3, round=1))
        stream.reply()
        ok = [draft_pb2.AheadAlternative(max_depth=2)]
        stream.send(ahead=draft_pb2.AheadRequest(path_nodes=[0], spec=spec_to_proto(CHAIN_SPEC), max_depth=3, round=2,
                                                 alternatives=ok if alternatives == "resolve" else alternatives))
        if alternatives == "resolve":
            reply = stream.reply().tree
            assert len(reply.alternatives) == 1 and reply.alternatives[0].tree.tokens
            stream.send(resolve=draft_pb2.AheadResolve(adopt=True, candidate=2))
        err = stream.error()
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details(), err.details()
        stream.close()


# ------------------------------------------------------------------------------------------------
# Pre-drafting during plain rounds: candidates = the draft's likeliest next tokens, empty paths
# ------------------------------------------------------------------------------------------------

def _session_state(runtime):
    s = runtime.sessions["s"]
    return list(s.tokens), s.cached_len, s.round_start, s.last_tree, [kv.clone() for pair in cache_kv(s.cache) for kv in pair]


@pytest.mark.parametrize("sampling,spec", [(GREEDY, SPEC), (SAMPLED, SAMPLED_SPEC), (SAMPLED, SPEC)])
@pytest.mark.parametrize("adopt", [0, 1, 2, None])
@pytest.mark.parametrize("after", ["start", "commit"])
def test_plain_round_ahead_equals_commit_then_propose(sampling, spec, adopt, after):
    """No tree proposed since the last commit (or ever): C candidates with empty paths are the top-C tokens of
    the draft's next-token logits, distinct; adopting candidate c (the plain step committed its token) equals
    commit([t]) + propose, a miss restores the session exactly, and the cache equals a fresh prefill after."""
    model, (ahead, plain) = _pair(sampling)
    if after == "commit":  # a drafted round, then the plain one
        for runtime in (ahead, plain):
            tree = runtime.propose("s", spec, 3)
            runtime.commit("s", [tree.tokens[0], 9], [0])
    before = _session_state(ahead)
    with torch.no_grad():
        top = model(torch.tensor([before[0]])).logits[0, -1].topk(3).indices.tolist()
    out = ahead.propose_candidates("s", [AheadCandidate((), 3)] * 3, spec)
    assert [token for token, _ in out] == top and len(set(top)) == 3
    if adopt is None:  # a miss: the plain step committed a token no candidate has
        ahead.resolve_ahead("s", adopt=False)
        after_state = _session_state(ahead)
        assert after_state[:4] == before[:4]
        assert all(torch.equal(a, b) for a, b in zip(after_state[4], before[4]))
        t = next(t for t in range(model.config.vocab_size) if t not in top)
        ahead.commit("s", [t], [])
        next_tree = ahead.propose("s", spec, 3)
    else:
        ahead.resolve_ahead("s", True, adopt)
        t, next_tree = out[adopt]
    plain.commit("s", [t], [])
    _assert_follows(ahead, plain, next_tree, spec, model)


def test_same_path_candidates_pick_distinct_tokens_after_a_tree():
    """With a tree proposed, two root-rejection candidates (empty path) pick the best two tokens that are none
    of the root's children, in request order."""
    model, (runtime, _) = _pair()
    tree = runtime.propose("s", SPEC, 3)
    kids = tuple(t for t, p in zip(tree.tokens, tree.parents) if p == ROOT)
    with torch.no_grad():
        row = model(torch.tensor([runtime.sessions["s"].tokens])).logits[0, -1]
    row[list(kids)] = float("-inf")
    out = runtime.propose_candidates("s", [AheadCandidate((), 3, kids)] * 2, SPEC)
    assert [token for token, _ in out] == row.topk(2).indices.tolist()
    runtime.resolve_ahead("s", adopt=False)


def test_predraft_plain_pays_on_a_slow_link_only():
    from orchestrator.planning.cost_aware import CostAwareControl, SharedState
    from orchestrator.planning.cost_model import CostModel, predraft_plain_pays

    assert predraft_plain_pays(0.3, draft_ms=40.0)  # the round trip dominates the in-line draft
    assert not predraft_plain_pays(0.001, draft_ms=40.0)
    assert not predraft_plain_pays(None, draft_ms=40.0)  # not measured yet: in line
    cost = CostModel({1: 100.0, 8: 110.0}, {1: 20.0, 8: 25.0}, alpha=0.0, source="configured")  # D 60 ms for 3 steps
    control = CostAwareControl(SPEC, SharedState(cost=cost))
    assert control.predraft_plain(0.3, 2) and not control.predraft_plain(0.03, 2)
    control.bind_request(SAMPLED)  # seeded: its rounds never depend on timings
    assert not control.predraft_plain(0.3, 2)


def _plain_predraft_run(rtt_s, wrong=False, n=40, pipeline=True):
    """One greedy request over a draft reporting ``rtt_s`` as its link's round trip, beside the front, the
    cost-aware control with scripted costs (V 100 ms, D 5 ms per step); every draft outcome checked."""
    from orchestrator.planning.cost_aware import CostAwareFactory, SharedState
    from orchestrator.planning.cost_model import CostModel
    from orchestrator.loop.controller import RoundController, sync_worker
    from specdec.config import CostAwareConfig, FallbackConfig

    class Remote(sync_worker):
        in_process = False

        @property
        def link_rtt_s(self):
            return rtt_s

    model = tiny_model("qwen2", seed=6, init_std=STD)
    draft_model = perturbed_copy(model, seed=2, scale=0.05)
    prompt = random_prompt(seed=25, length=10)
    target = RecordingTarget(TargetRuntime(model))
    draft = CandidateDraft(DraftRuntime(draft_model), draft_model, target, wrong)
    cost = CostModel({1: 100.0, 8: 110.0, 32: 130.0}, {1: 5.0, 8: 6.0}, alpha=0.0, source="configured")
    factory = CostAwareFactory(CostAwareConfig(first_round_plain=False), FallbackConfig(), SharedState(cost=cost))
    controller = RoundController(sync_worker(target), Remote(draft), [], 512, control_factory=factory,
                                 pipeline=pipeline, ahead_candidates=3)
    rounds = []
    out = asyncio.run(controller.generate(GenerationRequest(prompt, n, spec=CHAIN_SPEC), on_round=rounds.append))
    assert out.tokens == hf_greedy(model, prompt, n)
    assert target.committed == prompt + out.tokens
    assert not any(r.fallback == "draft_unavailable" for r in rounds)  # no check of the draft failed
    return out, rounds, draft


@pytest.mark.parametrize("pipeline", [True, "auto"])
def test_slow_link_runs_plain_and_predrafts_the_next_tree(pipeline):
    """A 300 ms link against D 15 ms: after the first (in-line) round, a round without a ready tree runs plain
    with an ahead of the draft's likeliest next tokens beside it; hits are verified next round with no draft
    call; output = the target alone, the draft's KV fresh after every outcome."""
    out, rounds, draft = _plain_predraft_run(0.3, pipeline=pipeline)
    assert rounds[0].drafted and rounds[0].fallback is None  # the first round keeps today's behaviour
    plain = [i for i, r in enumerate(rounds) if r.fallback == "predraft"]
    assert plain and all(rounds[i].proposed == 0 and rounds[i].kind == "in_line" for i in plain)
    assert all(rounds[i].ahead is not None for i in plain)
    adopted = [i + 1 for i in plain if rounds[i].ahead in ("hit", "predraft") and i + 1 < len(rounds)]
    assert adopted and all(rounds[i].kind != "in_line" and rounds[i].draft_s == 0.0 for i in adopted)
    in_line = [r for r in rounds if r.fallback is None and r.kind == "in_line"][1:]
    assert all(r.depth <= 1 for r in in_line)  # in line again only at the end (no budget for a tree after a token)
    stats = out.stats
    resolved = stats.pipeline_ahead_hits + stats.predraft_hits + stats.pipeline_ahead_misses
    assert resolved == len(draft.resolved) and stats.ahead_hit_rate > 0


def test_plain_round_aheads_that_miss_fall_back():
    """No candidate can match: every plain round's ahead misses (rollback, then the usual commit) and the next
    round runs plain again; the output is unchanged."""
    out, rounds, draft = _plain_predraft_run(0.3, wrong=True, n=25)
    plain = [r for r in rounds if r.fallback == "predraft"]
    assert len(plain) >= 20 and all(r.ahead == "miss" for r in plain)
    assert set(draft.resolved) == {None} and out.stats.predraft_hits == out.stats.pipeline_ahead_hits == 0


def test_fast_link_drafts_in_line():
    _, rounds, _ = _plain_predraft_run(0.00001, n=25)
    assert not any(r.fallback == "predraft" for r in rounds) and sum(1 for r in rounds if r.drafted) > 1


def test_plain_round_ahead_on_the_stream(services):
    """After a commit with no propose since: an ahead of three empty-path candidates answers three distinct
    tokens with their trees; adopting one makes its tree the last one (a commit against its nodes is taken)."""
    from specdec.v1 import draft_pb2
    from specdec.wire import spec_to_proto
    from tests.test_pipeline import _Stream

    stream = _Stream(services[0])
    stream.send(start=draft_pb2.DraftStart(session_id="plain", prompt_ids=random_prompt(seed=3, length=6)))
    stream.reply()
    stream.send(propose=draft_pb2.TreeRequest(spec=spec_to_proto(CHAIN_SPEC), max_depth=3, round=1))
    tree = stream.reply().tree.tree
    stream.send(commit=draft_pb2.DraftCommit(tokens=[tree.tokens[0], 4], accepted_nodes=[0]))
    others = [draft_pb2.AheadAlternative(max_depth=3)] * 2
    stream.send(ahead=draft_pb2.AheadRequest(spec=spec_to_proto(CHAIN_SPEC), max_depth=3, round=2, alternatives=others))
    reply = stream.reply().tree
    tokens = [reply.guess_token, *(a.token for a in reply.alternatives)]
    assert reply.ahead and len(set(tokens)) == 3 and all(len(a.tree.tokens) for a in reply.alternatives)
    stream.send(resolve=draft_pb2.AheadResolve(adopt=True, candidate=2))
    adopted = reply.alternatives[1].tree
    stream.send(commit=draft_pb2.DraftCommit(tokens=[adopted.tokens[0], 1], accepted_nodes=[0]))
    stream.send(propose=draft_pb2.TreeRequest(spec=spec_to_proto(CHAIN_SPEC), max_depth=3, round=3))
    assert stream.reply().tree.round == 3
    stream.close()


def test_slow_link_plain_predraft_over_services_equals_target_alone(services):
    """The round loop over the real services, the draft client reporting a 300 ms link: plain rounds pre-draft
    the next tree through the draft server and the output is the target's own."""
    import grpc

    from orchestrator.loop.clients import DraftClient, TargetClient
    from orchestrator.loop.controller import RoundController
    from orchestrator.planning.cost_aware import CostAwareFactory, SharedState
    from orchestrator.planning.cost_model import CostModel
    from specdec.config import CostAwareConfig, FallbackConfig

    class SlowLink(DraftClient):
        @property
        def link_rtt_s(self):
            return 0.3

    prompt = random_prompt(seed=32, length=12)
    alone, _, _ = _over_grpc(*services, prompt, 50, pipeline=False, speculate=False)
    cost = CostModel({1: 100.0, 8: 110.0, 32: 130.0}, {1: 5.0, 8: 6.0}, alpha=0.0, source="configured")
    factory = CostAwareFactory(CostAwareConfig(first_round_plain=False), FallbackConfig(), SharedState(cost=cost))

    async def run():
        async with grpc.aio.insecure_channel(services[1]) as tc, grpc.aio.insecure_channel(services[0]) as dc:
            target = TargetClient(tc)
            info = await target.info()
            controller = RoundController(target, SlowLink(dc, info.vocab_size), [], info.context_limit,
                                         control_factory=factory, pipeline=True, ahead_candidates=3)
            records = []
            result = await controller.generate(GenerationRequest(prompt, 50, spec=CHAIN_SPEC), on_round=records.append)
            return result, records
    result, records = asyncio.run(run())
    assert result.tokens == alone.tokens
    plain = [i for i, r in enumerate(records) if r.fallback == "predraft"]
    assert plain and all(records[i].ahead is not None for i in plain)
    assert any(records[i].ahead in ("hit", "predraft") and records[i + 1].kind != "in_line"
               for i in plain if i + 1 < len(records))
    assert not any(r.fallback == "draft_unavailable" for r in records)


def _same_draws(actual, expected):
    """The same tree drawn; log-probs up to float32 round-off scaled by 1 / temperature."""
    assert (actual.tokens, actual.parents) == (expected.tokens, expected.parents)
    assert torch.allclose(torch.tensor(actual.draft_logprobs), torch.tensor(expected.draft_logprobs), atol=1e-3)


class ShadowedDraft(CandidateDraft):
    """A CandidateDraft beside a shadow runtime drafting in line: each in-line tree equals the shadow's, and each
    adopted candidate's tree equals the shadow's propose after commit(that candidate's outcome)."""

    def __init__(self, model, target):
        super().__init__(DraftRuntime(model), model, target)
        self.shadow, self.pending, self.checked = DraftRuntime(model), None, []

    def start(self, session_id, prompt_ids, sampling=GREEDY):
        super().start(session_id, prompt_ids, sampling)
        self.shadow.start(session_id, prompt_ids, sampling)

    def propose(self, session_id, spec, max_depth):
        tree = super().propose(session_id, spec, max_depth)
        _same_draws(self.shadow.propose(session_id, spec, max_depth), tree)
        return tree

    def propose_candidates(self, session_id, candidates, spec):
        out = super().propose_candidates(session_id, candidates, spec)
        self.pending = (candidates, out, spec)
        return out

    def resolve_ahead(self, session_id, adopt, candidate=0):
        super().resolve_ahead(session_id, adopt, candidate)
        if adopt:
            candidates, out, spec = self.pending
            c, last = candidates[candidate], self.shadow.sessions[session_id].last_tree
            tokens = [last.tokens[n] for n in c.path_nodes] + [out[candidate][0]]
            self.shadow.commit(session_id, tokens, list(c.path_nodes))
            _same_draws(self.shadow.propose(session_id, spec, c.max_depth), out[candidate][1])
            self.checked.append(not c.path_nodes)

    def commit(self, session_id, tokens, accepted_nodes):
        super().commit(session_id, tokens, accepted_nodes)
        self.shadow.commit(session_id, tokens, accepted_nodes)


def test_seeded_sampled_plain_round_aheads_equal_in_line():
    """Every third round plain (a scripted control): each adopted tree, a plain round's included, is the tree an
    in-line propose after that outcome draws from the same random state (a shadow draft checks every one)."""
    from orchestrator.planning.control import COST, FixedControl

    class EveryThirdPlain(FixedControl):
        calls = 0

        def speculate(self, now, committed_len, depth):
            self.calls += 1
            if self.calls % 3 == 0:
                self.reason = COST
                return False
            return super().speculate(now, committed_len, depth)

    model = tiny_model("qwen2", seed=7, init_std=STD)
    draft_model = perturbed_copy(model, seed=3, scale=0.05)
    prompt = random_prompt(seed=26, length=9)
    sampling = SamplingParams(temperature=0.05, top_k=30, seed=7)  # peaked: plain tokens among the draft's top 3
    target = RecordingTarget(TargetRuntime(model))
    draft = ShadowedDraft(draft_model, target)
    engine = SpeculativeEngine(target, draft, eos_token_ids=[], context_limit=512, pipeline=True, ahead_candidates=3)
    engine.controller.control_factory = EveryThirdPlain
    rounds = []
    engine.controller.on_round = rounds.append
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=40, spec=SAMPLED_SPEC, sampling=sampling))
    assert target.committed == prompt + out.tokens and not any(r.fallback == "draft_unavailable" for r in rounds)
    assert any(draft.checked)  # adopted trees of plain rounds, checked against the shadow
    plain_adopted = [i for i, r in enumerate(rounds[:-1]) if not r.proposed and r.ahead in ("hit", "predraft")]
    assert plain_adopted and all(rounds[i + 1].kind != "in_line" for i in plain_adopted)


def test_ahead_exclude_lists_are_bounded_and_checked():
    """An ahead's excluded token ids are checked before they cost anything: negative ids and lists longer
    than a verified tree could hold are refused naming the field."""
    from draft_service.server import _token_ids
    from specdec.tree_spec import MAX_TREE_NODES

    assert _token_ids([3, 0, 7], "ahead.exclude") == (3, 0, 7)
    with pytest.raises(ValueError, match=r"ahead\.exclude\[1\] = -2"):
        _token_ids([3, -2], "ahead.exclude")
    with pytest.raises(ValueError, match=rf"ahead\.alternatives\[0\]\.exclude: {MAX_TREE_NODES + 1} token ids"):
        _token_ids([1] * (MAX_TREE_NODES + 1), "ahead.alternatives[0].exclude")
