"""Measured costs of this deployment: target verify latency V(n) and draft step latency D(p).

Units: milliseconds. n = rows of one verify forward ([R, nodes], so n = tree nodes + 1); p =
parents expanded by one draft step (rows of that draft forward).

Both curves are piecewise linear through measured points, extrapolated linearly past the last
one, and never decreasing (a point above its right neighbour is lowered to it: timing noise only
slows a forward down, so of two sizes measured out of order the smaller size's figure is the one a
disturbance inflated). They start from a
start-up measurement (a few forwards, ``measure_curve``) or from prior figures, and follow the
running deployment: every round's own timing moves one scale factor of the whole curve (the
first observation sets it, as prior figures may come from another machine; later ones move it by
an exponential moving average of observed / predicted, weight ``alpha``, one observation's ratio
clamped to [0.5, 2]). The shape measured at start-up is kept; drift (a busier machine, a longer
context) moves all sizes together, so one noisy round cannot make extra rows look expensive
or free.

Worked example: points {1: 285, 8: 449} give V(4) = 285 + (449 - 285) * 3/7 = 355.3 ms; an
observed V(4) of 426.3 ms (ratio 1.2) with alpha 0.5 moves the scale from 1 to 1.1, so V(4) is
then 390.8 ms and V(1) 313.5 ms.

The priors are CPU figures of the default pair (float32 1.5B target after 300 cached tokens, int8
0.5B draft): only their shape matters, as the first observation sets the scale.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
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
    """A latency curve ms(x) = scale * base(x) through measured points (module docstring).

    points: {x: ms} with x >= 1 integers (at least one point); alpha: weight of one observation;
    measured: the points were measured on this deployment (start-up), so the first observation
    moves the scale like any other instead of setting it (that rule is for prior figures, which may
    come from another machine), unless it is more than 4x off: then the start-up figure was not
    representative (a busy machine) and the observation sets the scale. Thread-safe: one lock around reads and updates (the front's requests share one curve).
    """

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
        monotone, low = {}, float("inf")
        for x, ms in sorted(self.points.items(), reverse=True):  # suffix minimum (module docstring)
            low = min(low, float(ms))
            monotone[int(x)] = low
        self.points = dict(sorted(monotone.items()))

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
        """Move the scale towards one observed latency ``ms`` at ``x`` (module docstring)."""
        self.observe_sum([x], ms)

    def observe_sum(self, xs: Iterable[float], ms: float, may_set: bool = True) -> None:
        """One observation of ``ms`` for a sequence of forwards of sizes xs (e.g. a draft proposal's steps).
        may_set False: never the first-observation rule, always the clamped moving average (a bound,
        not a measurement: a deadline that tripped once must not set the scale)."""
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
    """V(n) and D(p) of this deployment (module docstring), shared by the requests of one front.

    verify_ms: {rows: ms} measured or prior; draft_step_ms: {parents: ms}; round_overhead_ms:
    the rest of a round (stop checks, commits, transport), measured from the rounds.
    """

    def __init__(self, verify_ms: dict[int, float] | None = None, draft_step_ms: dict[int, float] | None = None,
                 alpha: float = 0.2, source: str = "prior"):
        measured = source in ("measured", "configured")
        self.verify = LatencyCurve(dict(verify_ms or PRIOR_VERIFY_MS), alpha, measured=measured and bool(verify_ms))
        self.draft_step = LatencyCurve(dict(draft_step_ms or PRIOR_DRAFT_STEP_MS), alpha,
                                       measured=measured and bool(draft_step_ms))
        self.round_overhead_ms = 0.0
        # "prior" | "measured" | "configured" (CostAwareConfig's figures): where the starting points
        # came from; measured and configured points are this deployment's (LatencyCurve.measured)
        self.source = source

    def draft_step_ms(self, parents: int) -> float:
        """D(parents). Until a draft step has been observed, the draft curve follows the verify
        curve's scale: prior or start-up figures hold the ratio of the two models' costs, and a
        machine that runs the target 10x faster than the figures runs the draft about as much faster."""
        if self.draft_step.observations == 0 and not self.draft_step.measured:
            return self.verify.scale * self.draft_step.base(parents)
        return self.draft_step(parents)

    def draft_ms(self, parents_per_step: Iterable[int]) -> float:
        """Predicted ms of a draft proposal that expands these parents per step (one entry per step)."""
        return sum(self.draft_step_ms(p) for p in parents_per_step)

    def drafted_verify(self, rows: float) -> float:
        """V(rows) of a drafted round: alone, the same as a plain round's (``LoadedCost`` differs)."""
        return self.verify(rows)

    def round_ms(self, rows: int, parents_per_step: Iterable[int] = ()) -> float:
        """Predicted ms of one round: drafting, then a verify of ``rows`` rows, plus the overhead."""
        return self.draft_ms(parents_per_step) + self.verify(rows) + self.round_overhead_ms

    def observe_round(self, rows: int, verify_s: float, parents_per_step: list[int], draft_s: float | None,
                      overhead_s: float = 0.0) -> None:
        """Fold one round's timings into the curves (seconds in, as the round loop measures them).
        rows: of the whole verify forward (every session's rows when the target merged several)."""
        self.verify.observe(rows, verify_s * 1000)
        if draft_s and parents_per_step:
            self._observe_draft(parents_per_step, draft_s * 1000)
        self.round_overhead_ms += 0.2 * (overhead_s * 1000 - self.round_overhead_ms)

    def observe_draft_timeout(self, parents_per_step: list[int], waited_s: float) -> None:
        """A draft proposal of these parents per step gave no reply within ``waited_s`` seconds (its
        deadline): a lower bound on its latency, folded into D like a reply that took that long
        where D predicted less, through the clamped moving average only (one timeout moves D by at
        most 1 + alpha). Without it, proposals that all time out would teach D nothing and every
        round would keep planning a draft that cannot answer in time. (Under load, on the draft's
        own device, the cost-aware control folds a timeout into the draft's queue share instead:
        ``SharedState.observe_draft_queue``.)"""
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


class LoadedCost:
    """The cost model as each of ``load`` requests whose rounds share one verify forward sees it.

    Goodput planning (Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large Language
    Models Using Goodput", SmartSpec, section 4): with B requests merged into each forward, each
    verifying r rows, a round takes D + V(B r) + overhead and yields B times one request's tokens, so
    the batch's best choice maximises one request's tokens / (D + V(B r) + overhead) (the symmetric
    case). ``verify(rows)`` is therefore V(load * rows): once V turns compute-bound, trees shrink as
    load grows, and a plain round beats drafting where batched decoding has the higher throughput.
    load: sessions per verify forward (>= 1, a moving average); load 1 is the cost model itself.

    shared_compute (``specdec.placement``): each request's draft steps take the target's compute;
    with m = 1 + draft_merge * (load - 1) sessions per draft forward (the draft service merges
    concurrent proposals) a step costs D(m p) * load / m of the batch's time: D(p) * load when every
    step runs alone, D(load p) in lockstep. On its own device one draft serves every request: a step
    costs D(p) * (1 + draft_queue * (load - 1)) (``queue_factor``), draft_queue learnt from the
    replies' wall times under load.
    """

    def __init__(self, cost: CostModel, load: float, shared_compute: bool = False, draft_queue: float = 0.0,
                 draft_merge: float = 0.0, verify_merge: float = 1.0):
        self.cost = cost
        self.load = max(float(load), 1.0)
        self.shared_compute = shared_compute
        self.draft_queue = max(float(draft_queue), 0.0)
        self.draft_merge = min(max(float(draft_merge), 0.0), 1.0)
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
        """ms of the batch's verifies for a drafted round of ``rows`` rows per request: with m =
        ``verify_sessions()`` sessions per forward the batch's rounds take load / m forwards of
        V(m rows). verify_merge 1 (drafted rounds keep in step: every request drafts alike, and
        their verifies merge) gives V(load rows), ``verify``; 0 (each drafted round misses the
        others' forward: a draft's time late) gives V(rows) * load, as a draft step alone on shared
        compute is priced (``draft_step_ms``)."""
        m = self.verify_sessions()
        return self.cost.verify(m * rows) * self.load / m

    def queue_factor(self) -> float:
        """How much longer than D a draft step takes as a request sees it, on the draft's own device:
        1 + draft_queue * (load - 1). draft_queue (learnt, ``SharedState.observe_draft_queue``) is
        the share of each other request's step that a step waits behind: 0 when the draft merges or
        overlaps every session's steps, 1 when they run one after another, more when other
        sessions' prefills queue there too."""
        return 1.0 + self.draft_queue * (self.load - 1.0)

    def merged_sessions(self) -> float:
        """Sessions per draft forward on shared compute: 1 + draft_merge * (load - 1)."""
        return 1.0 + self.draft_merge * (self.load - 1.0)

    def draft_step_ms(self, parents: int) -> float:
        if self.shared_compute:
            m = self.merged_sessions()
            return self.cost.draft_step_ms(parents * m) * self.load / m
        return self.cost.draft_step_ms(parents) * self.queue_factor()

    draft_ms = CostModel.draft_ms  # over this class's draft_step_ms
    round_ms = CostModel.round_ms  # over this class's verify, draft_step_ms and round_overhead_ms


def measure_curve(run: Callable[[int], float | None], xs: Iterable[int], repeats: int = 3,
                  clock: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """Time ``run(x)`` for each x; the median of ``repeats`` runs (ms) per x after one warm-up run of each.

    run: performs one forward of size x (rows or parents) and returns when it is done, with None
    (the run is timed by ``clock``, seconds) or the seconds the forward itself took (a service's
    own figure, without transport). The sizes take turns (x1, x2, ..., then x1, x2, ... again), so a disturbance shorter
    than one turn over the sizes (about 0.9 s for V(1..32) on the default pair) costs each size at
    most one of its runs, which the median drops; measured one size after the other, all runs of
    the first size could fall in it, leaving the curve flat (tree rows would look free for as long
    as the front runs: the curve's shape is kept, only its scale learns).
    """
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
    """A CostModel measured on workers with blocking calls (specdec.interfaces; the draft may be None):
    in-process runtimes, or the services' clients through ``measure_service_costs``.

    V(n): verifies of chains of n - 1 nodes after ``context_tokens`` cached tokens (``measure_curve``),
    timed by the forward's own time where the result reports it (``VerifyResult.forward_ms``), as the
    rounds teach V. D(p): a proposal of one step against one of 1 + DRAFT_STEPS steps whose later
    steps expand p parents each, the difference / DRAFT_STEPS (what every proposal costs besides its
    steps cancels). A call that a service merged with other sessions' work (``batch_size`` or
    ``last_batch_size`` over 1) is run again, up to MERGED_RETRIES times, then MeasurementDisturbed.

    Greedy sessions of ids 1, 2, ... (costs do not depend on them), named ``__cost_model__`` and a
    random suffix (two fronts measuring one target at once do not share one), released at the end
    even on errors, which propagate. The target session grows by at most ``context_tokens`` + 4 *
    (MERGED_RETRIES + 1) * len(rows) + max(rows) tokens; ``context_limit`` (the target's max
    positions) shrinks the context to fit (ValueError under 8 tokens); sizes over ``max_rows`` (the
    target's tree limit + 1) are left out (their V extrapolates). clock: seconds.
    """
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
    """A worker session for the body, released after it even when its start or the body failed
    (a start that timed out may still have opened it); a failed release hides no error of the body."""
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
    """``measure_worker_costs`` through awaitable workers (the services' gRPC clients,
    orchestrator.loop.clients): V(n) from the target's own forward time (its replies say it), D(p)
    from the proposals' wall time (transport cancels in the difference). The measurement runs on a
    thread whose calls wait on this event loop, so the loop stays free for them; each call may take
    ``call_timeout_s`` seconds, and none waits past ``total_timeout_s`` from the start (then
    TimeoutError, the call cancelled; the releases after it get ``call_timeout_s`` each). Cancelled, it stops the thread at its next call (the sessions' releases still go
    out). ``last_batch_size`` (sync in DraftClient) is called as it is.
    kwargs: ``measure_worker_costs``'s sizes, context and clock. Errors of the calls propagate."""
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    deadline = time.monotonic() + total_timeout_s

    def call(name: str, method, *args):
        """``method(*args)`` (the worker's ``name``) on the event loop, waited for on the measurement's thread."""
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
        return self.blocking(name, method, *args)
