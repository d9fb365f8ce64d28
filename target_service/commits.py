"""Commits that do not wait for the model worker (DESIGN.md "Batching").

A Commit keeps the accepted nodes' KV and drops the rest (``TargetRuntime.commit``: KV rollback).
Run as a job on the target's one model-worker thread, it waits behind whatever forward is running
there: with two requests whose rounds drifted apart, request A's commit (a quick rollback) waits for
the whole verify forward of request B that started the moment A's ended, and A's next round starts
only then.

``DeferredCommits`` wraps the runtime: ``defer(session_id, num_tokens)`` records the commit (the
server has already checked it against the pending result), and the session's next call on the
worker thread (verify, verify_batch, commit) applies it first; release and a new start under the
same id drop it. A rollback that raises is not retried: the session's later calls fail
(``apply``) until it is released. Each session's operations stay in their order, so every forward
sees the same KV as with the commit run at once; the commit's reply does not wait for other
sessions' forwards. The record is touched from the event
loop (``defer``) and the worker thread (the calls) for one session at a time: the server's session
states let no verify of a session be queued or running while its commit is taken.
"""

from __future__ import annotations

from typing import Sequence

from specdec.interfaces import SessionStateError
from target_service.tp import RankFailureError


class DeferredCommits:
    """A target runtime whose commits are applied at the session's next call (module docstring).

    runtime: ``TargetRuntime`` or anything with the same methods (commit, verify, optionally
    verify_batch, release); other attributes pass through.
    """

    def __init__(self, runtime):
        self.runtime = runtime
        self.deferred: dict[str, list[int]] = {}  # session id -> num_tokens of each commit not yet applied
        self.failed: dict[str, str] = {}  # session id -> the error of its rollback that raised
        if hasattr(runtime, "verify_batch"):
            self.verify_batch = self._verify_batch

    def __getattr__(self, name):
        return getattr(self.runtime, name)

    def defer(self, session_id: str, num_tokens: int) -> None:
        """Record a commit checked by the caller (a pending result, 1 <= num_tokens <= its tokens)."""
        self.deferred.setdefault(session_id, []).append(num_tokens)

    def apply(self, session_id: str) -> None:
        """Run the session's recorded commits, in order (on the worker thread).

        A commit that raises may have left the session's KV half rolled back: it is never run
        again, and this call and every later call of the session (until release, or a new start
        under its id) raise SessionStateError naming the session and the first error (a client
        sees FAILED_PRECONDITION: release the session and start again). A RankFailureError (a
        tensor-parallel rank died) propagates as itself: the server fails every call then."""
        broken = self.failed.get(session_id)
        if broken is not None:
            raise SessionStateError(f"session_id: {session_id!r}: its KV rollback failed ({broken}); release it")
        for num_tokens in self.deferred.pop(session_id, ()):
            try:
                self.runtime.commit(session_id, num_tokens)
            except RankFailureError:
                raise  # the ranks are gone: the server fails every call (UNAVAILABLE), not this session alone
            except Exception as exc:
                self.failed[session_id] = f"commit of {num_tokens} tokens: {type(exc).__name__}: {exc}"
                raise SessionStateError(
                    f"session_id: {session_id!r}: its KV rollback failed ({self.failed[session_id]}); release it") from exc

    def start(self, session_id: str, *args, **kwargs):
        """A new session under this id (one released by a cancelled Release may have left a record)."""
        self.deferred.pop(session_id, None)
        self.failed.pop(session_id, None)
        return self.runtime.start(session_id, *args, **kwargs)

    def commit(self, session_id: str, num_tokens: int) -> None:
        """A commit run now (after the recorded ones); one that raises fails the session as in ``apply``."""
        self.defer(session_id, num_tokens)
        self.apply(session_id)

    def verify(self, session_id: str, tree):
        self.apply(session_id)
        return self.runtime.verify(session_id, tree)

    def _verify_batch(self, items: Sequence[tuple]):
        """``runtime.verify_batch`` after each item's session's recorded commits; an item whose
        commits raise gets that exception in its slot (the others run)."""
        errors: dict[int, Exception] = {}
        for i, (session_id, _) in enumerate(items):
            try:
                self.apply(session_id)
            except Exception as exc:  # noqa: BLE001 - the item's own outcome
                errors[i] = exc
        if not errors:
            return self.runtime.verify_batch(items)
        rest = [i for i in range(len(items)) if i not in errors]
        outcomes = list(self.runtime.verify_batch([items[i] for i in rest])) if rest else []
        if len(outcomes) != len(rest):
            raise RuntimeError(f"verify_batch: {len(outcomes)} outcomes for {len(rest)} items")
        out: list = [None] * len(items)
        for i, exc in errors.items():
            out[i] = exc
        for i, outcome in zip(rest, outcomes):
            out[i] = outcome
        return out

    def release(self, session_id: str):
        self.deferred.pop(session_id, None)
        self.failed.pop(session_id, None)
        return self.runtime.release(session_id)
