"""Lock-step rounds: the requests of one front send their verifies together (``RoundClock``).

Why and when: docs/control.md "Lock-step rounds" (SmartSpec's goodput case, Liu et al. 2024 §4, which vLLM's and
SGLang's schedulers get by batching every request's draft and verify steps). Plain asyncio; a request joins after
its first round (the prefill gave its token), leaves when it ends.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable


START, VERIFY = "start", "verify"  # the two turns of a round


class RoundClock:
    """Two barriers per round for the requests in their decode rounds: ``turn(sid, START)`` before a round
    drafts, ``turn(sid, VERIFY)`` before it verifies.

    A VERIFY turn ends when every member waits at either turn (one that just joined waits at START and lets
    the others verify); a START turn when every member waits at START. Either ends after ``max_wait_s``
    without the missing members, who are not waited for again until their next turn (a slow draft costs the
    others one ``max_wait_s``, not one a turn). active: whether the turns hold anyone now (None = always);
    while False a turn returns at once and frees earlier waiters. Raises ValueError for max_wait_s <= 0.
    """

    def __init__(self, max_wait_s: float = 1.0, active: Callable[[], bool] | None = None):
        if max_wait_s <= 0:
            raise ValueError(f"max_wait_s: must be > 0, got {max_wait_s}")
        self.max_wait_s = max_wait_s
        self.active = active
        self.members: set[str] = set()
        self._waiting: dict[str, dict[str, asyncio.Event]] = {START: {}, VERIFY: {}}
        self._late: set[str] = set()  # members missing when a turn timed out: not waited for until their next turn
        self.ticks = 0  # turns ended with every member there (each one a set of calls sent together)
        self.timeouts = 0  # turns ended by max_wait_s with a member missing
        self.waited_s = 0.0  # total time requests spent waiting at turns

    def join(self, session_id: str) -> None:
        """The request is in its decode rounds (joining again is a no-op)."""
        self.members.add(session_id)

    def leave(self, session_id: str) -> None:
        """The request has ended (any way): no one waits for it any more."""
        self.members.discard(session_id)
        self._late.discard(session_id)
        for waiting in self._waiting.values():
            waiting.pop(session_id, None)
        self._settle()

    def _settle(self) -> None:
        """End the turns whose members are all there (VERIFY first: see the class docstring)."""
        start, verify = self._waiting[START], self._waiting[VERIFY]
        if verify and set(start) | set(verify) | self._late >= self.members:
            self._end(VERIFY)
        if start and set(start) | self._late >= self.members:
            self._end(START)

    def _end(self, phase: str, timed_out: bool = False) -> None:
        if timed_out:
            self.timeouts += 1
            self._late |= self.members - set(self._waiting[START]) - set(self._waiting[VERIFY])
        else:
            self.ticks += 1
        self._release(phase)

    def _release(self, phase: str) -> None:
        waiting, self._waiting[phase] = self._waiting[phase], {}
        for event in waiting.values():
            event.set()

    def _inactive(self) -> bool:
        """``active`` says the turns hold no one now: every request waiting at one goes on (not a tick)."""
        if self.active is None or self.active():
            return False
        self._release(VERIFY)
        self._release(START)
        return True

    async def turn(self, session_id: str, phase: str) -> float:
        """Wait for the others at ``phase``, at most ``max_wait_s``; returns seconds waited (0 for a non-member or alone)."""
        self._late.discard(session_id)
        if self._inactive():
            return 0.0
        if session_id not in self.members or len(self.members) < 2:
            return 0.0
        event = asyncio.Event()
        self._waiting[phase][session_id] = event
        self._settle()
        if event.is_set():
            return 0.0
        started = time.monotonic()
        try:
            await asyncio.wait_for(event.wait(), self.max_wait_s)
        except asyncio.TimeoutError:
            if self._waiting[phase].get(session_id) is event:  # nobody ended the turn meanwhile
                if not self._inactive():  # inactive meanwhile: no straggler to mark
                    self._end(phase, timed_out=True)  # go without the stragglers
        finally:
            if self._waiting[phase].get(session_id) is event:  # cancelled while waiting
                del self._waiting[phase][session_id]
                self._settle()
            waited = time.monotonic() - started
            self.waited_s += waited
        return waited
