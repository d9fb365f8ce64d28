"""SessionBatcher's gathering: waiting for the sessions expected back from their last call.

Scripted calls (a 100 ms sleep stands for the forward), no model: what is measured is which
sessions share each call. Four sessions loop submit -> answer -> a fixed per-session gap
(5 / 15 / 25 / 35 ms, an orchestrator's round overhead) -> submit. Without gathering, the sessions
whose gap exceeds wait_ms miss the call the first one starts and the calls split into groups that
alternate; with gathering, once each gap has been seen, every call holds all four.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from specdec.batching import SessionBatcher
from specdec.model_worker import ModelWorker

CALL_S = 0.1
GAPS_S = {"s0": 0.005, "s1": 0.015, "s2": 0.025, "s3": 0.035}


def _run_rounds(gather: float, rounds: int = 8, gaps: dict[str, float] = GAPS_S) -> list[list[str]]:
    """The sessions of every call, in order, for ``rounds`` items per session."""
    calls: list[list[str]] = []

    def batch_call(pairs):
        calls.append(sorted(sid for sid, _ in pairs))
        time.sleep(CALL_S)
        return [sid for sid, _ in pairs]

    async def session(batcher, sid):
        for r in range(rounds):
            assert await batcher.submit(sid, r) == sid
            await asyncio.sleep(gaps[sid])

    async def main():
        worker = ModelWorker("test-gather")
        batcher = SessionBatcher(worker, batch_call, lambda sid, payload: sid, max_batch=8, wait_ms=2.0, gather=gather)
        try:
            await asyncio.gather(*(session(batcher, sid) for sid in gaps))
        finally:
            worker.close()
        return batcher

    batcher = asyncio.run(main())
    return calls, batcher


def test_without_gathering_the_calls_split_into_alternating_groups():
    calls, _ = _run_rounds(gather=0.0)
    later = calls[4:]
    assert len(later) >= 6 and sum(len(c) == 4 for c in later) <= 1  # (almost) never all four again
    assert len(calls) >= 8 + 4  # more calls than rounds: the groups alternate


def test_gathering_keeps_every_call_whole_once_the_gaps_are_known():
    calls, batcher = _run_rounds(gather=0.5)  # waits up to 50 ms; the slowest session is back after 35 ms
    assert calls[0] == ["s0", "s1", "s2", "s3"]  # the first items arrive together
    # from the third call on (each session's gap seen once), every call holds all four sessions, up to
    # s0's last item (s0 went alone once, so it finishes one call ahead of the others)
    # (all six on a quiet machine; a scheduling hiccup may split one)
    assert sum(c == ["s0", "s1", "s2", "s3"] for c in calls[2:8]) >= 5, calls
    assert len(calls) <= 10
    assert batcher.gathered > 0


def test_a_session_beyond_the_window_is_not_waited_for():
    """s3 comes back 80 ms after its answer, beyond the 50 ms window: the others do not wait for it."""
    calls, _ = _run_rounds(gather=0.5, gaps={**GAPS_S, "s3": 0.08})
    middle = calls[2:8]  # s0..s2 all still running (s0 ends first)
    assert all({"s0", "s1", "s2"} <= set(c) for c in middle), calls  # the three in-window sessions stay together
    assert sum("s3" not in c for c in middle) >= 2  # s3 joins only the calls it happens to be back for


def test_expected_sessions_exclude_overdue_queued_and_forgotten_ones():
    batcher = SessionBatcher(ModelWorker.__new__(ModelWorker), None, lambda sid, payload: None, gather=0.5)
    batcher._call_s = 0.1
    now = 100.0
    batcher._answered = {"soon": now - 0.01, "late": now - 0.5, "far": now, "new": now}
    batcher._gap = {"soon": 0.03, "late": 0.03, "far": 0.2}  # "new": never came back yet, no gap known
    assert batcher._expected(now, now + 0.05) == ["soon"]  # late: overdue; far: beyond the limit; new: unknown
    batcher.forget("soon")
    assert batcher._expected(now, now + 0.05) == []
    with pytest.raises(ValueError, match="gather"):
        SessionBatcher(ModelWorker.__new__(ModelWorker), None, lambda sid, payload: None, gather=1.5)
