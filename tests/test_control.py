"""Per-request control policies (orchestrator/planning/control.py): FallbackPolicy, FixedControl.

Pure unit tests: scripted round outcomes and explicit times (seconds).
"""

from __future__ import annotations

import pytest

from orchestrator.planning.control import FallbackPolicy, FixedControl
from specdec.config import FallbackConfig
from specdec.tree_spec import DEFAULT_SPEC


# --------------------------------------------------------------------------- FallbackPolicy


def test_fallback_low_acceptance_never_turns_speculation_off():
    """Acceptance is not a fallback reason (the cost-aware control prices it): 50 rounds of nothing accepted
    still speculate."""
    ctl = FixedControl(DEFAULT_SPEC)
    for _ in range(50):
        assert ctl.speculate(0.0, 10, 8) is True and ctl.reason is None
        ctl.record(3, 5, 0)


def test_fallback_draft_failure_then_reconnect():
    policy = FallbackPolicy(FallbackConfig(reconnect_s=2.0))
    assert policy.speculate(10.0, 10) is True
    policy.draft_failed(10.0)
    assert policy.speculate(11.0, 10) is False and policy.reason == "draft_unavailable"
    assert policy.speculate(11.999, 10) is False
    assert policy.speculate(12.0, 10) is True and policy.reason is None   # the retry
    policy.draft_failed(12.0)        # the retry failed too: another reconnect_s
    assert policy.speculate(12.0, 10) is False
    assert policy.speculate(14.0, 10) is True


def test_fallback_context_limit():
    policy = FallbackPolicy(FallbackConfig())
    policy.set_draft_context_limit(100)
    assert policy.speculate(0.0, 97, depth=3) is True
    assert policy.speculate(0.0, 98, depth=3) is False and policy.reason == "draft_context_limit"
    assert policy.speculate(0.0, 98, depth=2) is True
    assert policy.speculate(0.0, 100, depth=1) is False and policy.reason == "draft_context_limit"
    policy.set_draft_context_limit(None)
    assert policy.speculate(0.0, 10**9) is True
    with pytest.raises(ValueError, match="draft_context_limit"):
        policy.set_draft_context_limit(0)


def test_fallback_reason_precedence():
    policy = FallbackPolicy(FallbackConfig(reconnect_s=1.0))
    policy.set_draft_context_limit(50)
    assert policy.speculate(0.0, 10)
    policy.draft_failed(0.0)
    # both hold: the context limit is the reason, and that plain round is not the retry
    assert policy.speculate(0.1, 49, depth=3) is False and policy.reason == "draft_context_limit"
    assert policy.speculate(0.2, 10) is False and policy.reason == "draft_unavailable"
    assert policy.speculate(1.0, 10) is True and policy.reason is None


def test_fallback_bad_input():
    with pytest.raises(ValueError):
        FallbackPolicy().speculate(0.0, 5, depth=0)
    with pytest.raises(ValueError):
        FallbackPolicy().speculate(0.0, -1)


# --------------------------------------------------------------------------- FixedControl


def test_fixed_control_plays_the_tree_behind_the_fallback():
    ctl = FixedControl(DEFAULT_SPEC, FallbackConfig(reconnect_s=1.0))
    # always wrong (DEFAULT_SPEC: 3 levels, 5 nodes): the same tree every round, speculation stays on
    for _ in range(20):
        assert ctl.speculate(0.0, 10, 8) is True and ctl.reason is None
        ctl.record(3, 5, 0)
    assert ctl.gamma == 3 and ctl.spec(DEFAULT_SPEC) is DEFAULT_SPEC
    ctl.draft_failed(0.0)
    assert ctl.speculate(0.0, 10, 8) is False and ctl.reason == "draft_unavailable"
    assert ctl.speculate(1.0, 10, 8) is True and ctl.reason is None   # the retry after reconnect_s
    ctl.set_draft_context_limit(13)
    assert ctl.speculate(1.0, 10, 8) is True                           # the tree's 3 levels fit: 10 + 3 <= 13
    assert ctl.speculate(1.0, 11, 8) is False and ctl.reason == "draft_context_limit"
    assert ctl.speculate(1.0, 11, 2) is True                           # the budget's 2 levels fit: 11 + 2 <= 13
    with pytest.raises(ValueError):
        ctl.record(2, 1, 2)      # accepted > proposed
