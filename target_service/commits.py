"""Commits that do not wait behind other sessions' forwards (docs/design.md "KV rollback").

``DeferredCommits.defer`` records a checked commit and the session's next call on the worker thread applies it
first; release or a new start drop it. Each session's operations keep their order, so every forward sees the
same KV as with the commit run at once.
"""

from __future__ import annotations

from typing import Sequence

from specdec.interfaces import SessionStateError
from target_service.tp import RankFailureError


class DeferredCommits:
    """A target runtime whose commits are applied at the session's next call; other attributes pass through."""

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
        """Run the session's recorded commits, in order (on the worker thread). A commit that raises may
        leave the KV half rolled back: it and every later call of the session until release raise
        SessionStateError (FAILED_PRECONDITION); a RankFailureError propagates as itself."""
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
        rest = [item for i, item in enumerate(items) if i not in errors]
        outcomes = list(self.runtime.verify_batch(rest)) if rest else []
        if len(outcomes) != len(rest):  # raised here: a StopIteration below would never reach the awaiting future
            raise RuntimeError(f"verify_batch: {len(outcomes)} outcomes for {len(rest)} items")
        remaining = iter(outcomes)
        return [errors[i] if i in errors else next(remaining) for i in range(len(items))]

    def release(self, session_id: str):
        self.deferred.pop(session_id, None)
        self.failed.pop(session_id, None)
        return self.runtime.release(session_id)
