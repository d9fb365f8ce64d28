"""The target server's session bookkeeping (``target_service.sessions``), without gRPC or a model:
KV accounting, the verify-pending/commit state machine and the idle reaper."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from specdec.interfaces import SessionStateError, UnknownSessionError, VerifyResult
from specdec.service_errors import CapacityError, DeadlineExpiredError
from specdec.tree import DraftTree
from target_service.sessions import SessionExistsError, TargetSessions

CHAIN_4 = DraftTree((5, 6, 7, 8), (-1, 0, 1, 2))  # depth 4
FAN_4 = DraftTree((5, 6, 7, 8), (-1, -1, -1, -1))  # depth 1
RESULT = VerifyResult((0, 1), (5, 6, 9))


def run(coro):
    """Run ``coro`` in a fresh event loop (sessions hold asyncio events: create them inside)."""
    return asyncio.run(coro)


def test_kv_accounting_follows_the_worked_example():
    async def body():
        book = TargetSessions(max_kv_tokens=100, context_limit=64)
        s = book.open("a", prompt_len=10)
        assert (s.held, s.busy, book.kv_held()) == (9, True, 9)  # busy until its prefill ran
        s.set_busy(False)
        assert book.begin_verify("a", FAN_4, b"t1") is FAN_4
        assert (s.tree_slots, book.kv_held(), s.busy) == (5, 14, True)  # 9 + 4 nodes + the root
        book.verified("a", RESULT)
        assert (s.pending, s.busy, book.kv_held()) == (RESULT, False, 14)  # held until commit
        commit = book.begin_commit("a")
        assert commit is s and s.busy
        s.set_busy(False)
        s.committed(3)
        # the 2 rejected rows stay in the target's cache until the rollback runs (before the next verify)
        assert (s.cached, s.tree_slots, s.stale, s.pending, s.tree_key, book.kv_held()) == (12, 0, 2, None, None, 14)

    run(body())


def test_the_rows_a_commit_rejects_count_until_the_next_verify_rolls_them_back():
    """A commit's rollback is deferred to the session's next verify (target_service.commits): until
    then its rejected rows are still held (a new session is refused when only they would make room),
    and the next verify may count them as freed (its forward runs after the rollback), unless that
    verify never reaches the model."""
    async def body():
        book = TargetSessions(max_kv_tokens=20, context_limit=64)
        s = book.open("a", prompt_len=10)
        s.set_busy(False)
        book.begin_verify("a", FAN_4, b"t1")  # 9 + 5
        book.verified("a", RESULT)
        book.begin_commit("a").set_busy(False)
        s.committed(1)  # the bonus only: 4 of the 5 rows go at the next verify
        assert (s.cached, s.stale, book.kv_held()) == (10, 4, 14)
        with pytest.raises(CapacityError, match=r"max_kv_tokens: 7 more KV slots .* \(14 held by 1 sessions\)"):
            book.open("b", prompt_len=8)  # 14 + 7 > 20, though 10 + 7 would fit
        big = DraftTree(tuple(range(9)), (-1,) * 9)  # 10 rows: 10 + 10 = 20 once the 4 stale rows are gone
        assert book.begin_verify("a", big, b"t2") is big
        assert (s.stale, s.tree_slots, book.kv_held()) == (4, 10, 20)  # recorded, not counted beside the new tree
        book.verified("a", None)  # dropped unrun (deadline, cancel): the rollback did not run either
        assert (s.busy, s.stale, s.tree_slots, book.kv_held()) == (False, 4, 0, 14)
        book.undo_begin([(s, book.begin_verify("a", big, b"t2"))])  # claimed in a VerifyBatch, never queued
        assert (s.busy, s.stale, s.tree_slots, book.kv_held()) == (False, 4, 0, 14)
        book.begin_verify("a", FAN_4, b"t3")
        book.verified("a", DeadlineExpiredError("deadline"))  # it ran (and failed): the rollback ran before it
        assert (s.stale, s.tree_slots, book.kv_held()) == (0, 0, 10)

    run(body())


def test_kv_accounting_refuses_past_the_budget_and_changes_nothing():
    async def body():
        book = TargetSessions(max_kv_tokens=20, context_limit=64)
        book.open("a", prompt_len=10).set_busy(False)  # holds 9
        with pytest.raises(CapacityError, match=r"max_kv_tokens: 12 more KV slots would exceed the limit of 20 \(9 held by 1 sessions\)"):
            book.open("b", prompt_len=13)
        assert "b" not in book.sessions and book.kv_held() == 9
        big = DraftTree(tuple(range(11)), (-1,) * 11)  # 11 nodes: 12 tree slots, 9 + 12 = 21 > 20
        with pytest.raises(CapacityError, match="max_kv_tokens: 12 more"):
            book.begin_verify("a", big, b"big")
        s = book.sessions["a"]
        assert (s.busy, s.tree_slots, s.tree_key, book.kv_held()) == (False, 0, None, 9)
        assert book.begin_verify("a", DraftTree(tuple(range(10)), (-1,) * 10), b"fits") is not None  # 9 + 11 = 20
        assert book.kv_held() == 20
        with pytest.raises(SessionExistsError, match="'a' is already open"):
            book.open("a", prompt_len=2)

    run(body())


def test_verify_is_idempotent_until_commit():
    async def body():
        book = TargetSessions(max_kv_tokens=100, context_limit=64)
        s = book.open("a", prompt_len=4)
        s.set_busy(False)
        assert book.begin_verify("a", FAN_4, b"t1") is FAN_4
        with pytest.raises(SessionStateError, match="'a' has a call in flight"):
            book.begin_verify("a", CHAIN_4, b"t2")  # another tree while the first runs
        book.verified("a", RESULT)
        # The retry of the same tree: nothing to run, the pending result is replayed; no new slots.
        session, tree = await book.claim_verify("a", FAN_4, b"t1")
        assert (session is s, tree, session.pending, book.kv_held()) == (True, None, RESULT, 3 + 5)
        with pytest.raises(SessionStateError, match="items\\[1\\].session_id: 'a' has an uncommitted verify of another tree"):
            book.begin_verify("a", CHAIN_4, b"t2", "items[1].")
        book.begin_commit("a")
        with pytest.raises(SessionStateError, match="has a call in flight"):
            book.begin_commit("a")
        s.set_busy(False)
        s.committed(2)
        assert book.begin_verify("a", CHAIN_4, b"t2") is CHAIN_4  # after the commit: a new tree
        with pytest.raises(UnknownSessionError, match="unknown target session 'zz'"):
            book.begin_verify("zz", FAN_4, b"t1")

    run(body())


def test_a_retry_waits_for_the_same_tree_in_flight_and_gets_its_result():
    async def body():
        book = TargetSessions(max_kv_tokens=100, context_limit=64)
        book.open("a", prompt_len=4).set_busy(False)
        book.begin_verify("a", FAN_4, b"t1")  # queued or running
        retry = asyncio.ensure_future(book.claim_verify("a", FAN_4, b"t1", deadline=time.monotonic() + 5))
        await asyncio.sleep(0.05)
        assert not retry.done()
        book.verified("a", RESULT)
        session, tree = await retry
        assert (tree, session.pending) == (None, RESULT)

    run(body())


def test_a_retry_past_its_deadline_and_a_failed_verify():
    async def body():
        book = TargetSessions(max_kv_tokens=100, context_limit=64)
        s = book.open("a", prompt_len=4)
        s.set_busy(False)
        book.begin_verify("a", FAN_4, b"t1")
        with pytest.raises(DeadlineExpiredError, match="expired while a verify of the same tree was in flight"):
            await book.claim_verify("a", FAN_4, b"t1", deadline=time.monotonic() + 0.05)
        book.verified("a", RuntimeError("forward failed"))  # a failed verify frees its tree slots
        assert (s.busy, s.pending, s.tree_slots, s.tree_key, book.kv_held()) == (False, None, 0, None, 3)
        book.begin_verify("a", FAN_4, b"t1")
        book.undo_begin([(s, FAN_4)])  # claimed, never handed to the model
        assert (s.busy, s.tree_slots, book.kv_held()) == (False, 0, 3)

    run(body())


def test_a_tree_past_the_context_limit_is_refused():
    async def body():
        book = TargetSessions(max_kv_tokens=100, context_limit=12)
        book.open("a", prompt_len=9).set_busy(False)  # L = 8: a depth-4 node would sit at position 12
        with pytest.raises(ValueError, match="tree: depth 4 after 9 committed tokens passes the context limit of 12"):
            book.begin_verify("a", CHAIN_4, b"chain")
        assert book.begin_verify("a", FAN_4, b"fan") is FAN_4  # depth 1 fits

    run(body())


def test_release_wakes_a_waiting_retry():
    async def body():
        book = TargetSessions(max_kv_tokens=100, context_limit=64)
        book.open("a", prompt_len=4).set_busy(False)
        book.begin_verify("a", FAN_4, b"t1")
        retry = asyncio.ensure_future(book.claim_verify("a", FAN_4, b"t1"))
        await asyncio.sleep(0.02)
        assert book.release("a") is not None and book.release("a") is None
        with pytest.raises(UnknownSessionError):
            await retry
        assert len(book) == 0 and book.kv_held() == 0

    run(body())


def test_a_released_sessions_verify_outcome_does_not_reach_a_new_session_under_its_id():
    """Release of a session whose verify is still running, then a Prefill under the same id: when the
    old verify's outcome arrives (the batcher's on_done, by session id), the new session stays busy
    with its prefill, with no result pending and no tree slots (the old result is not its own)."""
    async def body():
        book = TargetSessions(max_kv_tokens=100, context_limit=64)
        book.open("a", prompt_len=4).set_busy(False)
        book.begin_verify("a", FAN_4, b"t1")  # holds 3 + 5
        old = book.release("a")
        new = book.open("a", prompt_len=6)  # busy until its prefill ran; holds 5
        book.verified("a", RESULT)  # the old verify ends on the worker thread
        assert new is not old
        assert (new.busy, new.pending, new.tree_slots, new.tree_key, book.kv_held()) == (True, None, 0, None, 5)
        new.set_busy(False)  # the prefill ran
        assert book.begin_verify("a", CHAIN_4, b"t2") is CHAIN_4  # no stale result to commit first
        book.verified("a", RESULT)
        assert (new.busy, new.pending, book.kv_held()) == (False, RESULT, 10)

    run(body())


def test_a_verify_queued_when_its_session_is_released_never_runs_on_a_new_session_under_its_id():
    """A Verify still queued in the batcher (the worker busy with another session's forward) when its
    session is released and opened again under the same id: the queued verify fails with
    UnknownSessionError and never runs; the new session's own verify runs and its result is the one
    pending (the old tree's outcome, 9 as bonus, would otherwise be stored under the new tree's key)."""
    from specdec.batching import SessionBatcher
    from specdec.model_worker import ModelWorker

    hold = threading.Event()
    ran: list[tuple[str, bytes]] = []

    def batch_call(pairs):
        hold.wait(5.0)  # session b's forward keeps the worker busy while a is released and reopened
        ran.extend(pairs)
        return [VerifyResult((0,), (5, 9 if key == b"t1" else 6)) for _, key in pairs]

    async def body():
        worker = ModelWorker("test-forget")
        book = TargetSessions(max_kv_tokens=100, context_limit=64)
        batcher = SessionBatcher(worker, batch_call, lambda sid, key: batch_call([(sid, key)])[0],
                                 wait_ms=0.0, on_done=book.verified, what="verify")
        try:
            for sid in ("a", "b"):
                book.open(sid, prompt_len=4).set_busy(False)
            book.begin_verify("b", FAN_4, b"tb")
            first = asyncio.ensure_future(batcher.submit("b", b"tb"))
            await asyncio.sleep(0.05)  # b's call is running (blocked on hold)
            book.begin_verify("a", FAN_4, b"t1")
            old = asyncio.ensure_future(batcher.submit("a", b"t1"))
            await asyncio.sleep(0.01)
            book.release("a")
            batcher.forget("a")
            new = book.open("a", prompt_len=6)
            new.set_busy(False)  # its prefill ran
            book.begin_verify("a", CHAIN_4, b"t2")
            mine = asyncio.ensure_future(batcher.submit("a", b"t2"))
            hold.set()
            with pytest.raises(UnknownSessionError, match="released while its verify was queued"):
                await old
            assert (await mine).tokens == (5, 6) and (await first).tokens == (5, 6)
            assert ran == [("b", b"tb"), ("a", b"t2")]  # the old tree never ran
            assert (new.busy, new.pending.tokens, new.tree_key) == (False, (5, 6), b"t2")
        finally:
            hold.set()
            worker.close()

    run(body())


def test_the_reaper_releases_idle_sessions_only():
    async def body():
        book = TargetSessions(max_kv_tokens=100, context_limit=64, idle_s=10.0)
        idle, busy, fresh = book.open("idle", 5), book.open("busy", 5), book.open("fresh", 5)
        idle.set_busy(False)
        fresh.set_busy(False)
        now = time.monotonic()
        idle.last_used = busy.last_used = now - 11.0  # busy: a long prefill, never reaped
        assert book.reap(now) == ["idle"]
        assert sorted(book.sessions) == ["busy", "fresh"] and idle.idle.is_set()
        assert book.reap(now + 10.5) == ["fresh"]  # untouched for 10.5 s > idle_s
        assert list(book.sessions) == ["busy"] and book.kv_held() == 4

    run(body())


def test_the_reaper_loop_frees_the_kv_of_an_abandoned_session():
    async def body():
        book = TargetSessions(max_kv_tokens=100, context_limit=64, idle_s=0.1)  # checks every 0.05 s
        book.open("gone", 5).set_busy(False)
        kept = book.open("kept", 5)
        kept.set_busy(False)
        released: list[str] = []
        reaper = asyncio.ensure_future(book.reap_idle(released.append))
        for _ in range(8):
            await asyncio.sleep(0.04)
            kept.set_busy(False)  # touched: stays
        reaper.cancel()
        assert released == ["gone"] and list(book.sessions) == ["kept"]

    run(body())


def test_one_token_prefills_cannot_open_sessions_past_max_sessions():
    """Issue 57: a 1-token prefill holds no KV slot, so only the session cap stops 20,000 of them."""
    async def body():
        book = TargetSessions(max_kv_tokens=100, context_limit=64, max_sessions=3)
        for i in range(3):
            book.open(f"s{i}", prompt_len=1)
        assert book.kv_held() == 0
        with pytest.raises(CapacityError) as info:
            book.open("s3", prompt_len=1)
        assert str(info.value) == "target.max_sessions: all 3 target sessions are open"
        book.release("s0")
        book.open("s3", prompt_len=1)  # a released session's place is free again
        assert len(book) == 3

    run(body())

