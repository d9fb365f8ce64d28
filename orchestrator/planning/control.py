"""Per-request control of the round loop (docs/control.md): plain classes, no Ray, no gRPC.

``FixedControl`` (the TreeSpec every round) and ``RequestControl`` (``DynamicGamma`` + ``FallbackPolicy``);
the default, ``CostAwareControl``, is in orchestrator.planning.cost_aware.
Terms: acceptance rate = accepted / proposed draft tokens (tree nodes); accepted length = accepted draft
tokens on the path (bonus excluded). Times are seconds from a monotonic clock (``time.monotonic`` by default).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

from specdec.config import DynamicGammaConfig, FallbackConfig
from orchestrator.planning.shaping import ShapedTree
from specdec.sampling import SamplingParams
from specdec.stats import COST_REASON
from specdec.tree import DraftTree
from specdec.tree_spec import MAX_TREE_NODES, TreeSpec, max_depth_for, spec_at_depth

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- fallback reasons

# Why a round runs without the draft (a plain target step). The values are the label values of
# specdec_fallback_rounds_total{reason} and the ``fallback.reason`` attribute of round spans.
LOW_ACCEPTANCE = "low_acceptance"  # windowed acceptance below front.fallback.min_acceptance
DRAFT_UNAVAILABLE = "draft_unavailable"  # the draft failed, is unreachable or slower than its deadline
DRAFT_CONTEXT_LIMIT = "draft_context_limit"  # the draft's context cannot hold the next tree
COST = COST_REASON  # "cost": the cost model says no draft step pays this round (CostAwareControl)
DRAFT_OPENING = "draft_opening"  # the draft session was just opened: its service prefills it beside this plain round
FALLBACK_REASONS = (LOW_ACCEPTANCE, DRAFT_UNAVAILABLE, DRAFT_CONTEXT_LIMIT, COST, DRAFT_OPENING)

EMPTY_TREE = DraftTree((), ())  # a round without the draft verifies this: one plain target step


# --------------------------------------------------------------------------- the controller's interface


@dataclass(frozen=True)
class RoundObservation:
    """What one verified round (speculative or not) tells its control (``Control.observe``); seconds."""

    shaped: ShapedTree  # the verified tree
    accepted_nodes: Sequence[int]  # the accepted path, node indices of ``shaped.tree`` (before the stop checks)
    verify_s: float  # the verify call's wall time
    draft_s: float | None = None  # the draft phase's wall time (None: the draft was not asked, or drafted ahead)
    overhead_s: float = 0.0  # the rest of the round: stop checks, commits, transport
    drafted: DraftTree = EMPTY_TREE  # the tree the draft proposed (empty: none)
    batch_size: int = 1  # sessions of the target forward that verified it (VerifyResult; 0 = no forward ran)
    batch_rows: int = 0  # rows of that forward (0 = not reported: the tree's own)
    mergeable: int = 0  # sessions open at the target, up to its max_batch (VerifyResult.mergeable; 0 = not reported)
    forward_s: float = 0.0  # that forward's own time (VerifyResult.forward_ms / 1000; 0 = not reported)
    reply_s: float | None = None  # a tree drafted ahead (pipelining; draft_s then None): the ahead's wall time


class Control:
    """Every hook the round controller calls on one request's control; optional ones default to no-ops.

    Order within a round: ``round_context``, ``speculate``; if yes ``spec``; ``shape``; ``record`` after a
    verified non-empty drafted tree; ``observe`` after every round. ``draft_failed`` on any failed draft call
    (``draft_timed_out`` first on a deadline); ``set_draft_context_limit`` and ``draft_opened`` when a draft
    session opens.
    """

    gamma: int  # speculation depth of the next tree, tree levels
    reason: str | None  # why the last ``speculate`` said no (one of FALLBACK_REASONS), None when it said yes

    def spec(self, base: TreeSpec) -> TreeSpec:
        """The tree shape of this round, from the request's TreeSpec."""
        raise NotImplementedError

    def speculate(self, now: float, committed_len: int, depth: int) -> bool:
        """True = speculate with up to ``depth`` levels, False = a plain step. now: s; committed_len: tokens."""
        raise NotImplementedError

    def draft_failed(self, now: float) -> None:
        """A draft call failed at ``now`` (seconds)."""
        raise NotImplementedError

    def record(self, depth: int, proposed: int, accepted: int) -> None:
        """After a speculative round: tree levels reached, draft tokens proposed and accepted (bonus excluded)."""

    def set_draft_context_limit(self, limit: int | None) -> None:
        """The draft's max positions, tokens (None = unlimited)."""

    def shape(self, tree: DraftTree, context: list[int], max_depth: int, sunk_ms: float) -> ShapedTree:
        """The tree to verify this round from the drafted one (possibly empty); by default as it is.
        context: [T] committed tokens; max_depth: tree levels the budget allows; sunk_ms: ms spent drafting."""
        return ShapedTree.of(tree)

    def observe(self, obs: RoundObservation) -> None:
        """After every round, speculative or not: what it verified, accepted and cost."""

    def bind_request(self, sampling: SamplingParams) -> None:
        """Once, at the request's start: its sampling parameters."""

    def defer_draft_open(self, others: int) -> bool:
        """At the request's start (others: requests in flight): True = open the draft at its first drafted round."""
        return False

    def draft_opened(self) -> None:
        """A draft session (re-)opened."""

    def round_context(self, context: Sequence[int]) -> None:
        """Right before each ``speculate``: the committed tokens [T], prompt + generated."""

    def prefill_beside(self) -> None:
        """This round runs plain while a draft service prefills the session it just opened."""

    def draft_merged(self, batch_size: int) -> None:
        """An in-line proposal's reply: ``batch_size`` sessions' tree steps shared its forwards (1 = alone)."""

    def draft_forward(self, call_s: float) -> None:
        """An in-line proposal's reply: the draft call itself took ``call_s`` seconds."""

    def draft_timed_out(self, waited_s: float) -> None:
        """A proposal (in line or ahead) got no reply within the draft deadline, ``waited_s`` seconds."""

    def cost_snapshot(self) -> dict | None:
        """The cost figures this round was planned with, for round records and metrics (None: none)."""
        return None


ControlFactory = Callable[[TreeSpec], Control]


class FixedControl(Control):
    """The request's TreeSpec every round; a failed draft is not retried, its context limit not checked."""

    def __init__(self, spec: TreeSpec):
        self.gamma = spec.gamma
        self._failed = False
        self.reason: str | None = None

    def spec(self, base: TreeSpec) -> TreeSpec:
        return base

    def speculate(self, now: float, committed_len: int, depth: int) -> bool:
        self.reason = DRAFT_UNAVAILABLE if self._failed else None
        return not self._failed

    def draft_failed(self, now: float) -> None:
        self._failed = True


# --------------------------------------------------------------------------- dynamic gamma


class DynamicGamma:
    """Speculation depth gamma of one request, adapted after every speculative round.

    Start: spec.gamma clamped to [min_gamma, max_gamma], max_gamma capped so that ``spec_at_depth(spec, gamma)``
    fits max_nodes. After a round of depth ``proposed_depth`` with ``accepted_length`` draft tokens accepted:
    whole path accepted from a tree as deep as asked (proposed_depth >= gamma): +1; whole path accepted from a
    shallower tree (cut by the budget, the draft's context or gammaThreshold): unchanged, the round says nothing
    about gamma + 1; early rejection: -1; no tree: unchanged.

    Sources: HF transformers' assisted-generation "heuristic" schedule
    (``AssistedCandidateGenerator.update_candidate_strategy``: +2, else max(1, n - 1)); llama.cpp PR #3006
    (grow only when the full draft length was accepted). +1 rather than HF's +2: on a CPU each level costs
    about a fifth of a plain target step, where on HF's GPUs depth is nearly free.
    enabled=False: gamma stays spec.gamma. Raises ValueError when min_gamma exceeds the deepest tree within max_nodes.
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
        proposed_depth: depth of the proposed tree, 0 for none; accepted_length: bonus excluded.
        Raises ValueError when either is negative or accepted_length > proposed_depth."""
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


class AcceptanceWindow:
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


def check_counts(proposed: int, accepted: int) -> None:
    """Raises ValueError unless 0 <= accepted <= proposed (draft tokens of one round)."""
    if proposed < 0 or accepted < 0 or accepted > proposed:
        raise ValueError(f"need 0 <= accepted <= proposed, got accepted={accepted}, proposed={proposed}")


class FallbackPolicy:
    """Whether one request speculates this round or runs a plain target step (docs/control.md, Fallback).

    ``speculate`` once per round (it counts plain rounds), ``record`` after a speculative round, ``draft_failed``
    when a draft call fails. Speculation is off, first match is ``reason``:
    1. ``"draft_context_limit"``: committed_len + depth > draft_context_limit, while it holds (``context_room``
       tells how deep a tree still fits);
    2. ``"draft_unavailable"``: for reconnect_s s after ``draft_failed`` (also a draft_s over the deadline);
    3. ``"low_acceptance"``: a full ``window`` of rounds below min_acceptance; after ``probe_every`` such plain
       rounds one probe speculates with an emptied window.
    min_acceptance is a cheap proxy of Leviathan et al. 2023 (ICML) §3 Theorem 3.8's walltime improvement; a
    rate per node depends on the tree's width (at most 0.6 with DEFAULT_SPEC, 0.25 with SEED_SPEC).
    now: seconds of ``clock`` or None to read it. metrics: a SpecMetrics (not imported: it imports this module)
    whose fallback_rounds{reason} counter counts every plain round.
    """

    def __init__(self, config: FallbackConfig = FallbackConfig(), draft_context_limit: int | None = None,
                 metrics=None, clock: Callable[[], float] = time.monotonic):
        if draft_context_limit is not None and draft_context_limit < 1:
            raise ValueError(f"draft_context_limit: must be >= 1 tokens, got {draft_context_limit}")
        self.config = config
        self.draft_context_limit = draft_context_limit
        self.metrics = metrics
        self.clock = clock
        self.window = AcceptanceWindow(config.window)
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
        """True = speculate with up to ``depth`` (>= 1) levels, False = plain step; sets ``reason``.
        Raises ValueError for committed_len < 0 or depth < 1."""
        if committed_len < 0 or depth < 1:
            raise ValueError(f"speculate: need committed_len >= 0 and depth >= 1, got {committed_len}, {depth}")
        now = self.clock() if now is None else now
        reason = None
        if self.draft_context_limit is not None and committed_len + depth > self.draft_context_limit:
            reason = DRAFT_CONTEXT_LIMIT
        elif self._unavailable_until is not None and now < self._unavailable_until:
            reason = DRAFT_UNAVAILABLE
        elif self._low:
            if self._plain_since_low >= self.config.probe_every:
                self._low = False
                self._plain_since_low = 0
                self.window.clear()
                self.probes += 1
                log.info("fallback: probing speculation again after %d plain rounds", self.config.probe_every)
            else:
                self._plain_since_low += 1
                reason = LOW_ACCEPTANCE
        if reason is None and self._unavailable_until is not None:
            self._unavailable_until = None  # the retry
        self.reason = reason
        if reason is not None:
            self.fallback_rounds[reason] += 1
            if self.metrics is not None:
                self.metrics.fallback_rounds.labels(reason=reason).inc()
        return reason is None

    def record(self, proposed: int, accepted: int, now: float | None = None, draft_s: float | None = None) -> None:
        """Record a speculative round: proposed / accepted draft tokens, draft_s the draft's reply time (s);
        a draft_s over the deadline counts as ``draft_failed``. Raises ValueError for impossible counts."""
        check_counts(proposed, accepted)
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

    def set_draft_context_limit(self, limit: int | None) -> None:
        """The draft's max positions (None = unlimited). Raises ValueError for a limit < 1."""
        if limit is not None and limit < 1:
            raise ValueError(f"draft_context_limit: must be >= 1 tokens, got {limit}")
        self.draft_context_limit = limit

    def draft_failed(self, now: float | None = None) -> None:
        """Mark the draft unavailable (unreachable, error or too slow) until now + reconnect_s."""
        now = self.clock() if now is None else now
        self.draft_failures += 1
        self._unavailable_until = now + self.config.reconnect_s


# --------------------------------------------------------------------------- both


class RequestControl(Control):
    """DynamicGamma + FallbackPolicy of one request behind ``Control``. Raises ValueError as DynamicGamma does."""

    def __init__(self, spec: TreeSpec, dynamic_gamma: DynamicGammaConfig = DynamicGammaConfig(),
                 fallback: FallbackConfig = FallbackConfig(), draft_context_limit: int | None = None,
                 metrics=None, clock: Callable[[], float] = time.monotonic,
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
        """FallbackPolicy.speculate for min(gamma, depth) levels (depth None = no cap)."""
        gamma = self.dynamic.gamma
        return self.fallback.speculate(now, committed_len, gamma if depth is None else min(gamma, depth))

    def record(self, depth: int, proposed: int, accepted: int, now: float | None = None,
               draft_s: float | None = None) -> None:
        """After a speculative round: gamma, then the fallback window. Raises ValueError for impossible counts."""
        check_counts(proposed, accepted)
        self.dynamic.update(depth, accepted)
        self.fallback.record(proposed, accepted, now, draft_s)

    def draft_failed(self, now: float | None = None) -> None:
        """FallbackPolicy.draft_failed: no speculation for reconnect_s seconds."""
        self.fallback.draft_failed(now)

    def set_draft_context_limit(self, limit: int | None) -> None:
        self.fallback.set_draft_context_limit(limit)
