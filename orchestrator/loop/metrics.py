"""Prometheus metrics of the orchestrator's rounds (``SpecMetrics``) and the acceptance monitor (``AcceptanceMonitor``);
series, labels and units: docs/observability.md.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncGenerator, AsyncIterator, Sequence
from wsgiref.simple_server import WSGIRequestHandler, make_server

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import ThreadingWSGIServer

from orchestrator.planning.control import FALLBACK_REASONS, check_counts
from specdec.config import MonitorConfig
from specdec.security import token_accepted
from specdec.stats import RoundRecord

log = logging.getLogger(__name__)

PHASES = ("draft", "verify", "commit")
ALERT_SCOPES = ("request", "global")
AHEAD_OUTCOMES = ("hit", "predraft", "miss", "failed")  # RoundRecord.ahead
ROUND_KINDS = ("in_line", "pipelined", "predrafted")  # RoundRecord.kind
ROUND_MODES = ("speculative", "plain")
LINKS = ("draft", "target")  # the front's service links (specdec_link_rtt_seconds)

# gamma is an integer in [1, 64] (TreeSpec); one bucket per small depth, coarser beyond.
GAMMA_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)
# A CPU round phase takes 10 ms .. seconds; a GPU one 1 ms .. 100 ms.
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
# Request latency and TTFT: vLLM's buckets (vllm/v1/metrics/loggers.py), seconds
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


# attribute, kind, name, help, (label, values created up front; () = on first use) or None, histogram buckets
METRICS = (
    ("rounds", Counter, "rounds", "Rounds run, by mode (speculative or plain target step)", ("mode", ROUND_MODES)),
    ("proposed_tokens", Counter, "proposed_tokens", "Draft tokens (tree nodes) sent to the target", None),
    ("accepted_tokens", Counter, "accepted_tokens", "Draft tokens accepted by the target (bonus excluded)", None),
    ("committed_tokens", Counter, "committed_tokens", "Tokens committed (bonus included)", None),
    ("fallback_rounds", Counter, "fallback_rounds", "Plain rounds without the draft, by reason",
     ("reason", FALLBACK_REASONS)),
    ("acceptance_alerts", Counter, "acceptance_alerts", "Low-acceptance alerts raised, by scope",
     ("scope", ALERT_SCOPES)),
    ("acceptance_rate", Gauge, "acceptance_rate", "Global windowed acceptance rate (accepted / proposed draft tokens)",
     None),
    ("gamma", Histogram, "gamma", "Speculation depth gamma of each speculative round", None, GAMMA_BUCKETS),
    ("round_phase_seconds", Histogram, "round_phase_seconds", "Wall time of one round phase, seconds",
     ("phase", PHASES), PHASE_BUCKETS),
    ("cost_verify_ms", Gauge, "cost_verify_ms", "Cost model: predicted target verify latency for a tree of rows - 1 "
     "nodes, ms (cost-aware control)", ("rows", ())),
    ("cost_draft_step_ms", Gauge, "cost_draft_step_ms", "Cost model: predicted draft step latency for parents "
     "expanded nodes, ms", ("parents", ())),
    ("context_tokens", Counter, "context_tokens", "Context (n-gram) tree nodes, by outcome", ("outcome", ())),
    ("expected_accepted_tokens", Counter, "expected_accepted_tokens", "Draft tokens the cost-aware control expected "
     "to be accepted (compare with accepted_tokens)", None),
    ("position_proposed", Counter, "position_proposed_tokens", "Rounds whose verified tree reached this depth "
     "(position)", ("position", ())),
    ("position_accepted", Counter, "position_accepted_tokens", "Rounds whose accepted path reached this depth "
     "(position)", ("position", ())),
    ("request_latency", Histogram, "request_latency_seconds", "Request time from arrival to the end of its stream, "
     "seconds", None, REQUEST_LATENCY_BUCKETS),
    ("ttft", Histogram, "time_to_first_token_seconds", "Request time from arrival to its first token, seconds", None,
     TTFT_BUCKETS),
    ("inter_token_latency", Histogram, "inter_token_latency_seconds", "Gap between streamed rounds divided by the "
     "tokens of the later one, observed once per token, seconds", None, ITL_BUCKETS),
    ("failovers", Counter, "failovers", "Requests moved to another orchestrator actor after theirs failed (Ray front, "
     "orchestrator.serving.failover), one per move", None),
    ("requests_running", Gauge, "requests_running", "Requests streaming tokens (first token sent)", None),
    ("requests_waiting", Gauge, "requests_waiting", "Requests received without a first token yet (queued or in "
     "prefill)", None),
    ("link_rtt", Gauge, "link_rtt_seconds", "Measured round trip of a service link (draft, target): the median of "
     "recent calls' wall time at the front minus the service's own time, as of the last request to end, seconds "
     "(0: not measured yet)", ("link", LINKS)),
    ("pipeline_ahead", Counter, "pipeline_ahead", "Pipelining: trees drafted ahead during a verify, by outcome (hit = "
     "first candidate adopted, predraft = another candidate adopted, miss = discarded, failed)",
     ("outcome", AHEAD_OUTCOMES)),
    ("round_kinds", Counter, "round_kind", "Rounds by where their tree came from (in_line = drafted in the round or "
     "none, pipelined / predrafted = an ahead's first / another candidate)", ("kind", ROUND_KINDS)),
)


class SpecMetrics:
    """The orchestrator's metrics (METRICS) on ``registry`` (default: a fresh one), names prefixed by namespace.
    Raises ValueError when the registry already holds these names."""

    def __init__(self, registry: CollectorRegistry | None = None, namespace: str = "specdec"):
        self.registry = registry if registry is not None else CollectorRegistry()
        for attr, kind, name, help_text, labels, *buckets in METRICS:
            label_names = [labels[0]] if labels else []
            extra = {"buckets": buckets[0]} if buckets else {}
            metric = kind(name, help_text, label_names, namespace=namespace, registry=self.registry, **extra)
            setattr(self, attr, metric)
            for value in labels[1] if labels else ():  # every labelled series reads 0 before its first event
                metric.labels(value)

    def record_round(self, proposed: int, accepted: int, committed: int, gamma: int | None = None) -> None:
        """Count one round (proposed == 0: plain; gamma observed for speculative rounds only).
        Raises ValueError for negative counts or accepted > proposed."""
        check_counts(proposed, accepted)
        if committed < 0:
            raise ValueError(f"record_round: committed must be >= 0, got {committed}")
        speculative = proposed > 0
        self.rounds.labels(mode="speculative" if speculative else "plain").inc()
        self.proposed_tokens.inc(proposed)
        self.accepted_tokens.inc(accepted)
        self.committed_tokens.inc(committed)
        if speculative and gamma is not None:
            self.gamma.observe(gamma)

    def observe_round(self, record: RoundRecord) -> None:
        """Count one round from its RoundRecord (gamma 0 is not observed), fallback reason included."""
        self.record_round(record.proposed, record.accepted, len(record.tokens), record.gamma or None)
        for position in range(1, record.depth + 1):  # both series exist from a position's first tree on
            self.position_proposed.labels(position=str(position)).inc()
            self.position_accepted.labels(position=str(position)).inc(1 if position <= record.accepted else 0)
        if record.fallback:
            self.fallback_rounds.labels(reason=record.fallback).inc()
        if record.ahead is not None:
            self.pipeline_ahead.labels(outcome=record.ahead).inc()
        self.round_kinds.labels(kind=record.kind).inc()
        self.context_tokens.labels(outcome="proposed").inc(record.context_proposed)
        self.context_tokens.labels(outcome="accepted").inc(record.context_accepted)
        self.expected_accepted_tokens.inc(record.expected_accepted)
        self.observe_costs(record.cost)  # the cost-aware control's cost model when it decided this round

    def observe_costs(self, cost: dict | None) -> None:
        """Set the cost-model gauges from a ``CostModel.snapshot`` (None: no cost-aware control)."""
        for rows, ms in (cost or {}).get("verify_ms", {}).items():
            self.cost_verify_ms.labels(rows=str(rows)).set(ms)
        for parents, ms in (cost or {}).get("draft_step_ms", {}).items():
            self.cost_draft_step_ms.labels(parents=str(parents)).set(ms)

    def observe_links(self, draft_ms: float | None, target_ms: float | None) -> None:
        """Set the link round-trip gauges from a request's final statistics (ms; None: not measured, left as is)."""
        for link, ms in zip(LINKS, (draft_ms, target_ms)):
            if ms is not None:
                self.link_rtt.labels(link=link).set(ms / 1000)

    def observe_phase(self, phase: str, seconds: float) -> None:
        """Record one phase's wall time in seconds. Raises ValueError for an unknown phase."""
        if phase not in PHASES:
            raise ValueError(f"phase: {phase!r} is not one of {PHASES}")
        self.round_phase_seconds.labels(phase=phase).observe(seconds)

    async def track_stream(self, stream: AsyncGenerator, clock=time.perf_counter) -> AsyncIterator:
        """Pass a request's stream of (tokens, record, stats) through, feeding waiting / running, TTFT, n inter-token
        latencies of gap / n s per later chunk of n and the request latency (any end). clock: seconds."""
        started = last = clock()
        first = False
        self.requests_waiting.inc()
        try:
            async for tokens, record, stats in stream:
                if tokens:
                    now = clock()
                    if not first:
                        first = True
                        self.ttft.observe(now - started)
                        self.requests_waiting.dec()
                        self.requests_running.inc()
                    else:
                        for _ in tokens:
                            self.inter_token_latency.observe((now - last) / len(tokens))
                    last = now
                yield tokens, record, stats
        finally:
            (self.requests_running if first else self.requests_waiting).dec()
            self.request_latency.observe(clock() - started)
            await stream.aclose()  # closed early (client gone): the backend's stream ends too, freeing its KV


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


def start_metrics_server(port: int, metrics: SpecMetrics, addr: str = "127.0.0.1", tokens: Sequence[bytes] = ()):
    """Serve ``metrics``' registry at http://addr:port/metrics in a daemon thread; returns (server, thread). tokens:
    accepted bearer tokens (empty = no auth). Port 0 picks a free one. Raises OSError when the port is taken."""
    app = prometheus_client.make_wsgi_app(metrics.registry)

    def guarded(environ, start_response):
        if tokens and not token_accepted(tokens, environ.get("HTTP_AUTHORIZATION", "")):
            start_response("401 Unauthorized", [("WWW-Authenticate", "Bearer"), ("Content-Type", "text/plain")])
            return [b"missing or invalid bearer token (Authorization: Bearer ...)\n"]
        return app(environ, start_response)

    class Server(ThreadingWSGIServer):
        address_family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]

    server = make_server(addr, port, guarded, Server, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return server, thread


@dataclass
class _Track:
    """The last ``window`` rounds of (proposed, accepted) draft tokens of one scope, with its alert state."""

    window: deque[tuple[int, int]]
    rounds: int = 0            # rounds recorded (proposed > 0)
    low_windows: int = 0       # consecutive full windows below the threshold
    alerting: bool = False
    alerts: int = 0

    def sums(self) -> tuple[int, int]:  # (proposed, accepted) draft tokens over the window
        return sum(p for p, _ in self.window), sum(a for _, a in self.window)

    @property
    def rate(self) -> float | None:  # None while the window holds no proposed token
        proposed, accepted = self.sums()
        return accepted / proposed if proposed else None


class AcceptanceMonitor:
    """Windowed acceptance rate (accepted / proposed draft tokens) per request and globally, with alerts after
    ``alert_windows`` full windows below ``alert_threshold`` (docs/observability.md). Thread-safe."""

    def __init__(self, config: MonitorConfig = MonitorConfig(), metrics: SpecMetrics | None = None):
        self.config = config
        self.metrics = metrics
        self._global = self._new_track()
        self._requests: dict[str, _Track] = {}
        self._lock = threading.Lock()

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """Record one round of a request. Raises ValueError for negative counts or accepted > proposed."""
        check_counts(proposed, accepted)
        if proposed == 0:
            return
        with self._lock:
            track = self._requests.get(request_id)
            if track is None:
                track = self._requests[request_id] = self._new_track()
            self._add(track, "request", request_id, proposed, accepted)
            self._add(self._global, "global", None, proposed, accepted)
            if self.metrics is not None:
                self.metrics.acceptance_rate.set(self._global.rate)

    def rate(self, request_id: str | None = None) -> float | None:  # request_id None: global; None before any round
        track = self._track(request_id)
        return track.rate if track else None

    def alerting(self, request_id: str | None = None) -> bool:  # the scope's alert is raised and not yet cleared
        track = self._track(request_id)
        return bool(track and track.alerting)

    def alerts(self, request_id: str | None = None) -> int:  # alerts raised so far
        track = self._track(request_id)
        return track.alerts if track else 0

    def release(self, request_id: str) -> None:  # forget a finished request; unknown ids are ignored
        with self._lock:
            self._requests.pop(request_id, None)

    def _new_track(self) -> _Track:
        return _Track(deque(maxlen=self.config.window))

    def _track(self, request_id: str | None) -> _Track | None:
        return self._global if request_id is None else self._requests.get(request_id)

    def _add(self, track: _Track, scope: str, request_id: str | None, proposed: int, accepted: int) -> None:
        track.window.append((proposed, accepted))
        track.rounds += 1
        if track.rounds % self.config.window:
            return
        rate = track.rate  # the window now covers exactly the last `window` rounds
        who = "global" if request_id is None else f"request {request_id}"
        if rate < self.config.alert_threshold:
            track.low_windows += 1
            if track.low_windows >= self.config.alert_windows and not track.alerting:
                track.alerting = True
                track.alerts += 1
                proposed, accepted = track.sums()
                log.warning("acceptance alert (%s): acceptance rate %.3f (%d/%d draft tokens over the last %d rounds) "
                            "below %.3f for %d consecutive windows of %d rounds", who, rate, accepted, proposed,
                            self.config.window, self.config.alert_threshold, track.low_windows, self.config.window)
                if self.metrics is not None:
                    self.metrics.acceptance_alerts.labels(scope=scope).inc()
        else:
            if track.alerting:
                log.info("acceptance alert cleared (%s): acceptance rate %.3f >= %.3f",
                              who, rate, self.config.alert_threshold)
            track.alerting = False
            track.low_windows = 0
