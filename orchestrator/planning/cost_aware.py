"""The default per-request control: cost-aware tree shaping (``orchestrator.planning.shaping``) each round; rules:
docs/control.md "How a round's tree is shaped"; draft failures and the context limit: ``FallbackPolicy``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from orchestrator.planning.cost_model import CostModel, LoadedCost, predraft_pays, predraft_plain_pays
from orchestrator.planning.control import COST, Control, FallbackPolicy, RoundObservation
from orchestrator.planning.shaping import (AcceptanceCalibration, ContextCalibration, Lookup, ShapedTree,
                                           context_path, observe_verified, shape_tree)
from specdec.config import CostAwareConfig, FallbackConfig
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, ancestors, node_depths
from specdec.tree_spec import MAX_TREE_NODES, TreeSpec, max_depth_for, spec_at_depth

LOADED = 1.5  # sessions (moving average) from which other requests count as running: load-aware rules apply
UNPAYING_PROBE_FACTOR = 4  # probes come this much less often where no acceptance could make the draft pay


@dataclass
class SharedState:
    """What the requests of one front (or one embedded engine) learn together."""

    cost: CostModel = field(default_factory=CostModel)
    estimates: Estimates = field(default_factory=lambda: Estimates())  # every request's verified rounds
    rounds_without_draft: int = 0  # across requests, since any request last drafted (the probe counts these)
    load: float = 1.0  # sessions a verify forward holds or could hold, moving average over every request's rounds
    shared_compute: bool = False  # draft and target on the same hardware (specdec.placement; set at connect)
    draft_queue: float = 0.0  # the draft's queueing under load on its own device (LoadedCost.queue_factor)
    verify_merge: float = 1.0  # share of other requests in a drafted round's verify forward; 1 = all of them
    draft_cost_from_forward: bool = False  # D from the draft call's own time (CostAwareConfig.draft_cost_from)

    def queue_learns(self) -> bool:
        """Whether a draft reply's time beyond D teaches ``draft_queue`` rather than D (own device, under load)."""
        return not self.shared_compute and self.load >= LOADED

    def observe_draft_queue(self, observed_ms: float, steps_ms: float, lower_bound: bool = False,
                            alpha: float = 0.3) -> None:
        """One draft reply under load: share (observed_ms / steps_ms - 1) / (load - 1), clamped to [0, 8],
        into ``draft_queue`` as a moving average. lower_bound (deadline tripped): it only raises it."""
        if steps_ms <= 0 or self.load < LOADED:
            return
        share = min(max((observed_ms / steps_ms - 1.0) / (self.load - 1.0), 0.0), 8.0)
        if lower_bound and share <= self.draft_queue:
            return
        self.draft_queue += alpha * (share - self.draft_queue)

    def observe_verify_merge(self, batch_size: int, alpha: float = 0.3) -> None:
        """One drafted round's verify forward under load held ``batch_size`` sessions: folded into ``verify_merge``."""
        if self.load >= LOADED:
            share = min(max((batch_size - 1) / (self.load - 1.0), 0.0), 1.0)  # of the other requests, in [0, 1]
            self.verify_merge += alpha * (share - self.verify_merge)

    def observe_load(self, batch_size: int, alpha: float = 0.3) -> None:
        """One round's load (sessions per forward): a rise at once, a fall as a moving average."""
        load = max(batch_size, 1)
        self.load = float(load) if load > self.load else self.load + alpha * (load - self.load)
        if self.load < 1.1:
            self.verify_merge = 1.0

    def probe_interval(self, probe_every: int) -> float:
        """Rounds without a draft step before a probe: ``probe_every``, times the load on shared compute."""
        return probe_every * (self.load if self.shared_compute else 1.0)

    def defer_draft(self) -> bool:  # a new request's draft prefill waits for its first drafted round
        return self.shared_compute

    def planning_cost(self) -> CostModel | LoadedCost:
        """``LoadedCost`` at the current load; the model itself under load 1.1 (noise of an occasional merge)."""
        if self.load < 1.1:
            return self.cost
        queue = self.draft_queue if self.queue_learns() else 0.0  # learnt and priced at the same loads
        return LoadedCost(self.cost, self.load, self.shared_compute, queue, verify_merge=self.verify_merge)


@dataclass
class DepthEstimates:
    """Per-depth expectations (moving averages over drafted rounds): value[d-1], the expected sum of kept node
    values at depth d; rows[d-1], the expected kept nodes. Unseen depths extrapolate geometrically."""

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
    """Calibrations and per-depth values; a request's (``for_request``) start from the front's and feed them."""

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
    planned_spec: TreeSpec | None = None  # the tree shape the last drafting plan chose
    context: Sequence[int] | None = None  # this round's committed tokens (round_context), until speculate
    beside_prefill: bool = False  # this round's forward ran beside a draft prefill (prefill_beside), until observe


def plan_depth(est: DepthEstimates, cost: CostModel | LoadedCost, heads: list[int], max_steps: int,
               context_value: float = 0.0, context_rows: float = 0.0,
               context_path: Sequence[float] | None = None) -> tuple[int, float]:
    """The number of draft steps g in [0, max_steps] with the best predicted rate (tokens per ms), and that rate.
    heads: [max_steps] parents expanded by each step; context_*: expected value and rows of the context branch.
    Rate(g) = (1 + context_value + sum value(d), d <= g) / (sum D(heads[d]) + V(1 + context_rows + sum rows(d)) +
    overhead). context_path: [m] this round's own branch, replacing context_value / rows; the draft's value at
    depth d <= m then counts value(d) * (1 - context_path[d-1])."""
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
    """Whether some number of draft steps would beat a plain round if every drafted token were accepted; False
    where plain decoding wins whatever the acceptance (SmartSpec, Liu et al. 2024 §4). heads: [max_steps]."""
    perfect = DepthEstimates(value=[1.0] * max_steps, rows=[1.0] * max_steps)
    return max_steps >= 1 and plan_depth(perfect, cost, heads, max_steps)[0] > 0


def stop_threshold(cost: CostModel | LoadedCost, rate: float, heads: int, width: int, decay: float, raw_per_value: float,
                   lookahead: int = 3) -> float:
    """The draft's gammaThreshold: one more step costs D(heads) plus ``width`` verify rows (ms) and brings
    value * (decay + ... + decay^lookahead) tokens; threshold = cost * rate (tokens per ms) / gain * raw_per_value,
    clamped to [0, 0.95]."""
    step_ms = cost.draft_step_ms(heads) + width * max(cost.drafted_verify(2) - cost.drafted_verify(1), 0.0)
    decay = min(max(decay, 1e-3), 0.99)
    gain = sum(decay ** k for k in range(1, lookahead + 1))
    threshold = step_ms * rate / gain * raw_per_value
    return min(max(threshold, 0.0), 0.95)


class CostAwareControl(Control):
    """Cost-aware control of one request. spec: the request's TreeSpec, an upper bound on widths; shared: the
    front-wide SharedState; ngram_tokens: 0 = no context branch; lookup: replaces the n-gram lookup."""

    def __init__(self, spec: TreeSpec, shared: SharedState | None = None, fallback: FallbackConfig = FallbackConfig(),
                 max_gamma: int = 10, ngram_tokens: int = 8, max_ngram: int = 3, probe_every: int = 16,
                 first_round_plain: bool = True, max_nodes: int = MAX_TREE_NODES, lookup: Lookup | None = None):
        self.base = spec
        self.shared = shared or SharedState()
        self.fallback = FallbackPolicy(fallback)
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
        """A seeded sampled request's trees must not depend on timings: the TreeSpec every round, as drafted."""
        self.timing_free = sampling.seeded

    def round_context(self, context: Sequence[int]) -> None:  # this round's committed tokens [T]
        self.state.context = context

    def _first_round(self) -> bool:  # the first token comes from the target's prefill alone
        return self.first_round_plain and self.state.rounds == 0

    def speculate(self, now: float, committed_len: int, depth: int) -> bool:
        """Plan this round (``plan_depth``) under ``depth`` levels; False = no draft this round."""
        st = self.state
        st.probing = False
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
        cost = self.shared.planning_cost()  # under load: the batch's goodput (LoadedCost)
        g, rate = self._plan(context, cost, heads, max_steps, depth)
        if self._first_round():
            g = 0
        elif g == 0 and max_steps >= 1 and self._probe_due(cost, heads, max_steps):
            g = 1  # probe: has the draft become worth it? (counted across requests: short ones probe too)
            self.shared.rounds_without_draft = 0
            st.probing = True
        self.gamma, self.reason = g, (None if g else COST)
        if g:  # g decides whether to draft; the depth is the draft's own early stop
            width = sum(self.base.top_k_spec[-1])
            threshold = stop_threshold(cost, rate, heads[max_steps - 1], width,
                                       st.estimates.depths.ratio(), st.raw_per_value)
            spec = spec_at_depth(self.base, max_steps, self.max_nodes)
            st.planned_spec = spec.model_copy(update={"gamma_threshold": max(threshold, spec.gamma_threshold)})
        return g > 0

    def _plan(self, context: Sequence[int] | None, cost: CostModel | LoadedCost, heads: list[int], max_steps: int,
              depth: int) -> tuple[int, float]:
        """(draft steps g, predicted rate) of this round, valuing its context branch."""
        st = self.state
        path = None
        if context is not None and not self._first_round():
            path = context_path(context, st.estimates.ctx_calib, cost, cost.round_overhead_ms, self.ngram_tokens,
                                self.max_ngram, depth, self.lookup)
        return plan_depth(st.estimates.depths, cost, heads, max_steps, st.context_value, st.context_rows, path)

    def _probe_due(self, cost: CostModel | LoadedCost, heads: list[int], max_steps: int) -> bool:
        """Whether a probe is due: ``SharedState.probe_interval``; under load on shared compute only with a warm
        draft, and UNPAYING_PROBE_FACTOR times later where not even an always-right draft could pay."""
        interval, waited = self.shared.probe_interval(self.probe_every), self.shared.rounds_without_draft
        if waited < interval:
            return False
        loaded = self.shared.shared_compute and self.shared.load >= LOADED
        if loaded and not self.state.draft_warm:
            return False
        return not loaded or waited >= interval * UNPAYING_PROBE_FACTOR or could_pay(cost, heads, max_steps)

    def defer_draft_open(self, others: int = 0) -> bool:
        """Whether to open the draft at the first drafted round instead of the request's start: ``defer_draft``,
        or under load (others: requests in flight) when a new plan would not draft."""
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

    def spec(self, base: TreeSpec | None = None) -> TreeSpec:  # the last plan's shape (before any: the request's)
        return self.state.planned_spec or self.base

    def shape(self, tree: DraftTree, context: list[int], max_depth: int, sunk_ms: float) -> ShapedTree:
        """Drafted nodes that pay plus the context branch (``shape_tree``), priced as this round was planned."""
        cost = self.shared.planning_cost()
        if self.timing_free or self._first_round():  # TTFT: the first token from the prefill
            return ShapedTree.of(tree)
        estimates = self.state.estimates
        return shape_tree(tree, context, estimates.calib, estimates.ctx_calib, cost, sunk_ms + cost.round_overhead_ms,
                          self.ngram_tokens, self.max_ngram, max_depth, self.lookup)

    def observe(self, obs: RoundObservation) -> None:
        """Learn from a verified round: the estimates, the shared cost model and load."""
        st, shaped = self.state, obs.shaped
        st.rounds += 1
        if self.timing_free:
            return
        # the first round's empty verify reuses the prefill's logits: no forward ran, its ~1 ms says nothing of V(1)
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
        """Per-depth values and the raw/value ratio; returns parents per step where the draft time was steps' only."""
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
        """The shared load, merge and queue shares and cost model from the round's timings (docs/control.md)."""
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

    def predraft(self, link_rtt_s: float | None, candidates: int) -> bool:
        return predraft_pays(link_rtt_s, self._planned_draft_ms(), self.shared.shared_compute, candidates)

    def predraft_plain(self, link_rtt_s: float | None, candidates: int) -> bool:
        """``predraft_plain_pays``; never for a seeded request."""
        return not self.timing_free and predraft_plain_pays(link_rtt_s, self._planned_draft_ms())

    def _planned_draft_ms(self) -> float:
        spec = self.spec()
        return self.shared.planning_cost().draft_ms(spec.top_head[: max(spec.gamma, 1)])

    def cost_snapshot(self) -> dict:
        """CostModel.snapshot plus the shared load, draft queue and verify merge shares, after ``observe``."""
        return {**self.shared.cost.snapshot(), "load": round(self.shared.load, 2),
                "draft_queue": round(self.shared.draft_queue, 3), "verify_merge": round(self.shared.verify_merge, 3)}

    def prefill_beside(self) -> None:  # this round runs beside the draft's prefill: no cost is learnt from it
        self.state.beside_prefill = True

    def draft_opened(self) -> None:  # its first drafted round's time also holds the prefill
        self.state.draft_warm = False

    def draft_merged(self, batch_size: int) -> None:  # the proposal's forwards held batch_size sessions
        self.state.draft_batch = max(int(batch_size), 1)

    def draft_forward(self, call_s: float) -> None:  # the draft call's own s (0 = not reported)
        self.state.draft_call_s = call_s if call_s > 0 else None

    def draft_timed_out(self, waited_s: float) -> None:
        """No reply within ``waited_s`` s: a lower bound that raises the queue share (own device, under load) or D."""
        planned = self.state.planned_spec
        if self.timing_free or not self.gamma or planned is None or not waited_s:
            return
        # the steps it would have run: the last tree's depth, else g (the planned gamma is only a budget)
        steps = min(self.state.drafted_depth or self.gamma, planned.gamma)
        heads = list(planned.top_head[:steps])
        if self.shared.queue_learns():
            self.shared.observe_draft_queue(waited_s * 1000, self.shared.cost.draft_ms(heads), lower_bound=True)
            return
        # shared compute under load: LoadedCost already prices a step at D * load, the wait held the others' share
        per_request = self.shared.load if self.shared.shared_compute and self.shared.load >= LOADED else 1.0
        self.shared.cost.observe_draft_timeout(heads, waited_s / per_request)


def _parents_per_step(tree: DraftTree, depths: list[int]) -> list[int]:
    """Parents the draft expanded at each step: 1 (the root) then the expanded nodes per depth."""
    if not tree.size:
        return []
    return [1] + [sum(1 for i, dd in enumerate(depths) if dd == d and tree.expanded and tree.expanded[i])
                  for d in range(1, max(depths))]


class CostAwareFactory:
    """(TreeSpec, max_nodes) -> CostAwareControl sharing ``shared``."""

    def __init__(self, config: CostAwareConfig, fallback: FallbackConfig, shared: SharedState):
        self.config, self.fallback, self.shared = config, fallback, shared
        shared.draft_cost_from_forward = config.draft_cost_from == "forward"

    def __call__(self, spec: TreeSpec, max_nodes: int = MAX_TREE_NODES) -> CostAwareControl:
        c = self.config
        return CostAwareControl(spec, self.shared, self.fallback, max_gamma=c.max_gamma, ngram_tokens=c.ngram_tokens,
                                max_ngram=c.max_ngram, probe_every=c.probe_every,
                                first_round_plain=c.first_round_plain, max_nodes=max_nodes)
