"""Per-request control policies (orchestrator/planning/control.py): FallbackPolicy, FixedControl.

Pure unit tests: scripted round outcomes, an injected clock, fresh Prometheus registries.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from orchestrator.planning.control import FallbackPolicy, FixedControl
from orchestrator.loop.metrics import SpecMetrics
from specdec.config import FallbackConfig
from specdec.tree_spec import DEFAULT_SPEC


class Clock:
    """A settable clock (seconds)."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def sample(metrics: SpecMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


# --------------------------------------------------------------------------- FallbackPolicy


def test_fallback_low_acceptance_never_turns_speculation_off():
    """Acceptance is not a fallback reason (the cost-aware control prices it): 50 rounds of nothing accepted
    still speculate, and no plain round is counted."""
    policy = FallbackPolicy(FallbackConfig())
    for _ in range(50):
        assert policy.speculate(0.0, 10) is True and policy.reason is None
        policy.record(5, 0)
    assert policy.fallback_rounds == {"draft_unavailable": 0, "draft_context_limit": 0, "cost": 0, "draft_opening": 0}


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
    assert policy.draft_failures == 1


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


def test_fallback_reason_precedence():
    policy = FallbackPolicy(FallbackConfig(reconnect_s=1.0), draft_context_limit=50)
    assert policy.speculate(0.0, 10)
    policy.draft_failed(0.0)
    # both hold: the context limit is the reason, and that plain round is not the retry
    assert policy.speculate(0.1, 49, depth=3) is False and policy.reason == "draft_context_limit"
    assert policy.speculate(0.2, 10) is False and policy.reason == "draft_unavailable"
    assert policy.speculate(1.0, 10) is True and policy.reason is None
    assert policy.fallback_rounds == {"draft_unavailable": 1, "draft_context_limit": 1, "cost": 0, "draft_opening": 0}


def test_fallback_metrics_and_bad_input():
    metrics = SpecMetrics(CollectorRegistry())
    policy = FallbackPolicy(FallbackConfig(reconnect_s=1.0), metrics=metrics, draft_context_limit=20)
    policy.draft_failed(0.0)
    policy.speculate(0.5, 10)                   # draft unavailable
    policy.speculate(0.6, 10)                   # draft unavailable
    policy.speculate(1.0, 20)                   # context limit: 20 + 1 > 20
    assert policy.speculate(1.0, 10) is True    # the retry: no plain round
    assert sample(metrics, "specdec_fallback_rounds_total", reason="draft_unavailable") == 2
    assert sample(metrics, "specdec_fallback_rounds_total", reason="draft_context_limit") == 1
    assert sample(metrics, "specdec_fallback_rounds_total", reason="cost") == 0
    assert sample(metrics, "specdec_fallback_rounds_total", reason="low_acceptance") is None  # no such reason
    with pytest.raises(ValueError):
        policy.record(2, 3)
    with pytest.raises(ValueError):
        policy.speculate(0.0, 5, depth=0)


# --------------------------------------------------------------------------- FixedControl


def test_fixed_control_plays_the_tree_behind_the_fallback():
    clock = Clock(0.0)
    ctl = FixedControl(DEFAULT_SPEC, FallbackConfig(reconnect_s=1.0), clock=clock)
    # always wrong (DEFAULT_SPEC: 3 levels, 5 nodes): the same tree every round, speculation stays on
    for _ in range(20):
        assert ctl.speculate(None, 10, 8) is True and ctl.reason is None
        ctl.record(3, 5, 0)
    assert ctl.gamma == 3 and ctl.spec(DEFAULT_SPEC) is DEFAULT_SPEC
    ctl.draft_failed()
    assert ctl.speculate(None, 10, 8) is False and ctl.reason == "draft_unavailable"
    clock.t = 1.0
    assert ctl.speculate(None, 10, 8) is True and ctl.reason is None   # the retry after reconnect_s
    ctl.set_draft_context_limit(13)
    assert ctl.speculate(None, 10, 8) is True                           # the tree's 3 levels fit: 10 + 3 <= 13
    assert ctl.speculate(None, 11, 8) is False and ctl.reason == "draft_context_limit"
    assert ctl.speculate(None, 11, 2) is True                           # the budget's 2 levels fit: 11 + 2 <= 13
    assert ctl.fallback_rounds["draft_unavailable"] == 1 and ctl.fallback_rounds["draft_context_limit"] == 1
    with pytest.raises(ValueError):
        ctl.record(2, 1, 2)      # accepted > proposed


def test_fixed_control_slow_draft_reply_is_a_draft_failure():
    ctl = FixedControl(DEFAULT_SPEC, FallbackConfig(draft_deadline_ms=100.0, reconnect_s=1.0))
    ctl.record(3, 5, 2, now=0.0, draft_s=0.1)   # at the deadline: fine
    assert ctl.speculate(0.5, 10, 3) is True
    ctl.record(3, 5, 2, now=1.0, draft_s=0.2)   # over it: unavailable until 2.0
    assert ctl.speculate(1.5, 10, 3) is False and ctl.reason == "draft_unavailable"
    assert ctl.speculate(2.0, 10, 3) is True
