"""TreeSpec parsing (DESIGN.md "TreeSpec"): valid specs from JSON files, inline JSON and dicts; invalid
specs rejected with a TreeSpecError whose message names the offending field."""

from __future__ import annotations

import json

import pytest

from specdec.tree_spec import SEED_SPEC, TreeSpec, TreeSpecError, parse_tree_spec

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
