"""specdec.wire: the conversions between domain objects and specdec.v1 messages round-trip and refuse
malformed trees naming the field; and the generated gRPC code they target (specdec/v1) is what
scripts/gen_protos.py makes of protos/ (no hand edits, no stale files)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specdec.sampling import SamplingParams, SamplingParamsError
from specdec.tree import DraftTree, MalformedTreeError, Proposal
from specdec.tree_spec import DEFAULT_SPEC, SEED_SPEC, TreeSpecError
from specdec.v1 import tree_pb2
from specdec.wire import sampling_from_proto, sampling_to_proto, spec_from_proto, spec_to_proto, tree_from_proto, tree_to_proto

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*_pb2*.py*")}
    committed = {p.relative_to(ROOT): p.read_bytes() for p in (ROOT / "specdec" / "v1").glob("*_pb2*.py*")}
    assert set(fresh) == set(committed), "generated files differ from the committed set: run scripts/gen_protos.py"
    stale = [str(path) for path in fresh if fresh[path] != committed[path]]
    assert not stale, f"stale generated code (run python scripts/gen_protos.py): {stale}"


def test_round_trips():
    assert spec_from_proto(spec_to_proto(SEED_SPEC)) == SEED_SPEC
    assert spec_from_proto(spec_to_proto(DEFAULT_SPEC)) == DEFAULT_SPEC
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3)
    assert sampling_from_proto(sampling_to_proto(params)) == params
    assert sampling_from_proto(tree_pb2.SamplingParams()) == SamplingParams()  # unset = greedy, top_p off
    q = np.zeros(10)
    q[[2, 5]] = [0.25, 0.75]
    tree = DraftTree((2, 5, 7), (-1, -1, 0), (-1.5, -0.25, -0.5), (True, False, False), (Proposal(-1, q),))
    back = tree_from_proto(tree_to_proto(tree), vocab_size=10, max_nodes=8)
    assert (back.tokens, back.parents, back.expanded) == (tree.tokens, tree.parents, tree.expanded)
    assert np.allclose(back.draft_logprobs, tree.draft_logprobs)
    assert back.proposals[0].parent == -1 and np.array_equal(back.proposals[0].probs, q)


def _tree(**fields):
    base = dict(tokens=[1, 2, 3], parents=[-1, 0, 0], draft_logprobs=[-0.1, -0.2, -0.3], expanded=[True, False, False])
    base.update(fields)
    proposals = base.pop("proposals", [])
    msg = tree_pb2.TokenTree(**base)
    for parent, ids, probs in proposals:
        msg.proposals.add(parent=parent, token_ids=ids, probs=probs)
    return msg


MALFORMED = [
    (dict(parents=[-1, 5, 0]), "parents[1]"),
    (dict(parents=[-1, 2, 0]), "parents[1]"),  # not topological
    (dict(parents=[-2, 0, 0]), "parents[0]"),
    (dict(tokens=[1, 2, 10]), "tokens[2]"),
    (dict(tokens=[1, -1, 2]), "tokens[1]"),
    (dict(tokens=list(range(1, 10)), parents=[-1] + list(range(8)), draft_logprobs=[], expanded=[]), "tokens"),  # > max_nodes
    (dict(parents=[-1, 0]), "parents"),
    (dict(draft_logprobs=[-0.1]), "draft_logprobs"),
    (dict(expanded=[True]), "expanded"),
    (dict(draft_logprobs=[-0.1, math.nan, -0.3]), "draft_logprobs[1]"),
    (dict(proposals=[(-1, [1, 2], [0.5, math.nan])]), "proposals[0].probs"),
    (dict(proposals=[(-1, [1, 2], [0.5, 0.6])]), "proposals[0].probs"),
    (dict(proposals=[(-1, [1, 20], [0.5, 0.5])]), "proposals[0].token_ids"),
    (dict(proposals=[(7, [1], [1.0])]), "proposals[0].parent"),
    (dict(proposals=[(-1, [1], [1.0]), (-1, [2], [1.0])]), "proposals[1].parent"),
    (dict(proposals=[(-1, [1, 2], [1.0])]), "proposals[0].probs"),
]


@pytest.mark.parametrize("fields,field", MALFORMED, ids=[f"{i}-{f}" for i, (_, f) in enumerate(MALFORMED)])
def test_malformed_trees_name_the_field(fields, field):
    with pytest.raises(MalformedTreeError) as info:
        tree_from_proto(_tree(**fields), vocab_size=10, max_nodes=8)
    assert field in str(info.value)


def test_too_deep_tree():
    n = 6
    msg = tree_pb2.TokenTree(tokens=[1] * n, parents=[-1] + list(range(n - 1)))
    assert tree_from_proto(msg, vocab_size=10, max_nodes=8, max_depth=6).size == n
    with pytest.raises(MalformedTreeError, match="depth"):
        tree_from_proto(msg, vocab_size=10, max_nodes=8, max_depth=5)


def test_bad_spec_and_sampling_name_the_field():
    with pytest.raises(TreeSpecError, match="topHead"):
        spec_from_proto(tree_pb2.TreeSpec(gamma=1, top_k_spec=[tree_pb2.TopKRow(k=[2])], top_head=[2]))
    with pytest.raises(SamplingParamsError, match="top_k"):
        sampling_from_proto(tree_pb2.SamplingParams(temperature=1.0, top_k=-1))
