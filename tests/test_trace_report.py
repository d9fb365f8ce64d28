"""``specdec trace-report`` (orchestrator.measure.trace_report) on spans that a real three-process run (draft,
target and front, tiny models) wrote with the otlp_json_file exporter (specdec.telemetry); the
reader's errors; the exporter's OTLP JSON encoding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from orchestrator.measure.trace_report import PHASES, TraceFileError, parse_otlp_json
from specdec.harness.servers import launch_service, stop_service, wait_ready
from specdec.v1 import generation_pb2, generation_pb2_grpc
from specdec.harness.tiny_pair import save_tiny_pair, write_config

ROOT = Path(__file__).resolve().parents[1]


def _generate(address: str, request_id: str, prompt_ids: list[int], max_new_tokens: int):
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(request_id=request_id, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens)
        return [reply.stats for reply in stub.Generate(request, timeout=60) if reply.HasField("stats")][0]


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    """Three processes export to one spans file; two requests run; the services stop (their exporters
    flush). Returns (spans file, {request id: final stats})."""
    root = tmp_path_factory.mktemp("traced")
    pair = save_tiny_pair(root / "models", noise=0.03)
    config = write_config(root / "serve.yaml", pair, front={"port": 0, "cost_aware": {"enabled": False}})
    spans = root / "spans.jsonl"
    env = {"OTEL_TRACES_EXPORTER": "otlp_json_file", "SPECDEC_TRACES_FILE": str(spans), "OTEL_BSP_SCHEDULE_DELAY": "100"}
    draft = launch_service("draft", config, env={**env, "OTEL_SERVICE_NAME": "specdec-draft"})
    target = launch_service("target", config, env={**env, "OTEL_SERVICE_NAME": "specdec-target"})
    services = [draft, target]
    try:
        wait_ready(draft), wait_ready(target)
        front = wait_ready(launch_service("front", config, env={**env, "OTEL_SERVICE_NAME": "specdec-front"},
                                          draft_address=draft.address, target_address=target.address, no_ray=True))
        services.insert(0, front)
        stats = {"one": _generate(front.address, "one", [5, 6, 7, 8, 9], 20),
                 "two": _generate(front.address, "two", [11, 12, 13], 12)}
    finally:
        for service in services:
            stop_service(service)
    return spans, stats


def test_trace_report_covers_every_round_and_phases_add_up(traced_run, tmp_path):
    spans, stats = traced_run
    services = {s.service for s in parse_otlp_json(spans.read_text(), str(spans))}
    assert {"specdec-front", "specdec-draft", "specdec-target"} <= services
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "trace-report", str(spans), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "trace_report.json").read_text())
    requests = {r["request_id"].split("~")[0]: r for r in report["requests"]}
    assert set(requests) == {"one", "two"}
    for name, final in stats.items():
        request = requests[name]
        assert [r["round"] for r in request["rounds"]] == list(range(final.rounds))  # every round, once
        measured_ms = 0.0
        for r in request["rounds"]:
            phases = r["phases"]
            assert set(phases) == set(PHASES) and min(phases.values()) >= 0
            assert sum(phases.values()) == pytest.approx(r["round_ms"], rel=0.05)
            # the services' own figures reached every round: the draft's and target's compute, the batcher's wait
            assert phases["verify_compute"] > 0 and phases["verify_queue"] > 0
            assert (phases["draft_compute"] > 0) is (r["tree_nodes"] > 0)  # a plain round asks no draft
            measured_ms += r["round_ms"] - phases["control"]
        # the measured phases (all but the orchestrator's remainder) account for >= 95% of the rounds
        assert measured_ms >= 0.95 * sum(r["round_ms"] for r in request["rounds"])
        assert request["critical_path"]["dominant_phase"] in PHASES
    shares = [s["share"] for s in report["overall"].values()]
    assert sum(shares) == pytest.approx(1.0, abs=1e-6)
    png = (out / "trace_report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    md = (out / "trace_report.md").read_text()
    assert "verify_queue" in md and "| one~" in md


def test_exporter_writes_otlp_json_ids_in_hex(traced_run):
    spans, _ = traced_run
    first = json.loads(spans.read_text().splitlines()[0])
    span = first["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert len(span["traceId"]) == 32 and int(span["traceId"], 16) >= 0  # hex, not base64
    assert len(span["spanId"]) == 16 and isinstance(span["kind"], int)


def test_malformed_spans_file_names_the_line(tmp_path):
    with pytest.raises(TraceFileError, match="line 2"):
        parse_otlp_json('{"resourceSpans": []}\n{"resourceSpans": [{"scopeSpans": [{"spans": [{}]}]}]}\n', "x.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = subprocess.run([sys.executable, "-m", "orchestrator", "trace-report", str(empty), "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no spans" in proc.stderr
