"""The cost-aware control in the real round loop (orchestrator.planning.cost_aware with SpeculativeEngine).

Greedy output equals the target alone (float32, tiny models) with context (n-gram) branches merged
into the draft's trees: a scripted draft agrees with the target for exactly i tokens per round and a
scripted context branch for exactly j, every (i, j), so partial acceptance is forced at every depth
along a draft branch and along a context branch, and both kinds share their common first tokens.
Then the shaping rule on scripted costs, the always-wrong draft, the first round, and the draft's
cache after context tokens were accepted.
"""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from pydantic import ValidationError

from draft_service.runtime import DraftRuntime
from orchestrator.planning.control import RoundObservation
from orchestrator.planning.cost_aware import (
    CostAwareControl, DepthEstimates, SharedState, could_pay,
)
from orchestrator.planning.cost_model import PRIOR_DRAFT_STEP_MS, PRIOR_VERIFY_MS, CostModel
from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.engine import SpeculativeEngine
from orchestrator.planning.shaping import match_bucket, ngram_continuation
from specdec.config import CostAwareConfig
from specdec.tree_spec import TreeSpec
from target_service.runtime import TargetRuntime
from tests.conftest import (
    VOCAB, OracleDraft, RecordingDraft, RecordingTarget, SlowPropose, assert_kv_equal, cache_kv, hf_greedy,
    perturbed_copy, prefill_kv, random_prompt, tiny_model,
)

N_NEW = 16
CONTEXT = 512
CHAIN4 = TreeSpec.chain(4)


def free_costs() -> CostModel:
    """Verify rows and draft steps nearly free: every proposed node pays, no step is skipped. alpha 0:
    scripted costs stay as they are (the rounds' real timings would otherwise correct them)."""
    return CostModel({1: 100.0, 64: 100.001}, {1: 0.001}, alpha=0.0)


def scripted_lookup(prompt_len: int, reference: list[int], agree: int):
    """A context branch that follows the target's greedy continuation for exactly ``agree`` tokens,
    then proposes a wrong token (the reference token + 1)."""
    def lookup(context, max_tokens):
        done = len(context) - prompt_len
        want = reference[done:done + max_tokens + 1]
        chain = want[:agree] + [(want[agree] + 1) % VOCAB] if agree < len(want) else want
        return chain[:max_tokens], 3

    return lookup


def generate(model, draft, prompt, spec, control_factory, n=N_NEW):
    """(target wrapper, result, round records) of one greedy request."""
    target = RecordingTarget(TargetRuntime(model))
    engine = SpeculativeEngine(target, draft, eos_token_ids=[], context_limit=CONTEXT, control_factory=control_factory)
    records = []
    result = asyncio.run(engine.controller.generate(GenerationRequest(prompt, max_new_tokens=n, spec=spec),
                                                    on_round=records.append))
    assert sum((list(r.tokens) for r in records), []) == result.tokens
    assert target.final_cache_len == len(prompt) + n - 1  # nothing past the output left in the target cache
    return target, result, records


CASES = [(i, j) for i in range(CHAIN4.gamma + 1) for j in range(5)]


@pytest.mark.parametrize("agree_draft, agree_context", CASES)
def test_exact_with_context_branches(agree_draft, agree_context):
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=3000 + 7 * agree_draft + agree_context)
    reference = hf_greedy(model, prompt, N_NEW + 8)
    draft = OracleDraft(prompt, reference, agree=agree_draft, seed=agree_draft)
    shared = SharedState(cost=free_costs())
    factory = lambda spec: CostAwareControl(spec, shared, max_gamma=CHAIN4.gamma, ngram_tokens=4,  # noqa: E731
                                            first_round_plain=False,
                                            lookup=scripted_lookup(len(prompt), reference, agree_context))
    _, result, records = generate(model, draft, prompt, CHAIN4, factory)
    assert result.tokens == reference[:N_NEW]
    done = 0
    for r in records:
        max_depth = N_NEW - done - 1
        if max_depth >= 1:
            want = min(max(agree_draft, min(agree_context, 4)), max_depth)
            assert r.accepted == want, (done, r)
            draft_part = min(agree_draft, max_depth)
            # accepted tokens beyond the draft's correct run come from the context branch
            assert r.context_accepted == max(0, want - draft_part)
            assert r.depth >= want
        done += len(r.tokens)
    assert sum(r.accepted for r in records) == result.stats.accepted_tokens
    assert result.stats.context_accepted_tokens == sum(r.context_accepted for r in records)


def test_draft_cache_after_context_tokens_accepted():
    """A real draft runtime: the draft's cache equals a fresh prefill of the committed tokens after
    every round, also when the accepted path ran into context nodes the draft never fed."""
    model = tiny_model("qwen2", seed=0)
    draft_model = perturbed_copy(model, seed=5, scale=0.3)
    base = random_prompt(seed=41, length=12)
    prompt = base + base + base[:6]  # repeats: the context branch proposes the prompt's own sequel
    committed: dict[str, list[int]] = {}

    def check(inner, sid):
        s = inner.sessions[sid]
        # float32 round-off of an equivalent computation is ~2e-5 here; a wrong slot differs by O(1)
        assert_kv_equal(cache_kv(s.cache), prefill_kv(draft_model, s.tokens[: s.cached_len]), atol=1e-4, rtol=1e-4,
                        what="draft cache")
        committed[sid] = list(s.tokens)

    draft = RecordingDraft(DraftRuntime(draft_model), check_after_commit=check)
    shared = SharedState(cost=free_costs())
    factory = lambda spec: CostAwareControl(spec, shared, ngram_tokens=6, first_round_plain=False)  # noqa: E731
    _, result, records = generate(model, draft, prompt, TreeSpec(gamma=2, topKSpec=[[2], [1, 1]], topHead=[1, 2]),
                                  factory, n=24)
    assert result.tokens == hf_greedy(model, prompt, 24)
    assert result.stats.context_proposed_tokens > 0
    assert committed  # the check ran


@pytest.mark.parametrize("kind, draft_scale", [("qwen2", 0.05), ("llama", None)])
def test_greedy_equals_target_with_default_costs(kind, draft_scale):
    """Prior (CPU) costs, n-gram lookup on, first round plain: output equals the target alone."""
    model = tiny_model(kind, seed=2)
    draft_model = perturbed_copy(model, seed=3, scale=draft_scale) if draft_scale else tiny_model(kind, seed=9)
    spec = TreeSpec(gamma=3, topKSpec=[[3], [1], [1]], topHead=[1, 1, 1])
    shared = SharedState()
    factory = lambda s: CostAwareControl(s, shared)  # noqa: E731
    for seed in (1, 2, 3):
        base = random_prompt(seed=50 + seed, length=10)
        prompt = base + base[:5]
        _, result, records = generate(model, DraftRuntime(draft_model), prompt, spec, factory, n=20)
        assert result.tokens == hf_greedy(model, prompt, 20)
        assert records[0].drafted == 0 and records[0].fallback == "cost"  # the first round never drafts
        assert records[0].proposed == 0  # nor verifies context nodes: its token comes from the prefill


def _shapes(costs: CostModel, agree: int = 2, n: int = 24):
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=77)
    reference = hf_greedy(model, prompt, n + 8)
    draft = OracleDraft(prompt, reference, agree=agree, seed=1)
    spec = TreeSpec(gamma=4, topKSpec=[[4], [2, 2], [1, 1], [1]], topHead=[1, 2, 2, 1])
    shared = SharedState(cost=costs)
    factory = lambda s: CostAwareControl(s, shared, ngram_tokens=0, first_round_plain=False)  # noqa: E731
    _, result, records = generate(model, draft, prompt, spec, factory, n=n)
    assert result.tokens == reference[:n]
    spec_rounds = [r for r in records if r.drafted]
    nodes = sum(r.proposed for r in records) / len(records)
    depth = sum(r.depth for r in records) / len(records)
    return nodes, depth, len(spec_rounds)


def test_cheap_rows_build_wider_and_deeper_trees_than_dear_rows():
    """Scripted costs: with rows and steps nearly free the rounds verify wide, deep trees; when each
    verify row costs as much as a target step, the trees are narrower and shallower."""
    cheap_nodes, cheap_depth, _ = _shapes(free_costs())
    dear = CostModel({1: 300.0, 2: 600.0, 64: 19200.0}, {1: 45.0}, alpha=0.0)
    dear_nodes, dear_depth, _ = _shapes(dear)
    assert cheap_nodes > 2 * dear_nodes and cheap_depth > dear_depth
    assert cheap_depth >= 3


def test_always_wrong_draft_stops_drafting_without_a_fallback_rule():
    """A draft that never agrees: the calibrated values fall, no draft step pays, and the request
    decodes without the draft (reason "cost"), trying one step every probe_every rounds; no other
    fallback reason appears."""
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=88)
    n = 60
    reference = hf_greedy(model, prompt, n + 8)
    draft = OracleDraft(prompt, reference, agree=0, seed=2)
    shared = SharedState(cost=CostModel(dict(PRIOR_VERIFY_MS), dict(PRIOR_DRAFT_STEP_MS), alpha=0.0))
    factory = lambda s: CostAwareControl(s, shared, ngram_tokens=0, probe_every=8)  # noqa: E731
    _, result, records = generate(model, draft, prompt, CHAIN4, factory, n=n)
    assert result.tokens == reference[:n]
    assert all(r.fallback in (None, "cost") for r in records)
    late = records[20:]
    drafted = [r for r in late if r.drafted]
    assert len(drafted) <= len(late) // 8 + 1  # only the probes
    assert any(r.drafted for r in records[:20])  # it did try the draft first
    assert result.stats.accepted_tokens == 0


class AverageBranchControl(CostAwareControl):
    """The plan before it saw each round's branch: the moving average of past rounds' branches."""

    def round_context(self, context):
        pass


@pytest.mark.parametrize("cls", [CostAwareControl, AverageBranchControl])
def test_a_likely_context_branch_replaces_the_draft_in_its_round(cls):
    """Every round's context branch is the target's next 8 tokens, matched 6+ tokens back (bucket 5),
    and the draft is always right too. Once the branch's chances are learnt, the control that values
    each round's own branch stops drafting (the draft would only repeat the branch's nodes); the
    one that plans from the average of past branches counts the draft's value on top and drafts every
    round. Both give the target's tokens; every round past the learning commits the whole branch."""
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=91)
    n = 90
    reference = hf_greedy(model, prompt, n + 10)
    draft = OracleDraft(prompt, reference, agree=CHAIN4.gamma, seed=3)

    def lookup(context, max_tokens):
        done = len(context) - len(prompt)
        return reference[done:done + max_tokens], 5

    cost = CostModel({1: 300.0, 64: 300.0 + 63 * 10.0}, {1: 40.0}, alpha=0.0)  # 10 ms a row, 40 ms a step
    shared = SharedState(cost=cost)
    factory = lambda s: cls(s, shared, lookup=lookup)  # noqa: E731
    _, result, records = generate(model, draft, prompt, CHAIN4, factory, n=n)
    assert result.tokens == reference[:n]
    late = records[4:-1]  # past the first rounds (the calibration's prior is 0.4) and the budget's last round
    assert len(late) >= 4 and all(len(r.tokens) == 9 for r in late)  # 8 branch tokens + the bonus
    if cls is CostAwareControl:
        assert not any(r.drafted for r in late) and all(r.fallback == "cost" for r in late)
    else:
        assert all(r.drafted for r in late)


def test_lookup_is_the_ngram_continuation():
    assert ngram_continuation([5, 7, 9, 2, 5, 7], 3) == ([9, 2, 5], 2)
    assert ngram_continuation([1, 2, 3], 3) == ([], 0)
    # the key is the match-length bucket: a copied run of 6+ tokens is bucket 5, of 4-5 bucket 4
    source = [9, 1, 2, 3, 4, 5, 6, 7, 8]
    assert ngram_continuation(source + [0, 0, 1, 2, 3, 4, 5, 6], 2) == ([7, 8], 5)
    assert ngram_continuation(source + [0, 0, 3, 4, 5, 6], 2) == ([7, 8], 4)
    assert [match_bucket(m) for m in range(1, 9)] == [1, 2, 3, 4, 4, 5, 5, 5]
    long_source = [9, *range(10, 20), 7]  # a 10-token run, then 7
    assert ngram_continuation(long_source + [0, *range(10, 20)], 1) == ([7], 5)  # counted up to 6, still bucket 5
    assert {match_bucket(m) for m in range(1, 40)} == {1, 2, 3, 4, 5}


def test_seeded_sampled_requests_do_not_depend_on_timings():
    """A seeded sampled request gives the same tokens whatever the cost model says (its random draws
    follow the tree's shape, so the cost-aware control keeps the request's TreeSpec for it)."""
    from specdec.sampling import SamplingParams

    model = tiny_model("qwen2", seed=0)
    draft_model = perturbed_copy(model, seed=3, scale=0.05)
    prompt = random_prompt(seed=61)
    spec = TreeSpec(gamma=2, topKSpec=[[3], [2, 1]], topHead=[1, 2], treeType=1)
    outputs = []
    for cost in (free_costs(), CostModel({1: 300.0, 2: 600.0, 64: 19200.0}, {1: 45.0}, alpha=0.0)):
        shared = SharedState(cost=cost)
        factory = lambda s: CostAwareControl(s, shared)  # noqa: E731
        engine = SpeculativeEngine(TargetRuntime(model), DraftRuntime(draft_model), eos_token_ids=[],
                                   context_limit=CONTEXT, control_factory=factory)
        request = GenerationRequest(prompt, max_new_tokens=16, spec=spec, sampling=SamplingParams(0.8, seed=5))
        outputs.append(engine.generate(request).tokens)
    assert outputs[0] == outputs[1]


def test_the_first_rounds_free_verify_is_not_taken_as_a_cost_figure():
    """The first round verifies an empty tree on the prefill's logits (no forward, ~1 ms): the shared
    cost model must not learn V(1) from it (it once set V(1) to ~1 ms, and no draft step paid for
    dozens of rounds). A later plain round, which runs a forward, is observed."""
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=7)
    cost = CostModel({1: 300.0, 8: 450.0}, {1: 45.0}, alpha=0.5, source="measured")
    shared = SharedState(cost=cost)
    factory = lambda s: CostAwareControl(s, shared, ngram_tokens=0)  # noqa: E731
    _, _, records = generate(model, DraftRuntime(model), prompt, CHAIN4, factory, n=1)
    assert len(records) == 1 and records[0].proposed == 0
    assert cost.verify.observations == 0 and cost.verify(1) == 300.0
    generate(model, DraftRuntime(model), prompt, CHAIN4, factory, n=3)
    assert cost.verify.observations >= 1  # the rounds after the first one are figures


# Verification memory-bound up to 8 rows, then compute-bound at 100 ms a row (alpha 0: scripted).
BOUND_AT_8 = {1: 285.0, 8: 300.0, 64: 5900.0}


class ReportsBatch:
    """The target runtime, its verify results reporting a forward shared with ``sessions - 1``
    others' trees of the same size (what the target service's batcher reports under load); with
    ``open_only``, a forward of its own but ``sessions`` sessions open at the target (speculative
    requests that drifted apart: ``VerifyResponse.mergeable_sessions``)."""

    def __init__(self, runtime: TargetRuntime, sessions: int, open_only: bool = False):
        self.runtime, self.sessions, self.open_only = runtime, sessions, open_only

    def __getattr__(self, name):
        return getattr(self.runtime, name)

    def verify(self, session_id, tree):
        import dataclasses

        result = self.runtime.verify(session_id, tree)
        if self.open_only:
            return dataclasses.replace(result, batch_size=1, batch_rows=tree.size + 1, mergeable=self.sessions)
        return dataclasses.replace(result, batch_size=self.sessions, batch_rows=self.sessions * (tree.size + 1),
                                   mergeable=self.sessions)


@pytest.mark.parametrize("open_only", [False, True], ids=["8-per-forward", "8-open-sessions"])
def test_load_aware_control_turns_speculation_off_at_8_sessions_per_forward_and_on_at_1(open_only):
    """Goodput (LoadedCost): with verification compute-bound past 8 rows, a perfect draft still
    drafts every round when each forward holds one session, and stops drafting (reason "cost") once
    the target reports 8 sessions per forward: 8 trees of even 2 rows cost 1100 ms against 300 ms
    for 8 plain rows, and a 2-row tree brings at most 2 tokens (the rounds' own overhead, learnt from
    real timings, would have to pass 800 ms to change that). The same when each forward holds one
    session but 8 are open at the target (open_only): plain decoding would merge all 8. Output
    stays the target's own."""
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=91)
    n = 40
    reference = hf_greedy(model, prompt, n + 8)
    drafting = {}
    for sessions in (1, 8):
        shared = SharedState(cost=CostModel(dict(BOUND_AT_8), {1: 45.0}, alpha=0.0))
        factory = lambda s: CostAwareControl(s, shared, ngram_tokens=0, probe_every=1000)  # noqa: E731
        target = ReportsBatch(TargetRuntime(model), sessions, open_only)
        engine = SpeculativeEngine(target, OracleDraft(prompt, reference, agree=8), eos_token_ids=[],
                                   context_limit=CONTEXT, control_factory=factory)
        records = []
        result = asyncio.run(engine.controller.generate(GenerationRequest(prompt, max_new_tokens=n, spec=CHAIN4),
                                                        on_round=records.append))
        assert result.tokens == reference[:n]
        # after the first (plain) round at 1 session; at 8 once the load estimate (a moving average) is ~8
        late = records[1:-1] if sessions == 1 else records[8:-1]  # the last round: budget for the bonus only
        drafting[sessions] = (sum(1 for r in late if r.drafted), len(late), {r.fallback for r in late})
        if sessions == 8:
            assert shared.load > 7.5
    drafted, rounds, _ = drafting[1]
    assert drafted == rounds and rounds >= 3, drafting
    drafted, rounds, reasons = drafting[8]
    assert drafted == 0 and rounds >= 10 and reasons == {"cost"}, drafting


def test_loaded_cost_prices_rows_at_the_batch_and_observes_the_whole_forward():
    """LoadedCost: verify(r) = V(load * r); a round of a merged forward teaches V at the forward's
    rows (batch_rows), not at the request's own tree."""
    from orchestrator.planning.cost_model import LoadedCost
    from orchestrator.planning.shaping import ShapedTree
    from specdec.tree import DraftTree

    cost = CostModel(dict(BOUND_AT_8), {1: 45.0}, alpha=1.0, source="measured")
    loaded = LoadedCost(cost, 8)
    assert loaded.verify(1) == cost.verify(8) == 300.0
    assert loaded.verify(2) == cost.verify(16) == 1100.0
    assert LoadedCost(cost, 0.3).verify(2) == cost.verify(2)  # load under 1 counts as 1
    shared = SharedState(cost=cost)
    control = CostAwareControl(CHAIN4, shared, ngram_tokens=0)
    control.observe(RoundObservation(ShapedTree.of(DraftTree((), ())), [], 0.001, batch_size=8, batch_rows=8))
    assert shared.load == 1.0 and cost.verify.observations == 0  # the first round: no forward ran
    first = CostAwareControl(CHAIN4, SharedState(cost=cost), ngram_tokens=0)
    first.observe(RoundObservation(ShapedTree.of(DraftTree((), ())), [], 0.001, batch_size=1, mergeable=5))
    assert first.shared.load == 5.0  # ... but the sessions open at the target are known: round 2 plans with them
    tree = ShapedTree.of(DraftTree((5,), (-1,)))
    control.observe(RoundObservation(tree, [], 2.2, batch_size=8, batch_rows=16))  # V(16) observed at 2x
    assert cost.verify(16) == pytest.approx(2200.0) and shared.load == 8  # a rise is taken at once
    assert shared.planning_cost().verify(2) == pytest.approx(cost.verify(2 * shared.load))
    load = shared.load
    control.observe(RoundObservation(tree, [], 0.001, batch_size=0, batch_rows=0))  # a replayed result: no forward
    assert cost.verify(16) == pytest.approx(2200.0) and shared.load == load


@pytest.mark.parametrize("shared_compute", [False, True], ids=["own-device", "shared-compute"])
def test_a_draft_on_the_targets_hardware_is_priced_for_the_whole_batch(shared_compute):
    """4 sessions per verify forward (the requests' rounds together), verification memory-bound
    (V(4) ~ V(8) ~ 300 ms), a perfect draft at 150 ms a step. On its own device one step pays: 2
    tokens in 150 + V(8) = 450 ms beat 1 token in V(4) = 292 ms, so every round drafts. On the
    target's hardware the 4 requests' steps take the target's compute in turn (LoadedCost: 4 x 150
    ms): 2 tokens in 900 ms lose to plain rounds, so no round drafts (reason "cost"). Output stays
    the target's own either way."""
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=93)
    n = 80
    reference = hf_greedy(model, prompt, n + 8)
    shared = SharedState(cost=CostModel(dict(BOUND_AT_8), {1: 150.0}, alpha=0.0), shared_compute=shared_compute)
    factory = lambda s: CostAwareControl(s, shared, ngram_tokens=0, probe_every=1000)  # noqa: E731
    engine = SpeculativeEngine(ReportsBatch(TargetRuntime(model), 4),
                               OracleDraft(prompt, reference, agree=8), eos_token_ids=[],
                               context_limit=CONTEXT, control_factory=factory)
    records = []
    result = asyncio.run(engine.controller.generate(GenerationRequest(prompt, max_new_tokens=n, spec=CHAIN4),
                                                    on_round=records.append))
    assert result.tokens == reference[:n]
    assert shared.load > 3.5 and shared.verify_merge == 1.0  # every forward held all 4
    late = records[8:-1]  # once the load estimate (a moving average) is near 4
    drafted = sum(1 for r in late if r.drafted)
    if shared_compute:
        assert drafted == 0 and len(late) >= 8 and {r.fallback for r in late} == {"cost"}, [r.fallback for r in late]
    else:
        assert drafted == len(late) and len(late) >= 4, [r.fallback for r in late]


def test_drafted_rounds_that_miss_the_others_forward_stop_drafting_under_load():
    """The previous test's draft on its own device, but each drafted round's verify runs in a forward
    of its own while 4 sessions are open (a draft's time late, it missed the others' merged
    forward). Such a round teaches ``verify_merge`` a share of 0, 0.3 of the way from 1 (the
    session's first drafted round, which also waited for the draft's prefill, teaches nothing): 0.7
    after the second drafted round. LoadedCost then prices a drafted round's verify as 4 / m
    forwards of V(m rows), m = 1 + verify_merge * 3: at 0.7 (m = 3.1), V(6.2) * 4 / 3.1 = 382 ms,
    so 1 + v tokens in 150 + 382 ms beat 1 token in V(4) = 291 ms only if the kept node's
    calibrated value v passes 0.83, which two rounds have not taught; the rounds stop drafting
    (reason "cost"), and nothing drafted teaches the share again: plain rounds of the 4 sessions
    would share one forward. Output stays the target's own."""
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=93)
    n = 80
    reference = hf_greedy(model, prompt, n + 8)
    shared = SharedState(cost=CostModel(dict(BOUND_AT_8), {1: 150.0}, alpha=0.0))
    factory = lambda s: CostAwareControl(s, shared, ngram_tokens=0, probe_every=1000)  # noqa: E731
    engine = SpeculativeEngine(ReportsBatch(TargetRuntime(model), 4, open_only=True),
                               OracleDraft(prompt, reference, agree=8), eos_token_ids=[],
                               context_limit=CONTEXT, control_factory=factory)
    records, merge = [], []

    def on_round(record):
        records.append(record)
        merge.append(shared.verify_merge)

    result = asyncio.run(engine.controller.generate(GenerationRequest(prompt, max_new_tokens=n, spec=CHAIN4),
                                                    on_round=on_round))
    assert result.tokens == reference[:n]
    drafted = [i for i, r in enumerate(records) if r.drafted]
    assert drafted == [1, 2], [r.fallback for r in records]  # the first round is plain (TTFT)
    assert merge[1] == 1.0 and merge[2] == pytest.approx(0.7) and merge[-1] == pytest.approx(0.7)
    late = records[3:-1]
    assert len(late) >= 40 and {r.fallback for r in late} == {"cost"}, [r.fallback for r in records]
    assert records[2].cost["verify_merge"] == pytest.approx(0.7)  # the round's cost record


def test_verify_merge_is_learnt_under_load_only_and_starts_over_when_rounds_run_alone():
    """SharedState.observe_verify_merge at load 4: a drafted round's forward holding all 4 sessions
    is a share of 1, one holding 2 a share of 1/3; nothing is learnt below load 1.5. LoadedCost's
    drafted_verify by the numbers (V linear from 285 ms at 1 row to 300 at 8): merge 1 gives V(4 x 2)
    = 300 ms, as a plain round's pricing of the same rows; merge 0 gives 4 x V(2) = 1148.6 ms. Once the
    load falls under 1.1 the share is back at 1."""
    from orchestrator.planning.cost_model import LoadedCost

    shared = SharedState(load=4.0)
    shared.observe_verify_merge(2)
    assert shared.verify_merge == pytest.approx(1.0 + 0.3 * (1 / 3 - 1.0))
    shared.observe_verify_merge(4)
    assert shared.verify_merge == pytest.approx(0.8 + 0.3 * 0.2)
    cost = CostModel(dict(BOUND_AT_8), {1: 150.0}, alpha=0.0, source="measured")
    assert LoadedCost(cost, 4).drafted_verify(2) == pytest.approx(300.0) == LoadedCost(cost, 4).verify(2)
    assert LoadedCost(cost, 4, verify_merge=0.0).drafted_verify(2) == pytest.approx(4 * (285 + 15 / 7))
    assert LoadedCost(cost, 4, verify_merge=0.0).verify(2) == pytest.approx(300.0)  # plain rounds keep in step
    assert cost.drafted_verify(2) == cost.verify(2)
    for _ in range(12):
        shared.observe_load(1)
        assert (shared.verify_merge == 1.0) == (shared.load < 1.1)
    assert shared.load < 1.1
    alone = SharedState(load=1.2)
    alone.observe_verify_merge(1)
    assert alone.verify_merge == 1.0


def test_loaded_cost_prices_a_shared_draft_step_for_the_batch():
    from orchestrator.planning.cost_model import LoadedCost

    cost = CostModel(dict(BOUND_AT_8), {1: 45.0, 4: 60.0}, alpha=0.0, source="measured")
    assert LoadedCost(cost, 4).draft_step_ms(1) == 45.0  # own device: the step's own time
    assert LoadedCost(cost, 4, shared_compute=True).draft_step_ms(1) == 180.0
    assert LoadedCost(cost, 4, shared_compute=True).draft_ms([1, 4]) == 4 * (45.0 + 60.0)
    assert LoadedCost(cost, 4, shared_compute=True).verify(2) == cost.verify(8)  # verify pricing unchanged


def test_shares_compute_compares_host_device_and_cpus():
    from specdec.placement import Placement, placement, shares_compute

    here = placement("cpu")
    assert here.host and here.device == "cpu" and here.cpus
    assert shares_compute(Placement("a", "cpu", (0, 1)), Placement("a", "cpu", (1,)))
    assert not shares_compute(Placement("a", "cpu", (0,)), Placement("a", "cpu", (1,)))  # pinned apart
    assert shares_compute(Placement("a", "cpu", ()), Placement("a", "cpu", (1,)))  # unknown CPU set: shared
    assert not shares_compute(Placement("a", "cpu", (0,)), Placement("b", "cpu", (0,)))  # other host
    assert not shares_compute(Placement("a", "cuda:0", ()), Placement("a", "cuda:1", ()))
    assert shares_compute(Placement("a", "cuda:0", ()), Placement("a", "cuda:0", ()))
    assert not shares_compute(Placement("", "cpu", ()), Placement("", "cpu", ()))  # not reported (an old service)


def test_shared_compute_load_rises_at_once_scales_probes_and_defers_the_draft():
    shared, own = SharedState(shared_compute=True), SharedState()
    for state in (shared, own):
        state.observe_load(4)
        assert state.load == 4.0  # a rise is taken at once
    assert (shared.probe_interval(16), own.probe_interval(16)) == (64.0, 16.0)
    assert shared.defer_draft() and not own.defer_draft()
    shared.observe_load(1)
    assert shared.load == pytest.approx(4 + 0.3 * (1 - 4))  # a fall as a moving average
    for _ in range(10):
        shared.observe_load(1)
    # alone too: a draft service prefills on Start, beside the target's Prefill, on the same CPU
    assert shared.load < 1.5 and shared.defer_draft() and not own.defer_draft()
    # the control: deferred for a lone request too, unless its first round may draft (first_round_plain off)
    assert CostAwareControl(CHAIN4, shared).defer_draft_open(others=0)
    drafts_round_1 = CostAwareControl(CHAIN4, shared, first_round_plain=False)
    assert not drafts_round_1.defer_draft_open(others=0) and drafts_round_1.defer_draft_open(others=1)
    assert not CostAwareControl(CHAIN4, own).defer_draft_open(others=0)


def test_probes_thin_out_where_not_even_an_always_right_draft_could_pay():
    """Shared compute, this machine's measured costs (ms; V(1..32), D(1..8)): at load 8 every draft
    step is priced for the whole batch (8 x D(1) = 496 ms) and the batch's verify is compute-bound,
    so no depth beats a plain round even when every drafted token is accepted (by hand: g = 1 gives
    2 / (496 + V(16)) = 1 / 633 tokens per ms against 1 / V(8) = 1 / 547); the probe interval (16 x
    load rounds) is then four times longer. At load 4 an always-right chain pays (2 / (248 + V(8)) =
    1 / 398 against 1 / V(4) = 1 / 453), and alone it does too: the usual interval. On the draft's
    own device the load does not price the draft's steps this way: the usual interval. Under load on
    shared compute a request whose draft has not prefilled never probes (its prefill would take the
    batch's compute); alone, or on the draft's own device, it does."""
    cost = CostModel({1: 376.0, 4: 453.0, 8: 547.0, 16: 770.0, 32: 1160.0}, {1: 62.0, 2: 73.0, 4: 81.0, 8: 120.0},
                     alpha=0.0)

    def probes_after(load: float, rounds_without: int, shared_compute: bool = True, warm: bool = True) -> tuple:
        shared = SharedState(cost=cost, shared_compute=shared_compute)
        shared.observe_load(load)
        control = CostAwareControl(CHAIN4, shared, ngram_tokens=0, probe_every=16)
        control.state.rounds, control.state.draft_warm = 3, warm  # past the first (plain) round
        control.state.estimates.depths = DepthEstimates(value=[0.02], rows=[1.0])  # a draft that has been wrong: g = 0 planned
        shared.rounds_without_draft = rounds_without
        drafts = control.speculate(0.0, 100, 8)
        return drafts, control.state.probing, shared.rounds_without_draft, could_pay(shared.planning_cost(), [1] * 8, 8)

    assert probes_after(8.0, 16 * 8) == (False, False, 16 * 8, False)  # no probe at the usual interval
    assert probes_after(8.0, 4 * 16 * 8 - 1) == (False, False, 4 * 16 * 8 - 1, False)
    assert probes_after(8.0, 4 * 16 * 8) == (True, True, 0, False)  # four times later it still re-times the draft
    assert probes_after(4.0, 16 * 4) == (True, True, 0, True)
    assert probes_after(1.0, 16) == (True, True, 0, True)
    assert probes_after(8.0, 16, shared_compute=False)[:3] == (True, True, 0)
    assert probes_after(4.0, 16 * 4, warm=False) == (False, False, 16 * 4, True)  # cold draft under load: no probe
    assert probes_after(8.0, 4 * 16 * 8, warm=False)[:3] == (False, False, 4 * 16 * 8)
    assert probes_after(1.0, 16, warm=False) == (True, True, 0, True)  # alone: it probes and opens its draft
    assert probes_after(8.0, 16, shared_compute=False, warm=False)[:3] == (True, True, 0)


def test_a_deferred_draft_opens_at_the_first_drafted_round_and_the_output_is_exact():
    """Shared compute under load: the request starts without a draft session (no draft prefill
    beside the target's); once the load falls (in-process every forward holds one session) a round
    decides to draft, opens the draft then, and drafts from there on. Greedy output = target alone."""
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=95)
    reference = hf_greedy(model, prompt, 40)

    class CountingDraft(DraftRuntime):  # the target model as its own draft: every step agrees
        starts: list[int] = []

        def start(self, session_id, prompt_ids, *args, **kwargs):
            self.starts.append(len(prompt_ids))
            return super().start(session_id, prompt_ids, *args, **kwargs)

    draft = CountingDraft(model)
    shared = SharedState(cost=CostModel(dict(BOUND_AT_8), {1: 45.0}, alpha=0.0), shared_compute=True, load=4.0)
    factory = lambda s: CostAwareControl(s, shared, ngram_tokens=0, probe_every=1000)  # noqa: E731
    _, result, records = generate(model, draft, prompt, CHAIN4, factory, n=32)
    assert result.tokens == reference[:32]
    first = next(i for i, r in enumerate(records) if r.drafted)
    assert first >= 2 and len(draft.starts) == 1  # opened once, not at the start
    assert draft.starts[0] > len(prompt)  # with the tokens committed by the plain rounds before it
    assert sum(1 for r in records[first:] if r.drafted) >= 3


class DraftService(SlowPropose):
    """An in-process draft that the round loop treats as a draft service (its calls run beside the
    target's); ``starts`` records the length of each context it was opened with."""

    in_process = False

    def __init__(self, model):
        super().__init__(model, 0.0)
        self.starts: list[int] = []

    async def start(self, session_id, prompt_ids, *args, **kwargs):
        self.starts.append(len(prompt_ids))
        return await self.inner.start(session_id, prompt_ids, *args, **kwargs)


def _on_draft_service(shared: SharedState, prompt, n: int):
    """One request of n new tokens (CHAIN4) on the tiny model as target and as a DraftService, with
    the cost-aware control on ``shared`` (no context branches, no probes). Returns (result, the
    rounds' RoundRecords, the draft, the controller: more requests may run on it)."""
    from orchestrator.loop.controller import RoundController, sync_worker

    model = tiny_model("qwen2", seed=0)
    draft = DraftService(model)
    factory = lambda s: CostAwareControl(s, shared, ngram_tokens=0, probe_every=1000)  # noqa: E731
    ctl = RoundController(sync_worker(TargetRuntime(model)), draft, [], CONTEXT, control_factory=factory)
    records = []
    result = asyncio.run(ctl.generate(GenerationRequest(prompt, max_new_tokens=n, spec=CHAIN4), on_round=records.append))
    return result, records, draft, ctl


def test_a_draft_service_opened_by_a_round_prefills_beside_that_round_run_plain():
    """A draft that is not in-process (a draft service: Start queues its prefill and answers at
    once) opened by a round, deferred there by the load on shared compute: that round runs plain
    (reason "draft_opening") instead of waiting in its first proposal for the prefill, which
    under load queues behind the other requests' (past the deadline: the session dropped, then
    re-opened, prefilling again). The next round drafts; greedy output equals the target alone."""
    prompt = random_prompt(seed=95)
    reference = hf_greedy(tiny_model("qwen2", seed=0), prompt, 24)
    shared = SharedState(cost=CostModel(dict(BOUND_AT_8), {1: 45.0}, alpha=0.0), shared_compute=True, load=4.0)
    result, records, draft, ctl = _on_draft_service(shared, prompt, 24)
    assert result.tokens == reference
    opening = [i for i, r in enumerate(records) if r.fallback == "draft_opening"]
    assert len(opening) == 1 and opening[0] >= 1 and not records[opening[0]].drafted  # the deferred open's round
    assert records[opening[0] + 1].drafted and draft.proposes >= 1
    assert all(not r.drafted for r in records[:opening[0]])
    assert result.stats.fallback_rounds >= 1

    # a seeded sampled request: its trees must not depend on timings (the load), so no such round
    from specdec.sampling import SamplingParams

    seeded = SamplingParams(0.8, seed=3)
    records = []
    asyncio.run(ctl.generate(GenerationRequest(prompt, max_new_tokens=24, spec=CHAIN4, sampling=seeded),
                             on_round=records.append))
    assert "draft_opening" not in {r.fallback for r in records} and sum(1 for r in records if r.drafted) >= 3


def test_a_lone_request_on_shared_compute_opens_a_draft_service_at_round_2_and_learns_no_v_from_it():
    """One request, no load, the draft a service on the target's hardware: the draft is not opened
    at the start (its prefill would share the CPU with the target's Prefill: a later first token),
    round 1 reuses the prefill's logits, round 2 opens the draft and runs plain beside its prefill
    ("draft_opening"), round 3 drafts. Round 2's verify shared the CPU with that prefill, so it
    teaches the cost model nothing: V's observations are the rounds with a forward of their own,
    less that one (a forward slowed by the prefill would make plain rounds look dearer). Greedy
    output equals the target alone."""
    prompt = random_prompt(seed=96)
    reference = hf_greedy(tiny_model("qwen2", seed=0), prompt, 16)
    cost = CostModel(dict(BOUND_AT_8), {1: 45.0}, alpha=0.2, source="measured")
    result, records, draft, _ = _on_draft_service(SharedState(cost=cost, shared_compute=True), prompt, 16)
    assert result.tokens == reference
    assert draft.starts == [len(prompt) + 1]  # opened by round 2, with round 1's token
    assert [r.fallback for r in records[:2]] == ["cost", "draft_opening"] and records[2].drafted
    assert cost.verify.observations == len(records) - 2  # round 1: no forward; round 2: beside the prefill


def test_the_draft_queue_prices_a_step_under_load_on_its_own_device_only():
    """SharedState.observe_draft_queue and LoadedCost.queue_factor, by the numbers: at load 4 a reply
    of 300 ms for steps D prices at 60 ms is a queue share of (300 / 60 - 1) / 3 = 4/3; one
    observation moves draft_queue 0.3 of the way (0.4), so a step costs D * (1 + 0.4 * 3) = 2.2 D.
    A timeout is a lower bound: one under the current share changes nothing. At load 1 nothing is
    learnt and planning uses D itself; a draft sharing the target's compute keeps its D * load."""
    from orchestrator.planning.cost_model import LoadedCost

    cost = CostModel(dict(BOUND_AT_8), {1: 20.0}, alpha=0.0, source="measured")
    shared = SharedState(cost=cost, load=4.0)
    assert shared.queue_learns() and not SharedState(cost=cost, load=1.2).queue_learns()
    shared.observe_draft_queue(300.0, 60.0)
    assert shared.draft_queue == pytest.approx(0.4)
    assert shared.planning_cost().draft_step_ms(1) == pytest.approx(20.0 * 2.2)
    shared.observe_draft_queue(80.0, 60.0, lower_bound=True)  # share 1/9 < 0.4: no news
    assert shared.draft_queue == pytest.approx(0.4)
    shared.observe_draft_queue(1260.0, 60.0, lower_bound=True)  # share 20/3 > 0.4: raised
    assert shared.draft_queue == pytest.approx(0.4 + 0.3 * (20 / 3 - 0.4))
    shared.observe_draft_queue(60.0, 600.0)  # faster than D: share 0, the queue drains
    assert shared.draft_queue == pytest.approx(0.7 * (0.4 + 0.3 * (20 / 3 - 0.4)))
    shared.load = 1.0
    assert shared.planning_cost() is cost  # alone: no queue
    assert LoadedCost(cost, 4, shared_compute=True, draft_queue=5.0).draft_step_ms(1) == 80.0  # D * load


@pytest.mark.parametrize("delay_s", [0.0, 0.5], ids=["answers-in-time", "past-its-deadline"])
def test_a_draft_past_its_deadline_under_load_prices_itself_out(delay_s, monkeypatch):
    """Load 4 (sessions per verify forward), verification memory-bound (V(4) 58 ms, V(8) 60 ms, the
    figures of BOUND_AT_8 / 5), a draft on its own device that D prices at 5 ms a step, deadline
    0.2 s, re-open after 0.01 s. A draft that answers in time drafts most rounds. One whose replies
    take 0.5 s times out; the timeout is a lower bound on the queue share of the step the plan paid
    for ((200 / 5 - 1) / 3 = 13, clamped to 8): draft_queue 2.4, a step priced at 5 * (1 + 2.4 * 3)
    = 41 ms, past the 33 ms where 1.6 expected tokens in D + V(8) stop beating 1 in V(4). From then
    on the rounds run plain for "cost", not a timeout every other round that re-opens the draft
    each time. Either way D itself learns nothing under load (its alpha is 0.2 here): the replies'
    time beyond D is the queue's. Output = target alone."""
    import orchestrator.loop.controller as controller_module
    from orchestrator.loop.controller import RoundController, sync_worker
    from specdec.config import FallbackConfig

    monkeypatch.setattr(controller_module, "FRESH_DRAFT_S_PER_TOKEN", 0.0)  # no prefill allowance: 0.2 s each
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=97)
    n = 40
    reference = hf_greedy(model, prompt, n)
    scaled = {rows: ms / 5 for rows, ms in BOUND_AT_8.items()}
    cost = CostModel(scaled, {1: 5.0}, alpha=0.0, source="measured")
    cost.draft_step.alpha = 0.2  # D could learn (V stays scripted)
    shared = SharedState(cost=cost)
    factory = lambda s, *_: CostAwareControl(s, shared, FallbackConfig(reconnect_s=0.01),  # noqa: E731
                                             ngram_tokens=0, probe_every=1000)
    draft = SlowPropose(model, delay_s)
    ctl = RoundController(sync_worker(ReportsBatch(TargetRuntime(model), 4)), draft, [], CONTEXT,
                          control_factory=factory, draft_deadline_s=0.2)
    records = []
    result = asyncio.run(ctl.generate(GenerationRequest(prompt, max_new_tokens=n, spec=CHAIN4),
                                      on_round=records.append))
    assert result.tokens == reference
    assert shared.load == 4.0
    assert cost.draft_step.scale == 1.0 and cost.draft_step.observations == 0  # D learnt nothing under load
    if delay_s == 0.0:
        assert sum(1 for r in records if r.drafted) >= len(records) // 2
        return
    assert draft.proposes == 1  # then no round plans a draft
    assert shared.draft_queue == pytest.approx(2.4)
    assert [r.fallback for r in records[-10:-1]] == ["cost"] * 9  # the last round: budget for the bonus only


def test_a_congested_draft_is_not_opened_at_a_new_requests_start():
    """On its own device the draft opens beside the target's prefill, unless other requests run and
    the queue prices drafting out for a new request (defer_draft_open): opening it would only add a
    prefill to the queue. Same costs as above (break-even at a 33 ms step)."""
    scaled = {rows: ms / 5 for rows, ms in BOUND_AT_8.items()}
    shared = SharedState(cost=CostModel(scaled, {1: 5.0}, alpha=0.0, source="measured"), load=4.0)
    control = CostAwareControl(CHAIN4, shared, ngram_tokens=0)
    assert not control.defer_draft_open(others=3)  # 5 ms a step: drafting pays
    shared.draft_queue = 2.4  # 41 ms a step
    assert control.defer_draft_open(others=3)
    assert not control.defer_draft_open(others=0)  # alone now: the load of a past burst is stale
    shared.load = 1.0  # alone: no queue
    assert not control.defer_draft_open(others=3)


def test_on_shared_compute_every_request_opens_its_draft_at_its_first_drafted_round():
    """Draft on the target's hardware, no load reported yet (the first rounds): of three requests
    started together on one controller, none opens its draft at its start, the first one (alone in
    flight when it opened) included: a draft service prefills on Start, beside the target's Prefill,
    and on shared compute that delays the first token (no draft prefill on the compute the target
    prefills need). Each opens at its first drafted round (round 2: the first round is plain), with
    the prompt and round 1's token. Each request's output is the target's own greedy tokens."""
    from orchestrator.loop.controller import RoundController, sync_worker

    model = tiny_model("qwen2", seed=0)
    prompts = [random_prompt(seed=s, length=12 + s) for s in (1, 2, 3)]

    class CountingDraft(DraftRuntime):
        def __init__(self, model):
            super().__init__(model)
            self.starts: list[int] = []

        def start(self, session_id, prompt_ids, *args, **kwargs):
            self.starts.append(len(prompt_ids))
            return super().start(session_id, prompt_ids, *args, **kwargs)

    draft = CountingDraft(model)
    shared = SharedState(cost=CostModel(dict(BOUND_AT_8), {1: 45.0}, alpha=0.0), shared_compute=True)
    factory = lambda s, *_: CostAwareControl(s, shared, ngram_tokens=0, probe_every=1000)  # noqa: E731
    ctl = RoundController(sync_worker(TargetRuntime(model)), sync_worker(draft), [], CONTEXT, control_factory=factory)

    async def run():
        return await asyncio.gather(*(ctl.generate(GenerationRequest(p, max_new_tokens=6, spec=CHAIN4))
                                      for p in prompts))

    results = asyncio.run(run())
    for prompt, result in zip(prompts, results):
        assert result.tokens == hf_greedy(model, prompt, 6)
    assert draft.starts == [len(p) + 1 for p in prompts]  # the first at its start before 2026-12-04: len(prompts[0])
    assert ctl.running == 0


def test_a_timeout_is_a_bounded_lower_bound_on_d():
    """Alone (load 1) a proposal past its deadline moves D through the clamped moving average only:
    2 s for 4 steps D prices at 45 ms (11x) moves the scale by 1 + 0.2 * (2 - 1) = 1.2, never sets
    it to 11x; a deadline under what D already predicts says nothing. With the draft on the target's
    hardware under load 4, the wait is divided by the load (LoadedCost prices D * load already):
    0.3 s is then 75 ms for 180 predicted, no news, where alone it raises D (by 1 + 0.2 * (300 / 180 - 1))."""
    for shared_compute, load, waited_s, scale in [(False, 1.0, 2.0, 1.2), (False, 1.0, 0.1, 1.0),
                                                  (True, 4.0, 0.3, 1.0), (True, 1.0, 0.3, 1 + 0.2 * (300 / 180 - 1))]:
        cost = CostModel(dict(BOUND_AT_8), {1: 45.0}, alpha=0.2, source="measured")
        shared = SharedState(cost=cost, shared_compute=shared_compute, load=load)
        control = CostAwareControl(CHAIN4, shared, ngram_tokens=0)
        control.gamma, control.state.planned_spec, control.state.drafted_depth = 4, CHAIN4, 4  # it planned 4 steps
        control.draft_timed_out(waited_s)
        assert cost.draft_step.scale == pytest.approx(scale), (shared_compute, load, waited_s)
        assert shared.draft_queue == 0.0


def test_an_adopted_aheads_reply_time_teaches_the_queue_not_d():
    """Pipelining under load, draft on its own device: a round whose tree came from an ahead has no
    in-line draft time, but the ahead's wall time (reply_s) shows the queue: 0.6 s for 2 steps D
    prices at 100 ms (load 4) is a share of (600 / 100 - 1) / 3 = 5/3, draft_queue 0.5 after one.
    Alone (load 1) the same round teaches neither (an ahead is off the critical path)."""
    from orchestrator.planning.shaping import ShapedTree
    from specdec.tree import DraftTree

    for load, queue in [(4.0, 0.5), (1.0, 0.0)]:
        cost = CostModel(dict(BOUND_AT_8), {1: 50.0}, alpha=0.2, source="measured")
        shared = SharedState(cost=cost, load=load)
        control = CostAwareControl(CHAIN4, shared, ngram_tokens=0)
        control.gamma, control.state.planned_spec, control.state.draft_warm, control.state.rounds = 2, TreeSpec.chain(2), True, 3
        tree = DraftTree((5, 6), (-1, 0))
        control.observe(RoundObservation(ShapedTree.of(tree), [0, 1], 0.3, None, 0.0, tree, batch_size=int(load),
                                         batch_rows=3 * int(load), reply_s=0.6))
        assert shared.draft_queue == pytest.approx(queue)
        assert cost.draft_step.observations == 0  # D learns from in-line replies only


class ReportsDraftCall(OracleDraft):
    """The oracle draft, each proposal's reply taking ``wall_s`` seconds while reporting a draft call
    of ``call_ms`` (what the draft service's reply says: DraftClient.last_forward_ms): the rest is
    the wait a reply spends behind other sessions' proposals and prefills, and transport."""

    def __init__(self, *args, wall_s: float, call_ms: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.wall_s, self.call_ms = wall_s, call_ms

    def propose(self, session_id, spec, max_depth):
        time.sleep(self.wall_s)
        return super().propose(session_id, spec, max_depth)

    def last_forward_ms(self, session_id: str) -> float:
        return self.call_ms


@pytest.mark.parametrize("source", ["forward", "reply"])
def test_draft_steps_are_priced_from_the_draft_call_not_the_reply_wait(source):
    """CostAwareConfig.draft_cost_from: with "forward" D learns from the draft call's own time that the
    reply reports (as V learns the target forward's), with "reply" (the default) from the reply's
    wall time, the wait behind other sessions' proposals and prefills and transport included. A
    perfect draft whose 4-step proposals are answered after 200 ms of wall time (50 ms a step) but
    report a 4 ms call (1 ms a step): from D(1) = 30 ms the learnt step cost falls below 20 ms with
    "forward" and rises above 40 ms with "reply". Output is the target's own either way."""
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=131)
    n = 40
    reference = hf_greedy(model, prompt, n + 8)
    from orchestrator.planning.cost_aware import CostAwareFactory
    from specdec.config import CostAwareConfig, FallbackConfig

    assert CostAwareConfig().draft_cost_from == "reply" and not SharedState().draft_cost_from_forward
    shared = SharedState(cost=CostModel({1: 100.0, 64: 100.001}, {1: 30.0}, alpha=0.2, source="measured"))
    shared.cost.verify.alpha = 0.0  # V scripted (the tiny model's forwards take ~1 ms); D learns
    CostAwareFactory(CostAwareConfig(draft_cost_from=source), FallbackConfig(), shared)
    assert shared.draft_cost_from_forward is (source == "forward")
    factory = lambda s: CostAwareControl(s, shared, max_gamma=4, ngram_tokens=0, probe_every=1000)  # noqa: E731
    draft = ReportsDraftCall(prompt, reference, agree=8, wall_s=0.2, call_ms=4.0)
    _, result, records = generate(model, draft, prompt, CHAIN4, factory, n=n)
    assert result.tokens == reference[:n]
    assert sum(1 for r in records if r.drafted) >= 7  # the first drafted round (the draft's prefill) teaches nothing
    step = shared.cost.draft_step_ms(1)
    if source == "forward":
        assert step < 20.0, step
    else:
        assert step > 40.0, step


@pytest.mark.parametrize("given, field", [
    ({"verify_ms": {1: 10, 8: 20}}, "draft_step_ms: required with verify_ms"),
    ({"draft_step_ms": {1: 3, 4: 5}}, "verify_ms: required with draft_step_ms"),
    ({"verify_ms": {1: 10}, "draft_step_ms": {1: 3, 4: 5}}, "verify_ms"),
    ({"verify_ms": {0: 10, 8: 20}, "draft_step_ms": {1: 3, 4: 5}}, "verify_ms.0"),
    ({"verify_ms": {1: 10, 8: 20}, "draft_step_ms": {1: -3, 4: 5}}, "draft_step_ms.1"),
])
def test_given_cost_figures_are_both_or_neither_two_points_positive(given, field):
    """front.cost_aware.verify_ms / draft_step_ms: refused with the field named."""
    with pytest.raises(ValidationError, match=re.escape(field)):
        CostAwareConfig.model_validate(given)
    assert CostAwareConfig.model_validate({"verify_ms": {1: 10, 8: 20}, "draft_step_ms": {1: 3, 4: 5}}).verify_ms == {1: 10.0, 8: 20.0}
