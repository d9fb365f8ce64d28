"""``specdec trace-report``: each ``round`` span of OTLP JSON lines split into sequential phases (ms) that add up to
the round (docs/observability.md); writes ``trace_report.json``, ``trace_report.md`` and ``trace_report.png``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from orchestrator.measure import md_table

PHASES = ("draft_compute", "draft_wire", "verify_queue", "verify_compute", "verify_wire", "commit", "control")


class TraceFileError(ValueError):
    """An unreadable or malformed spans file; the message names the file and line."""


@dataclass(frozen=True)
class Span:
    """One span of the file: times in ns since the epoch, attributes as Python values."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


@dataclass(frozen=True)
class RoundPhases:
    """One round: its span's duration and its phases, ms; tree_nodes: nodes verified (0 = a plain round)."""

    request_id: str
    round: int
    round_ms: float
    phases: dict[str, float]
    tree_nodes: int = 0


_CASTS = {"intValue": int, "doubleValue": float, "stringValue": str, "boolValue": bool}  # int64 arrives as a string


def _value(any_value: dict):
    """The Python value of an OTLP JSON AnyValue (None: another kind)."""
    return next((_CASTS[key](value) for key, value in any_value.items() if key in _CASTS), None)


def _attributes(items: list) -> dict:
    return {a["key"]: _value(a.get("value", {})) for a in items or []}


def parse_otlp_json(text: str, source: str) -> list[Span]:
    """Spans of an OTLP JSON lines text; raises TraceFileError naming the line of a malformed document."""
    spans = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            document = json.loads(line)
            for resource_spans in document["resourceSpans"]:
                service = _attributes(resource_spans.get("resource", {}).get("attributes")).get("service.name", "?")
                for scope_spans in resource_spans.get("scopeSpans", []):
                    spans += [Span(s["traceId"], s["spanId"], s.get("parentSpanId", ""), s["name"], service,
                                   int(s["startTimeUnixNano"]), int(s["endTimeUnixNano"]), _attributes(s.get("attributes")))
                              for s in scope_spans.get("spans", [])]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise TraceFileError(f"{source}: line {n} is not an OTLP JSON traces document ({type(exc).__name__}: {exc})") from None
    return spans


def read_spans(paths: list[Path]) -> list[Span]:
    """Spans of every file; raises TraceFileError for a missing, unreadable or empty input."""
    spans = []
    for path in paths:
        if not path.is_file():
            raise TraceFileError(f"SPANS_FILE: no such file {path}")
        spans += parse_otlp_json(path.read_text(encoding="utf-8"), str(path))
    if not spans:
        raise TraceFileError(f"SPANS_FILE: no spans in {', '.join(map(str, paths))}")
    return spans


def _descendant(span: Span, children: dict[str, list[Span]], name: str) -> Span | None:
    """The first span called ``name`` under ``span`` (depth first), crossing process boundaries."""
    for child in children.get(span.span_id, []):
        if child.name == name:
            return child
        found = _descendant(child, children, name)
        if found is not None:
            return found
    return None


def round_phases(round_span: Span, children: dict[str, list[Span]]) -> RoundPhases:
    """Split one ``round`` span into PHASES (docs/observability.md), ms."""
    kids = {c.name: c for c in children.get(round_span.span_id, [])}
    phases = dict.fromkeys(PHASES, 0.0)
    draft, verify, commit = kids.get("draft"), kids.get("verify"), kids.get("commit")
    if draft is not None:
        phases["draft_compute"] = min(float(draft.attributes.get("draft.draft_ms", 0.0)), draft.ms)
        phases["draft_wire"] = draft.ms - phases["draft_compute"]
    if verify is not None:
        phases["verify_compute"] = min(float(verify.attributes.get("target.verify_ms", 0.0)), verify.ms)
        served = _descendant(verify, children, "target.verify")
        if served is not None:
            phases["verify_queue"] = min(float(served.attributes.get("specdec.queue_ms", 0.0)),
                                         verify.ms - phases["verify_compute"])
        phases["verify_wire"] = verify.ms - phases["verify_compute"] - phases["verify_queue"]
    if commit is not None:
        phases["commit"] = commit.ms
    phases["control"] = max(0.0, round_span.ms - sum(c.ms for c in (draft, verify, commit) if c is not None))
    request_id = str(round_span.attributes.get("request.id", round_span.trace_id))
    return RoundPhases(request_id, int(round_span.attributes.get("round", -1)), round_span.ms, phases,
                       int(round_span.attributes.get("tree.nodes", 0)))


def rounds_by_request(spans: list[Span]) -> dict[str, list[RoundPhases]]:
    """Every round span's phases, grouped by request id (rounds in order)."""
    children: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        children[s.parent_id].append(s)
    out: dict[str, list[RoundPhases]] = defaultdict(list)
    for s in spans:
        if s.name == "round" and s.service != "?":
            r = round_phases(s, children)
            out[r.request_id].append(r)
    return {rid: sorted(rs, key=lambda r: r.round) for rid, rs in out.items()}


def phase_stats(rounds: list[RoundPhases]) -> dict[str, dict[str, float]]:
    """Per phase: mean / p50 / p95 ms over the rounds and its share of the summed round time."""
    total = sum(r.round_ms for r in rounds)
    out = {}
    for phase in PHASES:
        values = np.array([r.phases[phase] for r in rounds])
        out[phase] = {"mean_ms": float(values.mean()), "p50_ms": float(np.percentile(values, 50)),
                      "p95_ms": float(np.percentile(values, 95)), "share": float(values.sum() / total) if total else 0.0}
    return out


def critical_path(rounds: list[RoundPhases]) -> dict:
    """A request's critical path (every phase of every round, all sequential): length, top phase, longest round."""
    totals = {p: sum(r.phases[p] for r in rounds) for p in PHASES}
    longest = max(rounds, key=lambda r: r.round_ms)
    return {"length_ms": sum(r.round_ms for r in rounds), "dominant_phase": max(totals, key=totals.get),
            "phase_ms": totals, "longest_round": longest.round, "longest_round_ms": longest.round_ms,
            "longest_round_phases": longest.phases}


def build_report(spans: list[Span]) -> dict:
    """The trace report document: overall and per-request phase statistics, critical paths, rounds."""
    by_request = rounds_by_request(spans)
    if not by_request:
        raise TraceFileError("SPANS_FILE: no orchestrator 'round' spans (was the front traced?)")
    every = [r for rs in by_request.values() for r in rs]
    return {"phases": list(PHASES), "requests_count": len(by_request), "rounds_count": len(every),
            "overall": phase_stats(every),
            "requests": [{"request_id": rid, "rounds_count": len(rs), "phases": phase_stats(rs),
                          "critical_path": critical_path(rs), "rounds": [asdict(r) for r in rs]}
                         for rid, rs in by_request.items()]}


def markdown(report: dict) -> str:
    """trace_report.md: the overall phase table, then one row per request."""
    phase_rows = [[p, f"{s['mean_ms']:.2f}", f"{s['p50_ms']:.2f}", f"{s['p95_ms']:.2f}", f"{s['share']:.1%}"]
                  for p, s in report["overall"].items()]
    request_rows = []
    for r in report["requests"]:
        path = r["critical_path"]
        dominant = path["dominant_phase"]
        request_rows.append([str(r["request_id"]), str(r["rounds_count"]), f"{path['length_ms']:.1f}",
                             f"{dominant} ({path['phase_ms'][dominant]:.1f} ms)",
                             f"{path['longest_round']} ({path['longest_round_ms']:.1f})"])
    return "\n".join([
        f"# specdec trace report ({report['requests_count']} requests, {report['rounds_count']} rounds)\n",
        "Phases of a round, in order; they add up to the round span (orchestrator/measure/trace_report.py).\n",
        "## All rounds\n",
        md_table(["phase", "mean ms", "p50 ms", "p95 ms", "share"], phase_rows),
        "## Per request (critical path: its rounds, one after another)\n",
        md_table(["request", "rounds", "critical path ms", "dominant phase", "longest round (ms)"], request_rows),
        "![phases](trace_report.png)\n"])


def figure(report: dict, path: Path) -> None:
    """Left: stacked phase bars per round of the longest request; right: each phase's distribution (ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    request = max(report["requests"], key=lambda r: r["rounds_count"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    bottom = np.zeros(request["rounds_count"])
    xs = [r["round"] for r in request["rounds"]]
    for phase in PHASES:
        values = np.array([r["phases"][phase] for r in request["rounds"]])
        left.bar(xs, values, bottom=bottom, label=phase)
        bottom += values
    left.set(title=f"request {request['request_id']}: phases per round", xlabel="round", ylabel="ms")
    left.legend(fontsize=7)
    every = [r for req in report["requests"] for r in req["rounds"]]
    right.boxplot([[r["phases"][p] for r in every] for p in PHASES], tick_labels=list(PHASES), showfliers=True)
    right.set(title=f"phase ms across {len(report['requests'])} requests", ylabel="ms")
    right.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_trace_report(paths: list[Path], out_dir: Path) -> dict:
    """Write trace_report.{json,md,png} under out_dir from the spans files; raises TraceFileError naming the file."""
    report = build_report(read_spans(paths))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "trace_report.json").write_text(json.dumps(report, indent=2))
    (out_dir / "trace_report.md").write_text(markdown(report))
    figure(report, out_dir / "trace_report.png")
    return report
