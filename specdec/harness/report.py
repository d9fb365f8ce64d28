"""Benchmark records: the machine a run was measured on, markdown tables, and a record's JSON + markdown pair."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np

from specdec.harness.servers import SOURCE_ROOT
from specdec.placement import cpu_model


def machine() -> dict:
    """The CPU model, its count and the checkout's commit: every record names them (figures belong to both)."""
    commit = subprocess.run(["git", "-C", str(SOURCE_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False)
    return {"cpu_model": cpu_model() or "unknown", "cpus": os.cpu_count(), "commit": commit.stdout.strip() or "unknown"}


def percentile(values, q: float) -> float:
    """The q-th percentile (0-100) of ``values``, linear between closest ranks (numpy's default); 0.0 for none."""
    return float(np.percentile(values, q)) if len(values) else 0.0


def md_table(head: list[str], rows: list[list]) -> list[str]:
    """The lines of a markdown table."""
    return (["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def nested_table(corner: str, nested: dict[str, dict[str, int]]) -> list[str]:
    """A row per outer key, a column per inner key (sorted; 0 where a row has none); ["(none)"] when empty."""
    columns = sorted({c for inner in nested.values() for c in inner})
    if not columns:
        return ["(none)"]
    return md_table([corner, *columns], [[name, *(inner.get(c, 0) for c in columns)] for name, inner in nested.items()])


def write_record(out_dir, name: str, result: dict, markdown: str) -> tuple[Path, Path]:
    """Write ``<name>.json`` and ``<name>.md`` under ``out_dir`` (made if missing); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / f"{name}.json", out / f"{name}.md"
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(markdown)
    return paths
