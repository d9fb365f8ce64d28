"""Benchmark aggregation: the sampled pass's acceptance figures reach the summary and the table."""

from __future__ import annotations

from orchestrator.bench import markdown_table, summarize


def _row(category: str, accepted: int, sampled_accepted: int) -> dict:
    spec = {"new_tokens": 32, "s": 2.0, "rounds": 16, "proposed": 192, "accepted": accepted, "ttft_ms": 50.0}
    return {
        "category": category, "prompt_tokens": 20,
        "target_only": {"new_tokens": 32, "s": 4.0},
        "speculative": spec,
        "spec_matches_target": True,
        "sampled": {**spec, "rounds": 20, "accepted": sampled_accepted},
    }


def test_sampled_pass_in_summary_and_table():
    rows = [_row("coding", 16, 12), _row("coding", 16, 8)]
    summary = summarize(rows)
    assert summary["sampled_acceptance_rate"] == 20 / 384
    assert summary["sampled_mean_accepted_length"] == 64 / 40
    assert summary["sampled_tokens_per_s"] == 16.0
    table = markdown_table({"coding": summary, "overall": summary}, temperature=0.7)
    header = table.splitlines()[0]
    assert "T=0.7 mean acc len" in header and "T=0.7 acc rate" in header
    assert "| 1.60 | 0.052 |" in table.splitlines()[2]


def test_table_without_sampled_pass():
    row = _row("math", 16, 0)
    del row["sampled"]
    summary = summarize([row])
    assert "sampled_acceptance_rate" not in summary
    assert "T=" not in markdown_table({"math": summary})
