"""Smoke test of benchmarks/serving.py on tiny models: every section runs end to end (services as
subprocesses, a Ray front, embedded mode) and the JSON holds the figures the issues ask for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.tiny_pair import save_tiny_pair

ROOT = Path(__file__).resolve().parents[1]  # the repository root


def test_serving_bench_smoke(tmp_path):
    pair = save_tiny_pair(tmp_path / "models", noise=0.03)
    out = tmp_path / "out"
    argv = [sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--target", str(pair.target), "--draft", str(pair.draft),
            "--sections", "grpc,concurrency,gamma", "--prompts", "2", "--max-new-tokens", "6", "--levels", "1,2",
            "--gamma-prompts", "2", "--max-prompt-tokens", "120", "--out", str(out)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out / "serving.json").read_text())
    md = (out / "serving.md").read_text()
    assert {"meta", "grpc", "concurrency", "gamma"} <= result.keys()
    meta = result["meta"]
    assert meta["target_threads"] == 2 and meta["draft_threads"] == 1 and meta["wall_s"] > 0
    # every service process's peak memory: a draft, a target and a front at least, each a loaded process
    peaks = meta["peak_rss_mb"]
    assert len(peaks) >= 3 and all(mb > 50 for mb in peaks.values()), peaks
    assert "peak resident memory" in md

    grpc_ = result["grpc"]
    assert grpc_["modes"] == ["embedded", "grpc_local", "grpc_ray"] and grpc_["prompts"] == 2
    assert grpc_["identical_outputs"] is True
    for mode in grpc_["modes"]:
        s = grpc_["summary"][mode]
        assert s["new_tokens"] > 0 and s["tokens_per_s"] > 0 and s["mean_accepted_length"] >= 1
        split = grpc_["round_split"][mode]
        assert split["rounds"] > 0 and split["round_ms"] > 0 and split["verify_server_ms"] > 0
        assert split["round_ms"] >= split["verify_ms"] > 0 and split["draft_ms"] > 0
        assert grpc_["tree_bytes"][mode]["tree_bytes_mean"] > 0

    conc = result["concurrency"]
    assert conc["identical_outputs"] is True
    assert {(r["config"], r["clients"]) for r in conc["rows"]} == {
        (c, n) for c in ("batched", "one_at_a_time", "target_only") for n in (1, 2)}
    for r in conc["rows"]:
        assert r["new_tokens"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["latency_p50_s"] <= r["latency_p95_s"]

    gamma = result["gamma"]
    assert gamma["identical_outputs"] is True and "embedded" in gamma["method"]
    assert {(r["category"], r["mode"]) for r in gamma["rows"]} == {
        (c, m) for c in ("math_reasoning", "translation") for m in ("fixed", "dynamic")}
    for r in gamma["rows"]:
        assert r["new_tokens"] > 0 and r["tokens_per_s"] > 0 and r["mean_accepted_length"] >= 1

    for title in ("gRPC vs embedded", "Concurrency", "Dynamic vs fixed gamma"):
        assert title in md
    if meta["dtype_arg"] == "auto" and meta["dtype"] == "float32":
        assert "bf16" in meta["bf16_note"] and "bf16" in md
