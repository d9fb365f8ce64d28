"""benchmarks/reliability.py, short versions of each part on one tiny deployment (draft, target and a
Ray front with 2 orchestrator actors, real subprocesses on loopback): load (no failures, greedy =
its solo target-only run), soak (aborts, cancels and short deadlines; target and draft sessions and
cached KV back to 0, RSS growth reported), chaos (draft, actor and target killed under load: nothing
hangs, no wrong output, the system serves again). The chaos test runs last: it restarts services.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_reliability():
    spec = importlib.util.spec_from_file_location("reliability", ROOT / "benchmarks" / "reliability.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["reliability"] = module
    spec.loader.exec_module(module)
    return module


rel = _load_reliability()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    dep = rel.LocalDeployment.start(tmp_path_factory.mktemp("reliability"), rel.parse_args(["load"]))
    yield dep
    dep.stop()


def run_part(argv: list[str], deployment):
    args = rel.parse_args(argv)
    return asyncio.run(rel.PARTS[args.part](args, deployment.endpoints, deployment))


def test_wrong_outputs_flags_a_different_greedy_output_and_a_stopped_non_prefix():
    plans = [rel.Plan(f"r{i}", [1, 2], 4) for i in range(4)] + [rel.Plan("s", [1, 2], 4, temperature=0.8)]
    refs = {plans[0].key: [5, 6, 7, 8]}

    def out(rid, status, tokens, stop=""):
        return rel.Outcome(rid, True, 2, status, tokens, 0.0, 1.0, 1.0, 0.1, stop_reason=stop)

    outcomes = [out("r0", "OK", [5, 6, 7, 8]), out("r1", "OK", [5, 6, 9, 8]),
                out("r2", "DEADLINE_EXCEEDED", [5, 6]), out("r3", "OK", [5, 7], stop="aborted"), out("s", "OK", [1])]
    assert rel.wrong_outputs(plans, outcomes, refs) == ["r1", "r3"]


def test_load_short(deployment, tmp_path):
    figures = run_part(["load", "--clients", "12", "--max-new-tokens", "12"], deployment)
    assert figures["greedy"] > 0 and figures["sampled"] > 0
    assert figures["failures"] == 0, figures["statuses"]
    assert figures["statuses"] == {"OK": 12}
    assert figures["greedy_mismatches"] == 0, figures["mismatched_ids"]
    assert 0 < figures["ttft_p50_s"] <= figures["latency_p50_s"] <= figures["latency_p95_s"]
    assert figures["ok"] is True


def test_cli_load_against_a_running_front_writes_json_and_markdown(deployment, tmp_path):
    ep = deployment.endpoints
    code = rel.main(["load", "--front", ep.front, "--target", ep.target, "--draft", ep.draft, "--clients", "3",
                     "--max-new-tokens", "6", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "reliability_load.json").read_text())
    assert result["load"]["failures"] == 0 and result["meta"]["deployment"] == f"front {ep.front}"
    md = (tmp_path / "reliability_load.md").read_text()
    assert "| failures | 0 |" in md and "| latency_p95_s |" in md


def test_soak_short_returns_sessions_and_kv_to_zero(deployment):
    figures = run_part(["soak", "--requests", "40", "--concurrency", "4", "--abort-rate", "0.3", "--deadline-rate", "0.3",
                        "--short-deadline-s", "0.4", "--abort-within-s", "0.3", "--max-new-tokens", "24",
                        "--settle-s", "20", "--rss-every-s", "1"], deployment)
    statuses = figures["statuses"]
    assert figures["hung"] == 0 and "HUNG" not in statuses
    # the stops really happened: aborted by RPC (stop reason "aborted") or by the client, deadlines passed
    assert statuses.get("aborted", 0) + statuses.get("CANCELLED", 0) > 0, statuses
    assert statuses.get("DEADLINE_EXCEEDED", 0) > 0, statuses
    assert figures["greedy_mismatches"] == 0, figures["mismatched_ids"]
    end = figures["counts_end"]
    assert set(end) == {"target_sessions", "target_cached_tokens", "draft_streams", "draft_runtime_sessions",
                        "draft_cached_tokens"}
    assert not any(end.values()), end
    assert set(figures["rss_growth_bytes"]) == {"front", "actors", "draft", "target"}
    assert figures["rss_baseline_bytes"]["actors"] > 0  # the actor workers were found and measured
    assert figures["rss_samples"] and set(figures["rss_growth_second_half_bytes"]) == set(figures["rss_growth_bytes"])
    assert figures["ok"] is True


def test_chaos_short_nothing_hangs_outputs_unchanged_serves_again(deployment):
    figures = run_part(["chaos", "--clients", "4", "--max-new-tokens", "12", "--down-s", "0.5", "--settle-s", "2",
                        "--deadline-s", "20"], deployment)
    assert [w["kind"] for w in figures["windows"]] == ["draft", "actor", "target"]
    table = figures["outcomes_by_window"]
    assert figures["hung"] == 0 and figures["wrong_outputs"] == 0, table
    assert set(table.get("none", {})) <= {"completed_equal"}, table
    assert set(table.get("draft", {})) <= {"completed_equal"}, table
    assert set(table.get("target", {})) <= {"completed_equal", "UNAVAILABLE"}, table
    assert set(table.get("actor", {})) <= {"completed_equal"}, table  # fail-over: none lost to the actor kill
    assert sum(table.get("draft", {}).values()) > 0, "no request ran while the draft was down"
    assert sum(table.get("actor", {}).values()) > 0, "no request ran while the actor was down"
    assert figures["max_latency_s"] < 20 + 10
    assert figures["recovery"]["serves_again"] is True, figures["recovery"]
    assert figures["ok"] is True
