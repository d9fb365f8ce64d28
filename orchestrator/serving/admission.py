"""Admission control of the front (``front.limits``; docs/serving.md "Client limits"), on the front's event loop.
Use: ``ticket = enter(client, id)``, ``if await ticket.granted:`` generate (False: aborted while waiting),
``leave(ticket)`` on every exit path.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Sequence

from specdec.config import ClientLimitsConfig
from specdec.security import token_index

log = logging.getLogger(__name__)

WAITING, RUNNING, LEFT = "waiting", "running", "left"
RETRY_AFTER_S = 1  # a refusal's hint: HTTP 429 Retry-After, gRPC RESOURCE_EXHAUSTED grpc-retry-pushback-ms


class AdmissionRefused(Exception):
    """Over a limit of ``front.limits``; the message names the field (RESOURCE_EXHAUSTED / HTTP 429)."""


@dataclass(eq=False)
class Ticket:
    """``granted`` resolves True once it holds a running slot, False when aborted while waiting."""

    client: str
    request_id: str
    granted: asyncio.Future
    state: str = field(default=WAITING)


class Admission:
    """Running slots and the FIFO queue of one front, under ``limits``; per-client caps by default half the slots
    and half the queue (rounded up)."""

    def __init__(self, limits: ClientLimitsConfig):
        self.limits = limits
        self.running_cap, self.waiting_cap = (cap if cap is not None else (total + 1) // 2 for cap, total in (
            (limits.max_running_per_client, limits.max_running), (limits.max_waiting_per_client, limits.max_waiting)))
        self.queue: deque[Ticket] = deque()
        self.running = 0                            # requests holding a running slot
        self.running_of: Counter[str] = Counter()   # client -> requests holding a slot
        self.waiting_of: Counter[str] = Counter()   # client -> requests in the queue

    @property
    def waiting(self) -> int:  # requests in the queue
        return len(self.queue)

    def enter(self, client: str, request_id: str) -> Ticket:
        """Admit a request now or queue it (on the event loop); returns its Ticket. Raises AdmissionRefused
        naming the limit when it may neither run nor wait."""
        ticket = Ticket(client, request_id, asyncio.get_running_loop().create_future())
        if self._may_run(client):
            self._start(ticket)
            return ticket
        self._check_queue(client)
        self.queue.append(ticket)
        self.waiting_of[client] += 1
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """The request is over: frees its slot or queue place. Idempotent."""
        if ticket.state == WAITING:
            self._dequeue(ticket)
        elif ticket.state == RUNNING:
            ticket.state = LEFT
            self.running -= 1
            self._count_down(self.running_of, ticket.client)
            self._promote()

    def abort(self, request_id: str) -> bool:
        """End a waiting request (``granted`` resolves False); returns whether one had this id."""
        for ticket in self.queue:
            if ticket.request_id == request_id and not ticket.granted.done():
                self._dequeue(ticket)
                ticket.granted.set_result(False)
                return True
        return False

    def _may_run(self, client: str) -> bool:
        return self.running < self.limits.max_running and self.running_of[client] < self.running_cap

    def _check_queue(self, client: str) -> None:
        """Raise AdmissionRefused when a request of ``client`` that cannot run may not wait either."""
        limits = self.limits
        if self.running < limits.max_running:  # slots are free, but not to this client
            run_field, running, whose = "max_running_per_client", self.running_of[client], " of this client"
        else:
            run_field, running, whose = "max_running", self.running, ""
        if self.waiting >= limits.max_waiting:
            wait_field, waiting, wait_limit, wait_whose = "max_waiting", self.waiting, limits.max_waiting, ""
        elif limits.max_waiting and self.waiting_of[client] >= self.waiting_cap:
            wait_field, waiting, wait_limit, wait_whose = ("max_waiting_per_client", self.waiting_of[client],
                                                           self.waiting_cap, " of this client")
        else:
            return
        if wait_limit == 0:
            message = (f"front.limits.{run_field}: {running} requests{whose} are running "
                       f"(and front.limits.{wait_field} is 0: none may wait)")
        else:
            message = (f"front.limits.{wait_field}: {waiting} requests{wait_whose} are waiting for a slot "
                       f"(front.limits.{run_field}: {running}{whose} running)")
        log.info("refused a request of client %s: %s", client, message)
        raise AdmissionRefused(message)

    def _start(self, ticket: Ticket) -> None:
        self.running += 1
        self.running_of[ticket.client] += 1
        ticket.state = RUNNING
        ticket.granted.set_result(True)

    def _dequeue(self, ticket: Ticket) -> None:
        self.queue.remove(ticket)
        self._count_down(self.waiting_of, ticket.client)
        ticket.state = LEFT

    def _promote(self) -> None:
        """Free slots to the waiters that may run: each to the first waiter of the client with the fewest running."""
        while self.running < self.limits.max_running:
            ready = [t for t in self.queue if not t.granted.done() and self._may_run(t.client)]
            if not ready:
                return
            ticket = min(ready, key=lambda t: self.running_of[t.client])  # min keeps the first of equals: FIFO
            self._dequeue(ticket)
            self._start(ticket)

    @staticmethod
    def _count_down(counts: Counter, client: str) -> None:
        counts[client] -= 1
        if counts[client] <= 0:
            del counts[client]  # no entry per client ever seen


def peer_host(peer: str) -> str:
    """The host of a gRPC ``context.peer()`` ("ipv4:10.0.0.7:51234" -> "10.0.0.7"); other forms returned whole."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in address:
        return address.rsplit(":", 1)[0].strip("[]")
    return peer


def client_key(tokens: Sequence[bytes], authorization: str, host: str) -> str:
    """``token N`` (its bearer token's 1-based line; never the token: keys are logged), else ``peer HOST``."""
    if tokens and (index := token_index(tokens, authorization)) is not None:
        return f"token {index + 1}"
    return f"peer {host}"
