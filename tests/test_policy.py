"""Per-request control policies (orchestrator/policy.py) and their metrics (orchestrator/metrics.py).

Pure unit tests: scripted round outcomes, an injected clock, fresh Prometheus registries.
"""

from __future__ import annotations

import logging
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from orchestrator.metrics import SpecMetrics, start_metrics_server
from orchestrator.policy import (
    AcceptanceMonitor, DynamicGamma, FallbackPolicy, RequestControl, max_depth_for, spec_at_depth, tree_depth,
)
from specdec.config import DynamicGammaConfig, FallbackConfig, MonitorConfig
from specdec.stats import RoundRecord
from specdec.tree_spec import DEFAULT_SPEC, SEED_SPEC, TreeSpec, TreeSpecError

WIDE_SPEC = TreeSpec(gamma=1, topKSpec=[[100]], topHead=[1])  # 100 nodes a row: 5 rows fit in 512


class Clock:
    """A settable clock (seconds)."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def sample(metrics: SpecMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


# --------------------------------------------------------------------------- spec_at_depth


@pytest.mark.parametrize("gamma, rows, heads, nodes", [
    (1, [[6]], [1], 6),
    (2, [[6], [2, 2]], [1, 2], 10),
    (3, [[6], [2, 2], [1, 1]], [1, 2, 2], 12),
    (4, [[6], [2, 2], [1, 1], [1, 1]], [1, 2, 2, 2], 14),
    (6, [[6], [2, 2], [1, 1], [1, 1], [1, 1], [1, 1]], [1, 2, 2, 2, 2, 2], 18),
])
def test_spec_at_depth_seed_spec(gamma, rows, heads, nodes):
    spec = spec_at_depth(SEED_SPEC, gamma)
    assert spec.gamma == gamma
    assert [list(r) for r in spec.top_k_spec] == rows
    assert list(spec.top_head) == heads
    assert spec.num_nodes == nodes


@pytest.mark.parametrize("gamma, nodes", [(1, 3), (2, 4), (3, 5), (5, 7), (8, 10)])
def test_spec_at_depth_default_spec(gamma, nodes):
    spec = spec_at_depth(DEFAULT_SPEC, gamma)
    assert [list(r) for r in spec.top_k_spec] == [[3]] + [[1]] * (gamma - 1)
    assert list(spec.top_head) == [1] * gamma
    assert spec.num_nodes == nodes


def test_spec_at_depth_same_gamma_is_the_spec_and_keeps_type_and_threshold():
    assert spec_at_depth(SEED_SPEC, 3) is SEED_SPEC
    sampled = TreeSpec(gamma=2, topKSpec=[[4], [2, 1]], topHead=[1, 2], treeType=1, gammaThreshold=0.25)
    deeper = spec_at_depth(sampled, 4)
    assert (deeper.tree_type, deeper.gamma_threshold) == (1, 0.25)
    # the repeated row expands 2 nodes of a depth holding 2 + 1 = 3: valid; each copy adds 3 nodes
    assert [list(r) for r in deeper.top_k_spec] == [[4], [2, 1], [2, 1], [2, 1]]
    assert list(deeper.top_head) == [1, 2, 2, 2]
    assert deeper.num_nodes == 4 + 3 * 3


def test_spec_at_depth_node_cap_and_bad_gamma():
    assert max_depth_for(WIDE_SPEC) == 5
    assert spec_at_depth(WIDE_SPEC, 5).num_nodes == 500
    with pytest.raises(TreeSpecError, match=r"gamma: 6 exceeds the deepest tree of this spec, 5"):
        spec_at_depth(WIDE_SPEC, 6)
    # SEED_SPEC: 12 nodes at depth 3, +2 a row; a 13-node target limit stops at depth 3
    assert [max_depth_for(SEED_SPEC, n) for n in (5, 6, 12, 13, 14)] == [0, 1, 3, 3, 4]
    with pytest.raises(TreeSpecError, match="gamma: 4 exceeds"):
        spec_at_depth(SEED_SPEC, 4, max_nodes=13)
    assert max_depth_for(SEED_SPEC) == 64  # 12 + 2 * 61 = 134 nodes: the 64-row bound binds first
    for bad in (0, -1, 65):
        with pytest.raises(TreeSpecError, match="gamma"):
            spec_at_depth(SEED_SPEC, bad)


def test_tree_depth():
    assert tree_depth([]) == 0
    assert tree_depth([-1, -1, -1]) == 1
    assert tree_depth([-1, -1, 0, 0, 2]) == 3


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
    assert policy.fallback_rounds == {"low_acceptance": 6, "draft_unavailable": 0, "draft_context_limit": 0}
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
    assert policy.fallback_rounds == {"low_acceptance": 2, "draft_unavailable": 1, "draft_context_limit": 1}


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


# --------------------------------------------------------------------------- AcceptanceMonitor


def test_monitor_alert_fires_once_after_n_low_windows_and_clears(caplog):
    metrics = SpecMetrics(CollectorRegistry())
    mon = AcceptanceMonitor(MonitorConfig(window=2, alert_threshold=0.5, alert_windows=3), metrics=metrics)
    caplog.set_level(logging.INFO, logger="orchestrator.policy")
    for i in range(5):                 # 2.5 low windows: no alert yet
        mon.record("r1", 5, 1)
    assert not mon.alerting("r1") and mon.alerts("r1") == 0
    mon.record("r1", 5, 1)             # third full low window
    assert mon.alerting("r1") and mon.alerting()
    for _ in range(4):                 # still low: no second alert
        mon.record("r1", 5, 1)
    assert mon.alerts("r1") == 1 and mon.alerts() == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2          # request and global, once each
    msg = warnings[0].getMessage()
    assert "request r1" in msg and "0.200" in msg and "2/10" in msg and "3 consecutive windows of 2" in msg
    assert sample(metrics, "specdec_acceptance_alerts_total", scope="request") == 1
    assert sample(metrics, "specdec_acceptance_alerts_total", scope="global") == 1

    mon.record("r1", 5, 5)             # window [1/5, 5/5] = 0.6: recovered
    assert mon.alerting("r1")          # judged only at the end of a window (round 12)
    mon.record("r1", 5, 2)             # window [5, 2] / 10 = 0.7
    assert not mon.alerting("r1") and not mon.alerting()
    assert any("cleared (request r1)" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    for _ in range(6):                 # three more low windows: a second alert
        mon.record("r1", 5, 0)
    assert mon.alerts("r1") == 2
    assert sample(metrics, "specdec_acceptance_alerts_total", scope="request") == 2


def test_monitor_needs_consecutive_low_windows():
    mon = AcceptanceMonitor(MonitorConfig(window=2, alert_threshold=0.5, alert_windows=2))
    for acc in [0, 0, 0, 0, 3, 3, 0, 0]:  # windows: low, low -> alert
        mon.record("a", 5, acc)
    assert mon.alerts("a") == 1
    mon2 = AcceptanceMonitor(MonitorConfig(window=2, alert_threshold=0.5, alert_windows=2))
    for acc in [0, 0, 3, 3, 0, 0, 3, 3]:  # low, ok, low, ok: never two in a row
        mon2.record("b", 5, acc)
    assert mon2.alerts("b") == 0 and not mon2.alerting("b")


def test_monitor_per_request_and_global_windows():
    metrics = SpecMetrics(CollectorRegistry())
    mon = AcceptanceMonitor(MonitorConfig(window=2, alert_threshold=0.5, alert_windows=1), metrics=metrics)
    for _ in range(3):                 # interleaved: a accepts nothing, b everything
        mon.record("a", 5, 0)
        mon.record("b", 5, 5)
    assert mon.rate("a") == 0.0 and mon.rate("b") == 1.0
    assert mon.rate() == 0.5           # global window = the last two rounds (one of each)
    assert mon.alerting("a") and not mon.alerting("b") and not mon.alerting()
    assert sample(metrics, "specdec_acceptance_rate") == 0.5
    mon.record("a", 0, 0)              # a plain round: ignored
    assert mon.rate() == 0.5
    mon.finish("a")
    assert mon.rate("a") is None and not mon.alerting("a") and mon.rate("b") == 1.0
    with pytest.raises(ValueError):
        mon.record("b", 1, 2)


# --------------------------------------------------------------------------- metrics


def test_metrics_round_counters_and_gamma_histogram():
    m = SpecMetrics(CollectorRegistry())
    assert sample(m, "specdec_rounds_total", mode="speculative") == 0
    m.record_round(proposed=5, accepted=2, committed=3, gamma=3)
    m.record_round(proposed=7, accepted=4, committed=5, gamma=5)
    m.record_round(proposed=0, accepted=0, committed=1, gamma=5)   # plain: gamma not observed
    assert sample(m, "specdec_rounds_total", mode="speculative") == 2
    assert sample(m, "specdec_rounds_total", mode="plain") == 1
    assert sample(m, "specdec_proposed_tokens_total") == 12
    assert sample(m, "specdec_accepted_tokens_total") == 6
    assert sample(m, "specdec_committed_tokens_total") == 9
    assert sample(m, "specdec_gamma_count") == 2
    assert sample(m, "specdec_gamma_sum") == 8
    assert sample(m, "specdec_gamma_bucket", le="3.0") == 1
    assert sample(m, "specdec_gamma_bucket", le="5.0") == 2
    with pytest.raises(ValueError, match="accepted 3 > proposed 2"):
        m.record_round(2, 3, 1)


def test_metrics_observe_round_record():
    m = SpecMetrics(CollectorRegistry())
    times = dict(draft_s=None, verify_s=0.1, commit_s=0.01)
    m.observe_round(RoundRecord((5, 6, 7), proposed=5, accepted=2, depth=3, fallback=None, gamma=4, **times))
    m.observe_round(RoundRecord((9,), proposed=0, accepted=0, depth=0, fallback="low_acceptance", gamma=4, **times))
    m.observe_round(RoundRecord((1,), proposed=0, accepted=0, depth=0, fallback=None, gamma=0, **times))
    assert sample(m, "specdec_rounds_total", mode="speculative") == 1
    assert sample(m, "specdec_rounds_total", mode="plain") == 2
    assert sample(m, "specdec_committed_tokens_total") == 5
    assert sample(m, "specdec_accepted_tokens_total") == 2
    assert sample(m, "specdec_fallback_rounds_total", reason="low_acceptance") == 1
    assert sample(m, "specdec_gamma_sum") == 4 and sample(m, "specdec_gamma_count") == 1


def test_metrics_phase_latency():
    m = SpecMetrics(CollectorRegistry())
    m.observe_phase("verify", 0.2)
    m.observe_phase("verify", 0.05)
    with m.time_phase("draft"):
        pass
    assert sample(m, "specdec_round_phase_seconds_count", phase="verify") == 2
    assert sample(m, "specdec_round_phase_seconds_sum", phase="verify") == pytest.approx(0.25)
    assert sample(m, "specdec_round_phase_seconds_bucket", phase="verify", le="0.1") == 1
    assert sample(m, "specdec_round_phase_seconds_count", phase="draft") == 1
    assert sample(m, "specdec_round_phase_seconds_count", phase="commit") == 0
    with pytest.raises(ValueError, match="phase"):
        m.observe_phase("prefill", 1.0)


def test_metrics_registries_are_independent():
    a, b = SpecMetrics(CollectorRegistry()), SpecMetrics(CollectorRegistry())
    a.record_round(3, 1, 2)
    assert sample(a, "specdec_proposed_tokens_total") == 3
    assert sample(b, "specdec_proposed_tokens_total") == 0
    with pytest.raises(ValueError):    # same names twice on one registry
        SpecMetrics(a.registry)


def test_metrics_http_server_serves_registry():
    m = SpecMetrics(CollectorRegistry())
    m.record_round(4, 3, 4, gamma=4)
    server, thread = start_metrics_server(0, m, addr="127.0.0.1")
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert "specdec_accepted_tokens_total 3.0" in body
    assert 'specdec_fallback_rounds_total{reason="draft_unavailable"} 0.0' in body
