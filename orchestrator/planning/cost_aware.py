"""The default per-request control: cost-aware tree shaping (``orchestrator.planning.shaping``) each round.

``CostAwareControl`` implements the round loop's ``Control`` (orchestrator.planning.control). What it
decides, per round:

- ``speculate`` / ``spec``: whether to draft at all (``plan_depth``: the best number of steps g,
  g = 0 being a round without the draft, reason ``"cost"``, which still verifies the free context
  branches), and the draft's early-stop threshold (``stop_threshold``), which sets the depth: the
  draft goes on while its best path is likely enough to pay for a step, up to the budget. The first
  round of a request never drafts: the target's prefill then gives the first token as soon as
  target-only decoding would (TTFT), and the draft's prefill moves to the second round;
- ``shape``: the nodes to verify, context branches merged (``shape_tree``);
- ``observe``: calibrations, per-depth value estimates and the shared cost model learn from the round.

A draft that is always wrong drives the calibrated values to zero, so g = 0 wins the comparison and
the request decodes without drafting: no separate low-acceptance rule. One draft step is still
tried after ``probe_every`` rounds without one (counted over all the requests sharing the state),
since nothing else would show that the draft got better; under load on shared compute, where not
even a draft that is always right could pay at the current costs (``could_pay``: plain batched
decoding wins whatever the acceptance), four times less often: such a probe only re-times the
draft, and takes every request's compute and, for a deferred draft, a prefill. Draft failures and
the draft's context limit keep their rules (``FallbackPolicy``, its low-acceptance cut-off switched
off).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from orchestrator.planning.cost_model import CostModel, LoadedCost
from orchestrator.planning.control import COST, Control, FallbackPolicy, RoundObservation
from orchestrator.planning.shaping import (
    AcceptanceCalibration, ContextCalibration, Lookup, ShapedTree, context_path, observe_verified, shape_tree,
)
from specdec.config import CostAwareConfig, FallbackConfig
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, ancestors, node_depths
from specdec.tree_spec import MAX_TREE_NODES, TreeSpec, max_depth_for, spec_at_depth

LOADED = 1.5  # sessions (moving average) from which other requests count as running: load-aware rules apply
UNPAYING_PROBE_FACTOR = 4  # probes come this much less often where no acceptance could make the draft pay


@dataclass
class SharedState:
    """What the requests of one front (or one embedded engine) learn together: the cost model, the
    load and merge shares, and the front-wide estimates that seed each request's own."""

    cost: CostModel = field(default_factory=CostModel)
    estimates: Estimates = field(default_factory=lambda: Estimates())  # every request's verified rounds
    rounds_without_draft: int = 0  # across requests, since any request last drafted (the probe counts these)
    load: float = 1.0  # sessions a verify forward holds or could hold, moving average over every request's rounds
    shared_compute: bool = False  # draft and target on the same hardware (specdec.placement; set at connect)
    draft_queue: float = 0.0  # the draft's queueing under load on its own device (LoadedCost.queue_factor)
    # under load on shared compute: the share of the other requests whose tree steps share a request's
    # draft forwards (LoadedCost.merged_sessions); starts at 0 (each step alone), learnt from replies
    draft_merge: float = 0.0
    # under load: the share of the other requests whose verifies share a drafted round's verify forward
    # (LoadedCost.verify_sessions); starts at 1 (rounds in step: the symmetric goodput case), learnt
    # from drafted rounds, back to 1 when rounds run alone again
    verify_merge: float = 1.0
    # under light load on shared compute the requests draft or decode plain together (``in_step_applies``);
    # False: each request plans alone with the learnt shares (fronts take CostAwareConfig.in_step)
    in_step: bool = False
    in_step_max_load: float = 8.5  # in step below this load only (CostAwareConfig.in_step_max_load)
    draft_cost_from_forward: bool = False  # D from the draft call's own time (CostAwareConfig.draft_cost_from)

    def in_step_applies(self) -> bool:
        """Whether this round's plan is the batch's (``CostAwareControl.speculate``): ``in_step`` is on,
        the draft shares the target's compute and other requests run, fewer than ``in_step_max_load``
        sessions per verify forward (1.5 <= load < in_step_max_load, default 8.5: up to eight requests).

        Requests whose rounds keep in step share every draft step (the draft service merges
        proposals that arrive together) and every verify forward (the target's batcher): a drafted
        round costs D(load p) per step and V(load rows) (``in_step_cost``). A request that drafts while
        the others decode plain reaches the target a draft's time after them and verifies alone, and
        such a mix drifts apart for good; so under load whether to draft is decided from the
        front-wide ``estimates.depths`` and every request follows it. The front's round clock
        (orchestrator.planning.lockstep) keeps the rounds in step; beyond ``in_step_max_load`` in step
        brought nothing."""
        return self.in_step and self.shared_compute and LOADED <= self.load < self.in_step_max_load

    def in_step_cost(self) -> LoadedCost:
        """The batch's costs when every request drafts alike (goodput's symmetric case, Liu et al.
        2024, SmartSpec section 4): draft steps and verifies merged across the ``load`` requests."""
        return LoadedCost(self.cost, self.load, self.shared_compute, 0.0, draft_merge=1.0, verify_merge=1.0)

    def queue_learns(self) -> bool:
        """Whether a draft reply's wall time now teaches ``draft_queue`` rather than D: the draft has its
        own device and other requests run (load >= 1.5). Their steps and prefills queue on the one
        draft, so the reply's time beyond D is queueing; learnt as D it would outlast the load."""
        return not self.shared_compute and self.load >= LOADED

    def observe_draft_queue(self, observed_ms: float, steps_ms: float, lower_bound: bool = False,
                            alpha: float = 0.3) -> None:
        """One draft reply under load: ``observed_ms`` wall time for steps that D prices at ``steps_ms``.
        Its queue share is (observed / steps - 1) / (load - 1), clamped to [0, 8], folded in as a
        moving average. lower_bound: the reply never came (its deadline), so the share is at least
        that: it only raises ``draft_queue``."""
        if steps_ms <= 0 or self.load < LOADED:
            return
        share = min(max((observed_ms / steps_ms - 1.0) / (self.load - 1.0), 0.0), 8.0)
        if lower_bound and share <= self.draft_queue:
            return
        self.draft_queue += alpha * (share - self.draft_queue)

    def merge_learns(self) -> bool:
        """Whether the draft's replies teach ``draft_merge``: the draft shares the target's compute and
        other requests run (load >= 1.5), so merged draft steps take that compute once."""
        return self.shared_compute and self.load >= LOADED

    def observe_draft_merge(self, batch_size: int, alpha: float = 0.3) -> None:
        """One in-line draft reply on shared compute under load (``merge_learns``): its forwards held
        ``batch_size`` sessions (``_share`` of the other requests), folded into ``draft_merge`` as a
        moving average. Requests whose rounds keep
        in step (merged verifies, then proposals that arrive together) share every draft step; rounds
        that drift apart draft alone, each step then taking the compute every request's verify needs.
        The priced step is ``LoadedCost.draft_step_ms`` (goodput, Liu et al. 2024, SmartSpec section 4)."""
        if self.merge_learns():
            self.draft_merge += alpha * (self._share(batch_size) - self.draft_merge)

    def observe_verify_merge(self, batch_size: int, alpha: float = 0.3) -> None:
        """One drafted round's verify forward under load (1.5 sessions or more), on any placement: it
        held ``batch_size`` sessions (``_share`` of the other requests), folded into ``verify_merge`` as
        a moving average. A drafted round reaches the target a draft's time after the plain rounds of
        the others, so it misses their merged forward unless the others drafted alike. Not a probe's
        round (it drafts alone by design) nor a session's first drafted round (it also waited for the
        draft's prefill)."""
        if self.load >= LOADED:
            self.verify_merge += alpha * (self._share(batch_size) - self.verify_merge)

    def _share(self, batch_size: int) -> float:
        """The other requests a forward of ``batch_size`` sessions held: (batch_size - 1) / (load - 1) in [0, 1]."""
        return min(max((batch_size - 1) / (self.load - 1.0), 0.0), 1.0)

    def observe_load(self, batch_size: int, alpha: float = 0.3) -> None:
        """One round's load: the sessions its verify forward held, or the target's open sessions
        (up to max_batch) when more (``CostAwareControl.observe``); 1 in-process. A rise is taken
        at once (the sessions are there now: speculation backs off before it costs the batch), a
        fall as a moving average. Once rounds run alone again (load under 1.1) ``verify_merge``
        starts over at 1: the next burst of requests may keep in step where this one did not."""
        load = max(batch_size, 1)
        self.load = float(load) if load > self.load else self.load + alpha * (load - self.load)
        if self.load < 1.1:
            self.verify_merge = 1.0

    def probe_interval(self, probe_every: int) -> float:
        """Rounds without a draft step (over all requests) before one is tried: ``probe_every``, times
        the load when the draft shares the target's compute (each probe then takes every request's
        compute, and the shared count grows with the number of requests)."""
        return probe_every * (self.load if self.shared_compute else 1.0)

    def defer_draft(self) -> bool:
        """Whether a new request should not prefill the draft until a round decides to draft: the
        draft shares the target's compute, where its prefill beside the target's would delay the first
        token (and under load every arriving request's would take the compute at once). Deferred, a
        draft service prefills beside the round that opens it, run plain; a seeded sampled request's
        round waits for that prefill and drafts (its trees must not depend on timings)."""
        return self.shared_compute

    def planning_cost(self) -> CostModel | LoadedCost:
        """The cost model the planning uses: ``LoadedCost`` at the current load (goodput), the model
        itself when rounds run alone (a load under 1.1 is noise of an occasional merge)."""
        if self.load < 1.1:
            return self.cost
        queue = self.draft_queue if self.queue_learns() else 0.0  # learnt and priced at the same loads
        return LoadedCost(self.cost, self.load, self.shared_compute, queue, self.draft_merge, self.verify_merge)


@dataclass
class DepthEstimates:
    """Per-depth expectations of one request (or of a front), exponential moving averages over drafted rounds.

    value[d-1]: expected sum of kept node values at depth d; rows[d-1]: expected kept nodes at
    depth d. Depths not seen yet extrapolate geometrically (ratio of the last two, in [0.3, 0.9]).
    """

    value: list[float] = field(default_factory=lambda: [0.6])
    rows: list[float] = field(default_factory=lambda: [1.0])
    alpha: float = 0.3

    def ratio(self) -> float:
        if len(self.value) < 2 or self.value[-2] <= 0:
            return 0.7
        return min(max(self.value[-1] / self.value[-2], 0.3), 0.9)

    def at(self, d: int) -> tuple[float, float]:
        """(expected value, expected rows) at depth d >= 1."""
        if d <= len(self.value):
            return self.value[d - 1], self.rows[d - 1]
        return self.value[-1] * self.ratio() ** (d - len(self.value)), self.rows[-1]

    def update(self, d: int, value: float, rows: float) -> None:
        while len(self.value) < d:
            v, r = self.at(len(self.value) + 1)
            self.value.append(v)
            self.rows.append(r)
        self.value[d - 1] += self.alpha * (value - self.value[d - 1])
        self.rows[d - 1] += self.alpha * (rows - self.rows[d - 1])


@dataclass
class Estimates:
    """What verified rounds teach about acceptance: the calibrations (orchestrator.planning.shaping)
    and the per-depth values. A request's (``for_request``) start from the front's and feed them:
    each ``observe_*`` updates the request's, then its ``front``'s."""

    calib: AcceptanceCalibration = field(default_factory=AcceptanceCalibration)
    ctx_calib: ContextCalibration = field(default_factory=ContextCalibration)
    depths: DepthEstimates = field(default_factory=DepthEstimates)
    front: Estimates | None = None

    @classmethod
    def for_request(cls, front: Estimates) -> Estimates:
        """A request's: calibrations with the front's as their prior, per-depth values of its own."""
        return cls(AcceptanceCalibration(front.calib), ContextCalibration(front.ctx_calib), DepthEstimates(), front)

    def _scopes(self) -> tuple[Estimates, ...]:
        return (self,) if self.front is None else (self, self.front)

    def observe_verified(self, shaped: ShapedTree, accepted_nodes: Sequence[int]) -> None:
        for scope in self._scopes():
            observe_verified(shaped, accepted_nodes, scope.calib, scope.ctx_calib)

    def observe_depth(self, d: int, value: float, rows: float) -> None:
        for scope in self._scopes():
            scope.depths.update(d, value, rows)


@dataclass
class RequestState:
    """One request's planning state between rounds (the front's is ``SharedState``)."""

    estimates: Estimates  # its own, feeding the front's (``Estimates.for_request``)
    context_value: float = 0.0  # EMA of the kept context nodes' values per round
    context_rows: float = 0.0  # EMA of the kept context nodes per round
    raw_per_value: float = 1.0  # EMA of raw best path probability / its calibrated value
    rounds: int = 0  # rounds observed
    draft_warm: bool = False  # the draft session has prefilled (its first tree is done)
    drafted_depth: int = 0  # steps of the last tree the draft returned (0: none yet)
    draft_batch: int = 1  # sessions that shared the last in-line proposal's draft forwards (draft_merged)
    draft_call_s: float | None = None  # the last in-line proposal's draft call, no queue (draft_forward)
    probing: bool = False  # this round drafts as a probe (one request alone: its reply says nothing of merging)
    in_step: bool = False  # this round's plan was the batch's (SharedState.in_step_applies)
    planned_spec: TreeSpec | None = None  # the tree shape the last drafting plan chose
    context: Sequence[int] | None = None  # this round's committed tokens (round_context), until speculate
    beside_prefill: bool = False  # this round's forward ran beside a draft prefill (prefill_beside), until observe


def plan_depth(est: DepthEstimates, cost: CostModel | LoadedCost, heads: list[int], max_steps: int,
               context_value: float = 0.0, context_rows: float = 0.0,
               context_path: Sequence[float] | None = None) -> tuple[int, float]:
    """The number of draft steps g in [0, max_steps] with the best predicted rate, and that rate.

    heads: [max_steps] parents expanded by each step (the TreeSpec's topHead); context_*: expected
    value and rows of the free context branch, present whatever g is. Rate(g) = (1 + context_value +
    sum of value(d), d <= g) / (D(heads[0]) + ... + D(heads[g-1]) + V(1 + context_rows + sum of
    rows(d)) + overhead), in tokens per ms; under load a drafted round's verify is priced as one
    that may not share the others' forward (``LoadedCost.drafted_verify``), a plain round's as one
    that does (``verify``).

    context_path: [m] this round's own branch (``orchestrator.planning.shaping.context_path``: value k = the
    chance its first k tokens are accepted); when given it replaces context_value / context_rows
    (its sum and length), and the draft's value at depth d <= m counts only where the branch fails
    by depth d, value(d) * (1 - context_path[d-1]): where the branch holds, the accepted token at d is
    the branch's, which a draft node either repeats (the same node, merged) or misses. Drafting thus
    stops paying where the context already gives a long, likely run (copying a prompt's passage).
    """
    if context_path is not None:
        context_value, context_rows = sum(context_path), len(context_path)
    path = list(context_path or ())
    tokens, rows = 1.0 + context_value, 1.0 + context_rows
    best_g, best_rate = 0, tokens / cost.round_ms(round(rows))
    draft_ms = 0.0
    for g in range(1, max_steps + 1):
        v, r = est.at(g)
        if g <= len(path):
            v *= 1.0 - path[g - 1]
        tokens += v
        rows += r
        draft_ms += cost.draft_step_ms(heads[g - 1])
        rate = tokens / (draft_ms + cost.drafted_verify(rows) + cost.round_overhead_ms)
        if rate > best_rate:
            best_g, best_rate = g, rate
    return best_g, best_rate


def could_pay(cost: CostModel | LoadedCost, heads: list[int], max_steps: int) -> bool:
    """Whether some number of draft steps beats a round without the draft when every drafted token
    is accepted (value 1 and one row per depth: the most any draft can bring, ``plan_depth``'s
    rate); False where plain decoding wins whatever the acceptance, as under load on shared compute
    once the batch's verify is compute-bound (SmartSpec's goodput, Liu et al. 2024, section 4).

    heads: [max_steps] parents expanded by each step (the TreeSpec's topHead)."""
    perfect = DepthEstimates(value=[1.0] * max_steps, rows=[1.0] * max_steps)
    return max_steps >= 1 and plan_depth(perfect, cost, heads, max_steps)[0] > 0


def stop_threshold(cost: CostModel | LoadedCost, rate: float, heads: int, width: int, decay: float, raw_per_value: float,
                   lookahead: int = 3) -> float:
    """The draft's gammaThreshold for this round: deepening stops when the best path probability
    falls below the value one more step must bring to pay for itself.

    One more step costs D(heads) plus ``width`` verify rows (the slope of V). It brings the best
    node's child, worth value(best) * decay tokens, and opens the way to the steps after it: with
    ``lookahead`` more steps at the same decay the gain is value(best) * (decay + ... +
    decay^lookahead) tokens (a one-step rule stops confident chains too early). A token is worth
    1 / rate ms at the round's rate (tokens per ms), so the threshold on calibrated value is
    cost * rate / (decay + ... + decay^lookahead); ``raw_per_value`` converts it to the draft's raw
    path probability. Clamped to [0, 0.95].
    """
    step_ms = cost.draft_step_ms(heads) + width * max(cost.drafted_verify(2) - cost.drafted_verify(1), 0.0)
    decay = min(max(decay, 1e-3), 0.99)
    gain = sum(decay ** k for k in range(1, lookahead + 1))
    threshold = step_ms * rate / gain * raw_per_value
    return min(max(threshold, 0.0), 0.95)


class CostAwareControl(Control):
    """Cost-aware control of one request (module docstring).

    spec: the request's TreeSpec, an upper bound on widths (rows past its gamma repeat its last
    row, up to max_gamma steps); shared: the front-wide SharedState; fallback: draft failure and
    context-limit rules (FallbackConfig; its min_acceptance is ignored); ngram_tokens / max_ngram:
    the context branch (0 tokens = off); first_round_plain: the TTFT rule; lookup: replaces the n-gram
    lookup (tests script the context branch). What the request learns between rounds is ``state``
    (RequestState), what the front learns ``shared``.
    """

    def __init__(self, spec: TreeSpec, shared: SharedState | None = None, fallback: FallbackConfig = FallbackConfig(),
                 max_gamma: int = 10, ngram_tokens: int = 8, max_ngram: int = 3, probe_every: int = 16,
                 first_round_plain: bool = True, max_nodes: int = MAX_TREE_NODES, clock=time.monotonic,
                 lookup: Lookup | None = None):
        self.base = spec
        self.shared = shared or SharedState()
        self.fallback = FallbackPolicy(fallback.model_copy(update={"min_acceptance": 0.0}), clock=clock)
        self.max_gamma = max(max_gamma, 1)
        self.max_nodes = max_nodes
        self.ngram_tokens, self.max_ngram = ngram_tokens, max_ngram
        self.probe_every = probe_every
        self.first_round_plain = first_round_plain
        self.lookup = lookup  # None = the n-gram lookup (orchestrator.planning.shaping.ngram_continuation)
        self.timing_free = False  # a seeded sampled request (bind_request): no timing-dependent decisions
        self.state = RequestState(Estimates.for_request(self.shared.estimates))
        self.gamma = 0  # draft steps planned for this round
        self.reason: str | None = None

    def bind_request(self, sampling: SamplingParams) -> None:
        """The request's SamplingParams (the round controller calls this once). A sampled request
        with a seed must give the same tokens every run, and its random draws follow the tree's
        shape, so its trees must not depend on timings: it gets the request's TreeSpec every round,
        verified as drafted (the fixed control's behaviour), with the draft-failure rules kept."""
        self.timing_free = sampling.seeded

    # ----------------------------------------------------------------- before drafting

    def round_context(self, context: Sequence[int]) -> None:
        """This round's committed tokens [T] (prompt + generated), given before ``speculate``: the
        plan then values this round's own context branch (``context_path``: its match length and
        calibrated chances) instead of the average branch of past rounds."""
        self.state.context = context

    def _first_round(self) -> bool:
        """The TTFT rule holds this round: the first token comes from the target's prefill alone."""
        return self.first_round_plain and self.state.rounds == 0

    def speculate(self, now: float | None, committed_len: int, depth: int) -> bool:
        """Plan this round (``plan_depth``) under ``depth`` levels; False = no draft this round."""
        st = self.state
        st.probing = st.in_step = False
        context, st.context = st.context, None
        if self.timing_free:
            self.gamma = min(depth, self.base.gamma)
            speculate = self.fallback.speculate(now, committed_len, self.gamma)
            self.reason, st.planned_spec = self.fallback.reason, self.base
            return speculate
        max_steps = min(depth, self.max_gamma, self._deepest())
        if not self.fallback.speculate(now, committed_len, 1):
            self.reason, self.gamma = self.fallback.reason, 0
            return False
        heads = list(spec_at_depth(self.base, max(max_steps, 1), self.max_nodes).top_head)
        st.in_step = self.shared.in_step_applies()
        # under load: the batch's goodput (LoadedCost), in step the symmetric case
        cost = self.shared.in_step_cost() if st.in_step else self.shared.planning_cost()
        g, rate, max_steps = self._plan(context, cost, heads, max_steps, depth)
        if self._first_round():
            g = 0
        elif g == 0 and max_steps >= 1 and self._probe_due(cost, heads, max_steps):
            g = 1  # probe: has the draft become worth it? (counted across requests: short ones probe too)
            self.shared.rounds_without_draft = 0
            st.probing = True
        self.gamma, self.reason = g, (None if g else COST)
        if g:
            # g decides whether to draft; how deep is the draft's own early stop on its confidence
            # (the threshold), up to every step the budget allows: depths the estimates undervalue
            # are still reached when the draft is sure, so the estimates keep learning them.
            width = sum(self.base.top_k_spec[-1])
            threshold = stop_threshold(cost, rate, heads[max_steps - 1], width,
                                       st.estimates.depths.ratio(), st.raw_per_value)
            spec = spec_at_depth(self.base, max_steps, self.max_nodes)
            st.planned_spec = spec.model_copy(update={"gamma_threshold": max(threshold, spec.gamma_threshold)})
        return g > 0

    def _plan(self, context: Sequence[int] | None, cost: CostModel | LoadedCost, heads: list[int], max_steps: int,
              depth: int) -> tuple[int, float, int]:
        """(draft steps g, predicted rate, max steps) of this round: the request's own ``plan_depth``,
        valuing this round's context branch; in step, the batch's plan over the front's estimates."""
        st = self.state
        path = None
        if context is not None and not self._first_round():
            path = context_path(context, st.estimates.ctx_calib, cost, cost.round_overhead_ms, self.ngram_tokens,
                                self.max_ngram, depth, self.lookup)
        g, rate = plan_depth(st.estimates.depths, cost, heads, max_steps, st.context_value, st.context_rows, path)
        if st.in_step:
            # the batch's plan, the same for every request; each drafting request at least one step
            # and at most one past the batch's best depth (the others' verifies wait for the deepest)
            batch_g, batch_rate = plan_depth(self.shared.estimates.depths, cost, heads, max_steps)
            if not batch_g:
                return 0, rate, max_steps
            max_steps = min(max_steps, batch_g + 1)
            g, rate = min(max(g, 1), max_steps), batch_rate
        return g, rate, max_steps

    def _probe_due(self, cost: CostModel | LoadedCost, heads: list[int], max_steps: int) -> bool:
        """Whether enough rounds ran without the draft (over all requests) for a probe:
        ``SharedState.probe_interval``, times UNPAYING_PROBE_FACTOR under load on shared compute where
        not even an always-right draft could pay at the current costs (``could_pay``). There a probe
        can change no plan through the acceptance it measures, only through the draft costs it
        re-times (which only drafted rounds teach), and it takes every request's compute plus, for a
        deferred draft, a prefill."""
        interval, waited = self.shared.probe_interval(self.probe_every), self.shared.rounds_without_draft
        if waited < interval:
            return False
        loaded = self.shared.shared_compute and self.shared.load >= LOADED
        return not loaded or waited >= interval * UNPAYING_PROBE_FACTOR or could_pay(cost, heads, max_steps)

    def defer_draft_open(self, others: int = 0) -> bool:
        """Whether the round loop should open the draft at the first drafted round instead of at the
        request's start: ``SharedState.defer_draft`` (the draft shares the target's compute; with
        ``first_round_plain`` off only while other requests run, as a lone request may then draft its
        first round), or on the draft's own device other requests are running (load >= 1.5; others:
        the front's other requests in flight) and, at the current costs, a new request's plan would not draft
        (a draft whose replies queue behind other sessions' steps and prefills prices itself out:
        ``draft_timed_out``); opening it anyway would add one more prefill to that queue."""
        if self.shared.defer_draft() and (self.first_round_plain or others >= 1 or self.shared.load >= LOADED):
            return True  # first_round_plain off: a lone request may draft round 1, its draft opened at the start
        if self.timing_free or self.shared.load < LOADED or others == 0:  # alone now: a past burst's load is stale
            return False
        st = self.state
        max_steps = min(self.max_gamma, self._deepest())
        heads = list(spec_at_depth(self.base, max_steps, self.max_nodes).top_head)
        g, _ = plan_depth(st.estimates.depths, self.shared.planning_cost(), heads, max_steps,
                          st.context_value, st.context_rows)
        return g == 0

    def _deepest(self) -> int:
        try:
            return max(1, min(self.max_gamma, max_depth_for(self.base, self.max_nodes)))
        except ValueError:
            return 1

    def spec(self, base: TreeSpec | None = None) -> TreeSpec:
        """The tree shape planned by the last ``speculate`` (the request's spec before any plan)."""
        return self.state.planned_spec or self.base

    # ----------------------------------------------------------------- after drafting

    def shape(self, tree: DraftTree, context: list[int], max_depth: int, sunk_ms: float) -> ShapedTree:
        """The tree to verify: drafted nodes that pay plus the context branch (``shape_tree``), priced
        as this round was planned (in step: ``SharedState.in_step_cost``)."""
        cost = self.shared.in_step_cost() if self.state.in_step else self.shared.planning_cost()
        if self.timing_free or self._first_round():  # TTFT: the first token from the prefill
            return ShapedTree.of(tree)
        estimates = self.state.estimates
        return shape_tree(tree, context, estimates.calib, estimates.ctx_calib, cost, sunk_ms + cost.round_overhead_ms,
                          self.ngram_tokens, self.max_ngram, max_depth, self.lookup)

    def observe(self, obs: RoundObservation) -> None:
        """Learn from a verified round: the estimates (the request's and the front's), the shared cost
        model and load (``_learn_costs``)."""
        st, shaped = self.state, obs.shaped
        st.rounds += 1
        if self.timing_free:
            return
        # the first round's empty verify reuses the prefill's logits: no forward ran, its ~1 ms says
        # nothing about V(1) (taken as a figure, it made drafting look 1000x dearer than verifying)
        no_forward = (st.rounds == 1 and not shaped.tree.size) or obs.batch_size == 0  # 0: a replayed result
        beside_prefill, st.beside_prefill = st.beside_prefill, False
        st.estimates.observe_verified(shaped, obs.accepted_nodes)
        ctx = [i for i, d in enumerate(shaped.draft_index) if d is None]
        st.context_value += 0.3 * (sum(shaped.values[i] for i in ctx) - st.context_value)
        st.context_rows += 0.3 * (len(ctx) - st.context_rows)
        drafted = bool(self.gamma and obs.drafted.size)
        warm = st.draft_warm  # False: this drafted round also waited for the draft's prefill
        if drafted:
            parents_per_step = self._learn_drafted(obs)
        else:
            parents_per_step = []
            self.shared.rounds_without_draft += 1
        self._learn_costs(obs, no_forward, drafted and warm, parents_per_step, beside_prefill)
        st.draft_call_s = None

    def _learn_drafted(self, obs: RoundObservation) -> list[int]:
        """A drafted round: per-depth values and the raw/value ratio; returns the parents the draft
        expanded per step where its time was a step's cost (not the session's first tree, which also
        prefilled the draft), else []."""
        st, shaped = self.state, obs.shaped
        self.shared.rounds_without_draft = 0
        depths = node_depths(shaped.tree.parents)
        drafted_depths = node_depths(obs.drafted.parents)
        st.drafted_depth = max(drafted_depths, default=0)
        for d in range(1, st.planned_spec.gamma + 1):  # depths the draft stopped short of count as 0
            kept = [i for i, dd in enumerate(depths) if dd == d and shaped.draft_index[i] is not None]
            st.estimates.observe_depth(d, sum(shaped.values[i] for i in kept), len(kept))
        parents_per_step: list[int] = []
        if st.draft_warm:
            parents_per_step = _parents_per_step(obs.drafted, drafted_depths)
            if st.draft_batch > 1 and obs.draft_s and not self.shared.queue_learns():  # D(b p) per step
                parents_per_step = [p * st.draft_batch for p in parents_per_step]
        st.draft_batch = 1
        st.draft_warm = True
        self._learn_raw_ratio(obs.drafted, shaped)
        return parents_per_step

    def _learn_costs(self, obs: RoundObservation, no_forward: bool, drafted_warm: bool, parents_per_step: list[int],
                     beside_prefill: bool) -> None:
        """The shared load, merge and queue shares and cost model from the round's timings.

        The load is the larger of the forward's sessions (``batch_size``) and the target's open ones
        (``mergeable``): speculative rounds of concurrent requests drift apart and share few
        forwards, yet each row they verify still takes the batch's time from the others, and plain
        decoding would merge every open session. V(rows) learns from the target's own forward time
        where reported (``forward_s``): ``verify_s`` also holds transport and, under load, the wait
        behind other sessions' forwards, which does not grow with this tree's rows. A tree drafted
        ahead teaches D nothing (off the critical path), but under load its ``reply_s`` shows the
        draft's queue as an in-line reply does. A forward beside a draft prefill teaches no cost."""
        shared = self.shared
        if no_forward:  # the open sessions are known even when no forward ran (the first round)
            if obs.mergeable:
                shared.observe_load(obs.mergeable)
            return
        if drafted_warm and not self.state.probing:  # before the load moves: the share is of this load
            shared.observe_verify_merge(obs.batch_size)
        shared.observe_load(max(obs.batch_size, obs.mergeable))
        rows = obs.batch_rows or obs.shaped.tree.size + 1  # the forward's rows decide its latency
        reply = obs.draft_s or obs.reply_s
        if parents_per_step and reply and shared.queue_learns():
            shared.observe_draft_queue(reply * 1000, shared.cost.draft_ms(parents_per_step))
            parents_per_step = []  # the reply's time beyond D was the queue's, not D's
        # D from the draft call's own time only with draft_cost_from "forward": by default from the
        # reply's wall time, which also holds transport and the wait behind other sessions' proposals
        # and prefills, a drafted round's cost too (learnt from the call, the plan drafted more under
        # load and was no faster)
        call_s = self.state.draft_call_s if shared.draft_cost_from_forward else None
        if not beside_prefill:  # a forward slowed by a draft prefill beside it is not V's
            shared.cost.observe_round(rows, obs.forward_s or obs.verify_s, parents_per_step, call_s or obs.draft_s,
                                      obs.overhead_s)

    def _learn_raw_ratio(self, drafted: DraftTree, shaped: ShapedTree) -> None:
        """raw best path probability / calibrated value of the deepest kept draft node."""
        best = max((i for i, d in enumerate(shaped.draft_index) if d is not None), key=lambda i: shaped.values[i],
                   default=None)
        if best is None or not drafted.draft_logprobs:
            return
        j = shaped.draft_index[best]
        raw = math.exp(sum(drafted.draft_logprobs[n] for n in ancestors(drafted.parents, j)))
        value = shaped.values[best]
        if value > 1e-6:
            self.state.raw_per_value += 0.2 * (min(raw / value, 5.0) - self.state.raw_per_value)

    def cost_snapshot(self) -> dict:
        """The shared cost model's figures (CostModel.snapshot) and the shared load, draft queue and
        draft and verify merge shares (``SharedState``), as they stand after this round's ``observe``, and whether
        this round's plan was the batch's (``in_step``), for round records and metrics."""
        return {**self.shared.cost.snapshot(), "load": round(self.shared.load, 2),
                "draft_queue": round(self.shared.draft_queue, 3), "draft_merge": round(self.shared.draft_merge, 3),
                "verify_merge": round(self.shared.verify_merge, 3), "in_step": self.state.in_step}

    # ----------------------------------------------------------------- the rest of the interface

    def record(self, depth: int, proposed: int, accepted: int, now: float | None = None,
               draft_s: float | None = None) -> None:
        """After a speculative round (the controller's common hook): draft deadline accounting."""
        self.fallback.record(proposed, accepted, now, draft_s)

    def prefill_beside(self) -> None:
        """This round runs plain beside the draft service's prefill of the session it opened
        (``draft_opening``): its verify forward may have shared the compute with that prefill, so
        ``observe`` does not teach V(rows) nor the round overhead from it (one slowed V sample per
        request would make plain rounds look dearer)."""
        self.state.beside_prefill = True

    def draft_opened(self) -> None:
        """A draft session (re-)opened: its first drafted round also prefills it, so that round's
        draft time is not a step's cost (the round loop calls this after each draft start)."""
        self.state.draft_warm = False

    def draft_failed(self, now: float | None = None) -> None:
        self.fallback.draft_failed(now)

    def draft_merged(self, batch_size: int) -> None:
        """An in-line proposal's reply: its draft forwards held ``batch_size`` sessions (the draft
        service merged concurrent proposals). On shared compute under load it teaches the merge share
        (``SharedState.observe_draft_merge``; not the session's first proposal, which also waited for
        its prefill, nor a probe, which drafts alone by design), and this round's draft time is then
        D(batch_size p) per step, not D(p)."""
        st = self.state
        st.draft_batch = max(int(batch_size), 1)
        if not self.timing_free and st.draft_warm and not st.probing:  # a first proposal waited for its prefill
            self.shared.observe_draft_merge(st.draft_batch)

    def draft_forward(self, call_s: float) -> None:
        """An in-line proposal's reply: the draft call that grew the tree took ``call_s`` seconds (every
        session's steps it held; 0 = not reported). Where ``SharedState.draft_cost_from_forward`` (config
        ``draft_cost_from: forward``), ``observe`` teaches D from it instead of the reply's wall time."""
        self.state.draft_call_s = call_s if call_s > 0 else None

    def draft_timed_out(self, waited_s: float) -> None:
        """The round's proposal got no reply within ``waited_s`` seconds (the draft deadline; the round
        loop calls this before ``draft_failed``), a lower bound on that proposal's latency: on the
        draft's own device under load it raises the queue share (``SharedState.observe_draft_queue``),
        elsewhere D (``CostModel.observe_draft_timeout``). The plan then drafts less, or not at all,
        before more deadlines trip (each failure drops the session, and its re-open prefills again)."""
        planned = self.state.planned_spec
        if self.timing_free or not self.gamma or planned is None or not waited_s:
            return
        # the steps it would have run: as many as the last tree it drafted, else the plan's g (the
        # planned spec's gamma is only the budget the draft's early stop may use)
        steps = min(self.state.drafted_depth or self.gamma, planned.gamma)
        heads = list(planned.top_head[:steps])
        if self.shared.queue_learns():
            self.shared.observe_draft_queue(waited_s * 1000, self.shared.cost.draft_ms(heads), lower_bound=True)
            return
        # shared compute under load: LoadedCost already prices a step at D * load, the wait held the others' share
        per_request = self.shared.load if self.shared.shared_compute and self.shared.load >= LOADED else 1.0
        self.shared.cost.observe_draft_timeout(heads, waited_s / per_request)

    def set_draft_context_limit(self, limit: int | None) -> None:
        self.fallback.set_draft_context_limit(limit)


def _parents_per_step(tree: DraftTree, depths: list[int]) -> list[int]:
    """Parents the draft expanded at each step: 1 (the root) then the expanded nodes per depth."""
    steps = [1]
    for d in range(1, max(depths, default=0)):
        steps.append(sum(1 for i, dd in enumerate(depths) if dd == d and tree.expanded and tree.expanded[i]))
    return steps if tree.size else []


class CostAwareFactory:
    """(TreeSpec, max_nodes) -> CostAwareControl with the front's settings; all the requests of the
    factory share ``shared`` (the cost model and the front-wide estimates). ``shared_compute``: the
    configured placement setting (True, False or "auto"), which the Orchestrator resolves into
    ``shared.shared_compute`` once it knows both services."""

    def __init__(self, config: CostAwareConfig, fallback: FallbackConfig, shared: SharedState):
        self.config, self.fallback, self.shared = config, fallback, shared
        self.shared_compute = config.shared_compute
        shared.in_step, shared.in_step_max_load = config.in_step, config.in_step_max_load
        shared.draft_cost_from_forward = config.draft_cost_from == "forward"

    def __call__(self, spec: TreeSpec, max_nodes: int = MAX_TREE_NODES) -> CostAwareControl:
        c = self.config
        return CostAwareControl(spec, self.shared, self.fallback, max_gamma=c.max_gamma, ngram_tokens=c.ngram_tokens,
                                max_ngram=c.max_ngram, probe_every=c.probe_every,
                                first_round_plain=c.first_round_plain, max_nodes=max_nodes)
