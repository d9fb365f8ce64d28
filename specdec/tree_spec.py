"""TreeSpec: the shape of the speculated token tree (DESIGN.md "TreeSpec").

``{"gamma": 3, "topKSpec": [[6], [2, 2], [1, 1]], "topHead": [1, 2, 2], "treeType": 0, "gammaThreshold": 0}``

Draft step d (0-based) expands ``topHead[d]`` depth-d nodes (the root alone at d = 0; for d >= 1 the
nodes with the highest path probability); the j-th of them keeps its draft top ``topKSpec[d][j]``
children. The example has 6 + 4 + 2 = 12 nodes.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator


MAX_TREE_NODES = 512  # what a target accepts in one verify (target_service.runtime)


class TreeSpecError(ValueError):
    """An invalid TreeSpec; the message names the field."""


class TreeSpec(BaseModel):
    """Validated tree shape. Raises TreeSpecError (via ``parse_tree_spec``) naming the bad field."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    gamma: StrictInt = Field(ge=1, le=64)
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

# The CLI default: top-3 at the root, then a chain. On a 2-core AVX2 CPU (float32 target, int8
# draft, 7 Spec-Bench questions x 40 tokens, one run) it gave 1.56x over target-only with mean
# accepted length 2.65, vs 1.39x / 2.91 for SEED_SPEC (12 nodes) and 1.56x / 2.51 for a chain of 3:
# there a verify row costs ~20 ms more, so a narrow tree wins. Wider trees pay where verify is flat (GPU).
DEFAULT_SPEC = TreeSpec(gamma=3, topKSpec=[[3], [1], [1]], topHead=[1, 1, 1], treeType=0, gammaThreshold=0)


def parse_tree_spec(source: str | dict) -> TreeSpec:
    """Build a TreeSpec from a dict, inline JSON or the path of a JSON file.

    Raises TreeSpecError whose message names the offending field.
    """
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
        raise TreeSpecError("invalid tree spec: " + _describe(exc)) from exc


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)
