"""Benchmark (``specdec bench``): aggregation and tables (per method TTFT, decode-only and end-to-end
tokens/s, speedups; the sampled pass), the built-in prompt set, question selection (--offset,
--questions) and the command end to end on tiny models without the sibling ../shared folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import orchestrator.measure.bench as bench_module
from orchestrator.measure.bench import (
    BUILTIN_QUESTIONS, QuestionsError, load_questions, markdown_table, parse_questions,
    run_question, summarize,
)
from orchestrator.loop.controller import GenerationResult
from specdec.argmax_head import fbgemm_available
from specdec.config import FrontConfig
from specdec.placement import cpu_model
from specdec.stats import GenerationStats
from specdec.harness.tiny_pair import save_tiny_pair

ROOT = Path(__file__).resolve().parents[1]  # the repository root
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities", "translation",
              "summarization", "qa", "math_reasoning", "rag")
METHODS = ("target_only", "plain", "speculative", "hf_assisted", "prompt_lookup")  # the command's default columns


def _row(category: str, accepted: int, sampled_accepted: int) -> dict:
    spec = {"new_tokens": 32, "s": 2.0, "rounds": 16, "proposed": 192, "accepted": accepted, "ttft_ms": 50.0}
    return {
        "category": category, "prompt_tokens": 20,
        "target_only": {"new_tokens": 32, "s": 4.0, "ttft_ms": 100.0},
        "speculative": {**spec, "matches_target": True},
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


def _method_rows() -> list[dict]:
    """Two questions with every greedy method; figures chosen so the aggregates are easy to check."""
    def run(new, s, ttft_ms, **extra):
        return {"new_tokens": new, "s": s, "ttft_ms": ttft_ms, **extra}

    return [
        {"category": "qa", "prompt_tokens": 10,
         "target_only": run(9, 2.0, 200.0),
         "speculative": run(9, 1.0, 250.0, rounds=3, proposed=12, accepted=6, matches_target=True),
         "hf_assisted": run(9, 1.6, 400.0, matches_target=False),
         "prompt_lookup": run(9, 2.5, 100.0, matches_target=True)},
        {"category": "qa", "prompt_tokens": 30,
         "target_only": run(5, 1.0, 200.0),
         "speculative": run(5, 0.5, 150.0, rounds=2, proposed=8, accepted=3, matches_target=True),
         "hf_assisted": run(5, 0.4, 200.0, matches_target=True),
         "prompt_lookup": run(5, 0.7, 100.0, matches_target=True)},
    ]


def test_summary_per_method_ttft_decode_speedups():
    s = summarize(_method_rows())
    approx = pytest.approx
    # end to end: new tokens / total s; decode only: (new tokens - 1) / (total s - TTFT s), sums over questions
    assert s["target_only_tokens_per_s"] == approx(14 / 3.0)
    assert s["target_only_decode_tokens_per_s"] == approx((8 + 4) / (1.8 + 0.8))
    assert s["speculative_tokens_per_s"] == approx(14 / 1.5)
    assert s["speculative_decode_tokens_per_s"] == approx(12 / (0.75 + 0.35))
    assert s["hf_assisted_decode_tokens_per_s"] == approx(12 / (1.2 + 0.2))
    assert s["prompt_lookup_decode_tokens_per_s"] == approx(12 / (2.4 + 0.6))
    # TTFT: mean over questions
    assert s["target_only_ttft_ms"] == approx(200.0) and s["speculative_ttft_ms"] == approx(200.0)
    assert s["hf_assisted_ttft_ms"] == approx(300.0) and s["prompt_lookup_ttft_ms"] == approx(100.0)
    assert s["hf_assisted_ttft_ratio"] == approx(1.5) and s["prompt_lookup_ttft_ratio"] == approx(0.5)
    # speedups against target-only, end to end and decode only
    assert s["speculative_speedup"] == approx(3.0 / 1.5)
    assert s["hf_assisted_speedup"] == approx(3.0 / 2.0)
    assert s["prompt_lookup_speedup"] == approx(3.0 / 3.2)
    assert s["speculative_decode_speedup"] == approx((12 / 1.1) / (12 / 2.6))
    assert s["prompt_lookup_decode_speedup"] == approx(2.6 / 3.0)
    # ours: acceptance figures and efficiency = speedup / mean accepted length
    assert s["mean_accepted_length"] == approx(14 / 5) and s["acceptance_rate"] == approx(9 / 20)
    assert s["efficiency"] == approx(2.0 / (14 / 5))
    assert s["speculative_match_fraction"] == 1.0 and s["hf_assisted_match_fraction"] == 0.5
    assert s["prompt_lookup_match_fraction"] == 1.0


def test_tables_show_every_method():
    s = summarize(_method_rows())
    lines = markdown_table({"qa": s, "overall": s}).splitlines()
    speed_head, speed_row = lines[0].split(" | "), lines[2].split(" | ")
    cell = dict(zip(speed_head, speed_row))
    assert cell["target tok/s"] == "4.67"
    assert cell["spec speedup"] == "2.00x" and cell["spec decode speedup"] == f"{(12 / 1.1) / (12 / 2.6):.2f}x"
    assert cell["HF assisted speedup"] == "1.50x" and cell["HF prompt lookup speedup"] == "0.94x"
    assert cell["HF prompt lookup decode speedup"] == "0.87x"
    assert cell["efficiency"] == "0.71" and cell["HF assisted = target"] == "50%" and cell["spec = target"] == "100%"
    second = lines.index("") + 1  # the TTFT / tokens/s table follows after a blank line
    cell = dict(zip(lines[second].split(" | "), lines[second + 2].split(" | ")))
    assert cell["target TTFT ms"] == "200" and cell["HF assisted TTFT ms"] == "300" and cell["HF prompt lookup TTFT ms"] == "100"
    assert cell["spec decode tok/s"] == f"{12 / 1.1:.2f}" and cell["target tok/s"] == "4.67"


def test_acceptance_by_position_sums_the_questions():
    rows = _method_rows()  # 3 rounds, 6 accepted draft tokens; 2 rounds, 3 accepted
    rows[0]["speculative"].update(position_proposed=[3, 3, 2, 1], position_accepted=[3, 2, 1, 0])  # trees 4, 3, 2 deep; 3, 2, 1 accepted
    rows[1]["speculative"].update(position_proposed=[2, 2, 1], position_accepted=[2, 1, 0])  # trees 3, 2 deep; 2, 1 accepted
    s = summarize(rows)
    assert s["position_proposed"] == [5, 5, 3, 1]
    assert s["acceptance_by_position"] == pytest.approx([1.0, 3 / 5, 1 / 3, 0.0])
    lines = markdown_table({"qa": s, "math": summarize(rows[1:])}).splitlines()
    head = lines.index("| acceptance at position | 1 | 2 | 3 | 4 |")
    assert lines[head + 2] == "| qa | 1.00 (5) | 0.60 (5) | 0.33 (3) | 0.00 (1) |"
    assert lines[head + 3] == "| math | 1.00 (2) | 0.50 (2) | 0.00 (1) | - |"  # its trees never reached depth 4
    old = summarize(_method_rows())  # rows written before the counts existed: no position table
    assert old["position_proposed"] == [] and "acceptance at position" not in markdown_table({"qa": old})


def test_phase_shares_and_table():
    """The speculative runs' phases as shares of their summed seconds, and the draft phase per drafted
    round; rows recorded before the phases existed give neither figures nor table."""
    rows = _method_rows()
    rows[0]["speculative"].update(draft_s=0.3, verify_s=0.4, draft_rounds=2)  # s 1.0, TTFT 0.25, 3 rounds
    rows[1]["speculative"].update(draft_s=0.1, verify_s=0.2, draft_rounds=1)  # s 0.5, TTFT 0.15, 2 rounds
    s = summarize(rows)
    approx = pytest.approx
    assert s["speculative_ttft_share"] == approx(0.4 / 1.5) and s["speculative_draft_share"] == approx(0.4 / 1.5)
    assert s["speculative_verify_share"] == approx(0.6 / 1.5)
    assert s["speculative_draft_rounds"] == 3 and s["speculative_draft_ms_per_draft_round"] == approx(400 / 3)
    lines = markdown_table({"qa": s, "overall": s}).splitlines()
    head = lines.index("| spec time share | TTFT | draft | verify | other | draft ms / draft round |")
    assert lines[head + 2] == "| qa | 27% | 27% | 40% | 7% | 133 |"
    for r in rows:  # no later round asked the draft: no mean to show
        r["speculative"].update(draft_s=0.0, draft_rounds=0)
    lines = markdown_table({"qa": summarize(rows)}).splitlines()
    assert lines[lines.index("| spec time share | TTFT | draft | verify | other | draft ms / draft round |") + 2] \
        == "| qa | 27% | 0% | 40% | 33% | - |"
    del rows[1]["speculative"]["draft_rounds"]  # a row recorded before the phases
    old = summarize(rows)
    assert "speculative_draft_share" not in old and "spec time share" not in markdown_table({"qa": old})


def test_table_without_hf_methods():
    rows = _method_rows()
    for r in rows:
        del r["hf_assisted"], r["prompt_lookup"]
    s = summarize(rows)
    assert "hf_assisted_speedup" not in s and "prompt_lookup_tokens_per_s" not in s
    table = markdown_table({"qa": s})
    assert "HF" not in table and "spec decode speedup" in table


# ----------------------------------------------------------------------------------------- questions

def test_builtin_prompt_set():
    text = BUILTIN_QUESTIONS.read_text(encoding="utf-8")
    assert len(text.encode()) < 150_000
    questions = parse_questions(text, "built-in")
    counts = Counter(q["category"] for q in questions)
    assert set(counts) == set(CATEGORIES) and min(counts.values()) >= 7
    assert len({q["question_id"] for q in questions}) == len(questions)
    assert all(q["turns"] and all(isinstance(t, str) and t.strip() for t in q["turns"]) for q in questions)
    longest = {c: min(len(q["turns"][0]) for q in questions if q["category"] == c) for c in ("summarization", "rag")}
    assert min(longest.values()) >= 1500  # long passages, as in Spec-Bench


def test_offset_picks_held_out_questions(tmp_path):
    every = parse_questions(BUILTIN_QUESTIONS.read_text(encoding="utf-8"), "built-in")
    picked = load_questions(None, per_category=2, offset=5)
    expected = [q for c in CATEGORIES for q in [q for q in every if q["category"] == c][5:7]]
    assert sorted(q["question_id"] for q in picked) == sorted(q["question_id"] for q in expected)
    assert Counter(q["category"] for q in picked) == {c: 2 for c in CATEGORIES}
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [f"q{i}"]}) + "\n"
                            for i, c in [(1, "a"), (2, "b"), (3, "a"), (4, "a"), (5, "b")]) + "\n")
    assert [q["question_id"] for q in load_questions(path, per_category=2, offset=1)] == [3, 4, 5]
    assert [q["question_id"] for q in load_questions(path, per_category=1, offset=0)] == [1, 2]
    assert [q["question_id"] for q in load_questions(path, per_category=2, offset=1, categories=["a"])] == [3, 4]
    with pytest.raises(QuestionsError, match="--category: c not in"):
        load_questions(path, per_category=2, categories=["a", "c"])
    with pytest.raises(QuestionsError, match="--offset 2: no category"):  # a has a third question, b has not
        load_questions(path, per_category=1, offset=2, categories=["b"])


@pytest.mark.parametrize("content, offset, needle", [
    (None, 0, "--questions: no such file"),
    ("not json\n", 0, "line 1 is not JSON"),
    ('{"question_id": 1, "category": "qa"}\n', 0, "line 1: expected an object"),
    ("\n", 0, "no questions"),
    ('{"question_id": 1, "category": "qa", "turns": ["hi"]}\n', 1, "--offset 1: no category"),
    ('{"question_id": 1, "category": "qa", "turns": ["hi"]}\n', -1, "--offset: must be >= 0"),
])
def test_bad_questions_name_the_option(tmp_path, content, offset, needle):
    path = tmp_path / "q.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(QuestionsError, match=needle.replace("(", r"\(")):
        load_questions(path, 1, offset)


# ----------------------------------------------------------------------------------------- end to end

# Fails the command if anything opens a file under the sibling ../shared folder of this checkout.
_GUARD = """
import os, sys
shared = sys.argv.pop(1)
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(args[0]))
        if path == shared or path.startswith(shared + os.sep):
            sys.stderr.write("opened " + path + "\\n")
            os._exit(97)
sys.addaudithook(hook)
from orchestrator.cli.main import main
sys.argv[0] = "specdec"
main()
"""


def run_bench_cli(tmp_path, *args, timeout=600):
    """``specdec bench`` in a subprocess whose cwd and HOME are fresh folders under tmp_path (no
    ../shared next to them) and which may not open anything under this checkout's ../shared."""
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    env = {**__import__("os").environ, "HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", _GUARD, str(ROOT.parent / "shared"), "bench", *args],
                          cwd=work, env=env, capture_output=True, text=True, timeout=timeout)


class _ScriptedPipe:
    """run_question's view of an EmbeddedPipeline (unit test fake): each method's passes return the
    scripted (tokens, total seconds) in turn; HF methods through a patched ``_hf_generate``."""

    def __init__(self, script: dict[str, list[tuple[list[int], float]]]):
        self.script = {m: list(passes) for m, passes in script.items()}
        self.calls: list[str] = []
        self.target_model, self.draft_model = "target", "draft"
        self.engine = self

    eos_token_ids = frozenset({0})

    def next(self, method: str) -> tuple[list[int], float]:
        self.calls.append(method)
        return self.script[method].pop(0)

    def generate(self, request):  # the engine's: no spec is plain decoding where the script has a plain column
        tokens, s = self.next("plain" if request.spec is None and "plain" in self.script else "speculative")
        return GenerationResult(tokens, GenerationStats(new_tokens=len(tokens), total_s=s, ttft_ms=s * 100, rounds=len(tokens)))

    def hf_generate(self, model, prompt_ids, max_new_tokens, eos, **extra):
        method = ("hf_assisted" if "assistant_model" in extra else "prompt_lookup" if "prompt_lookup_num_tokens" in extra
                  else "target_only")
        tokens, s = self.next(method)
        return tokens, {"new_tokens": len(tokens), "s": s, "ttft_ms": s * 100}


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_method_order_is_a_balanced_latin_square(n):
    """Over one cycle (n orders, 2n for odd n) every method runs equally often in every place and
    right after every other method equally often; a plain rotation (the order before 2026-12-06)
    has each method always after the same one."""
    methods = [f"m{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    orders = [bench_module.method_order(methods, k) for k in range(cycle)]
    assert all(sorted(o) == methods for o in orders)
    assert orders[0][:3] == methods[:2] + [methods[-1]] if n >= 3 else orders[0] == methods
    places = {(o[i], i) for o in orders for i in range(n)}
    assert len(places) == n * n  # every method in every place ...
    assert all(sum(o[i] == m for o in orders) == cycle // n for m in methods for i in range(n))  # ... equally often
    pairs = [(a, b) for o in orders for a, b in zip(o, o[1:])]
    assert {p: pairs.count(p) for p in set(pairs)} == {(a, b): cycle // n for a in methods for b in methods if a != b}
    assert bench_module.method_order(methods, cycle + 1) == orders[1] and bench_module.method_order([], 3) == []
    rotations = [methods[k:] + methods[:k] for k in range(n)]
    if n >= 3:
        assert len({(a, b) for o in rotations for a, b in zip(o, o[1:])}) < n * (n - 1)  # rotation is unbalanced


def test_repeats_record_each_methods_median_pass(monkeypatch):
    """--repeats 3: no figure comes from a pass disturbed by the machine (8 s against ~2 s); each method's
    row is its median pass whole (its own TTFT), passes run in the Latin square's orders, and one pass with other
    tokens makes matches_target False."""
    same, other = [5, 6, 7], [5, 6, 8]
    pipe = _ScriptedPipe({
        "target_only": [(same, 4.0), (same, 4.4), (same, 3.9)],
        "speculative": [(same, 8.0), (same, 2.1), (same, 2.3)],  # pass 1 disturbed: the median is 2.3 s
        "hf_assisted": [(same, 2.5), (other, 2.6), (same, 2.4)],
    })
    monkeypatch.setattr(bench_module, "_hf_generate", pipe.hf_generate)
    row = run_question(pipe, [1, 2], spec=None, max_new_tokens=3, prompt_lookup=False, rotate=1, repeats=3)
    assert row["orders"] == [["speculative", "hf_assisted", "target_only"], ["hf_assisted", "target_only", "speculative"],
                             ["hf_assisted", "speculative", "target_only"]]  # method_order 1, 2, 3 (3: 0 reversed)
    assert pipe.calls == [m for order in row["orders"] for m in order]
    assert row["target_only"]["s"] == 4.0 and row["target_only"]["repeat_s"] == [4.0, 4.4, 3.9]
    assert row["target_only"]["repeats_agree"] is True
    assert row["speculative"]["s"] == 2.3 and row["speculative"]["ttft_ms"] == pytest.approx(230.0)
    assert row["speculative"]["repeat_s"] == [8.0, 2.1, 2.3] and row["speculative"]["matches_target"] is True
    assert row["hf_assisted"]["s"] == 2.5 and row["hf_assisted"]["matches_target"] is False
    # a target whose passes disagree: flagged, and the others compare with its first pass, not its median one
    pipe = _ScriptedPipe({"target_only": [(same, 4.0), (other, 3.0), (other, 3.5)],
                          "speculative": [(same, 2.0), (same, 2.1), (same, 2.2)]})
    monkeypatch.setattr(bench_module, "_hf_generate", pipe.hf_generate)
    row = run_question(pipe, [1, 2], None, 3, hf_assisted=False, prompt_lookup=False, repeats=3)
    assert row["target_only"]["repeats_agree"] is False and row["target_only"]["s"] == 3.5
    assert row["speculative"]["matches_target"] is True
    pipe = _ScriptedPipe({"target_only": [(same, 4.0), (same, 3.0)], "speculative": [(same, 2.0), (same, 1.0)]})
    monkeypatch.setattr(bench_module, "_hf_generate", pipe.hf_generate)
    row = run_question(pipe, [1, 2], None, 3, hf_assisted=False, prompt_lookup=False, repeats=2)
    assert row["speculative"]["s"] == 1.0 and row["target_only"]["s"] == 3.0  # even R: the lower middle
    pipe = _ScriptedPipe({"target_only": [(same, 4.0)], "speculative": [(same, 2.0)]})
    monkeypatch.setattr(bench_module, "_hf_generate", pipe.hf_generate)
    row = run_question(pipe, [1, 2], None, 3, hf_assisted=False, prompt_lookup=False)
    assert "orders" not in row and "repeat_s" not in row["speculative"] and "repeats_agree" not in row["target_only"]
    with pytest.raises(ValueError, match="--repeats"):
        run_question(pipe, [1, 2], None, 3, repeats=0)


def test_plain_column_splits_the_speedup(monkeypatch):
    """--plain: our engine without a draft runs beside the others (a request with no spec), is checked
    against target-only like them, and speculative_over_plain is speculative's end-to-end tokens/s over
    plain's (here 14/1.5 over 14/2.0 = 1.33x, while speculative is 2.0x over target-only)."""
    same, other = [5, 6, 7], [5, 6, 8]
    pipe = _ScriptedPipe({"target_only": [(same, 4.0)], "plain": [(other, 3.0)], "speculative": [(same, 2.0)]})
    monkeypatch.setattr(bench_module, "_hf_generate", pipe.hf_generate)
    row = run_question(pipe, [1, 2], spec="tree", max_new_tokens=3, hf_assisted=False, prompt_lookup=False, plain=True)
    assert row["order"] == ["target_only", "plain", "speculative"] and pipe.calls == row["order"]
    assert row["plain"] == {"new_tokens": 3, "s": 3.0, "ttft_ms": 300.0, "rounds": 3, "drafted": 0, "matches_target": False}
    assert row["speculative"]["matches_target"] is True
    pipe = _ScriptedPipe({"target_only": [(same, 4.0)], "speculative": [(same, 2.0)]})
    monkeypatch.setattr(bench_module, "_hf_generate", pipe.hf_generate)
    assert "plain" not in run_question(pipe, [1, 2], "tree", 3, hf_assisted=False, prompt_lookup=False)  # off by default here
    rows = _method_rows()
    rows[0]["plain"] = {"new_tokens": 9, "s": 1.5, "ttft_ms": 150.0, "matches_target": True}
    rows[1]["plain"] = {"new_tokens": 5, "s": 0.5, "ttft_ms": 100.0, "matches_target": True}
    s = summarize(rows)
    assert s["plain_speedup"] == pytest.approx(3.0 / 2.0) and s["plain_match_fraction"] == 1.0
    assert s["speculative_over_plain"] == pytest.approx((14 / 1.5) / (14 / 2.0))
    table = markdown_table({"qa": s}).splitlines()
    head = [c.strip() for c in table[0].strip("|").split("|")]
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[head.index("spec / plain (ours)")] == "1.33x" and cells[head.index("plain (ours) speedup")] == "1.50x"
    assert "speculative_over_plain" not in summarize(_method_rows())
    assert "spec / plain" not in markdown_table({"qa": summarize(_method_rows())})


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    """Tiny pair with a 4096-token context: the long summarization and rag prompts fit."""
    return save_tiny_pair(tmp_path_factory.mktemp("bench_models"), max_pos=4096)


def test_bench_builtin_set_end_to_end(long_pair, tmp_path):
    out = tmp_path / "out"
    proc = run_bench_cli(tmp_path, "--per-category", "1", "--max-new-tokens", "8", "--target", str(long_pair.target),
                         "--draft", str(long_pair.draft), "--dtype", "float32", "--draft-quant", "none", "--threads", "1",
                         "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out / "results.json").read_text())
    assert result["meta"]["questions"] == "built-in" and result["meta"]["offset"] == 0 and not result["meta"]["skipped"]
    assert result["meta"]["methods"] == list(METHODS)
    rows = result["questions"]
    assert Counter(r["category"] for r in rows) == {c: 1 for c in CATEGORIES}
    for r in rows:
        assert sorted(r["order"]) == sorted(METHODS)
        for m in METHODS:
            assert r[m]["new_tokens"] >= 1 and r[m]["s"] > 0 and 0 < r[m]["ttft_ms"] <= r[m]["s"] * 1000
        assert r["speculative"]["matches_target"] is True  # float32: exact greedy output
        assert isinstance(r["hf_assisted"]["matches_target"], bool) and "sampled" in r
    summary = result["summary"]
    assert set(summary) == set(CATEGORIES) | {"overall"}
    for s in summary.values():
        for m in METHODS:
            assert s[f"{m}_tokens_per_s"] > 0 and s[f"{m}_decode_tokens_per_s"] > 0 and s[f"{m}_ttft_ms"] > 0
        for m in METHODS[1:]:
            assert s[f"{m}_speedup"] > 0 and s[f"{m}_decode_speedup"] > 0
        assert s["mean_accepted_length"] >= 1 and s["efficiency"] > 0
    spec_rows = [r["speculative"] for r in rows]
    for r in spec_rows:  # each accepted draft token sits at one position of its round's accepted path
        proposed, accepted = r["position_proposed"], r["position_accepted"]
        assert sum(accepted) == r["accepted"] and len(accepted) == len(proposed)
        assert all(a <= p for a, p in zip(accepted, proposed)) and proposed == sorted(proposed, reverse=True)
    assert max(len(r["position_proposed"]) for r in spec_rows) >= 1  # some round verified a tree
    assert "| acceptance at position | 1 |" in (out / "results.md").read_text()
    md = (out / "results.md").read_text()
    assert "built-in prompt set" in md and "HF prompt lookup decode speedup" in md and "spec TTFT ms" in md
    assert all(r["plain"]["matches_target"] is True for r in rows)  # our plain decoding: exact in float32 too
    assert all(r["plain"]["drafted"] == 0 and r["plain"]["rounds"] == r["plain"]["new_tokens"] for r in rows)  # no draft
    assert sum(r["speculative"]["drafted"] for r in rows) > 0
    assert "spec / plain (ours)" in md and "plain (ours) TTFT ms" in md
    assert all(s["speculative_over_plain"] == pytest.approx(s["speculative_tokens_per_s"] / s["plain_tokens_per_s"])
               for s in summary.values())
    # where the speculative time went: phases within each run's total, a draft phase where it drafted
    for r in spec_rows:  # the first token, the later rounds' draft phases and verifies: parts of the run
        assert r["draft_s"] + r["verify_s"] + r["ttft_ms"] / 1000 <= r["s"] + 1e-5
        assert r["draft_rounds"] <= r["rounds"] - 1 and (r["verify_s"] > 0) == (r["rounds"] > 1)
    assert sum(r["draft_rounds"] for r in spec_rows) > 0 and sum(r["draft_s"] for r in spec_rows) > 0
    assert "| spec time share | TTFT | draft | verify | other | draft ms / draft round |" in md


def test_bench_questions_file_offset_and_skipped_methods(long_pair, tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [f"hello world {i}"]}) + "\n"
                            for i, c in [(1, "qa"), (2, "math"), (3, "qa"), (4, "qa"), (5, "math")]))
    out = tmp_path / "out"
    proc = run_bench_cli(tmp_path, "--questions", str(path), "--offset", "1", "--per-category", "1",
                         "--max-new-tokens", "4", "--target", str(long_pair.target), "--draft", str(long_pair.draft),
                         "--dtype", "float32", "--draft-quant", "none", "--threads", "1", "--temperature", "0",
                         "--no-hf-assisted", "--no-prompt-lookup", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out / "results.json").read_text())
    assert [r["question_id"] for r in result["questions"]] == [3, 5]
    assert result["meta"]["methods"] == ["target_only", "plain", "speculative"] and result["meta"]["offset"] == 1
    assert result["meta"]["draft_window"] == FrontConfig().draft_window.model_dump()  # the service default
    screen = fbgemm_available()  # float32 CPU target: greedy rows through the screen where torch has the kernels
    assert result["meta"]["argmax_screen"] is screen and result["meta"]["argmax_screen_requested"] is True
    assert f"greedy argmax screen: {'on' if screen else 'off (requested'}" in (out / "results.md").read_text()
    # the record names the CPU it was measured on, and the torch threads (--threads 1)
    assert result["meta"]["cpu"] == cpu_model() and result["meta"]["threads"] == 1
    assert f"Machine: {cpu_model() or 'CPU model unknown'}, {os.cpu_count()} CPUs, 1 torch threads" in (out / "results.md").read_text()
    assert all(r["speculative"]["matches_target"] for r in result["questions"])
    # the cost model's start-up shape and its end-of-run figures, both in the record
    start, end = result["meta"]["cost_model_start"], result["meta"]["cost_model"]
    assert set(start["verify_ms"]) == set(end["verify_ms"]) and all(ms > 0 for ms in start["verify_ms"].values())
    assert list(start["verify_ms"].values()) == sorted(start["verify_ms"].values())  # never decreasing
    assert "Cost model at start-up: V(1, 4, 8, 16, 32) = " in (out / "results.md").read_text()
    out2 = tmp_path / "out2"
    proc = run_bench_cli(tmp_path, "--questions", str(path), "--category", "math", "--per-category", "2",
                         "--max-new-tokens", "4", "--target", str(long_pair.target), "--draft", str(long_pair.draft),
                         "--dtype", "float32", "--draft-quant", "none", "--threads", "1", "--temperature", "0",
                         "--no-hf-assisted", "--no-prompt-lookup", "--draft-window", "0", "--no-argmax-screen",
                         "--repeats", "2", "--no-plain", "--out", str(out2))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out2 / "results.json").read_text())
    assert result["meta"]["repeats"] == 2 and result["meta"]["target_repeats_agreed"] == 2
    md = (out2 / "results.md").read_text()
    assert "median pass by total time recorded (the faster of 2)" in md and "agreed on 2 of 2 questions" in md
    assert "plain (ours)" not in md  # --no-plain: neither the column nor its explanation
    for i, r in enumerate(result["questions"]):  # question i's passes: the square's orders i and i + 1
        assert r["orders"] == [bench_module.method_order(["target_only", "speculative"], i + j) for j in (0, 1)]
        assert r["orders"][0] != r["orders"][1]
        for m in ("target_only", "speculative"):
            assert len(r[m]["repeat_s"]) == 2 and r[m]["s"] == min(r[m]["repeat_s"])  # R = 2: the lower middle
        assert r["target_only"]["repeats_agree"] is True
    assert [r["question_id"] for r in result["questions"]] == [2, 5]
    assert result["meta"]["categories"] == ["math"] and result["meta"]["draft_window"] is None
    assert result["meta"]["argmax_screen"] is False and "greedy argmax screen: off" in (out2 / "results.md").read_text()
    assert all(r["speculative"]["matches_target"] for r in result["questions"])
    assert all("hf_assisted" not in r and "prompt_lookup" not in r and "sampled" not in r and "plain" not in r
               for r in result["questions"])
    assert result["meta"]["methods"] == ["target_only", "speculative"]


@pytest.mark.parametrize("args, needle", [
    (["--offset", "-1"], "--offset"),
    (["--offset", "99"], "--offset"),
    (["--questions", "missing.jsonl"], "--questions"),
    (["--questions", "bad.jsonl"], "--questions"),
    (["--questions", "q[old].jsonl"], "--questions: no such file q[old].jsonl"),  # printed whole, not as markup
    (["--category", "poetry"], "--category: poetry not in built-in"),
    (["--draft-window", "32"], "--draft-window: must be 0"),
    (["--draft-window", "-5"], "--draft-window: must be 0"),
    (["--repeats", "0"], "--repeats: must be >= 1"),
    (["--repeats", "-1"], "--repeats: must be >= 1"),
])
def test_bench_bad_flags_exit_with_message(tmp_path, args, needle):
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "bad.jsonl").write_text("{not json\n")
    # fails before any model loads (the model paths do not exist: a model load would fail naming --target)
    nowhere = str(tmp_path / "no-model")
    proc = run_bench_cli(tmp_path, *args, "--target", nowhere, "--draft", nowhere, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert needle in proc.stderr and "Traceback" not in proc.stderr

