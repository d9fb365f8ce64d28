"""DESIGN.md "Worked example": the SEED_SPEC tree of the real dump, its verification, one engine round.

Tree (BFS order, node index: token):
    depth 1 (root top-6):   0: 41824 (A1)  1: 43744 (A2)  2: 44298  3: 34051  4: 28380  5: 37539
    depth 2 (A1, A2 top-2): 6: 41760 (B11) 7: 35740 (B12) 8: 45315 (B21) 9: 41760 (B22)
    depth 3 (B11, B21 top-1): 10: 22870 (C111) 11: 22870 (C211)
Target argmax at R, A1, A2, B11, B21: 41824, 41760, 45315, 22870, 22870.
Accepted path 41824 -> 41760 -> 22870 + a bonus token; the matching branch under A2 is discarded.
"""

from __future__ import annotations

import math

import pytest
import torch

from draft_service.tree_builder import build_tree
from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.engine import SpeculativeEngine
from specdec.interfaces import DraftWorker, VerifyResult
from specdec.tree import DraftTree, node_depths
from specdec.tree_spec import SEED_SPEC
from target_service.verifier import verify_greedy

V = 50_000
PREFILL_TOP1 = 43107  # the root R: the prefill's top-1 token
BONUS = 999
OTHER = 7  # target argmax at rows that must not extend the path (not a child anywhere)

# Draft distributions, keyed by the root path: {token: probability}, best first.
DRAFT = {
    (): {41824: 0.40, 43744: 0.30, 44298: 0.06, 34051: 0.05, 28380: 0.04, 37539: 0.03},
    (41824,): {41760: 0.60, 35740: 0.30},  # path probs 0.24, 0.12
    (43744,): {45315: 0.50, 41760: 0.40},  # path probs 0.15, 0.12
    (41824, 41760): {22870: 0.70},
    (43744, 45315): {22870: 0.80},
}

TOKENS = (41824, 43744, 44298, 34051, 28380, 37539, 41760, 35740, 45315, 41760, 22870, 22870)
PARENTS = (-1, -1, -1, -1, -1, -1, 0, 0, 1, 1, 6, 8)


def _row(probs: dict[int, float]) -> torch.Tensor:
    """[V] log-probs with the given head; the remaining mass spread evenly over the rest."""
    rest = (1.0 - sum(probs.values())) / (V - len(probs))
    p = torch.full((V,), rest, dtype=torch.float64)
    for token, prob in probs.items():
        p[token] = prob
    return p.log().float()


def _path(tokens, parents, node):
    out = []
    while node != -1:
        out.append(tokens[node])
        node = parents[node]
    return tuple(out[::-1])


class ScriptedExpand:
    """expand(nodes, tokens, parents) -> [P, V] from DRAFT; records the calls."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def __call__(self, nodes, tokens, parents):
        self.calls.append(list(nodes))
        return torch.stack([_row(DRAFT[_path(tokens, parents, n)]) for n in nodes])  # (P, V)


def target_logits(argmax_by_row: dict[int, int], rows: int = len(TOKENS) + 1) -> torch.Tensor:
    """[rows, V] logits whose row r has its argmax at argmax_by_row.get(r, OTHER)."""
    logits = torch.zeros(rows, V)
    for r in range(rows):
        logits[r, argmax_by_row.get(r, OTHER)] = 5.0
        logits[r, 41760] = 1.0  # a runner-up that is a child in the tree, to catch off-by-one rows
    return logits


def target_argmax(argmax_by_row: dict[int, int], rows: int = len(TOKENS) + 1) -> list[int]:
    """The argmax ids of ``target_logits``' rows, as the target runtime hands them to ``verify_greedy``."""
    return target_logits(argmax_by_row, rows).argmax(dim=-1).tolist()


# Row 0 = R, row i + 1 = node i.
DUMP_ARGMAX = {0: 41824, 1: 41760, 2: 45315, 7: 22870, 9: 22870, 11: BONUS}


def test_seed_spec_shape():
    assert SEED_SPEC.gamma == 3
    assert SEED_SPEC.top_k_spec == ((6,), (2, 2), (1, 1))
    assert SEED_SPEC.top_head == (1, 2, 2)
    assert SEED_SPEC.num_nodes == 12


def test_build_tree_matches_dump():
    expand = ScriptedExpand()
    tree = build_tree(SEED_SPEC, expand, vocab_size=V)

    assert tree.size == 12
    assert tree.tokens == TOKENS
    assert tree.parents == PARENTS
    assert node_depths(tree.parents) == [1] * 6 + [2] * 4 + [3] * 2
    # Step 0 expands R, step 1 A1 and A2 (highest path probabilities), step 2 B11 (0.24) and B21 (0.15).
    assert expand.calls == [[-1], [0, 1], [6, 8]]
    assert tree.expanded == tuple(i in (0, 1, 6, 8) for i in range(12))
    # 5 parent positions (R + 4 expanded nodes) verify all 12 nodes.
    assert set(tree.parents) == {-1, 0, 1, 6, 8}
    assert len(set(tree.parents)) == 5
    # Draft log-probs are the per-step (conditional) log-probs.
    expected_probs = [0.40, 0.30, 0.06, 0.05, 0.04, 0.03, 0.60, 0.30, 0.50, 0.40, 0.70, 0.80]
    assert tree.draft_logprobs == pytest.approx([math.log(p) for p in expected_probs], abs=1e-5)


def test_path_probability_picks_expanded_nodes():
    """Depth-2 nodes are ranked by path probability (product from the root), not by their own
    conditional probability: B21 has the best conditional (0.9) but the lowest-but-one path
    probability (0.1 * 0.9), so both children of A1 are expanded."""
    draft = {
        (): {41824: 0.50, 43744: 0.10, 44298: 0.06, 34051: 0.05, 28380: 0.04, 37539: 0.03},
        (41824,): {41760: 0.40, 35740: 0.30},  # path 0.20, 0.15
        (43744,): {45315: 0.90, 41760: 0.05},  # path 0.09, 0.005
        (41824, 41760): {22870: 0.5},
        (41824, 35740): {11111: 0.5},
    }
    calls = []

    def expand(nodes, tokens, parents):
        calls.append(list(nodes))
        return torch.stack([_row(draft[_path(tokens, parents, n)]) for n in nodes])

    tree = build_tree(SEED_SPEC, expand, vocab_size=V)
    assert calls == [[-1], [0, 1], [6, 7]]
    assert tree.tokens[10:] == (22870, 11111)
    assert tree.parents[10:] == (6, 7)
    assert tree.expanded == tuple(i in (0, 1, 6, 7) for i in range(12))

    # Ranking order decides which expanded node gets topKSpec[d][0] children.
    spec = SEED_SPEC.model_copy(update={"top_k_spec": ((6,), (2, 2), (2, 1))})
    draft[(41824, 41760)] = {22870: 0.5, 33: 0.2}
    tree = build_tree(spec, expand, vocab_size=V)
    assert tree.tokens[10:] == (22870, 33, 11111)
    assert tree.parents[10:] == (6, 6, 7)


def test_path_probability_ties_follow_tree_order():
    draft = {
        (): {41824: 0.5, 43744: 0.25, 44298: 0.06, 34051: 0.05, 28380: 0.04, 37539: 0.03},
        (41824,): {41760: 0.25, 35740: 0.125},  # path 2^-3, 2^-4
        (43744,): {45315: 0.5, 41760: 0.125},  # path 2^-3, 2^-5
        (41824, 41760): {1: 0.5},
        (43744, 45315): {2: 0.5},
    }

    def expand(nodes, tokens, parents):
        return torch.stack([_row(draft[_path(tokens, parents, n)]) for n in nodes])

    calls = []
    tree = build_tree(SEED_SPEC, lambda *a: (calls.append(list(a[0])), expand(*a))[1], vocab_size=V)
    assert calls == [[-1], [0, 1], [6, 8]]
    # B11 and B21 tie at 2^-3 (float-exact: the same two log factors, added in either order):
    # B11 comes first in the tree, so it is expanded first and gets the first depth-3 node.
    assert tree.parents[10:] == (6, 8)
    assert tree.tokens[10:] == (1, 2)


@pytest.mark.parametrize("threshold, size", [(0.1, 12), (0.2, 12), (0.3, 10), (0.5, 6)])
def test_gamma_threshold_stops_deepening(threshold, size):
    """Best path probability: 0.40 at depth 1, 0.24 at depth 2; deepening stops below the threshold."""
    spec = SEED_SPEC.model_copy(update={"gamma_threshold": threshold})
    expand = ScriptedExpand()
    tree = build_tree(spec, expand, vocab_size=V)
    assert tree.size == size
    assert tree.tokens == TOKENS[:size] and tree.parents == PARENTS[:size]
    assert len(expand.calls) == {12: 3, 10: 2, 6: 1}[size]


def test_max_depth_caps_gamma():
    tree = build_tree(SEED_SPEC, ScriptedExpand(), max_depth=2, vocab_size=V)
    assert tree.tokens == TOKENS[:10] and tree.parents == PARENTS[:10]
    tree = build_tree(SEED_SPEC, ScriptedExpand(), max_depth=1, vocab_size=V)
    assert tree.tokens == TOKENS[:6] and tree.parents == PARENTS[:6]


def test_verify_greedy_dump():
    result = verify_greedy(TOKENS, PARENTS, target_argmax(DUMP_ARGMAX))
    assert result.accepted_nodes == (0, 6, 10)
    assert result.tokens == (41824, 41760, 22870, BONUS)
    assert result.tokens[-1] == BONUS


def test_verify_greedy_walks_one_path():
    # R -> 43744 instead: the other branch 43744 -> 45315 -> 22870 is accepted, bonus from C211's row.
    argmax = {0: 43744, 2: 45315, 9: 22870, 12: 123}
    result = verify_greedy(TOKENS, PARENTS, target_argmax(argmax))
    assert result.accepted_nodes == (1, 8, 11)
    assert result.tokens == (43744, 45315, 22870, 123)

    # A1's argmax is 45315: a child of A2, not of A1 -> stop at A1, 45315 is the bonus.
    argmax = {0: 41824, 1: 45315, 2: 45315, 9: 22870}
    result = verify_greedy(TOKENS, PARENTS, target_argmax(argmax))
    assert result.accepted_nodes == (0,)
    assert result.tokens == (41824, 45315)

    # Leaf B12 accepted: the bonus comes from B12's own row (row 8).
    argmax = {0: 41824, 1: 35740, 8: 555}
    result = verify_greedy(TOKENS, PARENTS, target_argmax(argmax))
    assert result.accepted_nodes == (0, 7)
    assert result.tokens == (41824, 35740, 555)

    # Nothing accepted: the target argmax at R is no child -> the bonus alone.
    result = verify_greedy(TOKENS, PARENTS, target_argmax({0: 43107}))
    assert result.accepted_nodes == ()
    assert result.tokens == (43107,)

    # Empty tree: one plain decoding step.
    result = verify_greedy((), (), target_argmax({0: 17}, rows=1))
    assert result == VerifyResult((), (17,))


# ------------------------------------------------------------------------------------------------
# The same round through the engine, with scripted workers.
# ------------------------------------------------------------------------------------------------

class ScriptedDraft(DraftWorker):
    """DraftWorker building the dump's tree every round."""

    def __init__(self):
        self.log = []

    def start(self, session_id, prompt_ids, sampling):
        self.log.append(("start", list(prompt_ids)))

    def propose(self, session_id, spec, max_depth):
        self.log.append(("propose", max_depth))
        return build_tree(spec, ScriptedExpand(), max_depth=max_depth, vocab_size=V)

    def commit(self, session_id, tokens, accepted_nodes):
        self.log.append(("commit", list(tokens), list(accepted_nodes)))

    def release(self, session_id):
        self.log.append(("release",))


class ScriptedTarget:
    """TargetWorker answering every tree with the dump's target argmax rows (rows past the tree dropped)."""

    def __init__(self):
        self.log = []
        self.pending = None

    def start(self, session_id, prompt_ids, sampling):
        self.log.append(("start", list(prompt_ids)))

    def verify(self, session_id, tree: DraftTree):
        assert self.pending is None
        rows = tree.size + 1
        self.log.append(("verify", tree.tokens, tree.parents))
        self.pending = verify_greedy(tree.tokens, tree.parents, target_argmax(DUMP_ARGMAX, rows))
        return self.pending

    def commit(self, session_id, num_tokens):
        self.log.append(("commit", num_tokens, self.pending.tokens[:num_tokens]))
        self.pending = None

    def release(self, session_id):
        self.log.append(("release",))


def test_engine_round_on_dump():
    draft, target = ScriptedDraft(), ScriptedTarget()
    engine = SpeculativeEngine(target, draft, eos_token_ids=[], context_limit=10_000)
    prompt = [11, 22, PREFILL_TOP1]
    rounds = []
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=6, spec=SEED_SPEC), on_tokens=rounds.append)

    # Round 1: the full dump round, 4 tokens. Round 2: budget 2 -> depth 1 tree (6 nodes), the root
    # argmax 41824 is accepted and A1's argmax 41760 is the bonus.
    assert rounds == [[41824, 41760, 22870, BONUS], [41824, 41760]]
    assert out.tokens == [41824, 41760, 22870, BONUS, 41824, 41760]
    assert out.stats.rounds == 2
    assert out.stats.proposed_tokens == 12 + 6
    assert out.stats.accepted_tokens == 3 + 1
    assert out.stats.stop_reason == "max_new_tokens"
    assert out.stats.acceptance_rate == pytest.approx(4 / 18)
    assert out.stats.mean_accepted_length == pytest.approx(3.0)

    assert draft.log == [
        ("start", prompt),
        ("propose", 5),  # budget 6 -> depth <= 5 (capped at gamma 3 by the builder)
        ("commit", [41824, 41760, 22870, BONUS], [0, 6, 10]),
        ("propose", 1),
        ("commit", [41824, 41760], [0]),
        ("release",),
    ]
    assert target.log[0] == ("start", prompt)
    assert target.log[1] == ("verify", TOKENS, PARENTS)
    assert target.log[2] == ("commit", 4, (41824, 41760, 22870, BONUS))
    assert target.log[3] == ("verify", TOKENS[:6], PARENTS[:6])
    assert target.log[4] == ("commit", 2, (41824, 41760))
    assert target.log[5] == ("release",)


def test_engine_stop_inside_dump_path():
    """EOS = 41760 (depth 2 of the accepted path): commit 2 tokens, the draft keeps node 0 only."""
    draft, target = ScriptedDraft(), ScriptedTarget()
    engine = SpeculativeEngine(target, draft, eos_token_ids=[41760], context_limit=10_000)
    out = engine.generate(GenerationRequest([PREFILL_TOP1], max_new_tokens=50, spec=SEED_SPEC))
    assert out.tokens == [41824, 41760]
    assert out.stats.stop_reason == "eos"
    assert out.stats.accepted_tokens == 2
    assert ("commit", [41824, 41760], [0, 6]) in draft.log
    assert ("commit", 2, (41824, 41760)) in target.log
