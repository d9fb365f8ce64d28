"""The config reference in docs/serving.md against specdec/config.py: every key documented, nothing documented that
is not a key, and each scalar default as the code has it, so the page cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from specdec import config

SERVING_MD = Path(__file__).resolve().parents[1] / "docs" / "serving.md"


def config_keys(model: type[BaseModel] = config.ServeConfig, prefix: str = "") -> dict[str, object]:
    """{dotted key: default} of every leaf field; a field whose type is a section model of specdec.config is walked."""
    keys = {}
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel) and kind.__module__ == config.__name__:
            keys.update(config_keys(kind, f"{prefix}{name}."))
        else:
            keys[f"{prefix}{name}"] = field.default
    return keys


def documented_rows() -> dict[str, str]:
    """{key: default cell} of the table under '## Config reference' (rows '| `key` | type | `default` | meaning |')."""
    section = SERVING_MD.read_text().split("## Config reference", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_.]+)` \| [^|]+ \| `([^`]*)` \|", section, flags=re.MULTILINE)
    return dict(rows)


def rendered(value) -> str | None:
    """A scalar default as the table writes it (YAML spelling); None for the rest (TreeSpec, dicts)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float, str)):
        return str(value)
    return None


def test_every_config_key_is_documented_and_every_documented_key_exists():
    keys, rows = config_keys(), documented_rows()
    assert "front.cost_aware.measure_at_start" in keys  # the walk reaches nested sections
    assert sorted(set(keys) - set(rows)) == [], "keys missing from docs/serving.md's config reference"
    assert sorted(set(rows) - set(keys)) == [], "docs/serving.md documents keys that specdec/config.py does not have"


def test_documented_defaults_match_the_code():
    keys, rows = config_keys(), documented_rows()
    wrong = {key: (rows[key], rendered(default)) for key, default in keys.items()
             if key in rows and rendered(default) is not None and rows[key] != rendered(default)}
    assert wrong == {}, "docs/serving.md default (documented, code)"
