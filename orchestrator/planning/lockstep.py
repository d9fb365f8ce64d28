"""Lock-step rounds: the requests of one front send their verifies together (``RoundClock``).

Where the draft shares the target's compute (two services on one machine's cores), a round of
speculation pays under load only when every request's draft steps share one draft forward and every
request's verify shares one target forward: the goodput case of Liu et al. 2024 ("Optimizing
Speculative Decoding for Serving LLMs Using Goodput", SmartSpec, section 4), which vLLM's and
SGLang's schedulers get by running all requests' draft and verify steps as one batch step. Requests
that run their rounds independently drift apart instead: one drafts while the other verifies, on
the same cores, and their verifies stop merging. The clock keeps them in step with two barriers a round: a round starts
when every request in its decode rounds has committed the last (so their proposals reach the draft
service together, and its batcher merges them), and a request that is ready to verify waits until
every other one is ready too (or ``max_wait_s`` has passed: a straggler is not waited for longer),
then all of them send their verifies at once, which the target's batcher merges into one forward.

What it brings shrinks as requests grow in number (every request drafting merged, then verifying
merged, beats plain batched decoding by less at each load, and not at all at 16); through the
services it pays at a few clients and is no different at 8. The front's clock
(cost_aware.in_step, on by default) holds its turns only while the in-step plan applies, below
cost_aware.in_step_max_load (``active``; 8.5 by default: up to 8 clients).

Plain asyncio; the round controller (orchestrator.loop.controller) joins a request after its first round
(which needs no forward of its own: the prefill gave its token), calls ``turn(sid, START)`` before
each round and ``turn(sid, VERIFY)`` before each verify, and ``leave`` when the request ends. One
clock per RoundController, so per orchestrator actor (``front.workers``); requests without a draft
(``no_spec``) join too with ``cost_aware.in_step_no_spec`` (on by default: plain verifies that
arrive apart miss the target's gather window).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable


START, VERIFY = "start", "verify"  # the two turns of a round


class RoundClock:
    """Two barriers per round for the requests in their decode rounds (module docstring): ``turn(sid,
    START)`` before a round drafts, ``turn(sid, VERIFY)`` before it verifies.

    A VERIFY turn ends when every member is waiting (at either turn): members that wait at START
    (a request that has just joined, mid-round of the others) let the others verify and join them
    at the next START. A START turn ends when every member waits at START. Either ends for a waiter
    after ``max_wait_s``: the others go without the members missing then, and no turn waits for
    those again until they come to a turn themselves (a request whose draft is slow for a while,
    e.g. the first proposal of a new draft session, costs the others one ``max_wait_s``, not one a
    turn). active: whether the turns hold anyone now (None = always; the front's: while the in-step
    plan applies, ``SharedState.in_step_applies``); a turn taken while it is False returns at once
    and lets go the requests still waiting from before. Raises ValueError for max_wait_s <= 0.
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
        """The request is in its decode rounds (the controller joins it after its first round; joining
        again is a no-op)."""
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
        """Wait for the others at ``phase`` (START or VERIFY), at most ``max_wait_s``; returns the
        seconds waited. A request that is not a member (never joined), or is alone, does not wait."""
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
