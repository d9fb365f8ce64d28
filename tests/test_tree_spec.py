"""TreeSpec parsing (DESIGN.md "TreeSpec"): valid specs from JSON files, inline JSON and dicts; invalid
specs rejected with a TreeSpecError whose message names the offending field. The tree shape per
speculation depth (``spec_at_depth``, ``max_depth_for``)."""

from __future__ import annotations

import json

import pytest

from specdec.tree import node_depths
from specdec.tree_spec import (
    DEFAULT_SPEC, SEED_SPEC, TreeSpec, TreeSpecError, max_depth_for, parse_tree_spec, spec_at_depth,
)

SEED_JSON = {"gamma": 3, "topKSpec": [[6], [2, 2], [1, 1]], "topHead": [1, 2, 2], "treeType": 0, "gammaThreshold": 0}


def _with(**changes):
    spec = json.loads(json.dumps(SEED_JSON))
    spec.update(changes)
    return spec


def test_inline_json():
    spec = parse_tree_spec(json.dumps(SEED_JSON))
    assert spec == SEED_SPEC
    assert spec.num_nodes == 12
    # Leading whitespace is still inline JSON.
    assert parse_tree_spec("  \n" + json.dumps(SEED_JSON)) == SEED_SPEC


def test_json_file(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"gamma": 2, "topKSpec": [[8], [4]], "topHead": [1, 1]}))
    spec = parse_tree_spec(str(path))
    assert spec.gamma == 2
    assert spec.top_k_spec == ((8,), (4,))
    assert spec.top_head == (1, 1)
    assert spec.tree_type == 0 and spec.gamma_threshold == 0.0  # defaults
    assert spec.num_nodes == 12


def test_dict_and_round_trip():
    spec = parse_tree_spec(SEED_JSON)
    assert spec == SEED_SPEC
    assert parse_tree_spec(spec.to_json()) == spec
    assert json.loads(spec.to_json())["topKSpec"] == [[6], [2, 2], [1, 1]]


def test_chain():
    chain = TreeSpec.chain(4)
    assert chain.gamma == 4
    assert chain.top_k_spec == ((1,),) * 4
    assert chain.top_head == (1,) * 4
    assert chain.num_nodes == 4


def test_valid_variants():
    spec = parse_tree_spec(_with(treeType=1, gammaThreshold=0.25))
    assert spec.tree_type == 1 and spec.gamma_threshold == 0.25
    # topHead[d] may equal the number of depth-d nodes.
    spec = parse_tree_spec({"gamma": 2, "topKSpec": [[3], [1, 2, 1]], "topHead": [1, 3]})
    assert spec.num_nodes == 7


@pytest.mark.parametrize(
    "spec, field",
    [
        (_with(gamma=2), "topKSpec"),  # gamma != len(topKSpec)
        (_with(gamma=4), "topKSpec"),
        ({"gamma": 3, "topKSpec": [[6], [2, 2], [1, 1]], "topHead": [1, 2]}, "topHead"),  # len(topHead) != gamma
        (_with(topKSpec=[[6], [2, 2, 2], [1, 1]]), "topKSpec[1]"),  # row length != topHead[1]
        (_with(topKSpec=[[6], [2], [1, 1]]), "topKSpec[1]"),
        (_with(topKSpec=[[6, 1], [2, 2], [1, 1]]), "topKSpec[0]"),
        ({"gamma": 2, "topKSpec": [[2], [1, 1, 1]], "topHead": [1, 3]}, "topHead[1]"),  # 3 > 2 nodes available
        ({"gamma": 3, "topKSpec": [[2], [1, 1], [1, 1, 1]], "topHead": [1, 2, 3]}, "topHead[2]"),
        (_with(topKSpec=[[6], [2, 0], [1, 1]]), "topKSpec[1][1]"),  # k <= 0
        (_with(topKSpec=[[-1], [2, 2], [1, 1]]), "topKSpec[0][0]"),
        (_with(topHead=[2, 2, 2]), "topHead[0]"),  # the root is the only depth-0 node
        (_with(topHead=[1, 0, 2]), "topHead[1]"),
        (_with(gamma=0, topKSpec=[], topHead=[]), "gamma"),
        (_with(treeType=2), "treeType"),
        (_with(gammaThreshold=1.5), "gammaThreshold"),
        (_with(topKSpec=[["a"], [2, 2], [1, 1]]), "topKSpec"),
        (_with(depth=3), "depth"),  # unknown key
        ({"topKSpec": [[1]], "topHead": [1]}, "gamma"),  # missing key
    ],
)
def test_invalid_spec_names_field(spec, field):
    with pytest.raises(TreeSpecError) as info:
        parse_tree_spec(spec)
    assert field in str(info.value)
    # The same spec as inline JSON fails the same way.
    with pytest.raises(TreeSpecError) as info:
        parse_tree_spec(json.dumps(spec))
    assert field in str(info.value)


def test_row_length_message_names_both_fields():
    with pytest.raises(TreeSpecError, match=r"topKSpec\[1\].*topHead\[1\]"):
        parse_tree_spec(_with(topKSpec=[[6], [2, 2, 2], [1, 1]]))


def test_invalid_json():
    with pytest.raises(TreeSpecError, match="invalid JSON"):
        parse_tree_spec('{"gamma": 3, "topKSpec": [[6]')


def test_invalid_json_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{gamma: 3}")
    with pytest.raises(TreeSpecError, match="invalid JSON"):
        parse_tree_spec(str(path))


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(TreeSpecError, match="nope.json"):
        parse_tree_spec(str(missing))


def test_not_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2, 3]")
    with pytest.raises(TreeSpecError, match="object"):
        parse_tree_spec(str(path))
    with pytest.raises(TreeSpecError, match="object"):
        parse_tree_spec(["gamma"])  # type: ignore[arg-type]


def test_spec_error_is_value_error():
    assert issubclass(TreeSpecError, ValueError)


WIDE_SPEC = TreeSpec(gamma=1, topKSpec=[[100]], topHead=[1])  # 100 nodes a row: 5 rows fit in 512


# --------------------------------------------------------------------------- spec_at_depth


@pytest.mark.parametrize("gamma, rows, heads, nodes", [
    (1, [[6]], [1], 6),
    (2, [[6], [2, 2]], [1, 2], 10),
    (3, [[6], [2, 2], [1, 1]], [1, 2, 2], 12),
    (4, [[6], [2, 2], [1, 1], [1, 1]], [1, 2, 2, 2], 14),
    (6, [[6], [2, 2], [1, 1], [1, 1], [1, 1], [1, 1]], [1, 2, 2, 2, 2, 2], 18),
])
def test_spec_at_depth_seed_spec(gamma, rows, heads, nodes):
    spec = spec_at_depth(SEED_SPEC, gamma)
    assert spec.gamma == gamma
    assert [list(r) for r in spec.top_k_spec] == rows
    assert list(spec.top_head) == heads
    assert spec.num_nodes == nodes


@pytest.mark.parametrize("gamma, nodes", [(1, 3), (2, 4), (3, 5), (5, 7), (8, 10)])
def test_spec_at_depth_default_spec(gamma, nodes):
    spec = spec_at_depth(DEFAULT_SPEC, gamma)
    assert [list(r) for r in spec.top_k_spec] == [[3]] + [[1]] * (gamma - 1)
    assert list(spec.top_head) == [1] * gamma
    assert spec.num_nodes == nodes


def test_spec_at_depth_same_gamma_is_the_spec_and_keeps_type_and_threshold():
    assert spec_at_depth(SEED_SPEC, 3) is SEED_SPEC
    sampled = TreeSpec(gamma=2, topKSpec=[[4], [2, 1]], topHead=[1, 2], treeType=1, gammaThreshold=0.25)
    deeper = spec_at_depth(sampled, 4)
    assert (deeper.tree_type, deeper.gamma_threshold) == (1, 0.25)
    # the repeated row expands 2 nodes of a depth holding 2 + 1 = 3: valid; each copy adds 3 nodes
    assert [list(r) for r in deeper.top_k_spec] == [[4], [2, 1], [2, 1], [2, 1]]
    assert list(deeper.top_head) == [1, 2, 2, 2]
    assert deeper.num_nodes == 4 + 3 * 3


def test_spec_at_depth_node_cap_and_bad_gamma():
    assert max_depth_for(WIDE_SPEC) == 5
    assert spec_at_depth(WIDE_SPEC, 5).num_nodes == 500
    with pytest.raises(TreeSpecError, match=r"gamma: 6 exceeds the deepest tree of this spec, 5"):
        spec_at_depth(WIDE_SPEC, 6)
    # SEED_SPEC: 12 nodes at depth 3, +2 a row; a 13-node target limit stops at depth 3
    assert [max_depth_for(SEED_SPEC, n) for n in (5, 6, 12, 13, 14)] == [0, 1, 3, 3, 4]
    with pytest.raises(TreeSpecError, match="gamma: 4 exceeds"):
        spec_at_depth(SEED_SPEC, 4, max_nodes=13)
    assert max_depth_for(SEED_SPEC) == 64  # 12 + 2 * 61 = 134 nodes: the 64-row bound binds first
    for bad in (0, -1, 65):
        with pytest.raises(TreeSpecError, match="gamma"):
            spec_at_depth(SEED_SPEC, bad)


def test_tree_depth_of_a_proposed_tree():
    """The depth the round controller records for a tree: the deepest node (0 for no tree)."""
    assert max(node_depths([]), default=0) == 0
    assert max(node_depths([-1, -1, -1]), default=0) == 1
    assert max(node_depths([-1, -1, 0, 0, 2]), default=0) == 3
