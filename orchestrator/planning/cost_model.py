"""Measured costs of this deployment: target verify latency V(n) and draft step latency D(p), ms; n = rows of one
verify forward (tree nodes + 1), p = parents expanded by one draft step (docs/control.md "The cost model").
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import functools
import itertools
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from specdec.interfaces import DraftWorker, VerifyResult, WorkerAdapter
from specdec.sampling import GREEDY
from specdec.tree import DraftTree
from specdec.tree_spec import TreeSpec

PRIOR_VERIFY_MS = {1: 285.0, 4: 365.0, 8: 449.0, 16: 606.0, 32: 894.0}
PRIOR_DRAFT_STEP_MS = {1: 45.0, 4: 55.0, 8: 70.0, 16: 100.0}
DRAFT_STEPS = 3  # steps per timed draft proposal at start-up
MERGED_RETRIES = 3  # a start-up call that a service merged with other sessions' work is run again, this many times at most


@dataclass
class LatencyCurve:
    """A latency curve ms(x) = scale * base(x) through measured points, never decreasing (a point above its
    right neighbour is lowered to it). points: {x: ms}, x >= 1 (at least one; ValueError otherwise); alpha: weight
    of one observation; measured: the first observation sets the scale only when over 4x off. Thread-safe."""

    points: dict[int, float]
    alpha: float = 0.2
    scale: float = 1.0
    observations: int = 0
    measured: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __post_init__(self):
        if not self.points:
            raise ValueError("points: a latency curve needs at least one measured point")
        if any(x < 1 or ms <= 0 for x, ms in self.points.items()):
            raise ValueError(f"points: need x >= 1 and ms > 0, got {self.points}")
        xs = sorted(self.points, reverse=True)  # suffix minimum
        self.points = dict(sorted(zip(map(int, xs), itertools.accumulate((float(self.points[x]) for x in xs), min))))

    def base(self, x: float) -> float:
        """The measured shape at x (>= 1), linear between points and past the ends, before scaling."""
        xs, ys = list(self.points), list(self.points.values())
        if len(xs) == 1:
            return ys[0] * max(x, 1) / xs[0] if x > xs[0] else ys[0]
        i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)  # segment [xs[i], xs[i+1]]
        slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
        return max(ys[i] + slope * (x - xs[i]), 1e-3)

    def __call__(self, x: float) -> float:
        """Predicted ms at x (>= 1)."""
        with self._lock:
            return self.scale * self.base(x)

    def observe(self, x: float, ms: float) -> None:
        self.observe_sum([x], ms)

    def observe_sum(self, xs: Iterable[float], ms: float, may_set: bool = True) -> None:
        """One observation of ``ms`` for forwards of sizes xs. may_set False (a bound): the clamped average only."""
        xs = [x for x in xs if x >= 1]
        if ms <= 0 or not xs:
            return
        with self._lock:
            predicted = self.scale * sum(self.base(x) for x in xs)
            first_sets = may_set and (not self.measured or not 0.25 <= ms / predicted <= 4.0)
            if self.observations == 0 and self.alpha > 0 and first_sets:  # prior figures: the first one here sets the scale
                self.scale *= ms / predicted
                self.observations += 1
                return
            ratio = min(max(ms / predicted, 0.5), 2.0)  # a GC pause moves it boundedly
            self.scale *= 1 + self.alpha * (ratio - 1)
            self.observations += 1

    def snapshot(self) -> dict[int, float]:
        """{x: predicted ms} at the measured points, scale applied."""
        with self._lock:
            return {x: round(self.scale * ms, 2) for x, ms in self.points.items()}


class CostModel:
    """V(n) and D(p), shared by the requests of one front. verify_ms: {rows: ms}; draft_step_ms: {parents: ms};
    round_overhead_ms: the rest of a round, learnt; source: "prior", "measured" or "configured"."""

    def __init__(self, verify_ms: dict[int, float] | None = None, draft_step_ms: dict[int, float] | None = None,
                 alpha: float = 0.2, source: str = "prior"):
        measured = source in ("measured", "configured")
        self.verify = LatencyCurve(dict(verify_ms or PRIOR_VERIFY_MS), alpha, measured=measured and bool(verify_ms))
        self.draft_step = LatencyCurve(dict(draft_step_ms or PRIOR_DRAFT_STEP_MS), alpha,
                                       measured=measured and bool(draft_step_ms))
        self.round_overhead_ms = 0.0
        self.source = source

    def draft_step_ms(self, parents: int) -> float:
        """D(parents); before any draft observation at the verify curve's scale (priors hold the cost ratio)."""
        if self.draft_step.observations == 0 and not self.draft_step.measured:
            return self.verify.scale * self.draft_step.base(parents)
        return self.draft_step(parents)

    def draft_ms(self, parents_per_step: Iterable[int]) -> float:
        """Predicted ms of a draft proposal that expands these parents per step (one entry per step)."""
        return sum(self.draft_step_ms(p) for p in parents_per_step)

    def drafted_verify(self, rows: float) -> float:  # alone, the same as a plain round's (LoadedCost differs)
        return self.verify(rows)

    def round_ms(self, rows: int, parents_per_step: Iterable[int] = ()) -> float:
        """Predicted ms of one round: drafting, then a verify of ``rows`` rows, plus the overhead."""
        return self.draft_ms(parents_per_step) + self.verify(rows) + self.round_overhead_ms

    def observe_round(self, rows: int, verify_s: float, parents_per_step: list[int], draft_s: float | None,
                      overhead_s: float = 0.0) -> None:
        """Fold one round's timings (s) into the curves. rows: of the whole verify forward, every session's."""
        self.verify.observe(rows, verify_s * 1000)
        if draft_s and parents_per_step:
            self._observe_draft(parents_per_step, draft_s * 1000)
        self.round_overhead_ms += 0.2 * (overhead_s * 1000 - self.round_overhead_ms)

    def observe_draft_timeout(self, parents_per_step: list[int], waited_s: float) -> None:
        """No reply within ``waited_s`` s (the deadline): a lower bound folded into D through the clamped average."""
        if parents_per_step and waited_s * 1000 > self.draft_ms(parents_per_step):  # a bound already met says nothing
            self._observe_draft(parents_per_step, waited_s * 1000, may_set=False)  # moves D by at most 1 + alpha

    def _observe_draft(self, parents_per_step: list[int], ms: float, may_set: bool = True) -> None:
        if self.draft_step.observations == 0 and not self.draft_step.measured:
            self.draft_step.scale = self.verify.scale  # prior figures: start from their ratio
        self.draft_step.observe_sum(parents_per_step, ms, may_set)

    def snapshot(self) -> dict:
        """Plain figures for stats, Info and metrics: {verify_ms: {rows: ms}, draft_step_ms: {...}, ...}."""
        draft = {p: round(self.draft_step_ms(p), 2) for p in self.draft_step.points}
        return {"verify_ms": self.verify.snapshot(), "draft_step_ms": draft,
                "round_overhead_ms": round(self.round_overhead_ms, 2), "source": self.source,
                "observations": self.verify.observations}


def predraft_pays(link_rtt_s: float | None, draft_ms: float, shared_compute: bool, candidates: int = 1) -> bool:
    """``front.pipeline: auto`` (docs/control.md "Pipelining"): pre-draft the next round during the verify (True)
    or draft it in line: always on the draft's own compute, on shared compute once the round trip (s) is at least
    candidates * D (``draft_ms``, ms). Example: D 40 ms, 2 candidates, shared: a 100 ms link pre-drafts."""
    if not shared_compute:
        return True
    return link_rtt_s is not None and link_rtt_s * 1000 >= candidates * draft_ms


def predraft_plain_pays(link_rtt_s: float | None, draft_ms: float) -> bool:
    """Run a round whose tree was not drafted ahead plain and pre-draft the next tree beside it (True), or draft in
    line (docs/control.md "Plain + pre-draft"): once the round trip (s) >= D (``draft_ms``, ms); unknown: in line."""
    return link_rtt_s is not None and link_rtt_s * 1000 >= draft_ms


class LoadedCost:
    """The cost model as each of ``load`` requests (>= 1) whose rounds share one verify forward sees it: SmartSpec
    goodput (Liu et al. 2024, §4), ``verify(rows)`` = V(load * rows). The rest: docs/control.md "Under load"."""

    def __init__(self, cost: CostModel, load: float, shared_compute: bool = False, draft_queue: float = 0.0,
                 verify_merge: float = 1.0):
        self.cost = cost
        self.load = max(float(load), 1.0)
        self.shared_compute = shared_compute
        self.draft_queue = max(float(draft_queue), 0.0)
        self.verify_merge = min(max(float(verify_merge), 0.0), 1.0)

    @property
    def round_overhead_ms(self) -> float:
        return self.cost.round_overhead_ms

    def verify(self, rows: float) -> float:
        """ms of a forward holding ``load`` trees of ``rows`` rows each."""
        return self.cost.verify(self.load * rows)

    def verify_sessions(self) -> float:
        """Sessions per verify forward of a drafted round: 1 + verify_merge * (load - 1)."""
        return 1.0 + self.verify_merge * (self.load - 1.0)

    def drafted_verify(self, rows: float) -> float:
        """ms of the batch's verifies for a drafted round of ``rows`` rows per request: load / m forwards of
        V(m rows), m = ``verify_sessions()`` (verify_merge 1: V(load rows); 0: V(rows) * load)."""
        m = self.verify_sessions()
        return self.cost.verify(m * rows) * self.load / m

    def queue_factor(self) -> float:
        """A draft step's time over D on the draft's own device: 1 + draft_queue * (load - 1), draft_queue the
        share of each other request's step that a step waits behind (learnt)."""
        return 1.0 + self.draft_queue * (self.load - 1.0)

    def draft_step_ms(self, parents: int) -> float:
        if self.shared_compute:  # every running request's step takes the shared compute in turn
            return self.cost.draft_step_ms(parents) * self.load
        return self.cost.draft_step_ms(parents) * self.queue_factor()

    draft_ms = CostModel.draft_ms  # over this class's draft_step_ms
    round_ms = CostModel.round_ms  # over this class's verify, draft_step_ms and round_overhead_ms


def measure_curve(run: Callable[[int], float | None], xs: Iterable[int], repeats: int = 3,
                  clock: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """Time ``run(x)`` for each x; the median of ``repeats`` runs (ms) per x after one warm-up run of each. run:
    one forward of size x, returning None (timed by ``clock``, s) or its own seconds. The sizes take turns, so a
    short disturbance costs each size at most one run."""
    xs = list(xs)
    for x in xs:  # warm-up: first calls pay allocation and kernel selection
        run(x)
    times: dict[int, list[float]] = {x: [] for x in xs}
    for _ in range(repeats):
        for x in xs:
            t0 = clock()
            took = run(x)
            times[x].append((clock() - t0 if took is None else took) * 1000)
    return {x: sorted(ts)[len(ts) // 2] for x, ts in times.items()}


class MeasurementDisturbed(RuntimeError):
    """A start-up measurement whose forwards kept sharing the service with other sessions' work."""


def measure_worker_costs(target, draft, vocab_size: int, context_tokens: int = 128,
                         rows: Iterable[int] = (1, 4, 8, 16, 32), parents: Iterable[int] = (1, 2, 4, 8),
                         clock: Callable[[], float] = time.perf_counter, context_limit: int | None = None,
                         max_rows: int | None = None) -> CostModel:
    """A CostModel measured on workers with blocking calls (the draft may be None). V(n): verifies of chains of
    n - 1 nodes after ``context_tokens`` cached tokens; D(p): a 1 + DRAFT_STEPS-step proposal (later steps
    expanding p parents) minus a one-step one, / DRAFT_STEPS. A merged call is rerun up to MERGED_RETRIES times,
    then MeasurementDisturbed. ``context_limit`` shrinks the context (ValueError under 8 tokens); rows over
    ``max_rows`` are left out. Sessions are released even on errors, which propagate."""
    rows = [n for n in rows if max_rows is None or n <= max_rows] or [1]
    if context_limit:
        context_tokens = min(context_tokens, context_limit - 4 * (MERGED_RETRIES + 1) * len(rows) - max(rows))
        if context_tokens < 8:
            raise ValueError(f"context_limit: {context_limit} positions leave no room for the measurement's session")
    sid = f"__cost_model__{secrets.token_hex(4)}"
    ids = [1 + i % (vocab_size - 1) for i in range(context_tokens)]
    chain = [1 + i % (vocab_size - 1) for i in range(max(rows))]  # the verified chains' tokens, whatever the context
    verify_ms = _measure_verify(target, sid, ids, chain, rows, clock)
    if draft is None:
        return CostModel(verify_ms, source="measured")
    return CostModel(verify_ms, _measure_draft(draft, sid, ids, parents, clock), source="measured")


def _alone(what: str, once: Callable[[], object], merged: Callable[[object], bool],
           clock: Callable[[], float]) -> tuple[object, float]:
    """once() until a call that no other session's work shared; (its result, its seconds)."""
    for _ in range(MERGED_RETRIES + 1):
        t0 = clock()
        out = once()
        took = clock() - t0
        if not merged(out):
            return out, took
    raise MeasurementDisturbed(f"{what}: shared with other sessions' work {MERGED_RETRIES + 1} times in a row "
                               "(the service is busy)")


def _measure_verify(target, sid: str, ids: list[int], chain: list[int], rows: list[int],
                    clock: Callable[[], float]) -> dict[int, float]:
    """{rows: ms} of verifies of chains of rows - 1 nodes (``measure_worker_costs``)."""

    def verify_once(n: int) -> VerifyResult:
        result = target.verify(sid, DraftTree(tuple(chain[:n - 1]), tuple(range(-1, n - 2))))
        target.commit(sid, 1)
        return result

    def verify(n: int) -> float:
        result, took = _alone(f"verify of {n} rows", lambda: verify_once(n), lambda r: r.batch_size > 1, clock)
        # a service's own forward time where it reports one: what the rounds teach V (CostAwareControl.observe)
        return result.forward_ms / 1000 if result.forward_ms > 0 else took

    with _session(target, sid, ids, GREEDY):
        return measure_curve(verify, rows, clock=clock)


def _measure_draft(draft: DraftWorker, sid: str, ids: list[int], parents: Iterable[int],
                   clock: Callable[[], float]) -> dict[int, float]:
    """{parents: ms} of one draft step expanding that many parents (``measure_worker_costs``)."""

    def steps(p: int) -> float:  # p = 0: one step; else 1 + DRAFT_STEPS steps, the later ones expanding p parents each
        if p == 0:
            spec, depth = TreeSpec.chain(1), 1
        else:
            spec = TreeSpec(gamma=1 + DRAFT_STEPS, topKSpec=[[p]] + [[1] * p] * DRAFT_STEPS,
                            topHead=[1] + [p] * DRAFT_STEPS)
            depth = 1 + DRAFT_STEPS
        _, took = _alone(f"draft proposal of {depth} steps", lambda: draft.propose(sid, spec, depth),
                         lambda _: (draft.last_batch_size(sid) or 1) > 1, clock)
        return took

    with _session(draft, sid, ids, GREEDY):
        draft.propose(sid, TreeSpec.chain(1), 1)  # prefill
        draft.commit(sid, [ids[0]], [])
        many = measure_curve(steps, [0, *parents], clock=clock)  # the one-step proposal takes its turns with the others
    one = many.pop(0)
    return {p: max((ms - one) / DRAFT_STEPS, 1.0) for p, ms in many.items()}


@contextlib.contextmanager
def _session(worker, sid: str, ids: list[int], sampling):
    """A worker session for the body, released even when its start (which may have opened it) or the body failed."""
    try:
        worker.start(sid, ids, sampling)
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            worker.release(sid)
        raise
    else:
        worker.release(sid)


async def measure_service_costs(target, draft, vocab_size: int, call_timeout_s: float = 60.0,
                                total_timeout_s: float = 120.0, **kwargs) -> CostModel:
    """``measure_worker_costs`` (kwargs) through awaitable workers, on a thread whose calls wait on this event
    loop: each call within ``call_timeout_s`` s, none past ``total_timeout_s`` (TimeoutError; releases still get
    ``call_timeout_s``). Cancelled, the thread stops at its next call."""
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    deadline = time.monotonic() + total_timeout_s

    def call(name: str, method, *args):
        release = name == "release"  # a release still goes out: the session must not stay open
        if not release:
            if stop.is_set():
                raise TimeoutError("cost measurement cancelled")
            if time.monotonic() > deadline:
                raise TimeoutError(f"cost measurement: not done within {total_timeout_s} s")
        wait_s = max(call_timeout_s if release else min(call_timeout_s, deadline - time.monotonic()), 0.0)
        future = asyncio.run_coroutine_threadsafe(method(*args), loop)
        try:
            return future.result(wait_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{name}: no reply within {wait_s:.1f} s") from None

    try:
        return await asyncio.to_thread(measure_worker_costs, _Blocking(target, call),
                                       _Blocking(draft, call) if draft is not None else None, vocab_size, **kwargs)
    finally:
        stop.set()  # cancelled (or done): the thread's next call, if any, ends it


class _Blocking(WorkerAdapter):
    """An awaitable worker's calls as blocking ones, through ``blocking`` (``measure_service_costs``)."""

    def __init__(self, worker, blocking: Callable):
        super().__init__(worker)
        self.blocking = blocking

    def call(self, name: str, method, *args, **kwargs):
        return self.blocking(name, functools.partial(method, **kwargs) if kwargs else method, *args)
