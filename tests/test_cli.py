"""CLI end to end on tiny saved models: generation output and bad input (clear message, exit 2, no traceback).

Generation runs ``python -m orchestrator.cli`` in a process of its own; bad input runs the same typer app in this
process (``cli_in_process``: each interpreter start costs seconds of imports), where an unexpected exception shows as
exit 1 with the exception kept.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from specdec.harness.tiny_pair import save_tiny
from tests.conftest import cli_in_process as in_process


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return save_tiny(root / "target", 0), save_tiny(root / "draft", 1)


def run_cli(*args, stdin: str | None = None):
    """``specdec generate *args`` in a process of its own, on one torch thread (tiny models; beside a second
    pytest-xdist worker two threads would only contend)."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "generate", *args, "--threads", "1"], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_generate_greedy_equals_target_only(pair):
    target, draft = pair
    base = ["--target", str(target), "--draft", str(draft), "--dtype", "float32", "--raw", "--max-new-tokens", "12"]
    spec = run_cli("the quick brown fox", *base)
    plain = run_cli("the quick brown fox", *base, "--no-spec")
    assert spec.returncode == 0, spec.stderr
    assert plain.returncode == 0, plain.stderr
    assert spec.stdout == plain.stdout and spec.stdout.strip()
    assert "acceptance rate" in spec.stderr and "mean accepted length" in spec.stderr and "TTFT" in spec.stderr


def test_generate_pipeline_flag_keeps_the_output(pair):
    target, draft = pair
    base = ["--target", str(target), "--draft", str(draft), "--dtype", "float32", "--raw", "--max-new-tokens", "24",
            "--control", "fixed", "--tree", '{"gamma": 2, "topKSpec": [[2], [1, 1]], "topHead": [1, 2]}']
    piped = run_cli("the quick brown fox", *base, "--pipeline")
    plain = run_cli("the quick brown fox", *base)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == plain.stdout and piped.stdout.strip()
    assert ("pipelining" in piped.stderr) and "pipelining" not in plain.stderr


def test_prompt_from_stdin_and_file(pair, tmp_path):
    target, draft = pair
    base = ["--target", str(target), "--draft", str(draft), "--dtype", "float32", "--raw", "--max-new-tokens", "5",
            "--threads", "1"]
    (tmp_path / "p.txt").write_text("the quick brown fox")
    from_arg = run_cli("the quick brown fox", *base)
    from_stdin = in_process("-", *base, stdin="the quick brown fox")
    from_file = in_process("--prompt-file", str(tmp_path / "p.txt"), *base)
    assert from_arg.returncode == from_stdin.returncode == from_file.returncode == 0, (from_stdin, from_file)
    assert from_arg.stdout == from_stdin.stdout == from_file.stdout


def _assert_clean_failure(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def test_unknown_model_path(pair, tmp_path):
    target, _ = pair
    proc = in_process("hello", "--target", str(target), "--draft", str(tmp_path / "nope"), "--dtype", "float32")
    _assert_clean_failure(proc, "--draft", "no model at")


def test_incompatible_tokenizers(pair, tmp_path):
    target, _ = pair
    other = save_tiny(tmp_path / "other", 2, corpus=["completely different text for another vocabulary"])
    proc = in_process("hello", "--target", str(target), "--draft", str(other), "--dtype", "float32")
    _assert_clean_failure(proc, "incompatible tokenizers")


@pytest.mark.parametrize("spec, field", [
    ('{"gamma": 2, "topKSpec": [[2]], "topHead": [1]}', "topKSpec"),
    ('{"gamma": 1, "topKSpec": [[0]], "topHead": [1]}', "topKSpec[0][0]"),
    ('{"gamma": 2, "topKSpec": [[2], [1, 1, 1]], "topHead": [1, 3]}', "topHead[1]"),
    ("not-a-file.json", "tree spec"),
])
def test_invalid_tree_spec(pair, spec, field):
    target, draft = pair
    proc = in_process("hello", "--target", str(target), "--draft", str(draft), "--tree", spec)
    _assert_clean_failure(proc, field)


def test_empty_prompt(pair):
    target, draft = pair
    proc = in_process("   ", "--target", str(target), "--draft", str(draft), "--dtype", "float32")
    _assert_clean_failure(proc, "empty prompt")


def test_prompt_over_context_limit(pair):
    target, draft = pair
    long_prompt = "zq " * 80  # > 64 tokens (max_position_embeddings)
    proc = in_process(long_prompt, "--target", str(target), "--draft", str(draft), "--dtype", "float32", "--raw")
    _assert_clean_failure(proc, "context limit")


def test_bad_dtype_and_max_new_tokens(pair):
    target, draft = pair
    _assert_clean_failure(in_process("hello", "--target", str(target), "--threads", "-1"), "--threads")
    _assert_clean_failure(in_process("--per-category", "0", command="bench"), "--per-category")
    _assert_clean_failure(in_process("hello", "--target", str(target), "--dtype", "int3"), "--dtype")
    _assert_clean_failure(in_process("hello", "--target", str(target), "--max-new-tokens", "0"), "--max-new-tokens")


def test_sampled_generation_is_reproducible_with_a_seed(pair):
    target, draft = pair
    base = ["--target", str(target), "--draft", str(draft), "--dtype", "float32", "--raw", "--max-new-tokens", "16",
            "--temperature", "0.8", "--top-p", "0.95", "--top-k", "40", "--seed", "3",
            "--tree", '{"gamma": 2, "topKSpec": [[3], [2, 1]], "topHead": [1, 2], "treeType": 1}']
    first, second = run_cli("the quick brown fox", *base), run_cli("the quick brown fox", *base)
    assert first.returncode == second.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.strip()
    assert "temperature 0.8, top-p 0.95, top-k 40, seed 3" in first.stderr and "acceptance rate" in first.stderr


@pytest.mark.parametrize("option, value", [("--temperature", "-0.5"), ("--top-p", "0"), ("--top-k", "-1")])
def test_bad_sampling_values(pair, option, value):
    target, _ = pair
    _assert_clean_failure(in_process("hello", "--target", str(target), option, value), option)


def test_bench_bad_sampling_value():
    _assert_clean_failure(in_process("--top-p", "1.5", command="bench"), "--top-p", "(0, 1]")


def test_sampling_option_names_in_messages():
    from orchestrator.cli.main import UsageError, sampling_params

    assert sampling_params(0.7, 0.9, 5, 1).temperature == 0.7
    for args, option in [((-1, 1.0, 0, None), "--temperature"), ((1, 2.0, 0, None), "--top-p"),
                         ((1, 1.0, -2, None), "--top-k"), ((1, 1.0, 0, -5), "--seed")]:
        with pytest.raises(UsageError, match=f"^{option}: "):
            sampling_params(*args)


def test_control_choices_are_cost_aware_and_fixed():
    """Dynamic gamma was removed: ``--control dynamic-gamma`` is refused, naming the two controls left."""
    from orchestrator.cli.main import UsageError, check_control

    check_control("cost-aware")
    check_control("fixed")
    with pytest.raises(UsageError, match=r"^--control: expected cost-aware, fixed, got 'dynamic-gamma'$"):
        check_control("dynamic-gamma")


def test_stats_table_shows_acceptance_by_position_for_local_and_remote_stats():
    """The end-of-run table reads the per-position counts from GenerationStats (in-process) and from
    FinalStats (generate --server) alike; positions past the eighth are summarized."""
    from types import SimpleNamespace

    from rich.console import Console

    from orchestrator.cli.main import stats_table
    from specdec.stats import GenerationStats
    from specdec.wire import stats_to_proto

    local = GenerationStats(new_tokens=12, rounds=4, proposed_tokens=20, accepted_tokens=8,
                            position_proposed=[4, 3, 3, 1, 1, 1, 1, 1, 1, 1], position_accepted=[3, 2, 1, 1, 1, 0, 0, 0, 0, 0])
    msg = stats_to_proto(local, prompt_tokens=5)
    remote = SimpleNamespace(**{f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}, tokens_per_s=0.0)  # as orchestrator.cli.remote
    for stats in (local, remote):
        console = Console(record=True, width=400)
        console.print(stats_table(stats, True))
        text = console.export_text()
        row = next(line for line in text.splitlines() if "acceptance by position" in line)
        assert row.split("│")[2].strip() == ("1: 0.75 (4), 2: 0.67 (3), 3: 0.33 (3), 4: 1.00 (1), 5: 1.00 (1), "
                                             "6: 0.00 (1), 7: 0.00 (1), 8: 0.00 (1), ... (2 deeper)"), text
        assert "... (2 deeper)" in text and "9:" not in text
    console = Console(record=True, width=400)
    console.print(stats_table(GenerationStats(new_tokens=3, rounds=3), True))  # no tree verified: no row
    assert "acceptance by position" not in console.export_text()


def test_stats_table_shows_time_by_phase_for_local_and_remote_stats():
    """The first token, the later rounds' draft phases and verifies, from GenerationStats and from
    FinalStats alike; no row where nothing was verified after the first token."""
    from types import SimpleNamespace

    from rich.console import Console

    from orchestrator.cli.main import stats_table
    from specdec.stats import GenerationStats
    from specdec.wire import stats_to_proto

    timed = GenerationStats(new_tokens=3, rounds=3, total_s=2.0, ttft_ms=200.0, draft_s=0.5, verify_s=1.2, draft_rounds=2)
    msg = stats_to_proto(timed, prompt_tokens=5)
    remote = SimpleNamespace(**{f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}, tokens_per_s=0.0)
    for stats in (timed, remote):
        console = Console(record=True, width=400)
        console.print(stats_table(stats, True))
        row = next(line for line in console.export_text().splitlines() if "time by phase" in line)
        assert row.split("│")[2].strip() == "first token 0.20 s (10%), draft 0.50 s (25%), verify 1.20 s (60%) of 2.00 s"
    console = Console(record=True, width=400)
    console.print(stats_table(GenerationStats(new_tokens=1, rounds=1, total_s=0.3, ttft_ms=300.0), True))
    assert "time by phase" not in console.export_text()


def test_stats_table_shows_the_link_round_trips_a_front_measured():
    """FinalStats' link round trips (generate --server) get a row; unset (0 on the message) or None: none."""
    from types import SimpleNamespace

    from rich.console import Console

    from orchestrator.cli.main import stats_table
    from specdec.stats import GenerationStats
    from specdec.wire import stats_to_proto

    def text(stats: GenerationStats) -> str:
        msg = stats_to_proto(stats, prompt_tokens=5)
        remote = SimpleNamespace(**{f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}, tokens_per_s=0.0)
        console = Console(record=True, width=400)
        console.print(stats_table(remote, True))
        return console.export_text()

    row = next(line for line in text(GenerationStats(draft_link_rtt_ms=31.26, target_link_rtt_ms=0.44)).splitlines()
               if "link round trips" in line)
    assert row.split("│")[2].strip() == "draft 31.3 ms, target 0.4 ms"
    assert "link round trips" not in text(GenerationStats())
