"""The narrow worker interface shared by embedded (in-process) and distributed (gRPC) modes.

A round: ``draft.propose`` -> ``target.verify`` -> the orchestrator's stop checks ->
``target.commit`` and ``draft.commit``. ``release`` frees a session's KV. ``start`` opens a session
with the request's SamplingParams, which hold for all its rounds (both workers must apply them
identically: ``specdec.sampling``).

Cache invariant (both sides, after every commit): the cache holds KV for a prefix of the committed
tokens; the target's holds exactly all committed tokens but the last one (the root R of the next
tree, whose KV the next verify computes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specdec.sampling import SamplingParams
from specdec.tree import DraftTree
from specdec.tree_spec import TreeSpec


class UnknownSessionError(KeyError):
    """No session with that id on a worker (never started, or released)."""


class SessionStateError(RuntimeError):
    """Calls out of order, e.g. commit without a pending verify."""


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one tree.

    accepted_nodes: node indices of the accepted path, root side first (may be empty);
    tokens: the accepted path's tokens followed by the bonus token (len = len(accepted_nodes) + 1).
    """

    accepted_nodes: tuple[int, ...]
    tokens: tuple[int, ...]

    @property
    def bonus_token(self) -> int:
        return self.tokens[-1]


class DraftWorker(Protocol):
    def start(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams) -> None: ...

    def propose(self, session_id: str, spec: TreeSpec, max_depth: int) -> DraftTree: ...

    def commit(self, session_id: str, tokens: list[int], accepted_nodes: list[int]) -> None: ...

    def release(self, session_id: str) -> None: ...


class TargetWorker(Protocol):
    def start(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams) -> None: ...

    def verify(self, session_id: str, tree: DraftTree) -> VerifyResult: ...

    def commit(self, session_id: str, num_tokens: int) -> None: ...

    def release(self, session_id: str) -> None: ...
