"""The round loop: propose, verify, stop checks, commit (embedded mode drives it in-process).

One round (DESIGN.md): the draft grows a token tree from the committed context; the target
verifies every node in one forward and returns the accepted path plus a bonus token; the tokens
pass the stop checks one at a time; both workers commit exactly the tokens that passed.
Workers are anything implementing specdec.interfaces (in-process runtimes or gRPC clients); each
request's SamplingParams reach both workers once, when its sessions start.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from orchestrator.stops import StopChecker
from specdec.interfaces import DraftWorker, TargetWorker
from specdec.sampling import GREEDY, SamplingParams
from specdec.tree import DraftTree
from specdec.tree_spec import TreeSpec

_EMPTY_TREE = DraftTree((), ())
_session_ids = itertools.count()


@dataclass
class GenerationStats:
    """Speculation statistics of one request (units in the names)."""

    new_tokens: int = 0
    rounds: int = 0
    proposed_tokens: int = 0  # draft tree nodes sent to the target
    accepted_tokens: int = 0  # draft tokens committed (bonus tokens excluded)
    ttft_ms: float = 0.0
    total_s: float = 0.0
    stop_reason: str | None = None

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per round, bonus included."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0


@dataclass
class GenerationRequest:
    """What to generate. prompt_ids: [T] token ids, T >= 1."""

    prompt_ids: list[int]
    max_new_tokens: int = 128
    stop_strings: tuple[str, ...] = ()
    spec: TreeSpec | None = None  # None = plain target decoding (no draft)
    sampling: SamplingParams = GREEDY  # temperature 0 = greedy; applied identically by draft and target

    def __post_init__(self):
        if isinstance(self.stop_strings, str):  # one stop string, not one per character
            self.stop_strings = (self.stop_strings,)


@dataclass
class _Run:
    """One request in flight: its session id, tree spec (None = plain decoding) and progress."""

    sid: str
    spec: TreeSpec | None
    stops: StopChecker
    stats: GenerationStats
    on_tokens: Callable[[list[int]], None] | None
    started: float  # time.perf_counter() at start


@dataclass
class GenerationResult:
    tokens: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)


class SpeculativeEngine:
    """Runs requests round by round over a draft worker and a target worker.

    eos_token_ids: ids that end generation; context_limit: max total tokens (prompt + generated);
    decode: ids -> text, used for stop strings.
    """

    def __init__(self, target: TargetWorker, draft: DraftWorker | None, eos_token_ids, context_limit: int, decode=None):
        self.target = target
        self.draft = draft
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_limit = context_limit
        self.decode = decode

    def generate(self, request: GenerationRequest, on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """Generate until a stop; ``on_tokens`` receives each round's committed tokens as they land.

        Raises ValueError (naming the field) for an empty prompt, a prompt at or over the context
        limit, or max_new_tokens < 1.
        """
        return self.generate_batch([request], [on_tokens])[0]

    def generate_batch(self, requests: Sequence[GenerationRequest],
                       on_tokens: Sequence[Callable[[list[int]], None] | None] | None = None) -> list[GenerationResult]:
        """Run requests side by side, one round of each in turn, until all stop.

        Every request keeps its own sessions (and, when sampling, its own random streams), so its
        tokens are those of its solo run. on_tokens: one callback (or None) per request.
        """
        for request in requests:
            self._check(request)
        callbacks = list(on_tokens) if on_tokens is not None else [None] * len(requests)
        runs: list[_Run] = []
        try:
            for request, callback in zip(requests, callbacks, strict=True):
                runs.append(self._open(request, callback))
            active = list(runs)
            while active:
                for run in active:
                    self._step(run)
                active = [run for run in active if run.stops.reason is None]
        finally:
            for run in runs:
                self._release(run)
        return [GenerationResult(list(run.stops.generated), run.stats) for run in runs]

    def _open(self, request: GenerationRequest, on_tokens) -> "_Run":
        speculate = request.spec is not None and self.draft is not None
        stops = StopChecker(
            len(request.prompt_ids), request.max_new_tokens, self.context_limit,
            self.eos_token_ids, tuple(request.stop_strings), self.decode,
        )
        run = _Run(f"req-{next(_session_ids)}", request.spec if speculate else None, stops,
                   GenerationStats(), on_tokens, time.perf_counter())
        self.target.start(run.sid, request.prompt_ids, request.sampling)
        if speculate:
            self.draft.start(run.sid, request.prompt_ids, request.sampling)
        return run

    def _step(self, run: "_Run") -> None:
        """One round of one request; records TTFT after the first and the totals after the last."""
        committed = self._round(run.sid, run.spec, run.stops, run.stats)
        if run.stats.rounds == 1:
            run.stats.ttft_ms = (time.perf_counter() - run.started) * 1000
        if run.on_tokens:
            run.on_tokens(committed)
        if run.stops.reason is not None:
            run.stats.total_s = time.perf_counter() - run.started
            run.stats.new_tokens = len(run.stops.generated)
            run.stats.stop_reason = run.stops.reason

    def _release(self, run: "_Run") -> None:
        self.target.release(run.sid)
        if run.spec is not None:
            self.draft.release(run.sid)

    def _round(self, sid: str, spec: TreeSpec | None, stops: StopChecker, stats: GenerationStats) -> list[int]:
        """One round; returns the tokens it committed."""
        # The accepted path plus the bonus must fit the budget: depth <= budget - 1.
        max_depth = stops.budget() - 1
        tree = self.draft.propose(sid, spec, max_depth) if spec is not None and max_depth >= 1 else _EMPTY_TREE
        result = self.target.verify(sid, tree)
        committed: list[int] = []
        for token in result.tokens:
            committed.append(token)
            if stops.push(token):
                break
        self.target.commit(sid, len(committed))
        accepted = list(result.accepted_nodes[: len(committed)])
        if spec is not None:
            self.draft.commit(sid, committed, accepted)
        stats.rounds += 1
        stats.proposed_tokens += tree.size
        stats.accepted_tokens += len(accepted)
        return committed

    def _check(self, request: GenerationRequest) -> None:
        if not request.prompt_ids:
            raise ValueError("prompt: empty prompt (no tokens)")
        if len(request.prompt_ids) >= self.context_limit:
            raise ValueError(
                f"prompt: {len(request.prompt_ids)} tokens leave no room under the context limit "
                f"of {self.context_limit} tokens"
            )
        if any(not s for s in request.stop_strings):
            raise ValueError("stop_strings: an empty stop string would stop after the first token")
        if request.stop_strings and self.decode is None:
            raise ValueError("stop_strings: this engine has no decode function (tokenizer) to match text")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {request.max_new_tokens}")
