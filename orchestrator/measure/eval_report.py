"""``specdec eval``: the SpeculativeReport of design note 004 (../shared/seeds), overall and per slice (category,
prompt length, output length, language): every question greedy, target-only and speculative, order alternating,
embedded or on a front (``--server``). Method: docs/observability.md.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import grpc
import numpy as np
from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.embedded import build_pipeline, encode_prompt
from orchestrator.measure.bench import _ratio, console, load_questions, method_figures
from specdec.config import FrontConfig
from specdec.v1 import generation_pb2, generation_pb2_grpc
from specdec.wire import spec_to_proto

PROMPT_BUCKETS = (128, 512)  # prompt tokens: <128, 128-512, >512
OUTPUT_BUCKETS = (32, 128)  # target-only new tokens: <32, 32-128, >128
DIMENSIONS = ("category", "promptLength", "outputLength", "language")
COMPARED_OUTPUTS = "greedy token ids, speculative vs target-only, per question"


class SpeculativeReport(BaseModel):
    """One slice's figures (camelCase JSON; the first nine fields are design note 004's SpeculativeReport).
    Units: ms, tokens/s, MB (10**6 bytes); ratios are speculative / target-only."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)

    task_set: str
    draft_model: str
    speculation_length: float | None  # None: the runner saw no tree depths (a remote front)
    acceptance_rate: float
    first_token_ms: float
    decode_tokens_per_second: float
    p95_latency_ms: float
    output_equivalent: bool
    peak_memory_mb: float | None  # None: no process's memory could be measured (a remote front without --service-pid)
    slice_dimension: str  # "overall" or one of DIMENSIONS
    slice_value: str
    questions: int
    output_equivalent_fraction: float
    compared_outputs: str
    target_only_first_token_ms: float
    target_only_decode_tokens_per_second: float
    target_only_p95_latency_ms: float
    speedup: float  # end-to-end tokens/s ratio
    decode_speedup: float
    first_token_ratio: float
    p95_latency_ratio: float
    mean_accepted_length: float  # tokens committed per round, bonus included
    acceptance_per_depth: list[float]
    peak_memory_by_process_mb: dict[str, float]
    peak_gpu_memory_mb: float | None  # torch.cuda.max_memory_allocated of this process; None without a GPU

    def to_json(self) -> dict:
        return self.model_dump(by_alias=True)


@dataclass(frozen=True)
class Run:
    """One greedy generation; rounds: (tree depth, accepted) per round, None from a remote front."""

    tokens: list[int]
    ttft_ms: float
    total_s: float
    rounds: list[tuple[int, int]] | None = field(default_factory=list)
    proposed: int = 0  # draft tokens (tree nodes) verified
    accepted: int = 0  # draft tokens committed
    rounds_count: int | None = None  # None = len(rounds)

    @property
    def round_count(self) -> int:
        return self.rounds_count if self.rounds_count is not None else len(self.rounds or [])

    def figures(self) -> dict:  # the row bench.method_figures aggregates
        return {"new_tokens": len(self.tokens), "s": self.total_s, "ttft_ms": self.ttft_ms}


@dataclass(frozen=True)
class QuestionRun:  # both runs of one question and its slice keys
    question_id: object
    category: str
    language: str
    prompt_tokens: int
    target: Run
    speculative: Run
    peak_memory_mb: dict[str, float]  # per process, after this question's runs

    def slice_value(self, dimension: str) -> str:
        return {"category": self.category, "language": self.language,
                "promptLength": length_bucket(self.prompt_tokens, PROMPT_BUCKETS),
                "outputLength": length_bucket(len(self.target.tokens), OUTPUT_BUCKETS)}[dimension]


class Runner(Protocol):  # runs one prompt greedily; ``speculate`` False = the target alone
    def prompt_tokens(self, prompt: str) -> int: ...

    def run(self, prompt: str, speculate: bool) -> Run: ...

    def peak_memory_mb(self) -> dict[str, float]: ...


def length_bucket(n: int, edges: tuple[int, int]) -> str:
    """'<lo', 'lo-hi' or '>hi' for n tokens (lo <= n <= hi is the middle bucket)."""
    lo, hi = edges
    return f"<{lo}" if n < lo else f">{hi}" if n > hi else f"{lo}-{hi}"


def peak_rss_mb(pid: int | None = None) -> float:
    """Peak RSS of a process (None = this one), MB (10**6 bytes); ValueError (naming the pid) if unreadable."""
    target = os.getpid() if pid is None else pid
    try:
        for line in Path(f"/proc/{target}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6  # kB (KiB)
    except OSError:
        pass
    if target == os.getpid():
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return maxrss / 1e6 if sys.platform == "darwin" else maxrss * 1024 / 1e6  # bytes on macOS, KiB elsewhere
    raise ValueError(f"--service-pid {target}: cannot read its peak memory (no /proc/{target}/status)")


def peak_gpu_memory_mb() -> float | None:
    """Peak GPU memory allocated by torch in this process, MB (10**6 bytes); None without CUDA."""
    import torch

    return torch.cuda.max_memory_allocated() / 1e6 if torch.cuda.is_available() else None


class EmbeddedRunner:  # both runs on the in-process engine of an EmbeddedPipeline
    def __init__(self, pipe, spec, max_new_tokens: int):
        self.pipe, self.spec, self.max_new_tokens = pipe, spec, max_new_tokens

    def _ids(self, prompt: str) -> list[int]:
        return encode_prompt(self.pipe.tokenizer, prompt, raw=False)

    def prompt_tokens(self, prompt: str) -> int:
        return len(self._ids(prompt))

    def run(self, prompt: str, speculate: bool) -> Run:
        rounds: list[tuple[int, int]] = []
        request = GenerationRequest(self._ids(prompt), self.max_new_tokens, spec=self.spec if speculate else None)
        controller = self.pipe.engine.controller
        controller.on_round = lambda record: rounds.append((record.depth, record.accepted))
        try:
            result = self.pipe.engine.generate(request)
        finally:
            controller.on_round = None
        s = result.stats
        return Run(list(result.tokens), s.ttft_ms, s.total_s, rounds, s.proposed_tokens, s.accepted_tokens)

    def peak_memory_mb(self) -> dict[str, float]:
        return {f"embedded (pid {os.getpid()})": peak_rss_mb()}


class RemoteRunner:
    """Both runs on a front at ``address``, timed here; ``service_pids``: processes whose memory to report."""

    def __init__(self, address: str, spec, max_new_tokens: int, service_pids: tuple[int, ...] = ()):
        self.address, self.spec, self.max_new_tokens, self.service_pids = address, spec, max_new_tokens, service_pids
        self._prompt_tokens: dict[str, int] = {}

    def prompt_tokens(self, prompt: str) -> int:
        return self._prompt_tokens[prompt]  # the front's count, from the target-only run (runs first)

    def run(self, prompt: str, speculate: bool) -> Run:
        request = generation_pb2.GenerateRequest(prompt=prompt, max_new_tokens=self.max_new_tokens, no_spec=not speculate)
        if speculate and self.spec is not None:
            request.tree.CopyFrom(spec_to_proto(self.spec))
        tokens, first, final = [], None, None
        start = time.perf_counter()
        try:
            with grpc.insecure_channel(self.address) as channel:
                for reply in generation_pb2_grpc.GenerationServiceStub(channel).Generate(request):
                    if reply.token_ids and first is None:
                        first = time.perf_counter()
                    tokens += reply.token_ids
                    final = reply.stats if reply.HasField("stats") else final
        except grpc.RpcError as exc:
            raise ValueError(f"--server {self.address}: {exc.code().name}: {exc.details()}") from None
        total_s = time.perf_counter() - start
        if final is None:
            raise ValueError(f"--server {self.address}: the stream ended without final statistics")
        self._prompt_tokens[prompt] = final.prompt_tokens
        ttft_ms = ((first or start + total_s) - start) * 1000
        # the front streams no tree depths: per-depth acceptance and speculation length need an embedded run
        return Run(tokens, ttft_ms, total_s, None, final.proposed_tokens, final.accepted_tokens, final.rounds)

    def peak_memory_mb(self) -> dict[str, float]:
        return {f"service (pid {pid})": peak_rss_mb(pid) for pid in self.service_pids}


def run_questions(runner: Runner, questions: list[dict], context_limit: int | None = None,
                  max_new_tokens: int = 0) -> tuple[list[QuestionRun], list]:
    """Both runs of every question (order alternating); returns the runs and the ids skipped as too long."""
    import py3langid  # the language slice: ISO 639 codes ('en', 'zh')

    runner.run("Say hi.", speculate=True)  # warm-up, not recorded
    out, skipped = [], []
    for i, q in enumerate(questions):
        prompt = q["turns"][0]
        if context_limit is not None and runner.prompt_tokens(prompt) + max_new_tokens > context_limit:
            skipped.append(q["question_id"])
            continue
        first_target = i % 2 == 0
        first = runner.run(prompt, speculate=not first_target)
        second = runner.run(prompt, speculate=first_target)
        target, speculative = (first, second) if first_target else (second, first)
        out.append(QuestionRun(q["question_id"], q["category"], py3langid.classify(prompt)[0],
                               runner.prompt_tokens(prompt), target, speculative, runner.peak_memory_mb()))
        console.print(f"eval {i + 1}/{len(questions)}: {q['category']} #{q['question_id']}", highlight=False, markup=False)
    return out, skipped


def acceptance_per_depth(runs: list[Run]) -> list[float]:
    """[D] accepted draft tokens at depth d / rounds whose tree reached depth d, d = 1..max depth."""
    rounds = [r for run in runs for r in run.rounds or []]
    deepest = max((depth for depth, _ in rounds), default=0)
    return [_ratio(sum(acc >= d for depth, acc in rounds if depth >= d), sum(depth >= d for depth, _ in rounds))
            for d in range(1, deepest + 1)]


def summarize_slice(runs: list[QuestionRun], dimension: str, value: str, task_set: str, draft_model: str) -> SpeculativeReport:
    """The SpeculativeReport of the questions ``runs`` (at least one)."""
    spec = [r.speculative for r in runs]
    target = [r.target for r in runs]
    fs, ft = method_figures([s.figures() for s in spec]), method_figures([t.figures() for t in target])
    p95 = float(np.percentile([s.total_s * 1000 for s in spec], 95))
    p95_target = float(np.percentile([t.total_s * 1000 for t in target], 95))
    equal = [r.speculative.tokens == r.target.tokens for r in runs]
    seen = all(s.rounds is not None for s in spec)
    depths = [depth for s in spec for depth, _ in s.rounds or []]
    by_process: dict[str, float] = {}
    for r in runs:
        for name, mb in r.peak_memory_mb.items():
            by_process[name] = max(by_process.get(name, 0.0), mb)
    return SpeculativeReport(  # ratios: speculative / target-only
        task_set=task_set, draft_model=draft_model,
        speculation_length=(float(np.mean(depths)) if depths else 0.0) if seen else None,
        acceptance_rate=_ratio(sum(s.accepted for s in spec), sum(s.proposed for s in spec)),
        first_token_ms=fs["ttft_ms"], decode_tokens_per_second=fs["decode_tokens_per_s"], p95_latency_ms=p95,
        output_equivalent=all(equal), peak_memory_mb=sum(by_process.values()) if by_process else None,
        slice_dimension=dimension, slice_value=value, questions=len(runs),
        output_equivalent_fraction=sum(equal) / len(equal), compared_outputs=COMPARED_OUTPUTS,
        target_only_first_token_ms=ft["ttft_ms"], target_only_decode_tokens_per_second=ft["decode_tokens_per_s"],
        target_only_p95_latency_ms=p95_target, speedup=_ratio(fs["tokens_per_s"], ft["tokens_per_s"]),
        decode_speedup=_ratio(fs["decode_tokens_per_s"], ft["decode_tokens_per_s"]),
        first_token_ratio=_ratio(fs["ttft_ms"], ft["ttft_ms"]), p95_latency_ratio=_ratio(p95, p95_target),
        mean_accepted_length=_ratio(sum(len(s.tokens) for s in spec), sum(s.round_count for s in spec)),
        acceptance_per_depth=acceptance_per_depth(spec), peak_memory_by_process_mb=by_process,
        peak_gpu_memory_mb=peak_gpu_memory_mb())


def build_reports(runs: list[QuestionRun], task_set: str, draft_model: str) -> list[SpeculativeReport]:
    """The overall report, then one per slice of each dimension (DIMENSIONS order, values sorted)."""
    reports = [summarize_slice(runs, "overall", "all", task_set, draft_model)]
    for dimension in DIMENSIONS:
        groups: dict[str, list[QuestionRun]] = defaultdict(list)
        for r in runs:
            groups[r.slice_value(dimension)].append(r)
        reports += [summarize_slice(groups[v], dimension, v, task_set, draft_model) for v in sorted(groups)]
    return reports


def write_report(runs: list[QuestionRun], meta: dict, out_dir: Path) -> list[SpeculativeReport]:
    """report.json, report.md and the figures under out_dir; returns the reports (overall first)."""
    from orchestrator.measure.eval_figures import markdown_report, write_figures  # matplotlib: the [eval] extra

    if not runs:
        raise ValueError(f"--max-new-tokens {meta.get('max_new_tokens')}: no selected question fits in the context")
    reports = build_reports(runs, meta["task_set"], meta["draft_model"])
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [{**{k: v for k, v in asdict(r).items() if k not in ("target", "speculative")},
             "slices": {d: r.slice_value(d) for d in DIMENSIONS},
             "target_only": _run_row(r.target), "speculative": _run_row(r.speculative)} for r in runs]
    document = {"meta": meta, "overall": reports[0].to_json(), "slices": [r.to_json() for r in reports[1:]],
                "questions": rows}
    (out_dir / "report.json").write_text(json.dumps(document, indent=2, ensure_ascii=False))
    figures = write_figures(reports, out_dir)
    (out_dir / "report.md").write_text(markdown_report(reports, meta, figures))
    return reports


def _run_row(run: Run) -> dict:
    return {"new_tokens": len(run.tokens), "ttft_ms": run.ttft_ms, "total_s": run.total_s, "rounds": run.round_count,
            "proposed": run.proposed, "accepted": run.accepted}


def run_eval(spec, questions_path: Path | None, per_category: int, max_new_tokens: int, out_dir: Path, *,
             target: str | None = None, draft: str | None = None, dtype: str = "auto", draft_quant: str = "auto",
             control: str = "cost-aware", server: str | None = None, service_pids: tuple[int, ...] = (),
             make_runner: Callable | None = None, device: str = "cpu",
             draft_device: str | None = None) -> list[SpeculativeReport]:
    """Run the evaluation (on ``server``, else on the pair loaded here) and write the report under out_dir;
    returns the reports, overall first. Raises QuestionsError / ModelError / ValueError naming the option."""
    questions = load_questions(questions_path, per_category)  # bad files fail before the models load
    if server is not None:
        runner, context_limit = RemoteRunner(server, spec, max_new_tokens, service_pids=service_pids), None
        draft_model = draft or f"the draft of the front at {server}"
    else:
        pipe = build_pipeline(target, draft, dtype=dtype, device=device, draft_quant=draft_quant, control=control,
                              draft_device=draft_device)
        runner, context_limit = EmbeddedRunner(pipe, spec, max_new_tokens), pipe.engine.context_limit
        draft_model = draft or "qwen2.5-coder-0.5b-instruct (default)"
    runner = make_runner(runner) if make_runner else runner
    runs, skipped = run_questions(runner, questions, context_limit, max_new_tokens)
    meta = {"task_set": "built-in" if questions_path is None else str(questions_path), "per_category": per_category,
            "max_new_tokens": max_new_tokens, "draft_model": draft_model, "target": target, "server": server,
            "dtype": dtype, "draft_quant": draft_quant, "control": None if server else control,
            "draft_window": None if server else FrontConfig().draft_window.model_dump(),  # build_pipeline's default
            "spec": json.loads(spec.to_json()) if spec is not None else None, "skipped": skipped,
            "compared_outputs": COMPARED_OUTPUTS, "prompt_buckets": PROMPT_BUCKETS, "output_buckets": OUTPUT_BUCKETS,
            "language_id": "py3langid"}
    return write_report(runs, meta, out_dir)
