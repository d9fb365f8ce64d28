"""TreeSpec: the shape of the speculated token tree (fields: docs/design.md "TreeSpec").

``{"gamma": 3, "topKSpec": [[6], [2, 2], [1, 1]], "topHead": [1, 2, 2], "treeType": 0, "gammaThreshold": 0}``
has 6 + 4 + 2 = 12 nodes.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator


MAX_TREE_NODES = 512  # what a target accepts in one verify (target_service.runtime)
MAX_GAMMA = 64  # TreeSpec.gamma's upper bound: the deepest tree, in levels


class TreeSpecError(ValueError):
    """An invalid TreeSpec; the message names the field."""


class TreeSpec(BaseModel):
    """Validated tree shape. Raises TreeSpecError (via ``parse_tree_spec``) naming the bad field."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    gamma: StrictInt = Field(ge=1, le=MAX_GAMMA)
    top_k_spec: tuple[tuple[StrictInt, ...], ...] = Field(alias="topKSpec")
    top_head: tuple[StrictInt, ...] = Field(alias="topHead")
    tree_type: StrictInt = Field(default=0, alias="treeType", ge=0, le=1)
    gamma_threshold: float = Field(default=0.0, alias="gammaThreshold", ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _check_shape(self) -> "TreeSpec":
        if len(self.top_k_spec) != self.gamma:
            raise ValueError(f"topKSpec: {len(self.top_k_spec)} rows but gamma = {self.gamma}")
        if len(self.top_head) != self.gamma:
            raise ValueError(f"topHead: {len(self.top_head)} entries but gamma = {self.gamma}")
        if self.top_head[0] != 1:
            raise ValueError(f"topHead[0]: must be 1 (the root), got {self.top_head[0]}")
        for d, (row, heads) in enumerate(zip(self.top_k_spec, self.top_head)):
            if heads < 1:
                raise ValueError(f"topHead[{d}]: must be positive, got {heads}")
            if len(row) != heads:
                raise ValueError(f"topKSpec[{d}]: {len(row)} entries but topHead[{d}] = {heads}")
            for j, k in enumerate(row):
                if k < 1:
                    raise ValueError(f"topKSpec[{d}][{j}]: must be positive, got {k}")
            if d >= 1 and heads > sum(self.top_k_spec[d - 1]):
                raise ValueError(
                    f"topHead[{d}]: {heads} nodes to expand but depth {d} has only "
                    f"{sum(self.top_k_spec[d - 1])} nodes"
                )
        if self.num_nodes > MAX_TREE_NODES:
            raise ValueError(f"topKSpec: {self.num_nodes} nodes exceed the limit of {MAX_TREE_NODES}")
        return self

    @property
    def num_nodes(self) -> int:
        """Speculative nodes of a full tree (the root excluded)."""
        return sum(sum(row) for row in self.top_k_spec)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True)

    @classmethod
    def chain(cls, gamma: int) -> "TreeSpec":
        """A single chain of depth gamma (classic speculative decoding)."""
        return cls(gamma=gamma, topKSpec=[[1]] * gamma, topHead=[1] * gamma)


SEED_SPEC = TreeSpec(gamma=3, topKSpec=[[6], [2, 2], [1, 1]], topHead=[1, 2, 2], treeType=0, gammaThreshold=0)

# The CLI default: top-3 at the root, then a chain. Narrow, because on a CPU every verify row costs
# more; wider trees pay where verify time is flat in the rows (GPU).
DEFAULT_SPEC = TreeSpec(gamma=3, topKSpec=[[3], [1], [1]], topHead=[1, 1, 1], treeType=0, gammaThreshold=0)


def spec_at_depth(spec: TreeSpec, gamma: int, max_nodes: int = MAX_TREE_NODES) -> TreeSpec:
    """The tree shape for speculation depth gamma: the first gamma rows, or rows past the spec repeating
    its last row (always valid: that row creates sum(k_j) >= topHead[-1] nodes to expand).
    Raises TreeSpecError naming ``gamma`` when gamma < 1, gamma > MAX_GAMMA or the tree would exceed
    max_nodes (``max_depth_for`` gives the deepest allowed gamma)."""
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise TreeSpecError(f"gamma: must be an integer >= 1, got {gamma!r}")
    if gamma == spec.gamma and spec.num_nodes <= max_nodes:
        return spec
    deepest = max_depth_for(spec, max_nodes)
    if gamma > deepest:
        raise TreeSpecError(
            f"gamma: {gamma} exceeds the deepest tree of this spec, {deepest} (limits: {MAX_GAMMA} rows, "
            f"{max_nodes} nodes; each row past {spec.gamma} adds {sum(spec.top_k_spec[-1])} nodes)"
        )
    rows = list(spec.top_k_spec[:gamma]) + [spec.top_k_spec[-1]] * max(0, gamma - spec.gamma)
    heads = list(spec.top_head[:gamma]) + [spec.top_head[-1]] * max(0, gamma - spec.gamma)
    return TreeSpec(gamma=gamma, topKSpec=rows, topHead=heads, treeType=spec.tree_type,
                    gammaThreshold=spec.gamma_threshold)


def max_depth_for(spec: TreeSpec, max_nodes: int = MAX_TREE_NODES) -> int:
    """The deepest gamma whose ``spec_at_depth`` tree has <= max_nodes nodes and <= MAX_GAMMA rows (0: none)."""
    total, depth = 0, 0
    while depth < MAX_GAMMA:
        row = spec.top_k_spec[min(depth, spec.gamma - 1)]
        if total + sum(row) > max_nodes:
            break
        total += sum(row)
        depth += 1
    return depth


def parse_tree_spec(source: str | dict) -> TreeSpec:
    """Build a TreeSpec from a dict, inline JSON or a JSON file path. Raises TreeSpecError naming the field."""
    if isinstance(source, str):
        text = source.strip()
        if not text.startswith("{"):
            path = Path(text)
            if not path.is_file():
                raise TreeSpecError(f"tree spec: {source!r} is neither inline JSON nor an existing file")
            text = path.read_text()
        try:
            source = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TreeSpecError(f"tree spec: invalid JSON ({exc})") from exc
    if not isinstance(source, dict):
        raise TreeSpecError("tree spec: expected a JSON object")
    try:
        return TreeSpec.model_validate(source)
    except ValidationError as exc:
        raise TreeSpecError("invalid tree spec: " + "; ".join(map(error_text, exc.errors()))) from exc


def error_text(err: dict) -> str:
    """One pydantic validation error as ``dotted.field: message`` (a check across fields names its field itself)."""
    loc = ".".join(str(x) for x in err["loc"])
    message = err["msg"].removeprefix("Value error, ")
    return f"{loc}: {message}" if loc else message
