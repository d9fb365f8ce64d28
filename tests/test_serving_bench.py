"""Runs of benchmarks/serving.py on tiny models (services as subprocesses, Ray fronts): the concurrency and
longprompt sections end to end, the JSON holding the figures the issues ask for, and the helpers on hand-made data.
Two runs serve every end-to-end test (module-scoped fixtures): each Ray front takes ~25 s to start on 2 cores."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.harness.tiny_pair import save_tiny_pair

ROOT = Path(__file__).resolve().parents[1]  # the repository root
VARIANTS = ("--front-variant", 'no_ctx={"cost_aware": {"ngram_tokens": 0}}',
            "--target-only-variant", 'plain_free={"cost_aware": {"probe_every": 4}}',
            "--mixed-variant", "mixed={}")
CONFIGS = ["batched", "no_ctx", "plain_free", "mixed", "speculative_pipelined", "target_only"]


def _can_pin() -> str | None:
    """None when --pin can run here, else why not (the skip reason)."""
    if shutil.which("taskset") is None:
        return "taskset (util-linux) is not installed"
    if not {0, 1} <= os.sched_getaffinity(0):
        return f"--pin needs CPUs 0 and 1; this process may use {sorted(os.sched_getaffinity(0))}"
    return None


def _run_bench(out: Path, pair, *flags: str) -> tuple[dict, str]:
    argv = [sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--target", str(pair.target), "--draft",
            str(pair.draft), "--prompts", "2", "--max-new-tokens", "6", "--max-prompt-tokens", "120",
            "--out", str(out), *flags]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "serving.json").read_text()), (out / "serving.md").read_text()


@pytest.fixture(scope="module")
def tiny_long_pair(tmp_path_factory):
    """A tiny pair with room for a 300-token prompt beside requests of 1500 new tokens."""
    return save_tiny_pair(tmp_path_factory.mktemp("models"), max_pos=2048, noise=0.03)


@pytest.fixture(scope="module")
def concurrency_run(tiny_long_pair, tmp_path_factory):
    """One closed-loop run at 1 and 2 clients of every concurrency configuration: batched, the three kinds of
    variant (--front-variant with no context branches, --target-only-variant, --mixed-variant),
    speculative_pipelined (--pipeline) and target_only, each row with its round log (--round-log)."""
    return _run_bench(tmp_path_factory.mktemp("out"), tiny_long_pair, "--sections", "concurrency", "--levels", "1,2",
                      "--pipeline", "--round-log", *VARIANTS)


@pytest.fixture(scope="module")
def pinned_longprompt_run(tiny_long_pair, tmp_path_factory):
    """One run of the concurrency section in open loop (2 requests per second, 4 requests) and the longprompt
    section, with --pin where the machine allows it."""
    flags = ["--sections", "concurrency,longprompt", "--open-loop", "--levels", "2", "--concurrency-prompts", "4",
             "--long-prompt-tokens", "300", "--long-running", "2", "--long-running-tokens", "1500",
             "--long-window-s", "1", "--prefill-chunk-tokens", "32"]
    if _can_pin() is None:
        flags.append("--pin")
    return _run_bench(tmp_path_factory.mktemp("out"), tiny_long_pair, *flags)


def test_concurrency_smoke(concurrency_run):
    result, md = concurrency_run
    assert set(result) == {"meta", "concurrency"}
    meta = result["meta"]
    assert meta["target_threads"] == 2 and meta["draft_threads"] == 1 and meta["wall_s"] > 0
    # every service process's peak memory: a draft, a target and the fronts, each a loaded process
    peaks = meta["peak_rss_mb"]
    assert len(peaks) >= 3 and all(mb > 50 for mb in peaks.values()), peaks
    assert "peak resident memory" in md
    starts = meta["front_start_costs"]  # each front measured the services when it connected (its log says)
    assert {"bench-front-ray-batched", "bench-front-ray-pipelined", "bench-front-variant-no_ctx"} <= starts.keys()
    for costs in starts.values():
        assert set(costs["verify_ms"]) == {"1", "4", "8", "16", "32"} and set(costs["draft_step_ms"]) == {"1", "2", "4", "8"}
        assert all(ms > 0 for ms in [*costs["verify_ms"].values(), *costs["draft_step_ms"].values()]), costs
    assert "cost model each front started from" in md
    conc = result["concurrency"]
    assert conc["configs"] == CONFIGS and conc["identical_outputs"] is True
    assert {(r["config"], r["clients"]) for r in conc["rows"]} == {(c, n) for c in CONFIGS for n in (1, 2)}
    for r in conc["rows"]:
        assert r["new_tokens"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["latency_p50_s"] <= r["latency_p95_s"]
    assert "## Concurrency" in md
    if meta["dtype_arg"] == "auto" and meta["dtype"] == "float32":
        assert "bf16" in meta["bf16_note"] and "bf16" in md


# ------------------------------------------------------------------------------ issue 12: --pin, longprompt, --pipeline

def test_pin_runs_target_on_core_0_and_draft_on_core_1(pinned_longprompt_run):
    reason = _can_pin()
    if reason:
        pytest.skip(reason)
    result, md = pinned_longprompt_run
    meta = result["meta"]
    pinning = meta["pinning"]
    assert pinning["pinned"] is True and pinning["cores"] == {"target": "0", "draft": "1", "front": "unpinned"}
    # the affinity each service process had once ready (os.sched_getaffinity of its pid)
    affinity = pinning["affinity"]
    assert affinity["bench-target-batched"] == [0] and affinity["bench-target-long-32"] == [0]
    assert affinity["bench-draft"] == [1]
    assert len(affinity["bench-front-ray-batched"]) >= 2  # fronts stay unpinned
    assert meta["target_threads"] == 1 and meta["draft_threads"] == 1
    # the target-only rows ran on that same pinned target
    assert {r["config"] for r in result["concurrency"]["rows"]} == {"batched", "target_only"}
    assert "CPU pinning (`--pin`" in md and "bench-target-batched [0]" in md


def test_longprompt_section_reports_itl_before_and_during(pinned_longprompt_run):
    result, md = pinned_longprompt_run
    lp = result["longprompt"]
    assert lp["long_prompt_tokens"] == 300 and lp["running"] == 2 and lp["prefill_chunk_settings"] == [[32, 16]]
    (row,) = lp["rows"]
    assert row["config"] == "speculative" and row["prefill_chunk_tokens"] == 32 and row["chunked"] is True
    assert row["prefill_busy_chunk_tokens"] == 16  # the config default: chunks ride in the running requests' forwards
    for key in ("itl_p50_before_ms", "itl_p95_before_ms", "itl_p50_during_ms", "itl_p95_during_ms",
                "max_gap_during_ms", "itl_p95_ratio", "long_ttft_s", "window_during_s"):
        assert row[key] > 0, (key, row)
    assert row["itl_p50_before_ms"] <= row["itl_p95_before_ms"] and row["itl_p50_during_ms"] <= row["itl_p95_during_ms"]
    assert row["itl_tokens_before"] > 0 and row["itl_tokens_during"] > 0
    assert row["running_outlasted"] == 2  # both still decoding when the long request's first token came
    assert 0 < row["long_new_tokens"] <= 6 and row["long_wall_s"] >= row["long_ttft_s"]
    assert "Long prompt beside running requests" in md and "| speculative | 32 | 16 | True |" in md
    # the concurrency table's new column
    conc = {r["config"]: r for r in result["concurrency"]["rows"]}
    assert conc["target_only"]["latency_p95_vs_target_only"] == 1.0
    assert conc["batched"]["latency_p95_vs_target_only"] == pytest.approx(
        conc["batched"]["latency_p95_s"] / conc["target_only"]["latency_p95_s"])
    assert "p95 latency vs target only" in md


def test_pipeline_configuration(concurrency_run):
    result, md = concurrency_run
    conc = result["concurrency"]
    rows = [r for r in conc["rows"] if r["config"] == "speculative_pipelined"]
    assert len(rows) == 2 and result["meta"]["pipeline"] is True
    for row in rows:
        assert row["new_tokens"] > 0 and row["tokens_per_s"] > 0
        for key in ("pipeline_ahead_hits", "pipeline_ahead_misses"):
            assert row[key] is None or row[key] >= 0
        if row["pipeline_ahead_hits"]:  # the traces tell the same story as the front's counters
            trace = row["pipeline_trace"]
            assert trace["hits"] == row["pipeline_ahead_hits"] and trace["adopted_rounds"] == trace["hits"]
            assert trace["adopted_with_draft_span"] == 0 and trace["hidden_share"] > 0 and trace["complete"] is True
            assert "Pipelining from the traces" in md
        else:
            assert "pipeline_trace" not in row
    assert "| speculative_pipelined | 2 |" in md
    assert all(0.0 <= r["fallback_round_share"] <= 1.0 for r in conc["rows"]) and "| fallback rounds |" in md
    assert not any("pipeline_trace" in r for r in conc["rows"] if r["config"] != "speculative_pipelined")


def test_cpu_by_process_per_row(concurrency_run):
    """CPU by process: the level's own front and the target computed; the other (idle) fronts are apart."""
    from benchmarks.serving import CPU_ROLES

    result, md = concurrency_run
    for r in result["concurrency"]["rows"]:
        cpu = r["cpu_s"]
        assert list(cpu) == list(CPU_ROLES) and cpu["target"] > 0 and cpu["front"] > 0, cpu
        assert cpu["front_ray"] > 0, cpu  # the orchestrator actors (the front's local Ray) ran the rounds
        cpus = len(os.sched_getaffinity(0))
        # psutil's CPU times count whole clock ticks (10 ms) per process: over a level of a fraction of a
        # second with ~10 busy processes that rounding alone reaches 0.1 s; counting a process twice would
        # add a whole window
        rounding_s = 10 * 0.01
        assert r["cpu_window_s"] >= r["wall_s"] and r["cpu_busy_share"] > 0
        assert sum(cpu.values()) <= r["cpu_window_s"] * cpus * 1.02 + rounding_s
    assert "CPU by process over each level" in md and "| front's Ray % |" in md


def test_variants_add_configurations_and_round_logs_cover_target_only(concurrency_run):
    """--front-variant NAME=JSON: a Ray front on the batched target with JSON merged into its front
    config (here no context branches: every verified row is then the bonus row, one per round);
    --round-log: every row, target_only too, gets its rounds' log (target-only: plain rounds);
    --target-only-variant NAME=JSON: no_spec requests on such a front (plain rounds, no draft);
    --mixed-variant NAME=JSON: the even-numbered requests no_spec, the others speculating, on one front."""
    result, md = concurrency_run
    conc, meta = result["concurrency"], result["meta"]
    assert meta["mixed_variants"] == {"mixed": {}} and "Configuration `mixed` (`--mixed-variant`)" in md
    assert meta["target_only_variants"] == {"plain_free": {"cost_aware": {"probe_every": 4}}}
    assert "Configuration `plain_free` (`--target-only-variant`)" in md
    assert "| no_ctx | 2 |" in md and meta["front_variants"] == {"no_ctx": {"cost_aware": {"ngram_tokens": 0}}}
    assert 'Configuration `no_ctx` (`--front-variant`)' in md and '{"cost_aware": {"ngram_tokens": 0}}' in md
    for row in (r for r in conc["rows"] if r["config"] in ("batched", "no_ctx", "plain_free", "target_only")):
        log = row["round_log"]
        assert log and len(log) == sum(r["rounds"] for r in row["per_request"])  # every round of the row
        if row["config"] in ("target_only", "plain_free"):  # no_spec: plain rounds, no draft
            assert all(r["nodes"] == 0 and r["draft_ms"] is None for r in log)
        if row["config"] == "no_ctx":
            assert all(r["nodes"] == 0 for r in log if r["gamma"] == 0)
    target_only = {r["clients"]: r for r in conc["rows"] if r["config"] == "target_only"}
    for mixed in (r for r in conc["rows"] if r["config"] == "mixed"):  # each kind's latency from its own requests
        plain = [r for r in mixed["per_request"] if r["no_spec"]]
        spec = [r for r in mixed["per_request"] if not r["no_spec"]]
        assert len(plain) == len(spec) == len(mixed["per_request"]) // 2 > 0
        for kind, reqs in (("no_spec", plain), ("spec", spec)):
            lat = sorted(r["wall_s"] for r in reqs)
            assert mixed[f"{kind}_latency_p50_s"] == pytest.approx(statistics.median(lat))
            assert lat[max(len(lat) - 2, 0)] <= mixed[f"{kind}_latency_p95_s"] <= lat[-1]  # near the slowest
        assert mixed["no_spec_latency_p95_vs_target_only"] == pytest.approx(
            mixed["no_spec_latency_p95_s"] / target_only[mixed["clients"]]["latency_p95_s"])
        assert all(r["proposed_tokens"] == 0 for r in plain) and any(r["proposed_tokens"] > 0 for r in spec)
    assert "Mixed traffic (`--mixed-variant`)" in md and "| mixed | 2 |" in md
    assert all("no_spec_latency_p95_s" not in r for r in conc["rows"] if r["config"] != "mixed")


def test_front_variant_flag_errors(capsys):
    from benchmarks.serving import parse_args

    for argv in (["no_ctx"], ["target_only={}"], ["1x={}"], ["v=[1]"], ["v={bad"],
                 ["v={}", "--front-variant", "v={}"],  # the same name twice
                 ['v={"cost_aware": {"ngram_tokns": 0}}'],  # a front config key that does not exist
                 ["v={}", "--sections", "longprompt"]):  # no concurrency section to add it to
        with pytest.raises(SystemExit):
            parse_args(["--front-variant", *argv])
        assert "--front-variant" in capsys.readouterr().err
    assert parse_args(["--front-variant", 'v={"pipeline": true}']).front_variant == [("v", {"pipeline": True})]
    with pytest.raises(SystemExit):  # a removed key names itself and where it went, as in a config file
        parse_args(["--front-variant", 'v={"cost_aware": {"in_step": false}}'])
    err = capsys.readouterr().err
    assert "front.cost_aware.in_step: no longer a config key" in err and "docs/heuristics.md" in err
    for argv in (["target_only={}"], ["v={bad"], ['v={"cost_aware": {"probe_evry": 4}}'],
                 ["v={}", "--front-variant", "v={}"]):  # a name taken by either flag
        with pytest.raises(SystemExit):
            parse_args(["--target-only-variant", *argv])
        assert "--target-only-variant" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            parse_args(["--mixed-variant", *argv])
        assert "--mixed-variant" in capsys.readouterr().err


def test_bad_flags_are_refused_naming_the_flag(capsys):
    from benchmarks.serving import parse_args, prefill_chunk_setting

    for argv, flag in ((["--longprompt-configs", "speculative,fast"], "--longprompt-configs"),
                       (["--levels", "1,16", "--concurrency-prompts", "8"], "--concurrency-prompts"),
                       (["--long-prompt-tokens", "0"], "--long-prompt-tokens"),
                       (["--long-window-s", "0"], "--long-window-s"),
                       (["--sections", "grpc"], "--sections"),  # retired sections (and flags) are refused
                       (["--sections", "gamma"], "--sections"), (["--skip-one-at-a-time"], "--skip-one-at-a-time")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert flag in capsys.readouterr().err
    args = parse_args(["--levels", "1,4,8,16", "--prompts", "8"])
    assert args.concurrency_prompts == 16  # every one of 16 clients has a request
    assert parse_args(["--pin"]).target_threads == 1
    # --prefill-busy-chunk-tokens 0: no riding (docs/heuristics.md), the busy chunk is the chunk
    no_riding = parse_args(["--prefill-chunk-tokens", "32", "--prefill-busy-chunk-tokens", "0"])
    assert prefill_chunk_setting(no_riding) == (32, 32)


def test_pin_without_taskset_is_a_clear_error(monkeypatch):
    from benchmarks.serving import pin_plan

    monkeypatch.setenv("PATH", "")
    with pytest.raises(SystemExit, match="taskset"):
        pin_plan(True)
    assert pin_plan(False) is None


def test_itl_samples_per_token_and_windows():
    from benchmarks.serving import itl_samples

    chunks = [(1.0, 2), (1.3, 3), (1.5, 1), (2.5, 2)]
    # window (1.0, 1.5]: gaps 0.3 over 3 tokens and 0.2 over 1 token
    samples, largest = itl_samples(chunks, 1.0, 1.5)
    assert samples == pytest.approx([0.1, 0.1, 0.1, 0.2]) and largest == pytest.approx(0.3)
    # window (1.3, 2.0]: only the chunk at 1.5; with close_after_end the open gap closing at 2.5 counts too
    assert itl_samples(chunks, 1.3, 2.0)[0] == pytest.approx([0.2])
    samples, largest = itl_samples(chunks, 1.3, 2.0, close_after_end=True)
    assert samples == pytest.approx([0.2, 0.5, 0.5]) and largest == pytest.approx(1.0)
    assert itl_samples(chunks[:1], 0.0, 9.0) == ([], 0.0)


def test_long_prompt_ids_are_deterministic_and_exact_length(tiny_long_pair):
    from transformers import AutoTokenizer

    from benchmarks.serving import long_prompt_ids

    tok = AutoTokenizer.from_pretrained(tiny_long_pair.target)
    ids = long_prompt_ids(tok, 2000)
    assert len(ids) == 2000 and ids == long_prompt_ids(tok, 2000)
    assert long_prompt_ids(tok, 300) == ids[:300]


def test_pipeline_overlap_from_spans():
    """pipeline_overlap on hand-made spans: a hit ahead partly inside its verify, one wholly inside, a
    miss, adopted rounds with and without a draft span, in-line drafted rounds; another request's
    spans are ignored."""
    from benchmarks.serving import pipeline_overlap
    from orchestrator.measure.trace_report import Span

    ms = 1_000_000

    def span(name, sid, parent, start, end, **attributes):
        return Span("", sid, parent, name, "front", start, end, attributes)

    spans = [
        # round 0 of req-0: drafted in line (draft 0-40 ms), verify 40-140, ahead 50-190 ends 50 ms after the verify: a hit
        span("round", "r0", "", 0, 200 * ms, **{"request.id": "req-0", "ahead.outcome": "hit"}),
        span("draft", "d0", "r0", 0, 40 * ms), span("verify", "v0", "r0", 40 * ms, 140 * ms),
        span("draft.ahead", "a0", "r0", 50 * ms, 190 * ms),
        # round 1: its tree was adopted (no draft span); its ahead misses
        span("round", "r1", "", 200 * ms, 400 * ms, **{"request.id": "req-0", "pipelined": True, "ahead.outcome": "miss"}),
        span("verify", "v1", "r1", 200 * ms, 300 * ms), span("draft.ahead", "a1", "r1", 210 * ms, 260 * ms),
        # round 2: drafted in line again (draft 60 ms); a hit ahead that ends inside its verify (no wait)
        span("round", "r2", "", 400 * ms, 600 * ms, **{"request.id": "req-0", "ahead.outcome": "hit"}),
        span("draft", "d2", "r2", 400 * ms, 460 * ms), span("verify", "v2", "r2", 460 * ms, 560 * ms),
        span("draft.ahead", "a2", "r2", 470 * ms, 530 * ms),
        # round 3: adopted, yet carries a draft span (counted, not hidden)
        span("round", "r3", "", 600 * ms, 700 * ms, **{"request.id": "req-0", "pipelined": True}),
        span("draft", "d3", "r3", 600 * ms, 610 * ms), span("verify", "v3", "r3", 610 * ms, 700 * ms),
        # another request's round: ignored
        span("round", "x0", "", 0, 100 * ms, **{"request.id": "other", "ahead.outcome": "hit"}),
        span("verify", "xv", "x0", 0, 10 * ms), span("draft.ahead", "xa", "x0", 50 * ms, 90 * ms),
    ]
    out = pipeline_overlap(spans, {"req-0"})
    assert out["rounds"] == 4 and out["aheads"] == 3 and out["hits"] == 2
    assert out["hit_ahead_ms_mean"] == pytest.approx((140 + 60) / 2)
    assert out["hidden_share"] == pytest.approx((90 + 60) / (140 + 60))  # 50-140 of 50-190 ms; all of 470-530 ms
    assert out["wait_ms_mean"] == pytest.approx((50.0 + 0.0) / 2)
    assert out["adopted_rounds"] == 2 and out["adopted_with_draft_span"] == 1
    assert out["adopted_round_ms_mean"] == pytest.approx((200 + 100) / 2)
    assert out["drafted_rounds"] == 2 and out["drafted_round_ms_mean"] == pytest.approx(200.0)
    assert out["drafted_draft_ms_mean"] == pytest.approx(50.0)
    empty = pipeline_overlap(spans, {"nobody"})
    assert empty["rounds"] == 0 and empty["hidden_share"] is None and empty["wait_ms_mean"] is None


def test_open_loop_sends_requests_on_a_schedule(pinned_longprompt_run):
    """--open-loop: --levels are request rates; request i is sent at i / rate s, not when a client
    is free (at 2 requests per second the 4 requests go out at 0, 0.5, 1 and 1.5 s, whatever their
    lengths), and the markdown says what the column holds."""
    result, md = pinned_longprompt_run
    conc = result["concurrency"]
    assert result["meta"]["open_loop"] is True and conc["levels"] == [2.0] and conc["identical_outputs"] is True
    for row in conc["rows"]:
        assert row["clients"] == 2.0 and row["requests"] == 4
        for i, r in enumerate(row["per_request"]):  # request i (the prompts' order), at its own slot
            assert i * 0.5 <= r["started_s"] < i * 0.5 + 0.25, (row["config"], i, r["started_s"])
        assert row["wall_s"] >= max(r["started_s"] + r["wall_s"] for r in row["per_request"]) - 1e-6
    assert "Open loop (`--open-loop`)" in md


def test_open_loop_flag_errors(capsys):
    from benchmarks.serving import parse_args

    for argv, flag in ((["--levels", "0"], "--levels"), (["--levels", "x"], "--levels"),
                       (["--levels", "1", "--sections", "longprompt"], "--open-loop")):
        with pytest.raises(SystemExit):
            parse_args(["--open-loop", *argv])
        assert flag in capsys.readouterr().err
    args = parse_args(["--open-loop", "--levels", "0.5,1", "--prompts", "6"])
    assert args.levels == [0.5, 1.0] and args.concurrency_prompts == 6


def test_front_start_costs_reads_the_fronts_log():
    from benchmarks.serving import front_start_costs

    log = ("2026-12-05 21:20:01 orchestrator.loop.service INFO cost model measured through the services: "
           "V(n) {1: 88.5, 4: 104.2, 8: 131.0} ms, D(p) {1: 20.1, 2: 23.9} ms\n")
    assert front_start_costs("ray started\n" + log) == {"verify_ms": {1: 88.5, 4: 104.2, 8: 131.0},
                                                          "draft_step_ms": {1: 20.1, 2: 23.9}}
    failed = ("x orchestrator.loop.service WARNING cost model: measuring through the services failed (TimeoutError: "
              "verify: no reply within 60.0 s); starting from the prior figures")
    assert front_start_costs(failed) == {"failed": failed.split("cost model: ", 1)[1]}
    assert front_start_costs("a front with measure_at_start: false logs neither\n") is None


def test_cpu_split_by_role():
    """cpu_split on hand-made snapshots: each role's seconds between the two, the row's own front apart
    from its Ray and from the other fronts; a process started in between counts whole, one whose
    owner or start time changed (a reused pid) counts from zero, one that ended is lost."""
    from benchmarks.serving import CPU_ROLES, cpu_split

    kinds = {"tgt": "target", "drf": "draft", "f1": "front", "f2": "front"}
    before = {1: ("tgt", "process", 10.0, 1.0), 2: ("drf", "process", 3.0, 1.0), 3: ("f1", "process", 1.0, 1.0),
              4: ("f1", "ray", 2.0, 1.0), 5: ("f2", "ray", 5.0, 1.0), 6: ("benchmark", "", 7.0, 1.0),
              7: ("other", "", 1.0, 1.0), 8: ("other", "", 4.0, 1.0), 9: ("f2", "process", 2.0, 1.0),
              11: ("other", "", 6.0, 1.0)}
    after = {1: ("tgt", "process", 25.5, 1.0), 2: ("drf", "process", 4.0, 1.0), 3: ("f1", "process", 1.5, 1.0),
             4: ("f1", "ray", 2.25, 1.0), 5: ("f2", "ray", 5.5, 1.0), 6: ("benchmark", "", 7.75, 1.0),
             7: ("other", "", 1.5, 1.0),
             10: ("f1", "ray", 0.5, 9.0),  # an actor worker started during the level: whole
             9: ("drf", "process", 0.125, 9.0),  # pid 9 reused by another owner: from zero
             11: ("other", "", 0.25, 9.0)}  # pid 11 reused by a new process of the same owner: from zero too
    split = cpu_split(before, after, kinds, front="f1")
    assert list(split) == list(CPU_ROLES)
    assert split == {"target": 15.5, "draft": 1.125, "front": 0.5, "front_ray": 0.75, "other_fronts": 0.5,
                     "benchmark": 0.75, "other": 0.75}
    # the same processes seen from the other front's row: f1's tree is now "other fronts"
    other = cpu_split(before, after, kinds, front="f2")
    assert other["front"] == 0.0 and other["front_ray"] == 0.5 and other["other_fronts"] == 0.5 + 0.25 + 0.5


def test_cpu_snapshot_owns_descendants_of_a_service(tmp_path):
    """cpu_snapshot: a service process is its own ("process"), a process it started is its "ray" part
    (a front's local Ray runs under it), this process is "benchmark"; the CPU a busy descendant burns
    shows up as its seconds."""
    from benchmarks.serving import cpu_snapshot

    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('done', flush=True)\n" \
           "import sys; sys.stdin.read()"
    script = tmp_path / "busy.py"
    script.write_text(busy)
    # the "service": a shell whose child burns 0.3 s of CPU, then waits on stdin (alive for the snapshot)
    svc = subprocess.Popen(["sh", "-c", f"{sys.executable} {script}; true"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert svc.stdout.readline().strip() == "done"
        snap = cpu_snapshot({svc.pid: ("svc", "target")})
        assert snap[svc.pid][:2] == ("svc", "process") and snap[svc.pid][3] > 0  # its start time
        children = [pid for pid, (owner, part, _, _) in snap.items() if (owner, part) == ("svc", "ray")]
        assert len(children) == 1 and snap[children[0]][2] >= 0.25
        assert snap[os.getpid()][:2] == ("benchmark", "")
    finally:
        svc.stdin.close()
        svc.wait(10)
        svc.stdout.close()
