"""``specdec eval`` (orchestrator.measure.eval_report, orchestrator.measure.eval_figures): the SpeculativeReport per
slice on tiny models (names and types, greedy equivalence, figures), a broken engine caught in its
slice only, measured peak memory, the language slice; the per-depth acceptance and buckets by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.measure.eval_report import (
    DIMENSIONS, EmbeddedRunner, Run, acceptance_per_depth, length_bucket, peak_rss_mb, run_eval,
)
from specdec.tree_spec import DEFAULT_SPEC
from specdec.harness.tiny_pair import save_tiny_pair

ROOT = Path(__file__).resolve().parents[1]
# The seed's SpeculativeReport (design note 004): field -> JSON type (None allowed for peakMemoryMb only remotely)
SEED_FIELDS = {"taskSet": str, "draftModel": str, "speculationLength": float, "acceptanceRate": float,
               "firstTokenMs": float, "decodeTokensPerSecond": float, "p95LatencyMs": float, "outputEquivalent": bool,
               "peakMemoryMb": float}
ENGLISH = "Write a short note to a neighbour about the quick brown fox in the garden."
CHINESE = "今天天气很好，我们去公园散步吧。"  # "the weather is nice today, let's walk in the park"
QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": [ENGLISH]},
    {"question_id": 2, "category": "writing", "turns": ["Tell the lazy dog a story about hello world."]},
    {"question_id": 3, "category": "translation", "turns": [CHINESE]},
    {"question_id": 4, "category": "translation", "turns": ["Translate into French: the quick brown fox jumps over the lazy dog. " * 12]},
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("eval_models"), max_pos=1024)


@pytest.fixture(scope="module")
def questions_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval_questions") / "question.jsonl"
    path.write_text("\n".join(json.dumps(q, ensure_ascii=False) for q in QUESTIONS) + "\n", encoding="utf-8")
    return path


def _all_reports(document: dict) -> list[dict]:
    return [document["overall"], *document["slices"]]


def test_eval_cli_report_fields_equivalence_figures_and_language(pair, questions_file, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "eval", "--questions", str(questions_file), "--per-category", "2",
         "--max-new-tokens", "8", "--target", str(pair.target), "--draft", str(pair.draft), "--dtype", "float32",
         "--draft-quant", "none", "--threads", "1", "--control", "fixed", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    document = json.loads((out / "report.json").read_text(encoding="utf-8"))
    reports = _all_reports(document)
    assert {(r["sliceDimension"]) for r in reports} == {"overall", *DIMENSIONS}
    for r in reports:
        for name, kind in SEED_FIELDS.items():
            assert type(r[name]) is kind, f"{r['sliceDimension']}={r['sliceValue']}: {name} is {r[name]!r}"
        assert r["outputEquivalent"] is True and r["outputEquivalentFraction"] == 1.0  # float32 greedy: exact
        assert r["peakMemoryMb"] > 50 and r["firstTokenMs"] > 0 and r["decodeTokensPerSecond"] > 0
        assert r["taskSet"] == str(questions_file) and r["draftModel"] == str(pair.draft)
        assert r["speedup"] > 0 and r["targetOnlyP95LatencyMs"] > 0 and r["p95LatencyRatio"] > 0
    overall = document["overall"]
    assert overall["questions"] == 4 and overall["speculationLength"] > 0 and overall["acceptanceRate"] > 0
    assert len(overall["acceptancePerDepth"]) >= 1 and all(0 <= a <= 1 for a in overall["acceptancePerDepth"])
    by_language = {r["sliceValue"]: r["questions"] for r in document["slices"] if r["sliceDimension"] == "language"}
    rows = {row["question_id"]: row for row in document["questions"]}
    assert rows[1]["language"] == "en" and rows[3]["language"] == "zh"
    assert by_language["en"] >= 1 and by_language["zh"] == 1  # the Chinese prompt has a slice of its own
    prompt_buckets = {r["sliceValue"] for r in document["slices"] if r["sliceDimension"] == "promptLength"}
    assert "<128" in prompt_buckets and len(prompt_buckets) >= 2  # the repeated prompt is longer
    for name in ("speedup.png", "latency.png", "acceptance_per_depth.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, name
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "## Overall" in md and "## By language" in md and "language=zh" in md and "![speedup.png]" in md


class _BrokenEngine:
    """An engine that changes the last token of the speculative output for one prompt (scripted fault)."""

    def __init__(self, inner, broken_prompt_ids: list[int]):
        self.inner, self.broken = inner, broken_prompt_ids
        self.controller = inner.controller

    def generate(self, request):
        result = self.inner.generate(request)
        if request.spec is not None and list(request.prompt_ids) == self.broken:
            result.tokens[-1] = (result.tokens[-1] + 1) % 200
        return result


def test_broken_engine_fails_equivalence_in_its_slices_only(pair, questions_file, tmp_path):
    def break_question_2(runner: EmbeddedRunner) -> EmbeddedRunner:
        runner.pipe.engine = _BrokenEngine(runner.pipe.engine, runner._ids(QUESTIONS[1]["turns"][0]))
        return runner

    reports = run_eval(DEFAULT_SPEC, questions_file, 2, 6, tmp_path / "out", target=str(pair.target),
                       draft=str(pair.draft), dtype="float32", draft_quant="none", control="fixed",
                       make_runner=break_question_2)
    document = json.loads((tmp_path / "out" / "report.json").read_text(encoding="utf-8"))
    broken = next(row for row in document["questions"] if row["question_id"] == 2)
    assert reports[0].output_equivalent is False and reports[0].output_equivalent_fraction == 0.75
    for r in reports[1:]:  # the slices holding question 2 fail, and only those
        assert r.output_equivalent is (broken["slices"][r.slice_dimension] != r.slice_value), (r.slice_dimension, r.slice_value)
    writing = next(r for r in reports if r.slice_dimension == "category" and r.slice_value == "writing")
    assert writing.output_equivalent_fraction == 0.5
    for dimension in DIMENSIONS:  # in every dimension exactly one slice (the broken question's) fails
        assert sum(not r.output_equivalent for r in reports if r.slice_dimension == dimension) == 1, dimension


_ALLOCATOR = """
import sys
import psutil
from orchestrator.measure.eval_report import peak_rss_mb
sys.stdin.readline()
print(psutil.Process().memory_info().rss / 1e6, flush=True)  # resident MB now, just before the block
block = b"\\x01" * (200 << 20)  # 200 MiB = 209.7 MB, every page written
del block
print(peak_rss_mb(), flush=True)  # after the block was freed: the peak, not the current RSS
sys.stdin.readline()
"""


def test_peak_memory_of_a_process_that_allocates_200_mb():
    """Baseline: the process's resident memory just before it allocates 200 MiB (209.7 MB; the margin
    covers the kernel's approximate RSS counters, a few hundred kB); its peak, read both from inside
    (the embedded runner's way) and from outside by pid (the --service-pid way), is at least 200 MB
    above, though the block is freed again before either reading."""
    proc = subprocess.Popen([sys.executable, "-c", _ALLOCATOR], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        baseline = float(proc.stdout.readline())
        own_peak = float(proc.stdout.readline())
        peak = peak_rss_mb(proc.pid)
        proc.stdin.write("end\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert own_peak - baseline >= 200
    assert peak - baseline >= 200


def test_peak_memory_of_a_missing_process_names_it():
    with pytest.raises(ValueError, match="--service-pid 999999999"):
        peak_rss_mb(999999999)


def test_acceptance_per_depth_and_buckets_by_hand():
    # rounds (tree depth, accepted): depth 1 reached 3 times (accepted >= 1 twice), depth 2 twice (once),
    # depth 3 once (never); the plain round (0, 0) counts nowhere
    runs = [Run([1, 2, 3], 1.0, 0.1, [(3, 2), (1, 0), (0, 0)]), Run([4], 1.0, 0.1, [(2, 1)])]
    assert acceptance_per_depth(runs) == [2 / 3, 1 / 2, 0.0]
    assert acceptance_per_depth([Run([1], 1.0, 0.1, [(0, 0)])]) == []
    assert [length_bucket(n, (128, 512)) for n in (0, 127, 128, 512, 513)] == ["<128", "<128", "128-512", "128-512", ">512"]


@pytest.fixture(scope="module")
def stack(pair, tmp_path_factory):
    """Draft, target and front processes on the tiny pair (front without Ray, the draft every round)."""
    from specdec.harness.servers import launch_service, stop_service, wait_ready
    from specdec.harness.tiny_pair import write_config

    config = write_config(tmp_path_factory.mktemp("eval_cfg") / "serve.yaml", pair,
                          front={"port": 0, "cost_aware": {"enabled": False}})
    draft, target = launch_service("draft", config), launch_service("target", config)
    services = [draft, target]
    try:
        wait_ready(draft), wait_ready(target)
        services.append(wait_ready(launch_service("front", config, draft_address=draft.address,
                                                  target_address=target.address, no_ray=True)))
        yield services
    finally:
        for service in services:
            stop_service(service)


def test_eval_against_a_running_front(stack, questions_file, tmp_path):
    draft, target, front = stack
    pids = [str(s.proc.pid) for s in stack]
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "eval", "--server", front.address, "--questions", str(questions_file),
         "--per-category", "2", "--max-new-tokens", "8", *[a for pid in pids for a in ("--service-pid", pid)],
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    document = json.loads((out / "report.json").read_text(encoding="utf-8"))
    overall = document["overall"]
    assert overall["outputEquivalent"] is True and overall["questions"] == 4  # greedy float32 services: exact
    assert overall["acceptanceRate"] > 0 and overall["meanAcceptedLength"] >= 1
    assert overall["speculationLength"] is None and overall["acceptancePerDepth"] == []  # the front streams no depths
    by_process = overall["peakMemoryByProcessMb"]
    assert sorted(by_process) == sorted(f"service (pid {pid})" for pid in pids)
    assert all(mb > 50 for mb in by_process.values()) and overall["peakMemoryMb"] == pytest.approx(sum(by_process.values()))
    assert {r["language"] for r in document["questions"]} >= {"en", "zh"}
