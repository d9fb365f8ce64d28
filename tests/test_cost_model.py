"""The measured cost model: piecewise-linear V(n) / D(p) with online correction (orchestrator.planning.cost_model)."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.planning.cost_model import CostModel, LatencyCurve, MeasurementDisturbed, measure_curve, measure_service_costs
from specdec.interfaces import DraftWorker, VerifyResult


def test_worked_example_interpolation_and_extrapolation():
    curve = LatencyCurve({1: 285.0, 8: 449.0})
    assert curve(4) == pytest.approx(285 + 164 * 3 / 7)
    assert curve(1) == 285.0 and curve(8) == 449.0
    assert curve(15) == pytest.approx(449 + 164)  # the last segment's slope past the end


def test_observation_scales_the_whole_curve():
    curve = LatencyCurve({1: 285.0, 8: 449.0}, alpha=0.5)
    curve.observe(1, 285.0)  # the first observation sets the scale (here: 1)
    predicted = curve(4)
    curve.observe(4, predicted * 1.2)
    assert curve.scale == pytest.approx(1.1)
    assert curve(4) == pytest.approx(predicted * 1.1) and curve(1) == pytest.approx(285 * 1.1)
    assert curve.snapshot() == {1: pytest.approx(313.5), 8: pytest.approx(493.9)}


def test_repeated_observations_converge_and_outliers_are_bounded():
    curve = LatencyCurve({1: 100.0, 16: 400.0}, alpha=0.3)
    curve.observe(1, 1000.0)
    assert curve(1) == pytest.approx(1000.0)  # the first figure sets the scale, unclamped
    for _ in range(60):
        curve.observe(1, 150.0)
    assert curve(1) == pytest.approx(150.0, rel=1e-3)
    assert curve(16) == pytest.approx(600.0, rel=1e-3)  # the shape is kept
    before = curve(16)
    curve.observe(16, 1e9)  # one absurd figure moves the scale at most by alpha * (2 - 1)
    assert curve(16) == pytest.approx(before * 1.3)


def test_measured_points_never_decrease():
    """Out of order, the smaller size's figure is lowered (noise only slows forwards down): a
    disturbed V(1) must not flatten the curve up to the largest size it exceeds."""
    curve = LatencyCurve({1: 300.0, 4: 280.0, 8: 450.0})  # a noisy start-up measurement
    assert curve.points == {1: 280.0, 4: 280.0, 8: 450.0}
    assert curve(2) >= curve(1)
    flat = LatencyCurve({1: 132.0, 4: 99.0, 8: 128.0, 16: 190.0})  # V(1) measured in a slow second
    assert flat.points == {1: 99.0, 4: 99.0, 8: 128.0, 16: 190.0}
    assert flat(8) - flat(1) == pytest.approx(29.0)  # rows from 4 on still cost (raising gave V(1..8) all 132: rows free)


def test_bad_points_are_refused():
    with pytest.raises(ValueError, match="points"):
        LatencyCurve({})
    with pytest.raises(ValueError, match="points"):
        LatencyCurve({0: 10.0})


def test_round_observation_splits_draft_time_by_prediction():
    cost = CostModel({1: 100.0, 8: 200.0}, {1: 10.0, 4: 20.0}, alpha=1.0)
    cost.observe_round(rows=4, verify_s=cost.verify(4) / 1000, parents_per_step=[1, 4], draft_s=0.060)
    # predicted 30 ms for steps of 1 and 4 parents, observed 60: the draft curve doubles (alpha 1)
    assert cost.draft_step(1) == pytest.approx(20.0) and cost.draft_step(4) == pytest.approx(40.0)
    assert cost.round_ms(8, [1]) == pytest.approx(200.0 + 20.0 + cost.round_overhead_ms)
    snap = cost.snapshot()
    assert snap["verify_ms"] == {1: 100.0, 8: 200.0} and snap["draft_step_ms"][4] == 40.0


def test_measure_curve_times_each_size():
    calls = []
    out = measure_curve(calls.append, [1, 4], repeats=3)
    assert calls == [1, 4, 1, 4, 1, 4, 1, 4]  # a warm-up of each, then the sizes in turn, three timed runs each
    assert set(out) == {1, 4} and all(ms >= 0 for ms in out.values())


def test_measure_curve_survives_a_slow_start():
    """A disturbance over the first timed turn (here: the warm-ups and the next three calls take 500 ms
    more) costs each size one run of three, which the median drops: every size gets its own cost.
    Measured one size after the other, all three runs of size 1 fell in it (V(1) 586 ms)."""
    now = [0.0]
    calls = []

    def run(x):
        calls.append(x)
        now[0] += (80.0 + 6.0 * x + (500.0 if len(calls) <= 6 else 0.0)) / 1000

    out = measure_curve(run, [1, 4, 8], repeats=3, clock=lambda: now[0])
    assert out == {1: pytest.approx(86.0), 4: pytest.approx(104.0), 8: pytest.approx(128.0)}


def test_draft_costs_follow_the_verify_scale_until_observed():
    """Prior figures on a 10x faster machine: the draft is assumed 10x faster too until a draft step
    is timed (else a front with prior figures would think drafting never pays)."""
    cost = CostModel({1: 300.0, 8: 450.0}, {1: 45.0}, alpha=1.0)
    cost.observe_round(rows=1, verify_s=0.030, parents_per_step=[], draft_s=None)
    assert cost.verify(1) == pytest.approx(30.0)
    assert cost.draft_step_ms(1) == pytest.approx(4.5)
    cost.observe_round(rows=1, verify_s=0.030, parents_per_step=[1], draft_s=0.009)
    assert cost.draft_step_ms(1) == pytest.approx(9.0)  # now its own


def test_measured_points_are_not_reset_by_the_first_observation():
    """Start-up figures of this deployment: one slow first round (2x) moves the scale by alpha, where
    prior figures let it set the scale; the draft curve keeps its own measured scale."""
    cost = CostModel({1: 300.0, 8: 450.0}, {1: 45.0}, alpha=0.2, source="measured")
    cost.observe_round(rows=1, verify_s=0.600, parents_per_step=[], draft_s=None)
    assert cost.verify(1) == pytest.approx(300.0 * 1.2)  # ratio 2, weight 0.2
    assert cost.draft_step_ms(1) == pytest.approx(45.0)
    prior = CostModel({1: 300.0, 8: 450.0}, {1: 45.0}, alpha=0.2)
    prior.observe_round(rows=1, verify_s=0.030, parents_per_step=[], draft_s=None)
    assert prior.verify(1) == pytest.approx(30.0) and prior.draft_step_ms(1) == pytest.approx(4.5)


def test_a_measured_curve_far_off_at_its_first_observation_is_rescaled():
    """A start-up figure taken on a busy machine (here 10x off) is replaced by the first round's own."""
    curve = LatencyCurve({1: 4.5, 4: 6.0}, alpha=0.2, measured=True)
    curve.observe(1, 45.0)
    assert curve(1) == pytest.approx(45.0) and curve(4) == pytest.approx(60.0)


class _ScriptedWorkers:
    """Awaitable target and draft workers (the services' clients' methods) on one scripted clock:
    a verify of n rows takes 16 + 2n ms, its forward 10 + 2n ms of them (the reply says); a proposal takes 7 ms (its reply and catch-up row) plus
    its steps, the first 4 ms, each later one 3 + p ms where it expands p parents."""

    def __init__(self):
        self.now = 0.0
        self.calls: list[tuple] = []
        self.open: set[tuple[str, str]] = set()
        self.target, self.draft = self._Worker(self, "target"), self._Worker(self, "draft")

    class _Worker(DraftWorker):
        def __init__(self, script, kind):
            self.script, self.kind = script, kind

        async def start(self, sid, ids, sampling):
            assert sampling.greedy and len(ids) == 128 and max(ids) < 50
            self.script.open.add((self.kind, sid))

        async def verify(self, sid, tree):
            forward_ms = 10 + 2 * (len(tree.tokens) + 1)
            self.script.now += (forward_ms + 6.0) / 1000  # 6 ms transport and gather window
            return VerifyResult((), (), forward_ms=forward_ms)

        async def propose(self, sid, spec, max_depth):
            steps = [4.0] + [3.0 + heads for heads in spec.top_head[1:]]
            self.script.now += (7.0 + sum(steps[:max_depth])) / 1000

        async def commit(self, sid, *args):
            self.script.calls.append((self.kind, "commit", sid))

        async def release(self, sid):
            self.script.open.discard((self.kind, sid))


def test_measure_service_costs_times_awaitable_workers_and_releases_their_sessions():
    """Through awaitable workers (as the front measures the services): V(n) is each size's own
    forward time as the target reports it (not the 6 ms of transport around it: the rounds teach V
    the same figure), D(p) the per-step difference of proposals (the 7 ms every reply costs cancels)."""
    script = _ScriptedWorkers()

    async def main():
        return await measure_service_costs(script.target, script.draft, 50, clock=lambda: script.now)

    cost = asyncio.run(main())
    assert cost.source == "measured"
    assert cost.verify.points == {n: pytest.approx(10 + 2 * n) for n in (1, 4, 8, 16, 32)}
    assert cost.draft_step.points == {p: pytest.approx(3 + p) for p in (1, 2, 4, 8)}
    assert cost.verify.measured and cost.draft_step.measured
    assert script.open == set()  # both sessions released
    sids = {sid for _, _, sid in script.calls}
    assert len(sids) == 1 and next(iter(sids)).startswith("__cost_model__")


def test_a_start_up_verify_merged_with_other_sessions_is_run_again():
    """A target that merges every other verify with another session's (batch_size 2, a forward
    that takes 100 ms more): only the verifies that ran alone are V(n)'s."""
    script = _ScriptedWorkers()
    calls = []

    async def verify(sid, tree):
        calls.append(len(tree.tokens) + 1)
        merged = len(calls) % 2 == 1
        forward_ms = 10 + 2 * (len(tree.tokens) + 1) + (100 if merged else 0)
        script.now += forward_ms / 1000
        return VerifyResult((), (), batch_size=2 if merged else 1, forward_ms=forward_ms)

    script.target.verify = verify

    async def main():
        return await measure_service_costs(script.target, None, 50, rows=(1, 8), clock=lambda: script.now)

    cost = asyncio.run(main())
    assert cost.verify.points == {1: pytest.approx(12.0), 8: pytest.approx(26.0)}
    assert calls == [1, 1, 8, 8] * 4  # each run once merged, then again alone


def test_measure_service_costs_gives_up_on_a_call_that_never_answers():
    """A service that never answers a verify: TimeoutError after call_timeout_s, the call cancelled."""
    script = _ScriptedWorkers()
    cancelled = []

    async def hang(sid, tree):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(sid)
            raise

    script.target.verify = hang

    async def main():
        with pytest.raises(TimeoutError, match="verify"):
            await measure_service_costs(script.target, script.draft, 50, call_timeout_s=0.2)
        await asyncio.sleep(0.05)  # the cancellation reaches the hung call

    asyncio.run(main())
    assert len(cancelled) == 1 and script.open == set()  # the target's session released all the same


def test_a_draft_that_merges_every_proposal_fails_the_measurement_and_releases_both_sessions():
    """Proposals the draft service always shares with other sessions (its reply's batch_size 3):
    no D(p) from them: MeasurementDisturbed (the front then starts from the priors)."""
    script = _ScriptedWorkers()
    script.draft.last_batch_size = lambda sid: 3  # a sync method, as DraftClient's

    async def main():
        await measure_service_costs(script.target, script.draft, 50, clock=lambda: script.now)

    with pytest.raises(MeasurementDisturbed, match="draft proposal"):
        asyncio.run(main())
    assert script.open == set()


def test_a_start_that_fails_still_releases_its_session():
    """A start that timed out may have opened the session at the service: it is released all the same."""
    script = _ScriptedWorkers()
    original = script.draft.start

    async def start_then_fail(sid, ids, sampling):
        await original(sid, ids, sampling)
        raise TimeoutError("start: no reply within 60 s")

    script.draft.start = start_then_fail

    async def main():
        await measure_service_costs(script.target, script.draft, 50, clock=lambda: script.now)

    with pytest.raises(TimeoutError, match="start"):
        asyncio.run(main())
    assert script.open == set()


def test_a_cancelled_measurement_stops_its_thread_and_releases_the_session():
    """Cancelled while it runs (a front stopped during connect): the thread makes no call after the
    one in flight but the release."""
    script = _ScriptedWorkers()
    calls = []

    async def slow_verify(sid, tree):
        calls.append("verify")
        await asyncio.sleep(0.02)
        return VerifyResult((), ())

    script.target.verify = slow_verify

    async def main():
        task = asyncio.ensure_future(measure_service_costs(script.target, script.draft, 50))
        await asyncio.sleep(0.15)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        at_cancel = len(calls)
        await asyncio.sleep(0.3)  # the thread's in-flight call ends, then its next call stops it
        return at_cancel

    at_cancel = asyncio.run(main())
    assert 0 < at_cancel < 20  # cancelled mid-way (a full measurement makes 20 verifies)
    assert len(calls) <= at_cancel + 1 and script.open == set()


def test_the_session_fits_the_targets_context_and_tree_limits():
    """A target of 130 positions and 16 tree nodes: the context shrinks so that the session's growth
    (a token a verify, retries counted, and the largest chain) fits, the chains keep their sizes
    (their tokens do not come from the context), sizes past the tree limit are left out; a
    target of 80 positions leaves no room: ValueError (the front keeps the priors)."""
    script = _ScriptedWorkers()
    seen = []

    async def start(sid, ids, sampling):
        seen.append(len(ids))
        script.open.add(("target", sid))

    async def verify(sid, tree):
        assert len(tree.tokens) == len(tree.parents) and len(tree.tokens) <= 16
        script.now += (10 + 2 * (len(tree.tokens) + 1)) / 1000
        return VerifyResult((), ())

    script.target.start = start
    script.target.verify = verify

    async def main(limit):
        return await measure_service_costs(script.target, None, 50, clock=lambda: script.now,
                                           context_limit=limit, max_rows=17)

    cost = asyncio.run(main(130))
    assert seen == [130 - 4 * 4 * 4 - 16] and set(cost.verify.points) == {1, 4, 8, 16}
    with pytest.raises(ValueError, match="context_limit"):
        asyncio.run(main(80))
    assert script.open == set()
