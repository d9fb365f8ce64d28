"""Statistics of a generation request: one ``RoundRecord`` per round, summed in ``GenerationStats`` (the in-process side
of ``specdec.v1.FinalStats``; terms: docs/usage.md "What the statistics mean")."""

from __future__ import annotations

from dataclasses import dataclass, field

COST_REASON = "cost"  # orchestrator.planning.control.COST: a planned round without the draft, not a fallback


def position_rates(proposed: list[int], accepted: list[int]) -> list[float]:
    """Per-position acceptance (vLLM's): [D] accepted[d] / proposed[d], 0 where proposed[d] is 0;
    proposed / accepted: [D] rounds whose verified tree / committed path reached depth d + 1."""
    return [a / p if p else 0.0 for a, p in zip(accepted, proposed)]


@dataclass(frozen=True)
class RoundRecord:
    """What one round did."""

    tokens: tuple[int, ...]  # token ids committed (accepted path + bonus, cut at a stop)
    proposed: int  # draft tokens proposed: nodes of the tree sent to the target (0 = a plain round)
    accepted: int  # draft tokens committed (bonus excluded)
    depth: int  # tree levels of the proposed tree (0 = no tree)
    fallback: str | None  # why the round ran without the draft (orchestrator.planning.control reasons); None = it did not
    gamma: int  # the request's speculation depth after this round, tree levels (0 = no control policy)
    draft_s: float | None  # wall time of the draft phase, seconds (None = the draft was not asked)
    verify_s: float  # wall time of the target's verify, seconds
    commit_s: float  # wall time of the commits on both workers, seconds
    drafted: int = 0  # nodes the draft proposed, before the control kept those worth verifying
    context_proposed: int = 0  # context (n-gram) nodes among the proposed ones
    context_accepted: int = 0  # context nodes among the accepted ones
    expected_accepted: float = 0.0  # draft tokens the control expected to be accepted (its decision), tokens
    cost: dict | None = None  # the cost model it decided with (CostModel.snapshot: ms by rows / parents), if any
    stop_reason: str | None = None  # set on the round that ended the request (its stats follow)
    pipelined: bool = False  # the tree came from an adopted ahead's first candidate (draft_s 0)
    predrafted: bool = False  # the tree came from another candidate of an adopted ahead (pre-drafting; draft_s 0)
    ahead: str | None = None  # this round's ahead: "hit" (first candidate), "predraft", "miss", "failed"; None
    ahead_s: float | None = None  # wall time of this round's ahead, seconds (beside the verify; None = none or failed)
    logprobs: tuple = ()  # one specdec.sampling.TokenLogprob per token when the request asks for logprobs
    prompt_logprobs: tuple = ()  # the request's first round: its prompt tokens' (but the first), when asked for

    @property
    def kind(self) -> str:
        """Where this round's tree came from: "in_line" (drafted in this round, or none), "pipelined", "predrafted"."""
        return "pipelined" if self.pipelined else "predrafted" if self.predrafted else "in_line"


@dataclass
class GenerationStats:
    """Speculation statistics of one request (units in the names)."""

    new_tokens: int = 0
    rounds: int = 0
    proposed_tokens: int = 0  # draft tree nodes sent to the target
    accepted_tokens: int = 0  # draft tokens committed (bonus tokens excluded)
    fallback_rounds: int = 0  # rounds without the draft: failed, full, opening, or pre-drafting beside the round
    cost_plain_rounds: int = 0  # rounds the cost-aware control ran without the draft (reason "cost")
    final_gamma: int = 0  # speculation depth after the last round (0 = never speculated)
    drafted_tokens: int = 0  # nodes the draft proposed, before shaping
    context_proposed_tokens: int = 0  # context (n-gram) nodes sent to the target
    context_accepted_tokens: int = 0  # context nodes committed
    expected_accepted_tokens: float = 0.0  # the control's expectation of accepted_tokens
    ttft_ms: float = 0.0
    total_s: float = 0.0
    draft_s: float = 0.0  # after the first round (inside ttft_ms): draft and verify wall time, rounds that drafted
    verify_s: float = 0.0
    draft_rounds: int = 0
    stop_reason: str | None = None
    failovers: int = 0  # times the request moved to another orchestrator actor after its own failed
    pipeline_ahead_hits: int = 0  # pipelining: aheads adopted (the next round's tree was ready when its verify began)
    pipeline_ahead_misses: int = 0  # pipelining: aheads discarded (a guess or a path missed) or failed
    predraft_hits: int = 0  # pre-drafting: aheads whose other candidate (an early rejection) was adopted
    pipelined_rounds: int = 0  # rounds whose tree came from an ahead's first candidate
    predrafted_rounds: int = 0  # rounds whose tree came from another candidate
    # vLLM's per-position acceptance: [d - 1] counts rounds whose verified tree / committed path reached depth d
    position_proposed: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    # the links' measured round trips at the end (``link_rtt_s``), ms; None: in-process, no draft, not measured
    draft_link_rtt_ms: float | None = None
    target_link_rtt_ms: float | None = None

    def add(self, record: RoundRecord, elapsed_s: float) -> None:
        """Count one round. elapsed_s: seconds from the request's start to the end of this round
        (the first round's is the time to first token)."""
        self.rounds += 1
        self.new_tokens += len(record.tokens)
        self.proposed_tokens += record.proposed
        self.accepted_tokens += record.accepted
        self.fallback_rounds += record.fallback is not None and record.fallback != COST_REASON
        self.cost_plain_rounds += record.fallback == COST_REASON
        self.drafted_tokens += record.drafted
        self.context_proposed_tokens += record.context_proposed
        self.context_accepted_tokens += record.context_accepted
        self.expected_accepted_tokens += record.expected_accepted
        if self.rounds > 1:
            self.draft_s += record.draft_s or 0.0
            self.verify_s += record.verify_s
            self.draft_rounds += record.draft_s is not None and not (record.pipelined or record.predrafted)
        self.final_gamma = record.gamma
        self.pipeline_ahead_hits += record.ahead == "hit"
        self.pipeline_ahead_misses += record.ahead in ("miss", "failed")
        self.predraft_hits += record.ahead == "predraft"
        self.pipelined_rounds += record.pipelined
        self.predrafted_rounds += record.predrafted
        for counts in (self.position_proposed, self.position_accepted):
            counts.extend([0] * (record.depth - len(counts)))
        for d in range(record.depth):
            self.position_proposed[d] += 1
            self.position_accepted[d] += d < record.accepted
        if self.rounds == 1:
            self.ttft_ms = elapsed_s * 1000

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per round, bonus included."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def round_shares(self) -> dict[str, float]:
        """Shares of the rounds by ``RoundRecord.kind`` (all 0 before any round)."""
        n = self.rounds or 1
        ahead = self.pipelined_rounds + self.predrafted_rounds
        return {"in_line": (self.rounds - ahead) / n if self.rounds else 0.0,
                "pipelined": self.pipelined_rounds / n, "predrafted": self.predrafted_rounds / n}

    @property
    def ahead_hit_rate(self) -> float:
        """Aheads adopted (any candidate) / aheads resolved (0 without any)."""
        hits = self.pipeline_ahead_hits + self.predraft_hits
        return hits / (hits + self.pipeline_ahead_misses) if hits + self.pipeline_ahead_misses else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0
