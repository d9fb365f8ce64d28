"""The fixed control inside the real round loop (RoundController + FixedControl), with scripted drafts
and the in-process target: no Ray, no gRPC.

Criteria: greedy output always equals target-only greedy (HF generate); every round drafts the request's
tree (cut only by the token budget), whatever the draft's acceptance; a draft that fails mid-request is
dropped, the request continues without it and speculation comes back after the reconnect delay.
"""

from __future__ import annotations

import asyncio

import pytest

from draft_service.runtime import DraftRuntime
from orchestrator.planning.control import FixedControl
from orchestrator.loop.controller import DraftUnavailableError, GenerationRequest, RoundController, sync_worker
from specdec.config import FallbackConfig
from specdec.interfaces import DraftWorker
from specdec.tree_spec import DEFAULT_SPEC, TreeSpec
from target_service.runtime import TargetRuntime
from tests.conftest import OracleDraft, hf_greedy, perturbed_copy, random_prompt, tiny_model

FALLBACK = FallbackConfig(reconnect_s=0.05)


def run(target_model, draft, prompt, n, spec=DEFAULT_SPEC):
    """Generate n tokens; returns (tokens, stats, per-round records)."""
    records = []
    ctl = RoundController(sync_worker(TargetRuntime(target_model)), sync_worker(draft), [], 10_000,
                          control_factory=lambda s: FixedControl(s, FALLBACK))
    result = asyncio.run(ctl.generate(GenerationRequest(prompt, n, spec=spec), on_round=records.append))
    return result.tokens, result.stats, records


@pytest.fixture(scope="module")
def target_model():
    return tiny_model(seed=0)


def test_always_right_draft_gets_the_whole_tree_every_round(target_model):
    prompt = random_prompt(1, 9)
    reference = hf_greedy(target_model, prompt, 80)
    draft = OracleDraft(prompt, reference, agree=1000)
    tokens, stats, records = run(target_model, draft, prompt, 60, spec=TreeSpec.chain(2))
    assert tokens == reference[:60]
    # 2 draft tokens + the bonus a round: 20 rounds, each the whole chain, never deeper
    assert [(r.depth, r.accepted, r.gamma) for r in records] == [(2, 2, 2)] * 20
    assert stats.fallback_rounds == 0 and stats.final_gamma == 2


def test_always_wrong_draft_keeps_speculating_with_the_same_tree(target_model):
    prompt = random_prompt(2, 7)
    reference = hf_greedy(target_model, prompt, 80)
    draft = OracleDraft(prompt, reference, agree=0)
    tokens, stats, records = run(target_model, draft, prompt, 40, spec=TreeSpec.chain(3))
    assert tokens == reference[:40]
    # one token (the bonus) a round; the chain of 3 until the budget cuts it (3 tokens left: 2 levels, ...)
    assert [r.proposed for r in records] == [3] * 37 + [2, 1, 0]
    assert all(r.fallback is None and r.gamma == 3 for r in records)
    assert stats.fallback_rounds == 0 and stats.accepted_tokens == 0


def test_partial_agreement_keeps_the_tree_and_output_exact(target_model):
    for agree in (1, 2, 3):
        prompt = random_prompt(10 + agree, 6)
        reference = hf_greedy(target_model, prompt, 80)
        tokens, stats, records = run(target_model, OracleDraft(prompt, reference, agree=agree), prompt, 50)
        assert tokens == reference[:50]
        spec_rounds = [r for r in records if r.proposed]
        assert all(r.accepted == min(agree, r.depth) for r in spec_rounds)
        assert all(r.gamma == DEFAULT_SPEC.gamma for r in records)
        assert all(r.depth == min(DEFAULT_SPEC.gamma, 50 - done - 1)
                   for r, done in zip(records, _done_before(records)))


def _done_before(records):
    """Tokens committed before each round."""
    done, out = 0, []
    for r in records:
        out.append(done)
        done += len(r.tokens)
    return out


class FlakyDraft(DraftWorker):
    """A real DraftRuntime that fails (DraftUnavailableError) on the proposals numbered in ``fail_on``."""

    def __init__(self, inner, fail_on):
        self.inner = inner
        self.fail_on = set(fail_on)
        self.calls = 0
        self.starts = []

    def start(self, sid, prompt_ids, sampling):
        self.starts.append(len(prompt_ids))
        return self.inner.start(sid, prompt_ids, sampling)

    def propose(self, sid, spec, max_depth):
        self.calls += 1
        if self.calls in self.fail_on:
            raise DraftUnavailableError("scripted failure")
        return self.inner.propose(sid, spec, max_depth)

    def commit(self, sid, tokens, accepted):
        return self.inner.commit(sid, tokens, accepted)

    def release(self, sid):
        return self.inner.release(sid)


def test_draft_failure_falls_back_and_reconnects(target_model):
    prompt = random_prompt(4, 8)
    reference = hf_greedy(target_model, prompt, 60)
    draft = FlakyDraft(DraftRuntime(perturbed_copy(target_model, 1, 0.02)), fail_on={3})
    records = []
    ctl = RoundController(sync_worker(TargetRuntime(target_model)), sync_worker(draft), [], 10_000,
                          control_factory=lambda s: FixedControl(s, FALLBACK))

    async def go():
        async def slow_round(record):  # give the reconnect delay time to pass during plain rounds
            records.append(record)
            await asyncio.sleep(0.02)

        return await ctl.generate(GenerationRequest(prompt, 50, spec=DEFAULT_SPEC), on_round=slow_round)

    result = asyncio.run(go())
    assert result.tokens == reference[:50]
    reasons = [r.fallback for r in records]
    assert "draft_unavailable" in reasons
    first_plain = reasons.index("draft_unavailable")
    assert records[first_plain - 1].proposed > 0  # speculated before the failure
    assert any(r.proposed > 0 for r in records[first_plain + 1:]), "speculation never came back"
    # the re-opened draft session started from every token committed so far (prompt + generated)
    assert len(draft.starts) == 2 and draft.starts[1] > len(prompt)
    assert result.stats.fallback_rounds >= 1


def test_a_control_with_only_the_required_hooks_runs_a_draft_session(target_model):
    """docs/design.md "A control": spec, speculate and draft_failed are required, every other hook a no-op by
    default; such a control (no FallbackPolicy of its own) runs a request whose draft reports a context limit."""
    from orchestrator.planning.control import Control

    class Minimal(Control):
        def __init__(self, spec):
            self.gamma, self.reason, self.failures = spec.gamma, None, []

        def spec(self, base):
            return base

        def speculate(self, now, committed_len, depth):
            return True

        def draft_failed(self, now):
            self.failures.append(now)

    prompt = random_prompt(3, 8)
    made = []
    ctl = RoundController(sync_worker(TargetRuntime(target_model)), sync_worker(DraftRuntime(perturbed_copy(
        target_model, 1, 0.02))), [], 10_000, control_factory=lambda s: made.append(Minimal(s)) or made[-1],
        draft_context_limit=64)
    result = asyncio.run(ctl.generate(GenerationRequest(prompt, 12, spec=TreeSpec.chain(2))))
    assert result.tokens == hf_greedy(target_model, prompt, 12)
    assert result.stats.proposed_tokens > 0 and made[0].failures == []
