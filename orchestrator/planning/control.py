"""Per-request control of the round loop (docs/control.md): the ``Control`` hooks, ``FallbackPolicy`` and
``FixedControl``; the default, ``CostAwareControl``, is in orchestrator.planning.cost_aware. Times: seconds of
``time.monotonic``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from specdec.config import FallbackConfig
from orchestrator.planning.shaping import ShapedTree
from specdec.sampling import SamplingParams
from specdec.stats import COST_REASON
from specdec.tree import DraftTree
from specdec.tree_spec import TreeSpec

# Why a round runs without the draft (specdec_fallback_rounds_total{reason}, the round span's fallback.reason)
DRAFT_UNAVAILABLE = "draft_unavailable"  # the draft failed, is unreachable or slower than its deadline
DRAFT_CONTEXT_LIMIT = "draft_context_limit"  # the draft's context cannot hold the next tree
COST = COST_REASON  # "cost": the cost model says no draft step pays this round (CostAwareControl)
DRAFT_OPENING = "draft_opening"  # the draft session was just opened: its service prefills it beside this plain round
PREDRAFT = "predraft"  # a slow draft link: plain, the next tree pre-drafted beside it instead of drafted in line
FALLBACK_REASONS = (DRAFT_UNAVAILABLE, DRAFT_CONTEXT_LIMIT, COST, DRAFT_OPENING, PREDRAFT)

EMPTY_TREE = DraftTree((), ())  # a round without the draft verifies this: one plain target step


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
    """Every hook the round controller calls on one request's control; optional ones default to no-ops. Order in a
    round: ``round_context``, ``speculate``; if yes ``spec``; ``shape``; ``record`` after a verified drafted tree;
    ``observe`` after every round. Draft failures and the draft's context limit go to ``fallback`` where set."""

    gamma: int  # speculation depth of the next tree, tree levels
    reason: str | None  # why the last ``speculate`` said no (one of FALLBACK_REASONS), None when it said yes
    fallback: FallbackPolicy | None = None

    def spec(self, base: TreeSpec) -> TreeSpec:
        """The tree shape of this round, from the request's TreeSpec."""
        raise NotImplementedError

    def speculate(self, now: float, committed_len: int, depth: int) -> bool:
        """True = speculate with up to ``depth`` levels, False = a plain step. now: s; committed_len: tokens."""
        raise NotImplementedError

    def draft_failed(self, now: float) -> None:
        """A draft call failed at ``now`` (required without ``fallback``: no speculation for its reconnect_s)."""
        if self.fallback is None:
            raise NotImplementedError
        self.fallback.draft_failed(now)

    def record(self, depth: int, proposed: int, accepted: int) -> None:
        """After a speculative round: tree levels reached, draft tokens proposed and accepted (bonus excluded).
        Raises ValueError for impossible counts (``check_counts``)."""
        check_counts(proposed, accepted)

    def set_draft_context_limit(self, limit: int | None) -> None:
        """The draft's max positions, tokens (None = unlimited); kept by ``fallback`` where set."""
        if self.fallback is not None:
            self.fallback.set_draft_context_limit(limit)

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

    def predraft(self, link_rtt_s: float | None, candidates: int) -> bool:
        """``front.pipeline: auto``: True = draft the next round's ``candidates`` trees during this verify, False =
        in line. link_rtt_s: the draft link's measured round trip (None = not yet)."""
        return False

    def predraft_plain(self, link_rtt_s: float | None, candidates: int) -> bool:
        """After ``speculate`` said draft: True = run this round plain and pre-draft the next tree beside it."""
        return False


ControlFactory = Callable[[TreeSpec], Control]


def check_counts(proposed: int, accepted: int) -> None:
    """Raises ValueError unless 0 <= accepted <= proposed (draft tokens of one round)."""
    if proposed < 0 or accepted < 0 or accepted > proposed:
        raise ValueError(f"need 0 <= accepted <= proposed, got accepted={accepted}, proposed={proposed}")


class FallbackPolicy:
    """Whether one request speculates this round or runs a plain target step (docs/control.md, Fallback); off,
    first match is ``reason``: ``"draft_context_limit"`` (committed_len + depth > draft_context_limit), then
    ``"draft_unavailable"`` (for reconnect_s s after ``draft_failed``)."""

    def __init__(self, config: FallbackConfig = FallbackConfig()):
        self.config = config
        self.draft_context_limit: int | None = None
        self.reason: str | None = None
        self._unavailable_until: float | None = None

    def speculate(self, now: float, committed_len: int, depth: int = 1) -> bool:
        """True = speculate with up to ``depth`` (>= 1) levels, False = plain step; sets ``reason``.
        Raises ValueError for committed_len < 0 or depth < 1."""
        if committed_len < 0 or depth < 1:
            raise ValueError(f"speculate: need committed_len >= 0 and depth >= 1, got {committed_len}, {depth}")
        reason = None
        if self.draft_context_limit is not None and committed_len + depth > self.draft_context_limit:
            reason = DRAFT_CONTEXT_LIMIT
        elif self._unavailable_until is not None and now < self._unavailable_until:
            reason = DRAFT_UNAVAILABLE
        if reason is None:
            self._unavailable_until = None  # the retry
        self.reason = reason
        return reason is None

    def set_draft_context_limit(self, limit: int | None) -> None:
        """The draft's max positions (None = unlimited). Raises ValueError for a limit < 1."""
        if limit is not None and limit < 1:
            raise ValueError(f"draft_context_limit: must be >= 1 tokens, got {limit}")
        self.draft_context_limit = limit

    def draft_failed(self, now: float) -> None:
        """Mark the draft unavailable (unreachable, error or too slow) until now + reconnect_s."""
        self._unavailable_until = now + self.config.reconnect_s


class FixedControl(Control):
    """The request's TreeSpec every round, behind ``FallbackPolicy`` (``--control fixed``)."""

    def __init__(self, spec: TreeSpec, fallback: FallbackConfig = FallbackConfig()):
        self.gamma = spec.gamma
        self.reason: str | None = None
        self.fallback = FallbackPolicy(fallback)

    def spec(self, base: TreeSpec) -> TreeSpec:
        return base

    def speculate(self, now: float, committed_len: int, depth: int) -> bool:
        go = self.fallback.speculate(now, committed_len, min(self.gamma, depth))
        self.reason = self.fallback.reason
        return go
