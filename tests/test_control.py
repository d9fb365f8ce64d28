"""Per-request control policies (orchestrator/planning/control.py): DynamicGamma, FallbackPolicy, RequestControl.

Pure unit tests: scripted round outcomes, an injected clock, fresh Prometheus registries.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from orchestrator.planning.control import DynamicGamma, FallbackPolicy, RequestControl
from orchestrator.loop.metrics import SpecMetrics
from specdec.config import DynamicGammaConfig, FallbackConfig
from specdec.tree_spec import DEFAULT_SPEC, SEED_SPEC, TreeSpec

WIDE_SPEC = TreeSpec(gamma=1, topKSpec=[[100]], topHead=[1])  # 100 nodes a row: 5 rows fit in 512


class Clock:
    """A settable clock (seconds)."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def sample(metrics: SpecMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


# --------------------------------------------------------------------------- DynamicGamma


def test_dynamic_gamma_always_right_rises_to_max_and_stays():
    dg = DynamicGamma(SEED_SPEC, DynamicGammaConfig(min_gamma=1, max_gamma=6))
    seen = []
    for _ in range(6):
        depth = dg.gamma  # the draft grew the full tree and every level was accepted
        seen.append(dg.update(depth, depth))
    assert seen == [4, 5, 6, 6, 6, 6]
    assert dg.spec.gamma == 6 and dg.spec.num_nodes == 18


def test_dynamic_gamma_always_wrong_falls_to_min_and_stays():
    dg = DynamicGamma(DEFAULT_SPEC, DynamicGammaConfig(min_gamma=1, max_gamma=8))
    assert [dg.update(dg.gamma, 0) for _ in range(4)] == [2, 1, 1, 1]
    assert dg.spec.top_k_spec == ((3,),)


def test_dynamic_gamma_mixed_sequence():
    dg = DynamicGamma(DEFAULT_SPEC, DynamicGammaConfig(min_gamma=2, max_gamma=5))
    rounds = [(3, 3), (4, 2), (3, 3), (4, 4), (5, 5), (5, 4), (4, 0), (3, 1), (2, 0)]
    assert [dg.update(d, a) for d, a in rounds] == [4, 3, 4, 5, 5, 4, 3, 2, 2]


def test_dynamic_gamma_shallow_tree_fully_accepted_keeps_gamma():
    dg = DynamicGamma(DEFAULT_SPEC)  # gamma 3
    assert dg.update(2, 2) == 3      # tree cut to depth 2 (budget): no evidence about depth 4
    assert dg.update(0, 0) == 3      # no tree at all
    assert dg.update(3, 3) == 4


def test_dynamic_gamma_start_is_clamped_and_disabled_is_fixed():
    assert DynamicGamma(SEED_SPEC, DynamicGammaConfig(min_gamma=4, max_gamma=8)).gamma == 4
    assert DynamicGamma(SEED_SPEC, DynamicGammaConfig(min_gamma=1, max_gamma=2)).gamma == 2
    off = DynamicGamma(SEED_SPEC, DynamicGammaConfig(enabled=False, min_gamma=4, max_gamma=8))
    assert (off.gamma, off.update(3, 3), off.update(3, 0)) == (3, 3, 3)
    assert off.spec is SEED_SPEC


def test_dynamic_gamma_max_is_capped_by_node_limit():
    dg = DynamicGamma(WIDE_SPEC, DynamicGammaConfig(min_gamma=1, max_gamma=8))
    assert dg.max_gamma == 5
    assert [dg.update(dg.gamma, dg.gamma) for _ in range(6)] == [2, 3, 4, 5, 5, 5]
    assert dg.spec.num_nodes == 500
    with pytest.raises(ValueError, match="dynamic_gamma.min_gamma: 6 exceeds"):
        DynamicGamma(WIDE_SPEC, DynamicGammaConfig(min_gamma=6, max_gamma=8))


def test_dynamic_gamma_rejects_impossible_counts():
    dg = DynamicGamma(DEFAULT_SPEC)
    for depth, acc in ((2, 3), (-1, 0), (3, -1)):
        with pytest.raises(ValueError, match="accepted_length"):
            dg.update(depth, acc)
    assert dg.gamma == 3


# --------------------------------------------------------------------------- FallbackPolicy


def drive(policy: FallbackPolicy, accepted_per_round, proposed: int = 5, committed_len: int = 10):
    """Run rounds; accepted_per_round[i] is what a speculative round i would accept."""
    decisions = []
    for acc in accepted_per_round:
        go = policy.speculate(0.0, committed_len)
        decisions.append(go)
        if go:
            policy.record(proposed, acc)
    return decisions


def test_fallback_always_wrong_engages_after_full_window_and_probes():
    policy = FallbackPolicy(FallbackConfig(window=4, min_acceptance=0.1, probe_every=3))
    T, F = True, False
    assert drive(policy, [0] * 15) == [T, T, T, T, F, F, F, T, T, T, T, F, F, F, T]
    assert policy.fallback_rounds == {"low_acceptance": 6, "draft_unavailable": 0, "draft_context_limit": 0, "cost": 0,
                                     "draft_opening": 0}
    assert policy.probes == 2
    assert policy.reason is None  # the last round was a probe


def test_fallback_recovers_after_probe():
    policy = FallbackPolicy(FallbackConfig(window=4, min_acceptance=0.1, probe_every=3))
    # bad for the first window, good from the probe on
    decisions = drive(policy, [0] * 4 + [3] * 20)
    assert decisions == [True] * 4 + [False] * 3 + [True] * 17
    assert policy.fallback_rounds["low_acceptance"] == 3
    assert policy.acceptance_rate == 3 / 5


def test_fallback_window_slides_and_threshold_is_strict():
    policy = FallbackPolicy(FallbackConfig(window=4, min_acceptance=0.1, probe_every=3))
    # window [2,0,0,0] of 5 each: 2/20 = 0.1, not below 0.1; then [0,0,0,0]: 0 -> off
    assert drive(policy, [2, 0, 0, 0, 0, 0]) == [True] * 5 + [False]
    assert policy.reason == "low_acceptance"
    fresh = FallbackPolicy(FallbackConfig(window=4, min_acceptance=0.1))
    assert drive(fresh, [0, 0, 0]) == [True] * 3  # 3 rounds: the window is not full yet


def test_fallback_draft_failure_then_reconnect_with_injected_clock():
    clock = Clock(10.0)
    policy = FallbackPolicy(FallbackConfig(reconnect_s=2.0), clock=clock)
    assert policy.speculate(None, 10) is True
    policy.draft_failed()            # at t = 10.0
    clock.t = 11.0
    assert policy.speculate(None, 10) is False and policy.reason == "draft_unavailable"
    clock.t = 11.999
    assert policy.speculate(None, 10) is False
    clock.t = 12.0
    assert policy.speculate(None, 10) is True and policy.reason is None   # the retry
    policy.draft_failed()            # the retry failed too: another reconnect_s
    assert policy.speculate(None, 10) is False
    assert policy.speculate(14.0, 10) is True  # explicit now overrides the clock
    assert policy.fallback_rounds["draft_unavailable"] == 3
    assert policy.draft_failures == 2


def test_fallback_slow_draft_counts_as_failure():
    policy = FallbackPolicy(FallbackConfig(draft_deadline_ms=2000.0, reconnect_s=1.0))
    assert policy.deadline_s == 2.0
    policy.record(5, 2, now=0.0, draft_s=2.0)    # at the deadline: fine
    assert policy.speculate(0.5, 10) is True
    policy.record(5, 2, now=1.0, draft_s=2.001)  # over it
    assert policy.speculate(1.5, 10) is False and policy.reason == "draft_unavailable"
    assert policy.speculate(2.0, 10) is True
    assert policy.window.accepted == 4  # both rounds still count for acceptance


def test_fallback_context_limit():
    policy = FallbackPolicy(FallbackConfig(), draft_context_limit=100)
    assert policy.context_room(97) == 3
    assert policy.speculate(0.0, 97, depth=3) is True
    assert policy.speculate(0.0, 98, depth=3) is False and policy.reason == "draft_context_limit"
    assert policy.speculate(0.0, 98, depth=2) is True
    assert policy.speculate(0.0, 100, depth=1) is False
    assert policy.fallback_rounds["draft_context_limit"] == 2
    assert FallbackPolicy().context_room(10**9) is None
    with pytest.raises(ValueError, match="draft_context_limit"):
        FallbackPolicy(draft_context_limit=0)


def test_fallback_reason_precedence_and_probe_counts_only_low_rounds():
    policy = FallbackPolicy(FallbackConfig(window=1, min_acceptance=0.5, probe_every=2, reconnect_s=1.0),
                            draft_context_limit=50)
    assert policy.speculate(0.0, 10)
    policy.record(4, 0)                      # window of 1 is full and low
    policy.draft_failed(0.0)
    assert policy.speculate(0.1, 49, depth=3) is False and policy.reason == "draft_context_limit"
    assert policy.speculate(0.2, 10) is False and policy.reason == "draft_unavailable"
    assert policy.speculate(1.0, 10) is False and policy.reason == "low_acceptance"
    assert policy.speculate(1.1, 10) is False and policy.reason == "low_acceptance"
    assert policy.speculate(1.2, 10) is True and policy.probes == 1
    assert policy.fallback_rounds == {"low_acceptance": 2, "draft_unavailable": 1, "draft_context_limit": 1, "cost": 0,
                                     "draft_opening": 0}


def test_fallback_metrics_and_bad_input():
    metrics = SpecMetrics(CollectorRegistry())
    policy = FallbackPolicy(FallbackConfig(window=2, min_acceptance=0.2, probe_every=5), metrics=metrics,
                            draft_context_limit=20)
    drive(policy, [0] * 6)                      # 2 speculative, then 4 low-acceptance plain rounds
    policy.speculate(0.0, 20)                   # context limit
    assert sample(metrics, "specdec_fallback_rounds_total", reason="low_acceptance") == 4
    assert sample(metrics, "specdec_fallback_rounds_total", reason="draft_context_limit") == 1
    assert sample(metrics, "specdec_fallback_rounds_total", reason="draft_unavailable") == 0
    with pytest.raises(ValueError):
        policy.record(2, 3)
    with pytest.raises(ValueError):
        policy.speculate(0.0, 5, depth=0)


# --------------------------------------------------------------------------- RequestControl


def test_request_control_scripted_rounds():
    clock = Clock(0.0)
    ctl = RequestControl(DEFAULT_SPEC, DynamicGammaConfig(min_gamma=1, max_gamma=5),
                         FallbackConfig(window=3, min_acceptance=0.1, probe_every=2, reconnect_s=1.0), clock=clock)
    gammas, decisions = [], []
    # always right: the tree reaches gamma, every level accepted (DEFAULT_SPEC: gamma + 2 nodes)
    for _ in range(4):
        decisions.append(ctl.speculate(None, 10, ctl.gamma))
        ctl.record(ctl.gamma, ctl.gamma + 2, ctl.gamma)
        gammas.append(ctl.gamma)
    assert gammas == [4, 5, 5, 5] and all(decisions)
    assert ctl.spec(DEFAULT_SPEC).top_k_spec == ((3,), (1,), (1,), (1,), (1,))
    # always wrong: gamma falls by one a round; after a full window of 3 low rounds speculation stops
    for _ in range(3):
        assert ctl.speculate(None, 10)
        ctl.record(ctl.gamma, ctl.gamma + 2, 0)
        gammas.append(ctl.gamma)
    assert gammas[4:] == [4, 3, 2]
    assert [ctl.speculate(None, 10) for _ in range(3)] == [False, False, True]   # 2 plain rounds, then a probe
    assert ctl.reason is None and ctl.fallback_rounds["low_acceptance"] == 2
    ctl.draft_failed()
    assert ctl.speculate(None, 10) is False and ctl.reason == "draft_unavailable"
    clock.t = 1.0
    assert ctl.speculate(None, 10) is True
    with pytest.raises(ValueError):
        ctl.record(2, 1, 2)      # accepted > proposed
