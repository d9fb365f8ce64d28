"""Per-request control policies of the orchestrator (DESIGN.md "Control"): plain classes, no Ray, no gRPC.

- ``spec_at_depth``: the TreeSpec for speculation depth gamma (rows beyond the spec repeat its last row).
- ``DynamicGamma``: per-request speculation depth, +1 after a fully accepted path, -1 after an early rejection.
- ``FallbackPolicy``: per-request choice, each round, between a speculative round and a plain target step.
- ``RequestControl``: both of the above behind the round controller's control interface.
- ``AcceptanceMonitor``: windowed acceptance rate per request and globally, with a low-acceptance alert.

Terms: acceptance rate = accepted draft tokens / proposed draft tokens (tree nodes); accepted
length = accepted draft tokens on the path (bonus excluded); mean accepted length = tokens
committed per round (bonus included). Times are seconds from any monotonic clock
(``time.monotonic`` by default).

One round with the per-request policies, as the round loop would drive them (``RequestControl``
bundles DynamicGamma and FallbackPolicy for orchestrator/controller.py)::

    if fallback.speculate(now, committed_len, depth=gamma.gamma):
        tree = draft.propose(sid, gamma.spec, max_depth)          # gamma.spec: spec_at_depth(...)
        result = target.verify(sid, tree)
        gamma.update(tree_depth(tree.parents), accepted)
        fallback.record(tree.size, accepted, now, draft_s=...)
        monitor.record(sid, tree.size, accepted)
    else:
        ...plain target step...
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from orchestrator.metrics import FALLBACK_REASONS, SpecMetrics
from specdec.config import DynamicGammaConfig, FallbackConfig, MonitorConfig
from specdec.tree_spec import MAX_TREE_NODES, TreeSpec, TreeSpecError

log = logging.getLogger(__name__)

MAX_GAMMA = 64  # TreeSpec.gamma's upper bound


# --------------------------------------------------------------------------- tree shape per depth


def spec_at_depth(spec: TreeSpec, gamma: int, max_nodes: int = MAX_TREE_NODES) -> TreeSpec:
    """The tree shape for speculation depth gamma (DESIGN.md "Control": rows beyond the spec repeat the last row).

    gamma < spec.gamma: the first gamma rows of topKSpec / topHead. gamma > spec.gamma: rows
    spec.gamma .. gamma-1 repeat the last row (its topKSpec row and topHead entry). A repeated row
    is always valid: the last row expands h = topHead[-1] nodes with k_j >= 1 children each, so the
    depth it creates holds sum(k_j) >= h nodes, enough for the next copy's h expansions.
    Each repeated row adds sum(topKSpec[-1]) nodes. treeType and gammaThreshold are kept;
    gamma == spec.gamma returns ``spec`` itself.

    Raises TreeSpecError (a ValueError) naming ``gamma`` when gamma < 1, gamma > 64 (TreeSpec's
    bound) or the tree would exceed max_nodes nodes (default MAX_TREE_NODES, what a target
    verifies in one forward); ``max_depth_for`` gives the deepest allowed gamma.
    """
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise TreeSpecError(f"gamma: must be an integer >= 1, got {gamma!r}")
    if gamma == spec.gamma and spec.num_nodes <= max_nodes:
        return spec
    deepest = max_depth_for(spec, max_nodes)
    if gamma > deepest:
        raise TreeSpecError(
            f"gamma: {gamma} exceeds the deepest tree of this spec, {deepest} (limits: {MAX_GAMMA} rows, "
            f"{max_nodes} nodes; each row past {spec.gamma} adds {sum(spec.top_k_spec[-1])} nodes)"
        )
    rows = list(spec.top_k_spec[:gamma]) + [spec.top_k_spec[-1]] * max(0, gamma - spec.gamma)
    heads = list(spec.top_head[:gamma]) + [spec.top_head[-1]] * max(0, gamma - spec.gamma)
    return TreeSpec(gamma=gamma, topKSpec=rows, topHead=heads, treeType=spec.tree_type,
                    gammaThreshold=spec.gamma_threshold)


def max_depth_for(spec: TreeSpec, max_nodes: int = MAX_TREE_NODES) -> int:
    """The deepest gamma whose ``spec_at_depth`` tree has <= max_nodes nodes (and <= 64 rows).

    Returns 0 when even the first row exceeds max_nodes.
    """
    total, depth = 0, 0
    while depth < MAX_GAMMA:
        row = spec.top_k_spec[min(depth, spec.gamma - 1)]
        if total + sum(row) > max_nodes:
            break
        total += sum(row)
        depth += 1
    return depth


def tree_depth(parents: Sequence[int]) -> int:
    """Depth of a token tree given its parent array (-1 = child of the root, parents[i] < i); 0 if empty."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


# --------------------------------------------------------------------------- dynamic gamma


class DynamicGamma:
    """Speculation depth gamma of one request, adapted after every speculative round.

    Start: spec.gamma clamped to [min_gamma, max_gamma]. Rule after a round whose tree reached
    depth ``proposed_depth`` and whose accepted path holds ``accepted_length`` draft tokens:

    - whole path accepted (accepted_length == proposed_depth) and the tree was as deep as asked
      (proposed_depth >= gamma): gamma + 1;
    - whole path accepted but the tree was shallower than gamma (cut by the token budget, the
      draft's context or gammaThreshold): unchanged, since the round says nothing about depth gamma + 1;
    - early rejection (accepted_length < proposed_depth): gamma - 1;
    - no tree (proposed_depth == 0, a plain round): unchanged;
    always within [min_gamma, max_gamma], where max_gamma is further capped so that
    ``spec_at_depth(spec, gamma)`` stays within max_nodes nodes.

    Sources: the "heuristic" schedule of HF transformers' assisted generation
    (``num_assistant_tokens_schedule="heuristic"``, ``AssistedCandidateGenerator.update_candidate_strategy``
    in transformers/generation/candidate_generator.py: +2 when every candidate token matched, else
    max(1, n - 1)); llama.cpp's speculative example heuristic (ggml-org/llama.cpp PR #3006: grow only
    when the full draft length was drafted and accepted, no change when a shorter draft was fully
    accepted, -1 on a rejection), which is where the "tree as deep as asked" condition comes from.
    Papers on a learned, per-token stopping rule instead of a schedule: DISCO, Mamou et al. 2024,
    "Dynamic Speculation Lookahead Accelerates Speculative Decoding of Large Language Models"
    (arXiv:2405.04304; a classifier decides after each draft token whether to keep drafting), and
    SpecDec++, Huang, Guo & Wang 2024, "Boosting Speculative Decoding via Adaptive Candidate Lengths"
    (arXiv:2405.19715; an MDP whose optimal policy is a threshold: stop when the predicted probability
    of at least one rejection exceeds a threshold, via a trained acceptance head). Neither is used
    here: both need per-token draft features or a trained head; the schedule needs only counts.

    Why +1 rather than HF's +2: on the 2-core CPU each level costs a draft step (~45 ms) plus
    ~20 ms of verify per extra node, ~0.2 of a plain target step (~300 ms), whereas HF's setting
    (GPU, flat verify) makes depth nearly free. A simulation with i.i.d. per-token acceptance a and
    round cost 300 ms + 65 ms * gamma (chain, gamma in [1, 8]) gave tokens/s for +1/-1 vs +2/-1 vs
    +1/to-accepted+1: a=0.5: 4.05 / 3.86 / 4.04; a=0.7: 4.96 / 4.81 / 4.96; a=0.9: 7.45 / 7.48 / 7.05;
    +1/-1 was best or within 0.5% for a in 0.3..0.95, and within 3.5% of the best static gamma
    (which would need a known in advance).

    enabled=False (DynamicGammaConfig): gamma stays spec.gamma and ``update`` changes nothing.
    Raises ValueError when min_gamma exceeds the deepest tree allowed by max_nodes.
    """

    def __init__(self, spec: TreeSpec, config: DynamicGammaConfig = DynamicGammaConfig(),
                 max_nodes: int = MAX_TREE_NODES):
        self.base_spec = spec
        self.enabled = config.enabled
        self.max_nodes = max_nodes
        deepest = max_depth_for(spec, max_nodes)
        if self.enabled:
            if config.min_gamma > deepest:
                raise ValueError(
                    f"dynamic_gamma.min_gamma: {config.min_gamma} exceeds the deepest tree of this spec "
                    f"within {max_nodes} nodes ({deepest})"
                )
            self.min_gamma = config.min_gamma
            self.max_gamma = min(config.max_gamma, deepest)
            self._gamma = min(max(spec.gamma, self.min_gamma), self.max_gamma)
        else:
            self.min_gamma = self.max_gamma = self._gamma = spec.gamma
        self._specs: dict[int, TreeSpec] = {}

    @property
    def gamma(self) -> int:
        """The current speculation depth (draft steps of the next round)."""
        return self._gamma

    @property
    def spec(self) -> TreeSpec:
        """The TreeSpec at the current gamma (``spec_at_depth``, cached per gamma)."""
        if self._gamma not in self._specs:
            self._specs[self._gamma] = spec_at_depth(self.base_spec, self._gamma, self.max_nodes)
        return self._specs[self._gamma]

    def update(self, proposed_depth: int, accepted_length: int) -> int:
        """Apply the rule (class docstring) after one round; returns the new gamma.

        proposed_depth: depth of the tree actually proposed (``tree_depth(tree.parents)``), 0 for
        none; accepted_length: draft tokens on the accepted path, bonus excluded. Raises ValueError
        when either is negative or accepted_length > proposed_depth.
        """
        if proposed_depth < 0 or accepted_length < 0 or accepted_length > proposed_depth:
            raise ValueError(f"update: need 0 <= accepted_length <= proposed_depth, got accepted_length="
                             f"{accepted_length}, proposed_depth={proposed_depth}")
        if not self.enabled or proposed_depth == 0:
            return self._gamma
        if accepted_length == proposed_depth:
            if proposed_depth >= self._gamma:
                self._gamma = min(self._gamma + 1, self.max_gamma)
        else:
            self._gamma = max(self._gamma - 1, self.min_gamma)
        return self._gamma


# --------------------------------------------------------------------------- fallback


class _Window:
    """Sliding window over the last n rounds of (proposed, accepted) draft tokens."""

    def __init__(self, n: int):
        self.rounds: deque[tuple[int, int]] = deque(maxlen=n)
        self.proposed = 0
        self.accepted = 0

    def add(self, proposed: int, accepted: int) -> None:
        if len(self.rounds) == self.rounds.maxlen:
            p, a = self.rounds[0]
            self.proposed -= p
            self.accepted -= a
        self.rounds.append((proposed, accepted))
        self.proposed += proposed
        self.accepted += accepted

    @property
    def full(self) -> bool:
        return len(self.rounds) == self.rounds.maxlen

    @property
    def rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    def clear(self) -> None:
        self.rounds.clear()
        self.proposed = self.accepted = 0


def _check_counts(proposed: int, accepted: int) -> None:
    if proposed < 0 or accepted < 0 or accepted > proposed:
        raise ValueError(f"need 0 <= accepted <= proposed, got accepted={accepted}, proposed={proposed}")


class FallbackPolicy:
    """Whether one request speculates this round or runs a plain target step (DESIGN.md "Control", Fallback).

    Call ``speculate`` exactly once per round (it counts plain rounds); after a speculative round
    call ``record``; when a draft call fails (unreachable, error, deadline) call ``draft_failed``.
    Speculation is off, checked in this order (the first that holds is ``reason``):

    1. ``"draft_context_limit"``: committed_len + depth > draft_context_limit (the draft must hold
       the committed tokens plus one position per tree level). Lasts as long as it holds
       (for the rest of the request, as committed_len only grows); ``context_room`` tells the
       caller how deep a tree still fits, so it can shrink gamma instead.
    2. ``"draft_unavailable"``: for reconnect_s seconds after ``draft_failed(now)``; the first
       round at or after now + reconnect_s speculates again (a retry; another failure re-arms it).
       ``record(..., draft_s=...)`` with draft_s above draft_deadline_ms counts as a failure.
    3. ``"low_acceptance"``: the acceptance rate (accepted / proposed draft tokens) over the last
       ``window`` speculative rounds is below min_acceptance, judged on a full window only. Then
       ``probe_every`` plain rounds run (only rounds whose reason is low_acceptance count), and the
       next round speculates again as a probe with an emptied window: speculation stays on until
       the window is full again and is judged afresh.

    Sources: DESIGN.md "Control" (fallback when acceptance says speculation does not pay, when the
    draft is unreachable or slow, or at the draft's context limit). The windowed-acceptance cut-off
    with periodic probing is this project's rule: speculation pays when the expected tokens per
    round, 1 + accepted length, exceed the round's cost in plain steps (Leviathan et al. 2023,
    "Fast Inference from Transformers via Speculative Decoding", ICML, section 3 "Analysis",
    Theorem 3.8: walltime improvement factor (1 - a^(gamma+1)) / ((1 - a)(gamma*c + 1)) for a chain
    with per-token acceptance a and draft/target cost ratio c); min_acceptance is a cheap proxy of that.
    A rate per proposed node depends on the tree's width: with DEFAULT_SPEC (5 nodes, depth 3)
    it is at most 3/5 = 0.6, with SEED_SPEC (12 nodes) at most 3/12 = 0.25; set min_acceptance
    for the tree in use.

    now: seconds of the injected clock (``clock``, default time.monotonic) or None to read it.
    ``fallback_rounds``: plain rounds so far by reason; ``probes``: probes started. metrics: a
    SpecMetrics whose fallback_rounds{reason} counter is incremented with every plain round.
    """

    def __init__(self, config: FallbackConfig = FallbackConfig(), draft_context_limit: int | None = None,
                 metrics: SpecMetrics | None = None, clock: Callable[[], float] = time.monotonic):
        if draft_context_limit is not None and draft_context_limit < 1:
            raise ValueError(f"draft_context_limit: must be >= 1 tokens, got {draft_context_limit}")
        self.config = config
        self.draft_context_limit = draft_context_limit
        self.metrics = metrics
        self.clock = clock
        self.window = _Window(config.window)
        self.reason: str | None = None
        self.fallback_rounds: dict[str, int] = {r: 0 for r in FALLBACK_REASONS}
        self.probes = 0
        self.draft_failures = 0
        self._unavailable_until: float | None = None
        self._low = False
        self._plain_since_low = 0

    @property
    def deadline_s(self) -> float:
        """The draft reply deadline in seconds (draft_deadline_ms / 1000), e.g. for an RPC timeout."""
        return self.config.draft_deadline_ms / 1000.0

    @property
    def acceptance_rate(self) -> float | None:
        """Acceptance rate over the current window (None when it holds no proposed token)."""
        return self.window.rate

    def context_room(self, committed_len: int) -> int | None:
        """Tree levels the draft's context still holds (limit - committed_len), None when unlimited."""
        if self.draft_context_limit is None:
            return None
        return self.draft_context_limit - committed_len

    def speculate(self, now: float | None, committed_len: int, depth: int = 1) -> bool:
        """Decide this round: True = speculate with a tree of up to ``depth`` levels, False = plain step.

        committed_len: tokens in the request's context (prompt + committed); depth: the tree depth
        the caller means to ask for (>= 1). Sets ``reason`` (None when True) and counts the plain
        round. Raises ValueError for committed_len < 0 or depth < 1.
        """
        if committed_len < 0 or depth < 1:
            raise ValueError(f"speculate: need committed_len >= 0 and depth >= 1, got {committed_len}, {depth}")
        now = self.clock() if now is None else now
        reason = None
        if self.draft_context_limit is not None and committed_len + depth > self.draft_context_limit:
            reason = "draft_context_limit"
        elif self._unavailable_until is not None and now < self._unavailable_until:
            reason = "draft_unavailable"
        elif self._low:
            if self._plain_since_low >= self.config.probe_every:
                self._low = False
                self._plain_since_low = 0
                self.window.clear()
                self.probes += 1
                log.info("fallback: probing speculation again after %d plain rounds", self.config.probe_every)
            else:
                self._plain_since_low += 1
                reason = "low_acceptance"
        if reason is None and self._unavailable_until is not None:
            self._unavailable_until = None  # the retry
        self.reason = reason
        if reason is not None:
            self.fallback_rounds[reason] += 1
            if self.metrics is not None:
                self.metrics.fallback_rounds.labels(reason=reason).inc()
        return reason is None

    def record(self, proposed: int, accepted: int, now: float | None = None, draft_s: float | None = None) -> None:
        """Record a speculative round: proposed / accepted draft tokens, draft_s the draft's reply time (s).

        A round with proposed == 0 is ignored by the window. draft_s > draft_deadline_ms / 1000
        marks the draft unavailable (as ``draft_failed(now)``). Raises ValueError for negative
        counts or accepted > proposed.
        """
        _check_counts(proposed, accepted)
        if draft_s is not None and draft_s > self.deadline_s:
            log.warning("fallback: draft reply took %.3f s, over the %.3f s deadline", draft_s, self.deadline_s)
            self.draft_failed(now)
        if proposed == 0:
            return
        self.window.add(proposed, accepted)
        rate = self.window.rate
        if self.window.full and rate is not None and rate < self.config.min_acceptance and not self._low:
            self._low = True
            self._plain_since_low = 0
            log.info("fallback: acceptance %.3f (%d/%d draft tokens over %d rounds) < %.3f; plain decoding "
                     "for %d rounds", rate, self.window.accepted, self.window.proposed, len(self.window.rounds),
                     self.config.min_acceptance, self.config.probe_every)

    def draft_failed(self, now: float | None = None) -> None:
        """Mark the draft unavailable (unreachable, error or too slow) until now + reconnect_s."""
        now = self.clock() if now is None else now
        self.draft_failures += 1
        self._unavailable_until = now + self.config.reconnect_s


# --------------------------------------------------------------------------- both, for the controller


class RequestControl:
    """DynamicGamma + FallbackPolicy of one request, behind the round controller's control interface.

    The interface of orchestrator.controller.FixedControl: ``gamma``, ``spec(base)``,
    ``speculate(now, committed_len, depth)``, ``record(depth, proposed, accepted)``,
    ``draft_failed(now)``, ``reason``. Rules and sources: DynamicGamma and FallbackPolicy.
    Raises ValueError as DynamicGamma does (min_gamma beyond the node limit).
    """

    def __init__(self, spec: TreeSpec, dynamic_gamma: DynamicGammaConfig = DynamicGammaConfig(),
                 fallback: FallbackConfig = FallbackConfig(), draft_context_limit: int | None = None,
                 metrics: SpecMetrics | None = None, clock: Callable[[], float] = time.monotonic,
                 max_nodes: int = MAX_TREE_NODES):
        self.dynamic = DynamicGamma(spec, dynamic_gamma, max_nodes)
        self.fallback = FallbackPolicy(fallback, draft_context_limit, metrics, clock)

    @property
    def gamma(self) -> int:
        """Current speculation depth (DynamicGamma.gamma)."""
        return self.dynamic.gamma

    @property
    def reason(self) -> str | None:
        """Why the last ``speculate`` said no (FallbackPolicy.reason), None when it said yes."""
        return self.fallback.reason

    @property
    def fallback_rounds(self) -> dict[str, int]:
        """Plain rounds so far by reason."""
        return self.fallback.fallback_rounds

    def spec(self, base: TreeSpec | None = None) -> TreeSpec:
        """The tree shape at the current gamma: ``spec_at_depth(base, gamma)`` (base defaults to the request's spec)."""
        if base is None or base == self.dynamic.base_spec:
            return self.dynamic.spec
        return spec_at_depth(base, self.dynamic.gamma, self.dynamic.max_nodes)

    def speculate(self, now: float | None, committed_len: int, depth: int | None = None) -> bool:
        """FallbackPolicy.speculate with depth defaulting to the current gamma."""
        return self.fallback.speculate(now, committed_len, self.dynamic.gamma if depth is None else depth)

    def record(self, depth: int, proposed: int, accepted: int, now: float | None = None,
               draft_s: float | None = None) -> None:
        """After a speculative round: tree depth reached, proposed draft tokens (tree nodes), accepted
        draft tokens (the accepted path, bonus excluded). Updates gamma, then the fallback window.
        Raises ValueError for impossible counts (accepted > depth or > proposed, negatives)."""
        _check_counts(proposed, accepted)
        self.dynamic.update(depth, accepted)
        self.fallback.record(proposed, accepted, now, draft_s)

    def draft_failed(self, now: float | None = None) -> None:
        """FallbackPolicy.draft_failed: no speculation for reconnect_s seconds."""
        self.fallback.draft_failed(now)

    def set_draft_context_limit(self, limit: int | None) -> None:
        """The draft's max positions, learnt when its session opens (None = unlimited)."""
        if limit is not None and limit < 1:
            raise ValueError(f"draft_context_limit: must be >= 1 tokens, got {limit}")
        self.fallback.draft_context_limit = limit


# --------------------------------------------------------------------------- acceptance monitor


@dataclass
class _Track:
    """Acceptance window and alert state of one scope (a request, or global)."""

    window: _Window
    rounds: int = 0            # rounds recorded (proposed > 0)
    low_windows: int = 0       # consecutive full windows below the threshold
    alerting: bool = False
    last_window_rate: float | None = None
    alerts: int = 0


class AcceptanceMonitor:
    """Windowed acceptance rate (accepted / proposed draft tokens) per request and globally, with alerts.

    Each scope (every request id, and the global one over all requests' rounds in record order)
    keeps a sliding window of its last ``window`` rounds (``rate``). Every ``window`` rounds, i.e.
    at the end of each full, non-overlapping window, the window's rate is judged: below
    ``alert_threshold`` it extends a run of low windows, otherwise it ends the run. When the run
    reaches ``alert_windows`` the scope raises one alert (a WARNING log with the numbers and
    acceptance_alerts{scope} + 1 on ``metrics``); no further alert until it clears, which happens
    at the first judged window at or above the threshold (an INFO log).
    Rounds with proposed == 0 (plain rounds) are not recorded. With metrics, the global sliding
    rate is written to the acceptance_rate gauge after each round. Thread-safe.

    Source: this project's rule (DESIGN.md "Terms" for the acceptance rate, MonitorConfig for the
    window, threshold and run length); no paper prescribes it.
    """

    def __init__(self, config: MonitorConfig = MonitorConfig(), metrics: SpecMetrics | None = None,
                 logger: logging.Logger | None = None):
        self.config = config
        self.metrics = metrics
        self.log = logger or log
        self._global = _Track(_Window(config.window))
        self._requests: dict[str, _Track] = {}
        self._lock = threading.Lock()

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        """Record one round of a request. Raises ValueError for negative counts or accepted > proposed."""
        _check_counts(proposed, accepted)
        if proposed == 0:
            return
        with self._lock:
            track = self._requests.get(request_id)
            if track is None:
                track = self._requests[request_id] = _Track(_Window(self.config.window))
            self._add(track, "request", request_id, proposed, accepted)
            self._add(self._global, "global", None, proposed, accepted)
            if self.metrics is not None and self._global.window.rate is not None:
                self.metrics.acceptance_rate.set(self._global.window.rate)

    def rate(self, request_id: str | None = None) -> float | None:
        """Sliding-window acceptance rate of a request (None = global); None before any round."""
        track = self._track(request_id)
        return track.window.rate if track else None

    def alerting(self, request_id: str | None = None) -> bool:
        """Whether the scope's low-acceptance alert is raised and not yet cleared."""
        track = self._track(request_id)
        return bool(track and track.alerting)

    def alerts(self, request_id: str | None = None) -> int:
        """Alerts raised so far by a request (None = global)."""
        track = self._track(request_id)
        return track.alerts if track else 0

    def release(self, request_id: str) -> None:
        """Forget a finished request (its window and alert state); unknown ids are ignored."""
        with self._lock:
            self._requests.pop(request_id, None)

    finish = release  # the front's name for it

    def _track(self, request_id: str | None) -> _Track | None:
        return self._global if request_id is None else self._requests.get(request_id)

    def _add(self, track: _Track, scope: str, request_id: str | None, proposed: int, accepted: int) -> None:
        track.window.add(proposed, accepted)
        track.rounds += 1
        if track.rounds % self.config.window:
            return
        rate = track.window.rate  # the window now covers exactly the last `window` rounds
        track.last_window_rate = rate
        who = "global" if request_id is None else f"request {request_id}"
        if rate < self.config.alert_threshold:
            track.low_windows += 1
            if track.low_windows >= self.config.alert_windows and not track.alerting:
                track.alerting = True
                track.alerts += 1
                self.log.warning(
                    "acceptance alert (%s): acceptance rate %.3f (%d/%d draft tokens over the last %d rounds) "
                    "below %.3f for %d consecutive windows of %d rounds",
                    who, rate, track.window.accepted, track.window.proposed, self.config.window,
                    self.config.alert_threshold, track.low_windows, self.config.window)
                if self.metrics is not None:
                    self.metrics.acceptance_alerts.labels(scope=scope).inc()
        else:
            if track.alerting:
                self.log.info("acceptance alert cleared (%s): acceptance rate %.3f >= %.3f",
                              who, rate, self.config.alert_threshold)
            track.alerting = False
            track.low_windows = 0
