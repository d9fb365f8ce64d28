"""The target server's session bookkeeping: KV accounting, the idempotent-verify state machine and the idle
reaper (plain asyncio, no gRPC, no model).

KV held: committed slots L, plus N + 1 tree slots from a verify's start to its commit, plus the rejected rows
(``stale``) until the next verify's forward rolls them back. Example: Prefill of 10 tokens holds 9; a 4-node
verify holds 14; Commit(num_tokens=3) makes L = 12 and still holds 14; the next verify counts 2 as freed.

    idle --begin_verify--> busy (tree slots held) --verified(result)--> pending --commit--> idle
                                                   --verified(error / unrun)--> idle (tree slots freed)

Until commit the pending tree (same serialized key) is replayed, the same tree in flight waited for, another
tree refused (SessionStateError).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from specdec.interfaces import SessionStateError, UnknownSessionError, VerifyResult
from specdec.service_errors import CapacityError, DeadlineExpiredError
from specdec.tree import DraftTree, node_depths

log = logging.getLogger(__name__)


class SessionExistsError(RuntimeError):
    """Prefill of a session id that is already open; maps to ALREADY_EXISTS."""


@dataclass
class SessionSlots:
    """The server's view of one session: KV slots held and the verify awaiting commit."""

    cached: int  # L: committed slots
    tree_slots: int = 0  # N + 1 from the start of a verify until its commit
    # rows of a committed tree not yet rolled back (before the next verify's forward)
    stale: int = 0
    busy: bool = False  # a prefill, a verify or a commit is queued or running
    tree_key: bytes | None = None  # serialized tree of the verify in flight / pending
    pending: VerifyResult | None = None
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set whenever not busy
    last_used: float = field(default_factory=time.monotonic)  # for the idle-session reaper

    def __post_init__(self):
        self.set_busy(self.busy)

    def set_busy(self, busy: bool) -> None:
        self.busy = busy
        self.last_used = time.monotonic()
        (self.idle.clear if busy else self.idle.set)()

    @property
    def held(self) -> int:
        return self.cached + self.tree_slots + (self.stale if self.tree_key is None else 0)

    def drop_tree(self) -> None:
        """Free the tree slots of a verify that failed, was not run or was undone."""
        self.tree_slots, self.tree_key = 0, None

    def committed(self, num_tokens: int) -> None:
        """The pending verify's first ``num_tokens`` are committed: L grows; the other rows become ``stale``."""
        self.cached += num_tokens
        self.stale = max(self.tree_slots - num_tokens, 0)
        self.tree_slots, self.tree_key, self.pending = 0, None, None


class SameTreeInFlight(Exception):
    """A verify of this very tree is queued or running (a client retry): wait for it."""


class TargetSessions:
    """Every open session of one target server. max_kv_tokens: KV slots over all sessions; context_limit:
    max prompt + generated tokens; idle_s: see ``reap_idle``; max_sessions: open sessions at most (a 1-token
    prefill holds no KV slot but a logits row). Create inside the running event loop."""

    def __init__(self, max_kv_tokens: int, context_limit: int, idle_s: float = 600.0, max_sessions: int = 512):
        self.max_kv_tokens = max_kv_tokens
        self.context_limit = context_limit
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self.sessions: dict[str, SessionSlots] = {}

    def __len__(self) -> int:
        return len(self.sessions)

    def kv_held(self) -> int:
        """KV slots held over all sessions (committed + trees awaiting commit + rows awaiting rollback)."""
        return sum(s.held for s in self.sessions.values())

    def reserve(self, slots: int, freed: int = 0) -> None:
        """Raise CapacityError if ``slots`` more KV slots (after freeing ``freed``) exceed the limit."""
        held = self.kv_held() - freed
        if held + slots > self.max_kv_tokens:
            raise CapacityError(
                f"max_kv_tokens: {slots} more KV slots would exceed the limit of {self.max_kv_tokens} "
                f"({held} held by {len(self.sessions)} sessions)"
            )

    def get(self, session_id: str) -> SessionSlots:
        """Raises UnknownSessionError naming ``session_id``."""
        try:
            return self.sessions[session_id]
        except KeyError:
            raise UnknownSessionError(f"session_id: unknown target session {session_id!r}") from None

    def open(self, session_id: str, prompt_len: int) -> SessionSlots:
        """A new session of prompt_len - 1 slots, busy until its prefill ran. Raises SessionExistsError, CapacityError."""
        if session_id in self.sessions:
            raise SessionExistsError(f"session_id: {session_id!r} is already open (release it first)")
        if len(self.sessions) >= self.max_sessions:
            raise CapacityError(f"target.max_sessions: all {self.max_sessions} target sessions are open")
        self.reserve(prompt_len - 1, freed=0)
        new = self.sessions[session_id] = SessionSlots(cached=prompt_len - 1, busy=True)
        return new

    def discard(self, session_id: str, slots: SessionSlots) -> None:
        """Forget a session whose prefill failed (unless the id was meanwhile released and reopened)."""
        if self.sessions.get(session_id) is slots:
            del self.sessions[session_id]

    def begin_commit(self, session_id: str) -> SessionSlots:
        """Mark the session busy for its commit (no verify, nor its replay, may start meanwhile); the
        caller ends with ``set_busy(False)`` and, if the commit ran, ``committed(num_tokens)``."""
        s = self.get(session_id)
        if s.busy:
            raise SessionStateError(f"session_id: {session_id!r} has a call in flight")
        s.set_busy(True)
        return s

    def release(self, session_id: str) -> SessionSlots | None:
        """Forget the session (None if unknown); retries waiting on it wake and find no session."""
        s = self.sessions.pop(session_id, None)
        if s is not None:
            s.idle.set()
        return s

    def begin_verify(self, session_id: str, tree: DraftTree, key: bytes, field: str = "") -> DraftTree | None:
        """Check one verify of ``tree`` (serialized as ``key``) and reserve its N + 1 tree slots; returns the tree to
        run, or None = replay the pending result. Raises UnknownSessionError, SessionStateError, SameTreeInFlight,
        ValueError (context limit) or CapacityError, each message starting with ``field`` (e.g. ``items[2].``)."""
        s = self.get(session_id)
        if s.pending is not None:
            if key == s.tree_key:
                return None
            raise SessionStateError(f"{field}session_id: {session_id!r} has an uncommitted verify of another tree (commit it first)")
        if s.busy:
            if key == s.tree_key:
                raise SameTreeInFlight()
            raise SessionStateError(f"{field}session_id: {session_id!r} has a call in flight")
        depth = max(node_depths(tree.parents), default=0)
        if s.cached + depth >= self.context_limit:
            raise ValueError(f"{field}tree: depth {depth} after {s.cached + 1} committed tokens passes the context "
                             f"limit of {self.context_limit} tokens")
        self.reserve(tree.size + 1, freed=s.stale)  # the last commit's rollback runs before this forward
        s.set_busy(True)  # until ``verified``
        s.tree_key, s.tree_slots = key, tree.size + 1
        return tree

    async def claim_verify(self, session_id: str, tree: DraftTree, key: bytes, field: str = "",
                           deadline: float | None = None) -> tuple[SessionSlots, DraftTree | None]:
        """``begin_verify``, first waiting (until ``deadline``, time.monotonic()) for a verify of the same tree in
        flight; (session, None) = replay ``session.pending``. Raises as begin_verify, or DeadlineExpiredError."""
        while True:
            try:
                run = self.begin_verify(session_id, tree, key, field)
                return self.sessions[session_id], run
            except SameTreeInFlight:
                s = self.sessions[session_id]
                timeout = None if deadline is None else deadline - time.monotonic()
                try:
                    await asyncio.wait_for(s.idle.wait(), timeout)
                except asyncio.TimeoutError:
                    raise DeadlineExpiredError("deadline: expired while a verify of the same tree was in flight") from None

    @staticmethod
    def undo_begin(begun: list[tuple[SessionSlots, DraftTree | None]]) -> None:
        """Give back the tree slots of verifies claimed but never handed to the model."""
        for s, tree in begun:
            if tree is not None:
                s.set_busy(False)
                s.drop_tree()

    def verified(self, session_id: str, outcome: VerifyResult | Exception | None) -> None:
        """Once per queued verify (the batcher's on_done): a result stays pending until commit, even when its
        caller has gone; a failed or unrun verify frees its tree slots; a released session's is dropped."""
        s = self.sessions.get(session_id)
        if s is None or not s.busy or s.tree_key is None:
            return
        s.set_busy(False)
        if outcome is not None:  # it reached the model: the last commit's rollback ran before it
            s.stale = 0
        if isinstance(outcome, VerifyResult):
            s.pending = outcome
        else:
            s.drop_tree()

    def reap(self, now: float | None = None) -> list[str]:
        """Forget the sessions not busy and untouched for over ``idle_s`` (at ``now``, time.monotonic());
        returns their ids, for the caller to free their KV."""
        now = time.monotonic() if now is None else now
        reaped = []
        for sid, s in list(self.sessions.items()):
            if not s.busy and now - s.last_used > self.idle_s:
                self.release(sid)
                log.warning("released session %r: idle for %.0f s (target.session_idle_s)", sid, now - s.last_used)
                reaped.append(sid)
        return reaped

    async def reap_idle(self, release: Callable[[str], None]) -> None:
        """Every min(30 s, idle_s / 2): ``reap`` and ``release(session_id)`` each reaped session.
        Runs until cancelled."""
        while True:
            await asyncio.sleep(min(30.0, self.idle_s / 2))
            for sid in self.reap():
                release(sid)
