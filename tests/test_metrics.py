"""The orchestrator's Prometheus metrics and the front-wide acceptance monitor (orchestrator/loop/metrics.py).

Pure unit tests: scripted round outcomes, fresh Prometheus registries.
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from orchestrator.loop.metrics import AcceptanceMonitor, SpecMetrics, start_metrics_server
from specdec.config import ConfigError, MonitorConfig, load_config
from specdec.stats import RoundRecord


def sample(metrics: SpecMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


# --------------------------------------------------------------------------- AcceptanceMonitor


def test_monitor_alert_fires_once_after_n_low_windows_and_clears(caplog):
    metrics = SpecMetrics(CollectorRegistry())
    mon = AcceptanceMonitor(MonitorConfig(window=2, alert_threshold=0.5, alert_windows=3), metrics=metrics)
    caplog.set_level(logging.INFO, logger="orchestrator.loop.metrics")
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
    mon.release("a")
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
    with pytest.raises(ValueError, match="accepted=3, proposed=2"):
        m.record_round(2, 3, 1)


def test_metrics_observe_round_record():
    m = SpecMetrics(CollectorRegistry())
    times = dict(draft_s=None, verify_s=0.1, commit_s=0.01)
    m.observe_round(RoundRecord((5, 6, 7), proposed=5, accepted=2, depth=3, fallback=None, gamma=4, **times))
    m.observe_round(RoundRecord((9,), proposed=0, accepted=0, depth=0, fallback="draft_context_limit", gamma=4,
                                **times))
    m.observe_round(RoundRecord((1,), proposed=0, accepted=0, depth=0, fallback=None, gamma=0, **times))
    assert sample(m, "specdec_rounds_total", mode="speculative") == 1
    assert sample(m, "specdec_rounds_total", mode="plain") == 2
    assert sample(m, "specdec_committed_tokens_total") == 5
    assert sample(m, "specdec_accepted_tokens_total") == 2
    assert sample(m, "specdec_fallback_rounds_total", reason="draft_context_limit") == 1
    assert sample(m, "specdec_gamma_sum") == 4 and sample(m, "specdec_gamma_count") == 1


def test_pipeline_ahead_counter_by_outcome():
    m = SpecMetrics(CollectorRegistry())
    times = dict(draft_s=0.0, verify_s=0.1, commit_s=0.01)
    for outcome in ("hit", "hit", "miss", "failed", None):
        m.observe_round(RoundRecord((5, 6), proposed=3, accepted=1, depth=2, fallback=None, gamma=3, ahead=outcome, **times))
    assert sample(m, "specdec_pipeline_ahead_total", outcome="hit") == 2
    assert sample(m, "specdec_pipeline_ahead_total", outcome="miss") == 1
    assert sample(m, "specdec_pipeline_ahead_total", outcome="failed") == 1


def test_link_round_trip_gauges_by_link_in_the_metrics_text():
    """specdec_link_rtt_seconds{link}: both series from the start (0), set in seconds from a request's final
    statistics (ms); a link not measured (None) keeps its last value."""
    m = SpecMetrics(CollectorRegistry())
    assert sample(m, "specdec_link_rtt_seconds", link="draft") == 0 == sample(m, "specdec_link_rtt_seconds", link="target")
    m.observe_links(draft_ms=12.5, target_ms=0.25)
    m.observe_links(draft_ms=None, target_ms=0.5)
    body = _scrape(m)
    assert 'specdec_link_rtt_seconds{link="draft"} 0.0125' in body
    assert 'specdec_link_rtt_seconds{link="target"} 0.0005' in body


def test_metrics_phase_latency():
    m = SpecMetrics(CollectorRegistry())
    m.observe_phase("verify", 0.2)
    m.observe_phase("verify", 0.05)
    m.observe_phase("draft", 0.01)
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


def _scrape(m: SpecMetrics) -> str:
    """The /metrics text of a metrics server started for ``m`` on a free loopback port."""
    server, _ = start_metrics_server(0, m, addr="127.0.0.1")
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_http_server_serves_registry():
    m = SpecMetrics(CollectorRegistry())
    m.record_round(4, 3, 4, gamma=4)
    body = _scrape(m)
    assert "specdec_accepted_tokens_total 3.0" in body
    assert 'specdec_fallback_rounds_total{reason="draft_unavailable"} 0.0' in body


def test_metrics_port_binds_loopback_by_default_and_can_require_a_token():
    """Issue 57: the metrics port listened on 0.0.0.0 whatever front.host said, and never asked for a token."""
    m = SpecMetrics(CollectorRegistry())
    m.record_round(4, 3, 4, gamma=4)
    server, _ = start_metrics_server(0, m, tokens=(b"scrape-tok",))
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        assert server.server_address[0] == "127.0.0.1"
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(url, timeout=5)
        assert info.value.code == 401 and info.value.headers["WWW-Authenticate"] == "Bearer"
        wrong = urllib.request.Request(url, headers={"Authorization": "Bearer nope"})
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(wrong, timeout=5)
        right = urllib.request.Request(url, headers={"Authorization": "Bearer scrape-tok"})
        assert "specdec_accepted_tokens_total 3.0" in urllib.request.urlopen(right, timeout=5).read().decode()
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_auth_needs_the_token_file():
    with pytest.raises(ConfigError) as info:
        load_config(None, {"front.metrics_auth": True})
    assert "front: metrics_auth: needs front.auth_token_file" in str(info.value)


def test_cost_aware_decisions_reach_the_metrics():
    """A round record of the cost-aware control sets the cost-model gauges and the context counters."""
    m = SpecMetrics()
    record = RoundRecord((5, 6, 7), proposed=4, accepted=2, depth=2, fallback=None, gamma=3, draft_s=0.1,
                         verify_s=0.3, commit_s=0.01, drafted=5, context_proposed=2, context_accepted=1,
                         expected_accepted=1.5, cost={"verify_ms": {1: 300.0, 8: 450.0}, "draft_step_ms": {1: 45.0}})
    m.observe_round(record)
    assert sample(m, "specdec_cost_verify_ms", rows="8") == 450.0
    assert sample(m, "specdec_cost_draft_step_ms", parents="1") == 45.0
    assert sample(m, "specdec_context_tokens_total", outcome="proposed") == 2
    assert sample(m, "specdec_context_tokens_total", outcome="accepted") == 1
    assert sample(m, "specdec_expected_accepted_tokens_total") == 1.5


def test_acceptance_per_position_from_round_records():
    m = SpecMetrics(CollectorRegistry())
    times = dict(draft_s=0.01, verify_s=0.1, commit_s=0.01)
    # depth 3 tree, 2 accepted; depth 2 tree, 0 accepted; a plain round (depth 0) counts nowhere
    m.observe_round(RoundRecord((5, 6, 7), proposed=5, accepted=2, depth=3, fallback=None, gamma=3, **times))
    m.observe_round(RoundRecord((8,), proposed=3, accepted=0, depth=2, fallback=None, gamma=2, **times))
    m.observe_round(RoundRecord((9,), proposed=0, accepted=0, depth=0, fallback=None, gamma=2, **times))
    proposed = [sample(m, "specdec_position_proposed_tokens_total", position=str(d)) for d in (1, 2, 3)]
    accepted = [sample(m, "specdec_position_accepted_tokens_total", position=str(d)) for d in (1, 2, 3)]
    assert proposed == [2, 2, 1] and accepted == [1, 1, 0]
    assert sample(m, "specdec_position_proposed_tokens_total", position="4") is None


def test_request_stats_time_by_phase_after_the_first_token():
    """GenerationStats' draft_s / verify_s / draft_rounds sum the rounds after the first (the first is
    inside ttft_ms, so the parts do not overlap); a round that did not ask the draft (draft_s None)
    adds its verify only, an adopted pipelined tree (draft_s 0) is no draft round; FinalStats carries them."""
    from specdec.stats import GenerationStats
    from specdec.wire import stats_to_proto

    def record(draft_s, verify_s, fallback=None, pipelined=False):
        return RoundRecord((1, 2), proposed=3, accepted=1, depth=2, fallback=fallback, gamma=2, draft_s=draft_s,
                           verify_s=verify_s, commit_s=0.01, pipelined=pipelined)

    stats = GenerationStats()
    rounds = [record(0.5, 0.3), record(0.04, 0.2), record(None, 0.1, fallback="cost"), record(0.0, 0.25, pipelined=True),
              record(None, 0.15, fallback="draft_unavailable"), record(0.06, 0.2)]
    for i, r in enumerate(rounds):
        stats.add(r, 0.4 * (i + 1))
    assert stats.ttft_ms == pytest.approx(400.0)
    assert stats.draft_s == pytest.approx(0.10) and stats.verify_s == pytest.approx(0.9) and stats.draft_rounds == 2
    msg = stats_to_proto(stats, prompt_tokens=3)
    assert msg.draft_s == pytest.approx(0.10) and msg.verify_s == pytest.approx(0.9) and msg.draft_rounds == 2


def test_request_stats_count_positions_as_the_metrics_do():
    """GenerationStats (the CLI's, the bench's and FinalStats' per-position counts) and the Prometheus
    series agree round by round; rounds of different depths, partial acceptance at depths 1-3, rounds
    accepting their whole tree (depth 4, depth 1), one accepting nothing, and a plain round."""
    from specdec.stats import GenerationStats, position_rates
    from specdec.wire import stats_to_proto

    times = dict(draft_s=0.01, verify_s=0.1, commit_s=0.01)
    outcomes = [(3, 1), (4, 4), (2, 0), (0, 0), (5, 3), (1, 1), (6, 2)]  # (tree depth, accepted draft tokens)
    m, stats = SpecMetrics(CollectorRegistry()), GenerationStats()
    for i, (depth, accepted) in enumerate(outcomes):
        record = RoundRecord(tuple(range(accepted + 1)), proposed=depth * 2, accepted=accepted, depth=depth,
                             fallback=None, gamma=depth, **times)
        m.observe_round(record)
        stats.add(record, 0.1 * (i + 1))
    assert stats.position_proposed == [6, 5, 4, 3, 2, 1]
    assert stats.position_accepted == [5, 3, 2, 1, 0, 0]
    assert position_rates(stats.position_proposed, stats.position_accepted) == [5 / 6, 3 / 5, 2 / 4, 1 / 3, 0.0, 0.0]
    for d in range(1, 7):
        assert sample(m, "specdec_position_proposed_tokens_total", position=str(d)) == stats.position_proposed[d - 1]
        assert sample(m, "specdec_position_accepted_tokens_total", position=str(d)) == stats.position_accepted[d - 1]
    msg = stats_to_proto(stats, prompt_tokens=3)  # what a gRPC (and HTTP) client's FinalStats carries
    assert list(msg.position_proposed) == [6, 5, 4, 3, 2, 1] and list(msg.position_accepted) == [5, 3, 2, 1, 0, 0]
    assert GenerationStats().position_proposed == [] == GenerationStats().position_accepted


def test_track_stream_request_latency_ttft_itl_and_gauges():
    """A scripted stream (first chunk of 1 token at t=0.5 s, then 3 tokens at 1.1 s, final stats at
    1.2 s) under a scripted clock; the gauges are read while the stream is inside each stage."""
    import asyncio

    m = SpecMetrics(CollectorRegistry())
    clock_values = iter([0.0, 0.5, 1.1, 1.2])
    gauges = []

    async def backend_stream():
        gauges.append((sample(m, "specdec_requests_waiting"), sample(m, "specdec_requests_running")))
        yield [7], "round-1", None
        gauges.append((sample(m, "specdec_requests_waiting"), sample(m, "specdec_requests_running")))
        yield [8, 9, 10], "round-2", None
        yield [], None, "stats"

    async def consume():
        return [chunk async for chunk in m.track_stream(backend_stream(), clock=lambda: next(clock_values))]

    chunks = asyncio.run(consume())
    assert chunks == [([7], "round-1", None), ([8, 9, 10], "round-2", None), ([], None, "stats")]  # passed through
    assert gauges == [(1, 0), (0, 1)]  # waiting before the first token, running after it
    assert sample(m, "specdec_requests_waiting") == 0 and sample(m, "specdec_requests_running") == 0
    assert sample(m, "specdec_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert sample(m, "specdec_inter_token_latency_seconds_count") == 3  # once per token of the later round
    assert sample(m, "specdec_inter_token_latency_seconds_sum") == pytest.approx(0.6)  # 3 x (0.6 s / 3)
    assert sample(m, "specdec_request_latency_seconds_sum") == pytest.approx(1.2)
    assert sample(m, "specdec_request_latency_seconds_bucket", le="1.5") == 1
    assert sample(m, "specdec_request_latency_seconds_bucket", le="1.0") == 0


def test_track_stream_request_that_fails_before_its_first_token_leaves_the_gauges():
    import asyncio

    m = SpecMetrics(CollectorRegistry())

    async def failing():
        raise RuntimeError("target gone")
        yield  # an async generator

    async def consume():
        async for _ in m.track_stream(failing()):
            pass

    with pytest.raises(RuntimeError, match="target gone"):
        asyncio.run(consume())
    assert sample(m, "specdec_requests_waiting") == 0 and sample(m, "specdec_request_latency_seconds_count") == 1
    assert sample(m, "specdec_time_to_first_token_seconds_count") == 0
