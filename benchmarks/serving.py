"""Serving benchmark on one model pair: gRPC vs embedded (issue 4), concurrency (issue 5), dynamic vs
fixed gamma (issue 5). One run, side by side, so the figures are ratios taken under the same noise.

    python benchmarks/serving.py                                   # the real pair, all sections
    python benchmarks/serving.py --sections grpc --prompts 4 --max-new-tokens 32
    python benchmarks/serving.py --target /tmp/tiny/target --draft /tmp/tiny/draft --prompts 2 \
        --max-new-tokens 6 --levels 1,2 --out /tmp/serving            # smoke run on tiny models

Writes ``serving.json`` and ``serving.md`` (same figures) under ``--out`` (default bench_out/serving/).

Sections (``--sections grpc,concurrency,gamma,longprompt``):

- ``grpc``: the same ``--prompts`` first turns of the built-in prompt set (or ``--questions`` FILE,
  a Spec-Bench question.jsonl; chat template applied here, sent as ``prompt_ids`` so every mode
  gets identical ids), greedy, the fixed tree DEFAULT_SPEC (dynamic
  gamma off), run (a) embedded in this process (the controller over in-process runtimes), (b) over
  gRPC through a front without Ray and (c) through a front on Ray; modes interleaved per prompt, the
  order rotated. Reports tokens/s (end to end and after the first round), whether the outputs are
  identical, bytes per serialized tree (``tree.bytes`` of the front's verify spans; computed with
  ``specdec.wire.tree_to_proto`` in embedded mode) and the per-round time split from the traces
  (OTLP to a receiver in this process; embedded spans from an in-memory exporter): ``round``,
  ``draft``, ``verify``, ``commit`` spans of the orchestrator and the services' own ``draft_ms`` /
  ``verify_ms``; transfer = round - draft_ms - verify_ms (so it holds the commit calls too; their
  share is shown apart). The target here has ``max_batch: 1`` so a lone verify never waits for
  company (the batched target's wait shows in the concurrency section).
- ``concurrency``: 1, 4, 8 (``--levels``) closed-loop clients over one grpc.aio channel, started
  together, sharing ``--concurrency-prompts`` requests of ``--max-new-tokens``; three
  configurations through Ray fronts: batched verification (target ``max_batch`` ``--max-batch``,
  ``batch_wait_ms`` ``--batch-wait-ms``), one verify at a time (``max_batch: 1``) and target only
  (``no_spec`` requests, on the batched target). Throughput = generated tokens / wall time of the
  level; latency = a request's time from send to its final message (p50, p95; with 8 requests
  p95 is close to the slowest). Levels run in turn, the configurations interleaved inside a level.
  ``--skip-one-at-a-time`` leaves the second configuration out, so only one target service runs
  (two float32 1.5B targets do not fit beside each other in 24 GiB).
- ``gamma``: dynamic vs fixed gamma on ``--gamma-categories`` (``--gamma-prompts`` each), embedded
  mode with the front's control policy (``RequestControl`` with ``front.dynamic_gamma.enabled``
  true / false, default fallback policy), interleaved per prompt.

- ``longprompt`` (issue 12): does a long prompt's prefill stall the requests already decoding?
  ``--long-running`` (4) speculative requests of ``--long-running-tokens`` (1024, ``ignore_eos``, so
  they keep generating) stream; once each has its first token, a window of ``--long-window-s`` (10 s)
  measures their inter-token latency (before); then one request whose prompt is
  ``--long-prompt-tokens`` (2000) ids (the built-in prompts' text concatenated, repeated and cut;
  deterministic) is sent, and their inter-token latency is measured again while it prefills, until
  its first token (during). ITL is per token: the gap between two consecutive streamed chunks of a
  request divided by the tokens in the later chunk, counted once per token of that chunk; a gap
  belongs to the window its closing chunk arrives in, and the during window also takes each running
  request's first chunk after the long request's first token (the gap the prefill held open). Rows:
  p50 / p95 ITL before vs during and the p95 ratio, the largest gap, the long request's TTFT, the
  target's ``prefill_chunk_tokens`` (``--prefill-chunk-tokens``) and ``prefill_busy_chunk_tokens``
  (``--prefill-busy-chunk-tokens``: the chunks that ride in the running requests' verify forwards),
  both by default the config defaults.
  ``--longprompt-configs`` (default ``speculative``; also ``speculative_pipelined`` (needs
  ``--pipeline``'s front key) and ``target_only``: every request ``no_spec``) picks the rows;
  ``--longprompt-unchunked`` adds each again on a target whose ``prefill_chunk_tokens`` and
  ``prefill_busy_chunk_tokens`` hold the whole long prompt (one prefill forward: chunking off). One target service runs at a time here
  (started and stopped per chunk setting; the concurrency section's are stopped first).

Flags of issue 12:

- ``--pin``: every draft and target service runs under ``taskset -c`` (util-linux; a clear error
  where it is missing or fewer than 2 CPUs are usable): the target on core 0, the draft on core 1,
  each with 1 torch thread (``models.threads: 1``; ``--target-threads`` / ``--draft-threads`` are
  set to 1), as if they were separate devices. The target-only rows use that same target (core 0,
  1 thread), so ratios compare like with like. Fronts and their Ray actors are not pinned (both
  cores; the orchestrator's own work is small). The embedded mode of the grpc and gamma sections
  runs in this process, unpinned, with the same thread counts. JSON ``meta.pinning``: ``pinned``,
  the cores per service kind and the affinity each service process actually had
  (``os.sched_getaffinity`` of its pid once ready).
- ``--pipeline``: the concurrency section gains a configuration ``speculative_pipelined``: a Ray
  front with ``front.pipeline: true`` (draft/verify pipelining) on the batched target. Its rows show
  the front's ``pipeline_ahead_hits`` / ``pipeline_ahead_misses`` where its final stats carry them
  ("-" otherwise). The key is only set with the flag; a ``specdec.config.FrontConfig`` without a
  ``pipeline`` field makes the flag an error.
- ``--in-step``: the concurrency section gains a configuration ``batched_in_step``: a Ray front with
  the in-step rule (on shared compute every request follows the batch's plan, drafting or not
  together) at every load (``front.cost_aware.in_step_max_load: 64``) on the batched target, where
  the default applies it below 8.5 sessions per verify forward only (2.5 until 2026-12-05): the A/B of
  the load cap in one run, which now differs from the default above 8 clients only.
- ``--front-variant NAME=JSON`` (repeatable): the concurrency section gains a configuration NAME: a
  Ray front on the batched target whose ``front`` config has JSON merged in (an A/B of a front
  setting in one run, e.g. ``no_ctx={"cost_aware": {"ngram_tokens": 0}}``).
- ``--target-only-variant NAME=JSON`` (repeatable): the same for ``no_spec`` requests (as
  ``target_only``, whose front has the defaults): an A/B of a front setting for plain decoding.
- ``--mixed-variant NAME=JSON`` (repeatable): mixed traffic on such a front: of each level's
  requests, the even-numbered are ``no_spec`` and the others speculate, side by side on one front.
  Its rows add each kind's p50 / p95 latency (``no_spec_latency_*``, ``spec_latency_*``) and the
  ``no_spec`` requests' p95 against target_only's (all requests ``no_spec``) in the same level run:
  what plain requests pay for sharing rounds with speculating ones (``mixed={}``: the defaults).
- ``--open-loop``: the concurrency section's ``--levels`` are request rates (requests per second,
  e.g. ``0.5,1``) instead of clients: request i is sent at i / rate seconds whether or not the
  earlier ones have finished (vLLM's ``benchmark_serving`` with a fixed, not Poisson, schedule), so
  a level's requests do not start in waves and finish in waves as closed-loop clients with fixed
  output lengths make them; throughput = generated tokens / (last finish - first send). The rows'
  ``clients`` field holds the rate.
- ``--round-log``: each concurrency row (target_only too) gets ``round_split`` (mean ms per phase) and
  ``round_log`` (every round: start, wall, draft and verify ms, the services' own ms and batch sizes,
  gamma, nodes, accepted length, fallback) from the traces, in the JSON.
- ``--batch-gather F``: ``draft.batch_gather`` and ``target.batch_gather`` of every service.
- ``--levels 1,4,8,16``: ``--concurrency-prompts`` defaults to the larger of ``--prompts`` and the
  largest level (so every client has a request), and the fronts' ``limits.max_running`` is set to
  admit every level's and the longprompt section's streams at once.

Threads: the target runs ``--target-threads`` torch threads and the draft ``--draft-threads`` in
every mode (services via ``models.threads``; embedded mode switches torch's thread count around
each draft call), so that the processes do not oversubscribe a 2-core CPU. Tracing is on in every
mode (the services export OTLP spans; the Ray actors export each span as it ends).

CPU: each concurrency row's ``cpu_s`` holds the CPU seconds every process on the machine spent over
the level (psutil; user + system), by role: the target and draft services, the row's own front
process and its local Ray (raylet, GCS, the orchestrator actors), the other fronts (idle, their Ray
daemons), this benchmark process (clients, OTLP receiver) and the rest; ``cpu_busy_share`` is their
sum over the level's time x the CPUs this process may use (its affinity). On shared cores it shows
what the services' plumbing takes from the forwards.

Memory: with the real pair (float32 target ~6 GB, int8 draft) the grpc/gamma phase holds the
embedded pair plus a target and a draft service; the concurrency phase two target services. The
concurrency services start early (overlapping start-up) only when they all fit in MemAvailable.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import gc
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import psutil  # noqa: E402
import yaml  # noqa: E402

from specdec.harness.otlp import OtlpReceiver, attribute_value  # noqa: E402
from specdec.harness.servers import (Service, launch_command, launch_service, server_command,  # noqa: E402
                                     stop_service)
from specdec.placement import cpu_model  # noqa: E402
from orchestrator.measure.eval_report import peak_rss_mb  # noqa: E402

SECTIONS = ("grpc", "concurrency", "gamma", "longprompt")
LONGPROMPT_CONFIGS = ("speculative", "speculative_pipelined", "target_only")
PIN_CORES = {"target": "0", "draft": "1"}  # --pin: taskset -c cores per service kind (fronts unpinned)
PIPELINE_STATS = ("pipeline_ahead_hits", "pipeline_ahead_misses")  # FinalStats fields, where the front has them
BF16_NOTE = ("The issues asked for bf16; on a CPU `models.dtype: auto` resolves to float32 (faster than bf16 for "
             "tree verification on both CPUs measured, and exact), which is what is measured.")


def log(msg: str) -> None:
    print(f"[serving {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------- prompts

def load_prompts(path: Path | None, tokenizer, max_prompt_tokens: int) -> list[dict]:
    """Every question's first turn with its token ids (chat template), if within max_prompt_tokens.
    path: a Spec-Bench question.jsonl; None = the built-in prompt set (orchestrator/measure/data/prompts.jsonl)."""
    from orchestrator.measure.bench import BUILTIN_QUESTIONS
    from orchestrator.loop.embedded import encode_prompt

    out = []
    for line in (BUILTIN_QUESTIONS if path is None else path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        q = json.loads(line)
        ids = encode_prompt(tokenizer, q["turns"][0], raw=False)
        if len(ids) <= max_prompt_tokens:
            out.append({"question_id": q["question_id"], "category": q["category"], "ids": ids})
    return out


def spread(prompts: list[dict], n: int) -> list[dict]:
    """n prompts round-robin over the categories (file order), so every category is represented."""
    by_cat: dict[str, list] = defaultdict(list)
    for p in prompts:
        by_cat[p["category"]].append(p)
    out, i = [], 0
    while len(out) < n and any(i < len(v) for v in by_cat.values()):
        out += [v[i] for v in by_cat.values() if i < len(v)][: n - len(out)]
        i += 1
    return out


# ----------------------------------------------------------------------------------------- traces

@dataclass
class Span:
    service: str
    name: str
    span_id: str
    parent_id: str
    attributes: dict
    ms: float
    start_ns: int = 0  # wall clock (time.time_ns), comparable across the processes of this machine
    end_ns: int = 0


class SpanCollector(OtlpReceiver):
    """specdec.harness.otlp.OtlpReceiver that also keeps each span's duration and start / end times."""

    def keep(self, service: str, span) -> Span:
        return Span(service, span.name, span.span_id.hex(), span.parent_span_id.hex(),
                    {a.key: attribute_value(a.value) for a in span.attributes},
                    (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6,
                    span.start_time_unix_nano, span.end_time_unix_nano)


def install_memory_tracing():
    """In-process tracer provider with an in-memory exporter (embedded mode's controller spans)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


def memory_spans(exporter) -> list[Span]:
    return [Span("embedded", s.name, format(s.context.span_id, "016x"), format(s.parent.span_id, "016x") if s.parent else "",
                 dict(s.attributes or {}), (s.end_time - s.start_time) / 1e6) for s in exporter.get_finished_spans()]


def request_rounds(spans: list[Span], request_ids: set[str]) -> dict[str, list[Span]]:
    """The ``round`` spans of each request: its ``request.id`` attribute is the request id, or the
    request id + "/suffix" (session ids derived from it), or its parent is the request's ``generate`` span."""
    generate = {s.span_id: s.attributes.get("request.id") for s in spans if s.name == "generate"}
    out: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        if s.name != "round":
            continue
        rid = str(s.attributes.get("request.id", ""))
        for key in (rid, rid.split("/")[0], generate.get(s.parent_id)):
            if key in request_ids:
                out[key].append(s)
                break
    return out


def round_children(spans: list[Span], request_ids: set[str], names: tuple[str, ...]) -> list[tuple[Span, dict[str, Span]]]:
    """The ``round`` spans of these requests, each with its children named in ``names`` (name -> span)."""
    rounds = [s for group in request_rounds(spans, request_ids).values() for s in group]
    ids = {s.span_id for s in rounds}
    children: dict[str, dict[str, Span]] = defaultdict(dict)
    for s in spans:
        if s.parent_id in ids and s.name in names:
            children[s.parent_id][s.name] = s
    return [(r, children[r.span_id]) for r in rounds]


def round_log(spans: list[Span], request_ids: set[str]) -> list[dict]:
    """One compact row per round of these requests, in start order (the concurrency rows'
    ``round_log``): request, start (s, from the first round's), round / draft / verify wall ms, the
    services' own ms and batch sizes (``draft.*`` / ``target.*`` attributes), gamma, verified nodes,
    drafted nodes, accepted length and fallback reason."""
    rounds = sorted(round_children(spans, request_ids, ("draft", "verify")), key=lambda rk: rk[0].start_ns)
    t0 = rounds[0][0].start_ns if rounds else 0
    out = []
    for r, kids in rounds:
        draft, verify = kids.get("draft"), kids.get("verify")
        out.append({"request": str(r.attributes.get("request.id", "")).split("/")[0],
                    "t_s": round((r.start_ns - t0) / 1e9, 3), "round_ms": round(r.ms, 1),
                    "draft_ms": round(draft.ms, 1) if draft else None,
                    "draft_server_ms": draft.attributes.get("draft.draft_ms") if draft else None,
                    "draft_batch": draft.attributes.get("draft.batch_size") if draft else None,
                    "verify_ms": round(verify.ms, 1) if verify else None,
                    "verify_server_ms": verify.attributes.get("target.verify_ms") if verify else None,
                    "verify_batch": verify.attributes.get("target.batch_size") if verify else None,
                    "gamma": r.attributes.get("gamma"), "nodes": r.attributes.get("tree.nodes"),
                    "drafted": r.attributes.get("tree.drafted"), "accepted": r.attributes.get("accepted_length"),
                    "fallback": r.attributes.get("fallback.reason")})
    return out


def round_split(spans: list[Span], request_ids: set[str]) -> dict:
    """Mean ms per phase over the round spans of these requests (and their children)."""
    rounds = round_children(spans, request_ids, ("draft", "verify", "commit"))
    rows = defaultdict(list)
    tree_bytes = []
    for r, kids in rounds:
        draft, verify, commit = kids.get("draft"), kids.get("verify"), kids.get("commit")
        draft_ms = verify_ms = None
        rows["round"].append(r.ms)
        rows["draft"].append(draft.ms if draft else 0.0)
        rows["verify"].append(verify.ms if verify else 0.0)
        rows["commit"].append(commit.ms if commit else 0.0)
        if draft is not None:
            draft_ms = draft.attributes.get("draft.draft_ms", draft.ms)  # embedded: the call itself
        if verify is not None:
            verify_ms = verify.attributes.get("target.verify_ms", verify.ms)
            if r.attributes.get("tree.nodes", 0) and "tree.bytes" in verify.attributes:
                tree_bytes.append(verify.attributes["tree.bytes"])
        rows["draft_server"].append(draft_ms or 0.0)
        rows["verify_server"].append(verify_ms or 0.0)
        rows["transfer"].append(r.ms - (draft_ms or 0.0) - (verify_ms or 0.0))
        rows["other"].append(r.ms - rows["draft"][-1] - rows["verify"][-1] - rows["commit"][-1])
    out = {"rounds": len(rounds)}
    for key, values in rows.items():
        out[f"{key}_ms"] = sum(values) / len(values) if values else 0.0
    out["draft_wire_ms"] = out.get("draft_ms", 0.0) - out.get("draft_server_ms", 0.0)
    out["verify_wire_ms"] = out.get("verify_ms", 0.0) - out.get("verify_server_ms", 0.0)
    if tree_bytes:
        out["tree_bytes_mean"] = sum(tree_bytes) / len(tree_bytes)
        out["tree_bytes_max"] = max(tree_bytes)
    return out


def wait_for_rounds(collector: SpanCollector, expected: dict[str, int], timeout_s: float = 30.0) -> bool:
    """Wait until each request's ``round`` spans (expected: request id -> rounds) have arrived; False
    (and a warning naming what is missing) after timeout_s."""
    deadline = time.monotonic() + timeout_s
    got: dict[str, int] = {}
    while time.monotonic() < deadline:
        got = {k: len(v) for k, v in request_rounds(collector.spans(), set(expected)).items()}
        if all(got.get(k, 0) >= v for k, v in expected.items()):
            return True
        time.sleep(0.3)
    seen = defaultdict(int)
    for s in collector.spans():
        seen[(s.service, s.name)] += 1
    log(f"warning: round spans missing after {timeout_s:.0f} s (got {dict(got)}, expected {expected}); spans seen: {dict(seen)}")
    return False


def pipeline_overlap(spans: list[Span], request_ids: set[str]) -> dict:
    """Draft/verify pipelining read from the traces of these requests (issue 12: in rounds whose guess
    was right, the critical path holds no draft time).

    Round r's ``draft.ahead`` span (round r+1's tree, drafted beside round r's verify) is set against
    round r's ``verify`` span. ``aheads`` counts every ahead (failed ones too), ``hits`` those whose
    guess was right (round attribute ``ahead.outcome``). Over the hits: ``hit_ahead_ms_mean`` = an
    ahead's own time; ``hidden_share`` = their time inside their verify span / their whole time;
    ``wait_ms_mean`` = how long after its verify ended an ahead still ran (an upper bound on what the
    round waited for it: the round awaits the ahead after the target's commit). Round r+1, whose tree
    was adopted (``pipelined``), runs no draft call: ``adopted_with_draft_span`` counts those that
    still have a ``draft`` child (0 expected); ``adopted_round_ms_mean`` / ``drafted_round_ms_mean``
    are the mean round times of adopted rounds and of rounds that drafted in line (whose mean
    ``draft`` span is ``drafted_draft_ms_mean``). All times ms.
    """
    rounds = round_children(spans, request_ids, ("draft", "verify", "draft.ahead"))
    aheads = 0
    ahead_ns = hidden_ns = 0
    hit_ms, waits, adopted_ms, drafted_ms, drafted_draft = [], [], [], [], []
    adopted_with_draft = 0
    for r, kids in rounds:
        ahead, verify, draft = kids.get("draft.ahead"), kids.get("verify"), kids.get("draft")
        if ahead is not None and verify is not None:
            aheads += 1
            if r.attributes.get("ahead.outcome") == "hit":
                hit_ms.append(ahead.ms)
                ahead_ns += ahead.end_ns - ahead.start_ns
                hidden_ns += max(0, min(ahead.end_ns, verify.end_ns) - max(ahead.start_ns, verify.start_ns))
                waits.append(max(0, ahead.end_ns - verify.end_ns) / 1e6)
        if r.attributes.get("pipelined"):
            adopted_ms.append(r.ms)
            adopted_with_draft += draft is not None
        elif draft is not None:
            drafted_ms.append(r.ms)
            drafted_draft.append(draft.ms)

    def mean(values):
        return sum(values) / len(values) if values else None

    return {"rounds": len(rounds), "aheads": aheads, "hits": len(hit_ms), "hit_ahead_ms_mean": mean(hit_ms),
            "hidden_share": hidden_ns / ahead_ns if ahead_ns else None, "wait_ms_mean": mean(waits),
            "adopted_rounds": len(adopted_ms), "adopted_with_draft_span": adopted_with_draft,
            "adopted_round_ms_mean": mean(adopted_ms), "drafted_rounds": len(drafted_ms),
            "drafted_round_ms_mean": mean(drafted_ms), "drafted_draft_ms_mean": mean(drafted_draft)}


# ----------------------------------------------------------------------------------------- embedded

class ThreadScoped:
    """An in-process worker whose calls run with ``threads`` torch threads (restored afterwards);
    ``on_tree`` sees every proposed DraftTree."""

    def __init__(self, worker, threads: int | None, on_tree=None):
        self._worker, self._threads, self._on_tree = worker, threads, on_tree

    def __getattr__(self, name):
        import torch

        attr = getattr(self._worker, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            prev = torch.get_num_threads()
            switch = bool(self._threads) and prev != self._threads
            if switch:
                torch.set_num_threads(self._threads)
            try:
                out = attr(*args, **kwargs)
            finally:
                if switch:
                    torch.set_num_threads(prev)
            if name == "propose" and self._on_tree is not None:
                self._on_tree(out)
            return out

        return call


def make_engine(pipe, draft_threads: int | None, dynamic: bool, tree_bytes: list | None = None):
    from orchestrator.loop.engine import SpeculativeEngine
    from orchestrator.planning.control import RequestControl
    from specdec.config import DynamicGammaConfig, FallbackConfig
    from specdec.wire import tree_to_proto

    def on_tree(tree):
        if tree_bytes is not None and tree.size:
            tree_bytes.append(tree_to_proto(tree).ByteSize())

    gamma_cfg, fallback = DynamicGammaConfig(enabled=dynamic), FallbackConfig()
    base = pipe.engine
    return SpeculativeEngine(base.target, ThreadScoped(base.draft, draft_threads, on_tree), base.eos_token_ids,
                             base.context_limit, base.decode,
                             control_factory=lambda spec: RequestControl(spec, gamma_cfg, fallback),
                             draft_context_limit=base.controller.draft_context_limit,
                             draft_window=base.controller.draft_window)  # embedded mode's, as build_pipeline set it


def run_embedded(engine, ids: list[int], max_new: int, spec, request_id: str) -> dict:
    from orchestrator.loop.controller import GenerationRequest

    first = []
    start = time.perf_counter()

    def on_tokens(tokens):
        if tokens and not first:
            first.append(time.perf_counter())
            first.append(len(tokens))

    result = asyncio.run(engine.controller.generate(GenerationRequest(list(ids), max_new, spec=spec), on_tokens,
                                                    session_id=request_id))
    wall = time.perf_counter() - start
    s = result.stats
    return {"tokens": result.tokens, "new_tokens": len(result.tokens), "wall_s": wall,
            "ttft_s": (first[0] - start) if first else wall, "first_tokens": first[1] if first else 0, "rounds": s.rounds, "proposed": s.proposed_tokens,
            "accepted": s.accepted_tokens, "fallback_rounds": s.fallback_rounds, "final_gamma": s.final_gamma}


# ----------------------------------------------------------------------------------------- gRPC client

async def grpc_generate(stub, request_id: str, ids: list[int], max_new: int, no_spec: bool = False,
                        timeout: float = 1800.0, ignore_eos: bool = False, chunks: list | None = None) -> dict:
    """One streamed request. chunks: if given, (perf_counter s, tokens) of each message with tokens is
    appended as it arrives (readable while the request runs). The pipeline_* keys are None where the
    front's FinalStats has no such field."""
    from specdec.v1 import generation_pb2

    tokens, first, first_tokens, stats = [], None, 0, None
    start = time.perf_counter()
    request = generation_pb2.GenerateRequest(request_id=request_id, prompt_ids=list(ids), max_new_tokens=max_new,
                                             no_spec=no_spec, ignore_eos=ignore_eos)
    async for reply in stub.Generate(request, timeout=timeout):
        if reply.token_ids:
            now = time.perf_counter()
            if first is None:
                first, first_tokens = now, len(reply.token_ids)
            if chunks is not None:
                chunks.append((now, len(reply.token_ids)))
        tokens += reply.token_ids
        if reply.HasField("stats"):
            stats = reply.stats
    wall = time.perf_counter() - start
    fields = stats.DESCRIPTOR.fields_by_name
    return {"tokens": tokens, "new_tokens": len(tokens), "wall_s": wall, "ttft_s": (first or time.perf_counter()) - start,
            "first_tokens": first_tokens,
            "rounds": stats.rounds, "acceptance_rate": stats.acceptance_rate, "fallback_rounds": stats.fallback_rounds,
            "final_gamma": stats.final_gamma, "stop_reason": stats.stop_reason,
            "proposed_tokens": stats.proposed_tokens, "cost_plain_rounds": stats.cost_plain_rounds,
            **{key: getattr(stats, key) if key in fields else None for key in PIPELINE_STATS}}


def grpc_one(address: str, request_id: str, ids: list[int], max_new: int, no_spec: bool = False) -> dict:
    from specdec.v1 import generation_pb2_grpc

    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            await asyncio.wait_for(channel.channel_ready(), 60)
            return await grpc_generate(generation_pb2_grpc.GenerationServiceStub(channel), request_id, ids, max_new, no_spec)

    return asyncio.run(run())


def target_batched_forwards(address: str) -> int:
    from specdec.v1 import target_pb2, target_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return target_pb2_grpc.TargetServiceStub(channel).Info(target_pb2.InfoRequest(), timeout=30).batched_forwards


def draft_batched_forwards(address: str | None) -> int | None:
    """The draft service's propose calls that merged sessions so far (None = no draft address)."""
    if address is None:
        return None
    from specdec.v1 import draft_pb2, draft_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return draft_pb2_grpc.DraftServiceStub(channel).Info(draft_pb2.DraftInfoRequest(), timeout=30).batched_forwards


PER_REQUEST = ("client", "started_s", "prompt_tokens", "wall_s", "ttft_s", "new_tokens", "rounds", "proposed_tokens",
               "cost_plain_rounds", "fallback_rounds", "no_spec")  # each request's row in a level's JSON (per_request)
MIXED = "mixed"  # a configuration's no_spec value for mixed traffic: even-numbered requests no_spec, the others speculate


def request_no_spec(no_spec: bool | str, i: int) -> bool:
    """Whether request i of a level is ``no_spec``: ``no_spec`` itself, or for MIXED traffic i even."""
    return i % 2 == 0 if no_spec == MIXED else bool(no_spec)


def run_level(address: str, prompts: list[list[int]], clients: int, max_new: int, no_spec: bool | str, tag: str,
              rate: float | None = None) -> dict:
    """``clients`` closed-loop clients started together, sharing the prompts; wall time and per-request rows.
    no_spec: every request's flag, or MIXED (see request_no_spec). rate: open loop instead (requests per
    second): request i is sent at i / rate s, ``clients`` unused."""
    from specdec.v1 import generation_pb2_grpc

    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            await asyncio.wait_for(channel.channel_ready(), 60)
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            queue = list(enumerate(prompts))
            results: list = [None] * len(prompts)

            async def send(i: int, ids: list[int], c: int):
                began = time.perf_counter() - start
                plain = request_no_spec(no_spec, i)
                results[i] = await grpc_generate(stub, f"{tag}-{i}", ids, max_new, plain)
                results[i].update(client=c, started_s=began, prompt_tokens=len(ids), no_spec=plain)

            async def client(c: int):  # closed loop: the next request when this one has finished
                while queue:
                    await send(*queue.pop(0), c)

            async def scheduled(i: int, ids: list[int]):  # open loop: request i at i / rate s (its own "client")
                await asyncio.sleep(max(start + i / rate - time.perf_counter(), 0.0))
                await send(i, ids, i)

            start = time.perf_counter()
            if rate is None:
                await asyncio.gather(*(client(c) for c in range(clients)))
            else:
                await asyncio.gather(*(scheduled(i, ids) for i, ids in queue))
            return time.perf_counter() - start, results

    wall, results = asyncio.run(run())
    return {"wall_s": wall, "requests": results}


# ----------------------------------------------------------------------------------------- services

@dataclass
class Services:
    """The server subprocesses of a run (stopped in reverse order of launch)."""

    workdir: Path
    env: dict
    pin: dict | None = None  # kind -> taskset core list ("0"); kinds not named run unpinned
    running: list = field(default_factory=list)
    peak_rss_mb: dict = field(default_factory=dict)  # name -> peak resident MB (VmHWM), read as each stops
    affinity: dict = field(default_factory=dict)  # name -> CPUs its process may run on, read once ready
    start_costs: dict = field(default_factory=dict)  # front name -> the cost model it started from (front_start_costs)

    def note_peak(self, service: Service) -> None:
        """Record the service's peak resident memory (its own process; a Ray front's actors not
        included) and, for a front, the cost model it started from (its log)."""
        try:
            self.peak_rss_mb[service.name] = peak_rss_mb(service.proc.pid)
        except (ValueError, OSError):  # already gone, or no /proc here
            pass
        if service.kind == "front":
            try:
                costs = front_start_costs(service.stderr)
            except OSError:
                costs = None
            if costs is not None:
                self.start_costs[service.name] = costs

    def launch(self, kind: str, name: str, config: dict, **flags) -> Service:
        """Start a service from ``config`` (written to the workdir); under ``taskset -c`` when ``pin`` names its kind."""
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        env = {**self.env, "OTEL_SERVICE_NAME": name}
        cores = (self.pin or {}).get(kind)
        if cores is None:
            service = launch_service(kind, path, env=env, **flags)
        else:  # taskset execs the server: the pid stays the server's own
            service = launch_command(kind, ["taskset", "-c", cores, *server_command(kind, path, **flags)], env)
        service.name = name
        self.running.append(service)
        return service

    def wait(self, service: Service, timeout_s: float = 600.0) -> Service:
        service.ready.wait(timeout_s)
        if not service.port:
            code = service.proc.poll()
            raise RuntimeError(f"{service.name} ({service.kind}) {'exited with %s' % code if code is not None else 'not ready'}; "
                               f"stderr:\n{service.stderr[-4000:]}")
        if service.name not in self.affinity:
            self.affinity[service.name] = sorted(os.sched_getaffinity(service.proc.pid))
        return service

    def stop(self, service: Service) -> None:
        if service in self.running:
            self.running.remove(service)
            self.note_peak(service)
            stop_service(service, timeout_s=30)
            try:
                service.stderr_path.unlink()
            except OSError:
                pass

    def stop_all(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to every service at once, then wait for each (SIGKILL past ``timeout_s``). A Ray
        front gets the time it needs to shut its local Ray down."""
        services, self.running = list(reversed(self.running)), []
        for service in services:
            self.note_peak(service)
            if service.proc.poll() is None:
                service.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for service in services:
            try:
                service.proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log(f"{service.name} did not exit after SIGTERM; killing it")
                service.proc.kill()
                service.proc.wait()
            try:
                service.stderr_path.unlink()
            except OSError:
                pass


_MEASURED = re.compile(r"cost model measured through the services: V\(n\) (\{[^}]*\}) ms, D\(p\) (\{[^}]*\}) ms")


def front_start_costs(log_text: str) -> dict | None:
    """The cost model a front started from, read from its log (orchestrator.loop.service.Orchestrator
    ._measure_costs): {"verify_ms": {rows: ms}, "draft_step_ms": {parents: ms}} when it measured
    the services, {"failed": the warning} when that failed, None when it did not measure (no
    cost-aware control, ``measure_at_start`` off or figures given: it started from those)."""
    found = _MEASURED.search(log_text)
    if found:
        return {"verify_ms": ast.literal_eval(found.group(1)), "draft_step_ms": ast.literal_eval(found.group(2))}
    for line in log_text.splitlines():
        if "cost model: measuring through the services failed" in line:
            return {"failed": line.split("cost model: ", 1)[1]}
    return None


RESERVED_CONFIGS = ("batched", "batched_in_step", "one_at_a_time", "speculative_pipelined", "target_only")


def front_variant(text: str, flag: str = "--front-variant") -> tuple[str, dict]:
    """``--front-variant NAME=JSON`` (or ``flag``'s) -> (NAME, the JSON object). Raises
    argparse.ArgumentTypeError (a usage error naming the flag) for a missing '=', a bad or reserved
    name, or JSON that is not an object."""
    name, sep, body = text.partition("=")
    if not sep or not name.isidentifier() or name in RESERVED_CONFIGS:
        raise argparse.ArgumentTypeError(f"{flag}: need NAME=JSON with NAME an identifier other than "
                                         f"{', '.join(RESERVED_CONFIGS)}, got {text!r}")
    try:
        front = json.loads(body)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{flag} {name}: not JSON ({exc})") from exc
    if not isinstance(front, dict):
        raise argparse.ArgumentTypeError(f"{flag} {name}: need a JSON object, got {body!r}")
    return name, front


def deep_merge(base: dict, over: dict) -> dict:
    """base with over's keys set, nested mappings merged key by key (a new dict; neither is changed)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def target_only_variant(text: str) -> tuple[str, dict]:
    """``--target-only-variant NAME=JSON`` -> (NAME, the JSON object); errors as ``front_variant``'s."""
    return front_variant(text, "--target-only-variant")


def mixed_variant(text: str) -> tuple[str, dict]:
    """``--mixed-variant NAME=JSON`` -> (NAME, the JSON object); errors as ``front_variant``'s."""
    return front_variant(text, "--mixed-variant")


def check_front_variants(p: argparse.ArgumentParser, args) -> None:
    """--front-variant, --target-only-variant, --mixed-variant: distinct names (over all three), the concurrency section
    selected, and each front config valid (specdec.config.FrontConfig, unknown keys refused) before
    any model loads."""
    from specdec.config import FrontConfig

    flags = {name: "--front-variant" for name, _ in args.front_variant}
    flags.update({name: "--target-only-variant" for name, _ in args.target_only_variant})
    flags.update({name: "--mixed-variant" for name, _ in args.mixed_variant})
    variants = args.front_variant + args.target_only_variant + args.mixed_variant
    if not variants:
        return
    names = [name for name, _ in variants]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        p.error(f"--front-variant/--target-only-variant/--mixed-variant: {', '.join(twice)} given more than once")
    if "concurrency" not in args.sections:
        p.error(f"{'/'.join(sorted(set(flags.values())))}: adds concurrency configurations; --sections has no concurrency")
    for name, front in variants:
        try:
            FrontConfig.model_validate(deep_merge({"use_ray": True}, front))
        except ValueError as exc:
            p.error(f"{flags[name]} {name}: not a valid front config ({exc})")


def service_config(args, threads: int | None = None, target: dict | None = None, front: dict | None = None) -> dict:
    data: dict = {
        "models": {"target": str(args.target), "draft": str(args.draft), "dtype": args.dtype, "draft_quant": args.draft_quant},
        "grpc": {"shutdown_grace_s": 2.0},
        "draft": {"port": 0},
        "target": {"port": 0, **(target or {})},
    }
    if getattr(args, "batch_gather", None) is not None:  # both services' batchers
        data["draft"]["batch_gather"] = data["target"]["batch_gather"] = args.batch_gather
    if threads:
        data["models"]["threads"] = threads
    if front is not None:
        from specdec.config import ClientLimitsConfig

        # admit every stream the run opens at once (the largest level; longprompt: running + long request)
        # (open loop: every request of a level may be running at once)
        level = args.concurrency_prompts if args.open_loop else max(args.levels)
        streams = max(level, args.long_running + 1, ClientLimitsConfig().max_running)
        data["front"] = deep_merge({"port": 0, "max_new_tokens": args.max_new_tokens, "dynamic_gamma": {"enabled": False},
                                    "workers": args.workers, "ray_num_cpus": 2, "limits": {"max_running": streams}}, front)
    return data


def weights_bytes(model_dir: Path) -> int:
    files = list(Path(model_dir).glob("*.safetensors")) or list(Path(model_dir).glob("*.bin"))
    return sum(f.stat().st_size for f in files)


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# ----------------------------------------------------------------------------------------- stats

def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    v = sorted(values)
    if not v:
        return 0.0
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


CPU_ROLES = ("target", "draft", "front", "front_ray", "other_fronts", "benchmark", "other")


def cpu_snapshot(services: dict[int, tuple[str, str]]) -> dict[int, tuple[str, str, float, float]]:
    """Every process's CPU time so far: pid -> (owner, part, seconds of user + system time of its own
    threads, children not included, its start time; psutil). services: pid -> (name, kind) of the
    benchmark's server processes. owner: the service whose process tree holds the process (its Ray
    processes are the front's: a front's local Ray runs under it; a Ray cluster started apart, e.g.
    ``ray start`` or RAY_ADDRESS, would count as "other"), "benchmark" (this process: the clients
    and the OTLP receiver) or "other"; part: "process" (the service's own), "ray" (a descendant:
    raylet, GCS, actor workers) or "" (no service). Processes that vanish while read are skipped."""
    me, out = os.getpid(), {}
    for proc in psutil.process_iter():
        try:
            times, started = proc.cpu_times(), proc.create_time()
            owner, part = "other", ""
            if proc.pid == me:
                owner = "benchmark"
            elif proc.pid in services:
                owner, part = services[proc.pid][0], "process"
            else:
                for parent in proc.parents():
                    if parent.pid in services:
                        owner, part = services[parent.pid][0], "ray"
                        break
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        out[proc.pid] = (owner, part, times.user + times.system, started)
    return out


def cpu_split(before: dict, after: dict, kinds: dict[str, str], front: str | None) -> dict[str, float]:
    """CPU seconds spent between two ``cpu_snapshot`` calls, by role (CPU_ROLES): target and draft
    (every target / draft service), front (the row's own front process, ``front``: its service
    name) and front_ray (the processes of its local Ray), other_fronts (every other front's tree:
    idle fronts still run Ray's daemons), benchmark, other (the rest of the machine). kinds: service
    name -> kind. A process started in between counts whole (a pid reused by a new process too: its
    start time differs); one that ended is lost."""
    split = dict.fromkeys(CPU_ROLES, 0.0)
    for pid, (owner, part, seconds, started) in after.items():
        old = before.get(pid)
        same = old is not None and (old[0], old[1], old[3]) == (owner, part, started)
        spent = seconds - old[2] if same else seconds
        kind = kinds.get(owner)
        if owner == front:
            role = "front" if part == "process" else "front_ray"
        elif kind == "front":
            role = "other_fronts"
        elif kind in ("target", "draft"):
            role = kind
        else:
            role = owner if owner == "benchmark" else "other"
        split[role] += max(spent, 0.0)
    return split


def throughput(rows: list[dict]) -> dict:
    tokens = sum(r["new_tokens"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    decode_tokens = sum(r["new_tokens"] - r.get("first_tokens", 0) for r in rows)
    decode_s = sum(r["wall_s"] - r["ttft_s"] for r in rows)
    rounds = sum(r["rounds"] for r in rows)
    return {"requests": len(rows), "new_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else 0.0,
            "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
            "ttft_s_mean": sum(r["ttft_s"] for r in rows) / len(rows) if rows else 0.0,
            "rounds": rounds, "mean_accepted_length": tokens / rounds if rounds else 0.0}


def md_table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _f(x, nd=2):
    return f"{x:.{nd}f}"


# ----------------------------------------------------------------------------------------- sections

def section_grpc(args, pipe, prompts, fronts: dict, collector, mem_exporter) -> dict:
    from specdec.tree_spec import DEFAULT_SPEC

    tree_bytes: list[int] = []
    engine = make_engine(pipe, args.draft_threads, dynamic=False, tree_bytes=tree_bytes)
    modes = ["embedded", *fronts]
    # warm-up of every mode (not recorded)
    warm = prompts[0]["ids"]
    run_embedded(engine, warm, 4, DEFAULT_SPEC, "warm-embedded")
    for mode, address in fronts.items():
        grpc_one(address, f"warm-{mode}", warm, 4)
    tree_bytes.clear()
    rows = []
    for i, p in enumerate(prompts):
        order = modes[i % len(modes):] + modes[: i % len(modes)]
        row = {"question_id": p["question_id"], "category": p["category"], "prompt_tokens": len(p["ids"]), "order": order}
        for mode in order:
            rid = f"grpc-{mode}-{i}"
            if mode == "embedded":
                out = run_embedded(engine, p["ids"], args.max_new_tokens, DEFAULT_SPEC, rid)
            else:
                out = grpc_one(fronts[mode], rid, p["ids"], args.max_new_tokens)
            out["request_id"] = rid
            row[mode] = out
        ref = row["embedded"]["tokens"]
        row["identical"] = {m: row[m]["tokens"] == ref for m in fronts}
        rows.append(row)
        log(f"grpc {i + 1}/{len(prompts)} q{p['question_id']} ({len(p['ids'])} prompt tokens): "
            + ", ".join(f"{m} {row[m]['new_tokens'] / row[m]['wall_s']:.2f} tok/s" for m in modes))
    # first-round tokens, for decode tok/s
    summary = {}
    for mode in modes:
        mode_rows = [r[mode] for r in rows]
        summary[mode] = throughput(mode_rows)
        summary[mode]["ratio_vs_embedded"] = (summary[mode]["tokens_per_s"] / summary["embedded"]["tokens_per_s"]
                                              if summary["embedded"]["tokens_per_s"] else 0.0)
    identical = {m: sum(r["identical"][m] for r in rows) for m in fronts}
    wait_for_rounds(collector, {r[m]["request_id"]: r[m]["rounds"] for r in rows for m in fronts})
    spans = collector.spans()
    split = {"embedded": round_split(memory_spans(mem_exporter), {r["embedded"]["request_id"] for r in rows})}
    for m in fronts:
        split[m] = round_split(spans, {r[m]["request_id"] for r in rows})
    if tree_bytes:
        split["embedded"]["tree_bytes_mean"] = sum(tree_bytes) / len(tree_bytes)
        split["embedded"]["tree_bytes_max"] = max(tree_bytes)
    for r in rows:
        for m in modes:
            r[m].pop("tokens")
    return {"modes": modes, "summary": summary, "identical_outputs": all(v == len(rows) for v in identical.values()),
            "identical_count": identical, "prompts": len(rows), "round_split": split,
            "tree_bytes": {m: {k: split[m].get(k) for k in ("tree_bytes_mean", "tree_bytes_max")} for m in modes},
            "rows": rows}


def section_concurrency(args, prompts, configs: dict, collector: SpanCollector | None = None,
                        draft: str | None = None, services: Services | None = None) -> dict:
    """configs: name -> (front address, target address, no_spec: a bool or MIXED); collector: the services' spans
    (rows with ahead hits get ``pipeline_trace``, see pipeline_overlap; ``complete``: every round span
    of their requests arrived); draft: the draft service's address (rows count its merged proposals);
    services: the running servers (rows get ``cpu_s``, CPU seconds by role over the level, see
    cpu_split, ``cpu_window_s``, the seconds between its two snapshots, and ``cpu_busy_share``, their
    sum over that window x the CPUs this process may use)."""
    ids = [p["ids"] for p in prompts]
    running = list(services.running) if services is not None else []
    pids = {svc.proc.pid: (svc.name, svc.kind) for svc in running}
    kinds = {svc.name: svc.kind for svc in running}
    front_names = {svc.address: svc.name for svc in running if svc.kind == "front"}
    for name, (front, _, no_spec) in configs.items():  # warm-up
        grpc_one(front, f"warm-conc-{name}", ids[0], 4, no_spec is True)
    names = list(configs)
    rows, outputs = [], defaultdict(dict)
    traced: dict[int, dict[str, int]] = {}  # row index -> {request id: rounds} of the rows with ahead hits
    for li, level in enumerate(args.levels):
        order = names[li % len(names):] + names[: li % len(names)]
        for name in order:
            front, target, no_spec = configs[name]
            before, draft_before = target_batched_forwards(target), draft_batched_forwards(draft)
            cpu_before = cpu_snapshot(pids) if pids else None
            cpu_began = time.perf_counter()
            out = run_level(front, ids, int(level), args.max_new_tokens, no_spec, f"conc-{name}-{level}",
                            rate=level if args.open_loop else None)
            cpu_window = time.perf_counter() - cpu_began  # the snapshots' own window (wall_s starts later)
            cpu = cpu_split(cpu_before, cpu_snapshot(pids), kinds, front_names.get(front)) if pids else None
            merged = target_batched_forwards(target) - before
            draft_merged = None if draft is None else draft_batched_forwards(draft) - draft_before
            reqs = out["requests"]
            lat = [r["wall_s"] for r in reqs]
            tokens = sum(r["new_tokens"] for r in reqs)
            rounds = sum(r["rounds"] for r in reqs)
            rows_verified = sum(r["proposed_tokens"] for r in reqs) + rounds  # each round verifies its tree + 1 row
            for i, r in enumerate(reqs):
                outputs[i][(name, level)] = r.pop("tokens")
            row = {"config": name, "clients": level, "requests": len(reqs), "new_tokens": tokens, "wall_s": out["wall_s"],
                   "tokens_per_s": tokens / out["wall_s"], "latency_p50_s": percentile(lat, 50),
                   "latency_p95_s": percentile(lat, 95), "ttft_p50_s": percentile([r["ttft_s"] for r in reqs], 50),
                   "ttft_p95_s": percentile([r["ttft_s"] for r in reqs], 95),
                   "mean_accepted_length": tokens / rounds if rounds else 0.0, "merged_verify_forwards": merged,
                   "merged_draft_calls": draft_merged,
                   "mean_tree_rows": rows_verified / rounds if rounds else 0.0,
                   "cost_plain_round_share": sum(r["cost_plain_rounds"] for r in reqs) / rounds if rounds else 0.0,
                   "fallback_round_share": sum(r["fallback_rounds"] for r in reqs) / rounds if rounds else 0.0,
                   "run_order": order.index(name), "level_run": li,
                   "cpu_s": cpu, "cpu_window_s": cpu_window if cpu is not None else None,
                   "cpu_busy_share": (sum(cpu.values()) / (cpu_window * len(os.sched_getaffinity(0)))
                                      if cpu is not None else None),
                   "per_request": [{key: r[key] for key in PER_REQUEST} for r in reqs]}
            if no_spec == MIXED:
                for kind, plain in (("no_spec", True), ("spec", False)):
                    kind_lat = [r["wall_s"] for r in reqs if r["no_spec"] is plain]
                    row[f"{kind}_latency_p50_s"] = percentile(kind_lat, 50) if kind_lat else None
                    row[f"{kind}_latency_p95_s"] = percentile(kind_lat, 95) if kind_lat else None
            for key in PIPELINE_STATS:  # None: the front's final stats have no such field
                values = [r[key] for r in reqs if r[key] is not None]
                row[key] = sum(values) if values else None
            if collector is not None and row["pipeline_ahead_hits"]:
                traced[len(rows)] = {f"conc-{name}-{level}-{i}": r["rounds"] for i, r in enumerate(reqs)}
            rows.append(row)
            log(f"concurrency {name} x{level}: {row['tokens_per_s']:.2f} tok/s, p50 {row['latency_p50_s']:.2f} s, "
                f"p95 {row['latency_p95_s']:.2f} s, merged forwards {merged}")
    for i, expected in traced.items():
        complete = wait_for_rounds(collector, expected)
        rows[i]["pipeline_trace"] = {**pipeline_overlap(collector.spans(), set(expected)), "complete": complete}
    if collector is not None and args.round_log:
        for row in rows:  # target_only too: its batch sizes and verify times are the reference
            expected = {f"conc-{row['config']}-{row['clients']}-{i}": r["rounds"] for i, r in enumerate(row["per_request"])}
            wait_for_rounds(collector, expected)
            ids = set(expected)  # a level repeated (--levels 4,4) reuses its ids: its rows log every repeat's rounds
            row["round_split"] = round_split(collector.spans(), ids)
            row["round_log"] = round_log(collector.spans(), ids)
    base = {r["level_run"]: r for r in rows if r["config"] == "target_only"}
    for r in rows:  # against the target_only row of the same level run (--levels 16,16: each repeat its own pair)
        ref = base.get(r["level_run"])
        r["speedup_vs_target_only"] = r["tokens_per_s"] / ref["tokens_per_s"] if ref and ref["tokens_per_s"] else None
        r["latency_p95_vs_target_only"] = (r["latency_p95_s"] / ref["latency_p95_s"]
                                           if ref and ref["latency_p95_s"] else None)
        if r.get("no_spec_latency_p95_s") is not None:  # mixed traffic: what its plain requests paid
            r["no_spec_latency_p95_vs_target_only"] = (r["no_spec_latency_p95_s"] / ref["latency_p95_s"]
                                                       if ref and ref["latency_p95_s"] else None)
    ref_key = ("target_only", args.levels[0]) if "target_only" in names else (names[0], args.levels[0])
    same = [all(v == out[ref_key] for v in out.values()) for out in outputs.values()]
    return {"levels": args.levels, "configs": names, "rows": rows, "identical_outputs": all(same),
            "identical_prompts": sum(same), "prompts": len(prompts)}


def section_gamma(args, pipe, by_category: dict[str, list[dict]]) -> dict:
    from specdec.tree_spec import DEFAULT_SPEC

    engines = {"fixed": make_engine(pipe, args.draft_threads, dynamic=False),
               "dynamic": make_engine(pipe, args.draft_threads, dynamic=True)}
    warm = next(iter(by_category.values()))[0]["ids"]
    for name, engine in engines.items():
        run_embedded(engine, warm, 4, DEFAULT_SPEC, f"warm-gamma-{name}")
    rows, questions = [], []
    k = 0
    for cat, prompts in by_category.items():
        per = {"fixed": [], "dynamic": []}
        for p in prompts:
            order = ["fixed", "dynamic"] if k % 2 == 0 else ["dynamic", "fixed"]
            k += 1
            q = {"question_id": p["question_id"], "category": cat, "prompt_tokens": len(p["ids"])}
            outs = {}
            for name in order:
                outs[name] = run_embedded(engines[name], p["ids"], args.max_new_tokens, DEFAULT_SPEC, f"gamma-{name}-{k}")
                per[name].append(outs[name])
            q["identical"] = outs["fixed"]["tokens"] == outs["dynamic"]["tokens"]
            for name in order:
                outs[name].pop("tokens")
                q[name] = outs[name]
            questions.append(q)
            log(f"gamma {cat} q{p['question_id']}: fixed {q['fixed']['new_tokens'] / q['fixed']['wall_s']:.2f} tok/s, "
                f"dynamic {q['dynamic']['new_tokens'] / q['dynamic']['wall_s']:.2f} tok/s")
        for name in ("fixed", "dynamic"):
            t = throughput(per[name])
            proposed = sum(r["proposed"] for r in per[name])
            rows.append({"category": cat, "mode": name, **t,
                         "acceptance_rate": sum(r["accepted"] for r in per[name]) / proposed if proposed else 0.0,
                         "final_gamma_mean": sum(r["final_gamma"] for r in per[name]) / len(per[name]),
                         "fallback_rounds": sum(r["fallback_rounds"] for r in per[name])})
        fixed_tps = rows[-2]["tokens_per_s"]
        rows[-1]["ratio_vs_fixed"] = rows[-1]["tokens_per_s"] / fixed_tps if fixed_tps else None
        rows[-2]["ratio_vs_fixed"] = 1.0
    return {"method": "embedded: SpeculativeEngine with orchestrator.planning.control.RequestControl "
                      "(front.dynamic_gamma enabled true vs false, default fallback), base tree DEFAULT_SPEC",
            "rows": rows, "identical_outputs": all(q["identical"] for q in questions), "questions": questions}


# ----------------------------------------------------------------------------------------- longprompt

def long_prompt_ids(tokenizer, n_tokens: int) -> list[int]:
    """``n_tokens`` prompt ids: the built-in prompt set's first turns joined by blank lines, tokenized
    without special tokens, repeated until long enough and cut (deterministic for a tokenizer)."""
    from orchestrator.measure.bench import BUILTIN_QUESTIONS

    lines = BUILTIN_QUESTIONS.read_text(encoding="utf-8").splitlines()
    text = "\n\n".join(json.loads(line)["turns"][0] for line in lines if line.strip())
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return (ids * (n_tokens // len(ids) + 1))[:n_tokens]


def itl_samples(chunks: list[tuple[float, int]], start_s: float, end_s: float,
                close_after_end: bool = False) -> tuple[list[float], float]:
    """Per-token inter-token latencies (s) of one request's streamed chunks ``[(arrival s, tokens)]``
    whose closing chunk arrives in (start_s, end_s]; ``close_after_end`` also takes the first chunk
    after end_s (the gap still open at end_s). Each gap counts once per token of its closing chunk,
    as gap / tokens. Returns (samples, largest gap s).

    Example: chunks at 1.0 s (2 tokens) and 1.3 s (3 tokens), window (1.0, 2.0]: [0.1, 0.1, 0.1], 0.3.
    """
    samples, largest = [], 0.0
    for (t0, _), (t1, k) in zip(chunks, chunks[1:]):
        if t1 <= start_s:
            continue
        if t1 > end_s and not close_after_end:
            break
        samples += [(t1 - t0) / k] * k
        largest = max(largest, t1 - t0)
        if t1 > end_s:
            break
    return samples, largest


async def _until(ready, tasks: list, timeout_s: float, what: str) -> None:
    """Poll ``ready()`` every 10 ms; raise what a failed task raised, or TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        if time.monotonic() > deadline:
            raise TimeoutError(f"longprompt: {what} not within {timeout_s:.0f} s")
        await asyncio.sleep(0.01)


async def longprompt_run(address: str, running_ids: list[list[int]], long_ids: list[int], args, no_spec: bool,
                         tag: str) -> dict:
    """Running requests stream (ignore_eos); after ``args.long_window_s`` of steady decoding the long
    request is sent; returns every chunk's arrival, the window bounds (perf_counter s) and the long
    request's result. The running requests are cancelled once each has streamed past the long
    request's first token (or ended)."""
    from specdec.v1 import generation_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 60)
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        chunks: list[list] = [[] for _ in running_ids]
        runs = [asyncio.create_task(grpc_generate(stub, f"{tag}-run-{i}", ids, args.long_running_tokens, no_spec,
                                                  ignore_eos=True, chunks=chunks[i])) for i, ids in enumerate(running_ids)]
        await _until(lambda: all(chunks), runs, 600, "the running requests' first tokens")
        window_start = time.perf_counter()
        await asyncio.sleep(args.long_window_s)
        long_chunks: list = []
        sent = time.perf_counter()
        long_task = asyncio.create_task(grpc_generate(stub, f"{tag}-long", long_ids, args.max_new_tokens, no_spec,
                                                      chunks=long_chunks))
        await _until(lambda: long_chunks or long_task.done(), [long_task], 1800, "the long request's first token")
        if not long_chunks:
            raise RuntimeError(f"longprompt: the long request ended without a token: {await long_task}")
        first = long_chunks[0][0]
        await _until(lambda: all(t.done() or c[-1][0] > first for t, c in zip(runs, chunks)), runs, 600,
                     "a chunk of every running request after the long request's first token")
        outlasted = sum(c[-1][0] > first for c in chunks)
        for task in runs:
            task.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        long = await long_task
    return {"chunks": chunks, "window_start": window_start, "sent": sent, "long_first": first, "long": long,
            "outlasted": outlasted}


def longprompt_row(config: str, chunk_tokens: int, run: dict, args, busy_tokens: int | None = None) -> dict:
    """One table row: p50 / p95 ITL (ms) of the running requests before vs during the long prefill.
    busy_tokens: the target's prefill_busy_chunk_tokens (None = chunk_tokens: no riding)."""
    busy_tokens = chunk_tokens if busy_tokens is None else busy_tokens
    before, during, gap_before, gap_during = [], [], 0.0, 0.0
    for chunks in run["chunks"]:
        samples, gap = itl_samples(chunks, run["window_start"], run["sent"])
        before, gap_before = before + samples, max(gap_before, gap)
        samples, gap = itl_samples(chunks, run["sent"], run["long_first"], close_after_end=True)
        during, gap_during = during + samples, max(gap_during, gap)

    def ms(values, q):
        return percentile(values, q) * 1e3 if values else None

    row = {"config": config, "prefill_chunk_tokens": chunk_tokens, "prefill_busy_chunk_tokens": busy_tokens,
           "chunked": min(chunk_tokens, busy_tokens) < args.long_prompt_tokens,
           "long_prompt_tokens": args.long_prompt_tokens, "running": len(run["chunks"]),
           "running_max_new_tokens": args.long_running_tokens, "window_before_s": run["sent"] - run["window_start"],
           "window_during_s": run["long_first"] - run["sent"],
           "itl_p50_before_ms": ms(before, 50), "itl_p95_before_ms": ms(before, 95),
           "itl_p50_during_ms": ms(during, 50), "itl_p95_during_ms": ms(during, 95),
           "max_gap_before_ms": gap_before * 1e3, "max_gap_during_ms": gap_during * 1e3,
           "itl_tokens_before": len(before), "itl_tokens_during": len(during),
           "long_ttft_s": run["long"]["ttft_s"], "long_new_tokens": run["long"]["new_tokens"],
           "long_wall_s": run["long"]["wall_s"], "running_outlasted": run["outlasted"]}
    b, d = row["itl_p95_before_ms"], row["itl_p95_during_ms"]
    row["itl_p95_ratio"] = d / b if b and d is not None else None
    return row


def section_longprompt(args, services: Services, draft: Service, tokenizer, prompts: list[dict]) -> dict:
    """For each prefill chunk setting: start a target and the fronts ``--longprompt-configs`` need,
    run every configuration once (after a short warm-up request), stop them (one target at a time)."""
    from specdec.config import TargetServerConfig

    long_ids = long_prompt_ids(tokenizer, args.long_prompt_tokens)
    running_ids = [prompts[i % len(prompts)]["ids"] for i in range(args.long_running)]
    chunk = args.prefill_chunk_tokens or TargetServerConfig().prefill_chunk_tokens
    busy_arg = args.prefill_busy_chunk_tokens  # 0 = no riding (the busy chunk is the chunk)
    busy = chunk if busy_arg == 0 else min(busy_arg or TargetServerConfig().prefill_busy_chunk_tokens or chunk, chunk)
    whole = max(chunk, len(long_ids))  # unchunked: one forward for the whole prompt, riding off
    settings = [[chunk, busy]] + ([[whole, whole]] if args.longprompt_unchunked else [])
    front_keys = {"speculative": {"use_ray": True}, "target_only": {"use_ray": True},
                  "speculative_pipelined": {"use_ray": True, "pipeline": True}}
    rows = []
    for chunk_tokens, busy_tokens in settings:
        target = services.wait(services.launch("target", f"bench-target-long-{chunk_tokens}", service_config(
            args, args.target_threads, {"max_batch": args.max_batch, "batch_wait_ms": args.batch_wait_ms,
                                        "prefill_chunk_tokens": chunk_tokens,
                                        "prefill_busy_chunk_tokens": busy_tokens})))
        fronts = {}
        for config in args.longprompt_configs:
            key = "pipelined" if config == "speculative_pipelined" else "plain"
            if key not in fronts:
                fronts[key] = services.wait(services.launch(  # one at a time: each measures the services
                    "front", f"bench-front-long-{key}-{chunk_tokens}", service_config(args, front=front_keys[config]),
                    draft_address=draft.address, target_address=target.address))
        for config in args.longprompt_configs:
            front = services.wait(fronts["pipelined" if config == "speculative_pipelined" else "plain"])
            no_spec = config == "target_only"
            grpc_one(front.address, f"warm-long-{config}-{chunk_tokens}", running_ids[0], 4, no_spec)
            run = asyncio.run(longprompt_run(front.address, running_ids, long_ids, args, no_spec,
                                             f"long-{config}-{chunk_tokens}"))
            rows.append(longprompt_row(config, chunk_tokens, run, args, busy_tokens))
            r = rows[-1]
            log(f"longprompt {config} chunk {chunk_tokens}: ITL p95 before {_or_dash(r['itl_p95_before_ms'], 1)} ms, "
                f"during {_or_dash(r['itl_p95_during_ms'], 1)} ms, long TTFT {r['long_ttft_s']:.2f} s")
        for front in fronts.values():
            services.stop(front)
        services.stop(target)
    return {"long_prompt_tokens": len(long_ids), "running": args.long_running,
            "running_max_new_tokens": args.long_running_tokens, "window_s": args.long_window_s,
            "configs": args.longprompt_configs, "prefill_chunk_settings": settings, "rows": rows}


# ----------------------------------------------------------------------------------------- markdown

def markdown(result: dict) -> str:
    meta = result["meta"]
    parts = [f"# Serving benchmark ({meta['target_name']} target, {meta['draft_name']} draft)\n",
             f"- dtype: `{meta['dtype']}` (requested `{meta['dtype_arg']}`), draft quantization: `{meta['draft_quant']}` "
             f"(requested `{meta['draft_quant_arg']}`)",
             f"- threads: target {meta['target_threads']}, draft {meta['draft_threads']} in every mode "
             f"(services: `models.threads`; embedded: switched around each draft call); {meta['cpu_count']} CPUs "
             f"({meta['cpu']}), {meta['machine']}",
             f"- greedy, TreeSpec `{meta['tree']}`, {meta['max_new_tokens']} new tokens, prompts <= "
             f"{meta['max_prompt_tokens']} tokens (Spec-Bench first turns, chat template, sent as `prompt_ids`)",
             "- tracing on in every mode (OTLP to a receiver in the benchmark process; embedded: in-memory exporter)",
             f"- wall time of the run: {meta['wall_s']:.0f} s"]
    if meta.get("peak_rss_mb"):
        parts.append("- peak resident memory per service process (VmHWM, MB; a Ray front's actors not included): "
                     + ", ".join(f"{name} {mb:,.0f}" for name, mb in meta["peak_rss_mb"].items()))
    if meta.get("front_start_costs"):
        shown = []
        for name, costs in meta["front_start_costs"].items():
            if "failed" in costs:
                shown.append(f"{name} prior figures ({costs['failed']})")
            else:
                v = ", ".join(f"{ms:.0f}" for ms in costs["verify_ms"].values())
                d = ", ".join(f"{ms:.1f}" for ms in costs["draft_step_ms"].values())
                shown.append(f"{name} V({', '.join(map(str, costs['verify_ms']))}) = {v} ms, "
                             f"D({', '.join(map(str, costs['draft_step_ms']))}) = {d} ms")
        parts.append("- cost model each front started from, measured through the services when it connected "
                     "(fronts not named started from the prior figures or given ones): " + "; ".join(shown))
    if meta.get("bf16_note"):
        parts.append(f"- {meta['bf16_note']}")
    parts.append(pinning_line(meta.get("pinning")))
    parts.append("")
    g = result.get("grpc")
    if g:
        parts.append(f"## gRPC vs embedded (issue 4): {g['prompts']} prompts, fixed tree, dynamic gamma off\n")
        parts.append("Modes interleaved per prompt (order rotated). tok/s = new tokens / request wall time (prefill "
                     "included); decode tok/s leaves out the time to the first round. The gRPC target runs "
                     "`max_batch: 1` (a lone verify never waits for company).\n")
        head = ["mode", "tok/s", "vs embedded", "decode tok/s", "TTFT s", "mean acc len", "identical to embedded"]
        rows = []
        for m in g["modes"]:
            s = g["summary"][m]
            ident = "-" if m == "embedded" else f"{g['identical_count'][m]}/{g['prompts']}"
            rows.append([m, _f(s["tokens_per_s"]), f"{s['ratio_vs_embedded']:.3f}x", _f(s["decode_tokens_per_s"]),
                         _f(s["ttft_s_mean"]), _f(s["mean_accepted_length"]), ident])
        parts.append(md_table(head, rows))
        parts.append(f"Outputs identical in every mode: **{g['identical_outputs']}**\n")
        parts.append("Per-round time split (mean ms per round, from the `round`/`draft`/`verify`/`commit` spans). "
                     "draft / verify / commit: the orchestrator's spans; draft_ms / verify_ms: the services' own "
                     "figures (embedded: the calls themselves); transfer = round - draft_ms - verify_ms (holds the "
                     "commit calls: their share is the commit column); wire = span - server figure.\n")
        head = ["mode", "rounds", "round", "draft", "draft_ms", "verify", "verify_ms", "commit", "transfer",
                "draft wire", "verify wire", "tree bytes mean", "tree bytes max"]
        rows = []
        for m in g["modes"]:
            s = g["round_split"][m]
            tb_mean, tb_max = s.get("tree_bytes_mean"), s.get("tree_bytes_max")
            rows.append([m, s["rounds"], _f(s.get("round_ms", 0)), _f(s.get("draft_ms", 0)), _f(s.get("draft_server_ms", 0)),
                         _f(s.get("verify_ms", 0)), _f(s.get("verify_server_ms", 0)), _f(s.get("commit_ms", 0)),
                         _f(s.get("transfer_ms", 0)), _f(s.get("draft_wire_ms", 0)), _f(s.get("verify_wire_ms", 0)),
                         _f(tb_mean, 0) if tb_mean is not None else "-", tb_max if tb_max is not None else "-"])
        parts.append(md_table(head, rows))
        parts.append("Tree bytes: `specdec.wire.tree_to_proto(tree).ByteSize()` of each non-empty tree (gRPC: the "
                     "front's `tree.bytes` span attribute; embedded: computed).\n")
    c = result.get("concurrency")
    if c:
        parts.append(f"## Concurrency (issue 5): {c['prompts']} requests per level, Ray front\n")
        for name, front in (meta.get("front_variants") or {}).items():
            parts.append(f"Configuration `{name}` (`--front-variant`): a Ray front on the batched target with "
                         f"`{json.dumps(front)}` merged into its front config.\n")
        for name, front in (meta.get("target_only_variants") or {}).items():
            parts.append(f"Configuration `{name}` (`--target-only-variant`): `no_spec` requests (as target_only) on a "
                         f"Ray front on the batched target with `{json.dumps(front)}` merged into its front config.\n")
        for name, front in (meta.get("mixed_variants") or {}).items():
            parts.append(f"Configuration `{name}` (`--mixed-variant`): mixed traffic, the even-numbered requests "
                         f"`no_spec` and the others speculating, on a Ray front on the batched target with "
                         f"`{json.dumps(front)}` merged into its front config.\n")
        parts.append(f"Closed-loop clients started together over one grpc.aio channel. batched: target `max_batch` "
                     f"{meta['max_batch']}, `batch_wait_ms` {meta['batch_wait_ms']}; one_at_a_time: `max_batch` 1; "
                     f"target_only: `no_spec` requests on the batched target (kept in step by the front's round clock "
                     f"since 2026-12-05, `cost_aware.in_step_no_spec`). Throughput = generated tokens / wall "
                     f"time of the level; latency per request from send to its final message. merged = target verify "
                     f"forwards that held more than one request; draft merged = the draft service's propose calls "
                     f"(aheads included) whose forwards held more than one request (the draft is shared by every "
                     f"config); tree rows / round = verified rows (tree nodes + 1) per round; plain rounds (cost) = rounds the cost-aware control ran without the draft because no "
                     f"draft step paid (under load: the batch's goodput); fallback rounds = rounds without the draft "
                     f"because it failed, was past its deadline, was full or was being opened. Once speculative requests overlap, the draft service "
                     f"({meta['draft_threads']} thread(s)) and the target service ({meta['target_threads']}) compute at "
                     f"the same time on {meta['cpu_count']} CPUs.\n")
        if meta.get("open_loop"):
            parts.append("Open loop (`--open-loop`): the clients column is the request rate (requests per second); "
                         "request i is sent at i / rate s whether or not the earlier ones have finished.\n")
        head = ["config", "clients", "tok/s", "vs target only", "p50 latency s", "p95 latency s",
                "p95 latency vs target only", "p50 TTFT s", "p95 TTFT s", "mean acc len", "tree rows / round",
                "plain rounds (cost)", "fallback rounds", "merged", "draft merged", "ahead hits", "ahead misses"]
        rows = []
        for r in sorted(c["rows"], key=lambda r: (c["configs"].index(r["config"]), r["clients"])):
            sp, lat = r.get("speedup_vs_target_only"), r.get("latency_p95_vs_target_only")
            rows.append([r["config"], r["clients"], _f(r["tokens_per_s"]), f"{sp:.2f}x" if sp else "-",
                         _f(r["latency_p50_s"]), _f(r["latency_p95_s"]), f"{lat:.2f}x" if lat else "-",
                         _f(r["ttft_p50_s"]), _f(r.get("ttft_p95_s")),
                         _f(r["mean_accepted_length"]), _f(r.get("mean_tree_rows")),
                         f"{r.get('cost_plain_round_share', 0):.0%}", f"{r.get('fallback_round_share', 0):.0%}",
                         r["merged_verify_forwards"], _or_dash(r.get("merged_draft_calls")),
                         _or_dash(r.get("pipeline_ahead_hits")), _or_dash(r.get("pipeline_ahead_misses"))])
        parts.append(md_table(head, rows))
        parts.append("p95 latency vs target only: the row's p95 latency / target_only's in the same level run (a repeated level pairs each repeat with its own target_only row; <= 1: "
                     "never worse). ahead hits / misses: the front's `pipeline_ahead_hits` / `pipeline_ahead_misses` "
                     "(draft rounds started ahead of the verify outcome that were used / discarded), '-' where its "
                     "final stats have no such field.\n")
        mixed = [r for r in c["rows"] if "no_spec_latency_p95_s" in r]
        if mixed:
            parts.append("Mixed traffic (`--mixed-variant`): latency per kind of request in the same rows; no_spec p95 "
                         "vs target only: the no_spec requests' p95 / target_only's p95 (every request no_spec) in the "
                         "same level run.\n")
            head = ["config", "clients", "tok/s", "no_spec p50 s", "no_spec p95 s", "no_spec p95 vs target only",
                    "speculating p50 s", "speculating p95 s"]
            rows = []
            for r in sorted(mixed, key=lambda r: (c["configs"].index(r["config"]), r["level_run"])):
                ratio = r.get("no_spec_latency_p95_vs_target_only")
                rows.append([r["config"], r["clients"], _f(r["tokens_per_s"]), _or_dash(r["no_spec_latency_p50_s"]),
                             _or_dash(r["no_spec_latency_p95_s"]), f"{ratio:.2f}x" if ratio else "-",
                             _or_dash(r["spec_latency_p50_s"]), _or_dash(r["spec_latency_p95_s"])])
            parts.append(md_table(head, rows))
        traced = [r for r in c["rows"] if r.get("pipeline_trace")]
        if traced:
            parts.append("Pipelining from the traces (rows with ahead hits): aheads = `draft.ahead` spans (failed ones "
                         "too); over the hit aheads: their mean ms, the share of their time inside their round's `verify` "
                         "span (hidden) and how long after the verify ended they still ran (wait, mean ms, an upper bound "
                         "on what the round waited). Adopted rounds (their tree came from a hit) against rounds that "
                         "drafted in line: mean round ms, and the adopted rounds that still had a `draft` span.\n")
            head = ["config", "clients", "rounds", "aheads", "hits", "hit ahead ms", "hidden behind verify",
                    "wait after verify ms", "adopted rounds", "their round ms", "with a draft span",
                    "in-line drafted rounds", "their round ms", "their draft ms", "all spans"]
            rows = []
            for r in sorted(traced, key=lambda r: (c["configs"].index(r["config"]), r["clients"])):
                t = r["pipeline_trace"]
                rows.append([r["config"], r["clients"], t["rounds"], t["aheads"], t["hits"], _or_dash(t["hit_ahead_ms_mean"], 1),
                             f"{t['hidden_share']:.0%}" if t["hidden_share"] is not None else "-", _or_dash(t["wait_ms_mean"], 1),
                             t["adopted_rounds"], _or_dash(t["adopted_round_ms_mean"], 1), t["adopted_with_draft_span"],
                             t["drafted_rounds"], _or_dash(t["drafted_round_ms_mean"], 1),
                             _or_dash(t["drafted_draft_ms_mean"], 1), "yes" if t.get("complete", True) else "no"])
            parts.append(md_table(head, rows))
        timed = [r for r in c["rows"] if r.get("cpu_s")]
        if timed:
            parts.append("CPU by process over each level (psutil: user + system time of every process on the "
                         "machine, % of one CPU over the level's time between the two snapshots): target and draft services; the row's "
                         "front process and its local Ray (raylet, GCS, the orchestrator actors); the other fronts "
                         "(idle, their Ray daemons); this benchmark process (the clients and the OTLP receiver); the "
                         "rest of the machine. busy: their sum over that time x the CPUs this benchmark may use.\n")
            head = ["config", "clients", "target %", "draft %", "front %", "front's Ray %", "other fronts %",
                    "benchmark %", "other %", "busy"]
            rows = []
            for r in sorted(timed, key=lambda r: (c["configs"].index(r["config"]), r["level_run"])):
                window = r.get("cpu_window_s") or r["wall_s"]
                pct = {role: 100 * sec / window for role, sec in r["cpu_s"].items()}
                rows.append([r["config"], r["clients"], *(_f(pct[role], 1) for role in CPU_ROLES),
                             f"{r['cpu_busy_share']:.0%}"])
            parts.append(md_table(head, rows))
        parts.append(f"Outputs identical across configurations and levels: **{c['identical_outputs']}** "
                     f"({c['identical_prompts']}/{c['prompts']} prompts)\n")
    d = result.get("gamma")
    if d:
        parts.append("## Dynamic vs fixed gamma (issue 5)\n")
        parts.append(f"Method: {d['method']}; interleaved per prompt (order alternated).\n")
        head = ["category", "mode", "n", "tok/s", "vs fixed", "decode tok/s", "mean acc len", "acc rate",
                "final gamma (mean)", "fallback rounds"]
        rows = [[r["category"], r["mode"], r["requests"], _f(r["tokens_per_s"]), f"{r['ratio_vs_fixed']:.3f}x",
                 _f(r["decode_tokens_per_s"]), _f(r["mean_accepted_length"]), _f(r["acceptance_rate"], 3),
                 _f(r["final_gamma_mean"], 1), r["fallback_rounds"]] for r in d["rows"]]
        parts.append(md_table(head, rows))
        parts.append(f"Outputs identical (dynamic vs fixed): **{d['identical_outputs']}**\n")
    if result.get("longprompt"):
        parts.append(longprompt_markdown(result["longprompt"]))
    return "\n".join(parts)


def _or_dash(x, nd=2) -> str:
    if x is None:
        return "-"
    return str(x) if isinstance(x, int) else _f(x, nd)


def pinning_line(pinning: dict | None) -> str:
    if not pinning or not pinning["pinned"]:
        return "- CPU pinning: none (every process may run on every CPU)"
    cores = ", ".join(f"{kind} {core}" for kind, core in pinning["cores"].items())
    seen = "; ".join(f"{name} {cpus}" for name, cpus in pinning["affinity"].items())
    return (f"- CPU pinning (`--pin`, taskset -c, 1 torch thread per pinned service): {cores}; "
            f"observed affinity: {seen}")


def longprompt_markdown(lp: dict) -> str:
    parts = [f"## Long prompt beside running requests (issue 12): {lp['long_prompt_tokens']}-token prompt, "
             f"{lp['running']} running requests\n",
             f"The running requests (ignore_eos, up to {lp['running_max_new_tokens']} new tokens) decode for "
             f"{lp['window_s']:.1f} s (before), then the long request arrives; during = until its first token. ITL per "
             f"token: chunk gap / tokens in the chunk; a gap belongs to the window its closing chunk arrives in (during "
             f"also takes each running request's first chunk after the long request's first token). chunked: the "
             f"target's `prefill_chunk_tokens` is below the prompt length (its prefill interleaves with verifies); "
             f"busy chunk: `prefill_busy_chunk_tokens`, the chunk size while other sessions decode, fed inside their "
             f"verify forwards (equal to the prefill chunk: no riding).\n"]
    head = ["config", "prefill chunk", "busy chunk", "chunked", "ITL p50 before ms", "ITL p95 before ms", "ITL p50 during ms",
            "ITL p95 during ms", "p95 during / before", "max gap during ms", "long TTFT s", "long new tokens",
            "running outlasted"]
    rows = [[r["config"], r["prefill_chunk_tokens"], r.get("prefill_busy_chunk_tokens", r["prefill_chunk_tokens"]), r["chunked"], _or_dash(r["itl_p50_before_ms"], 1),
             _or_dash(r["itl_p95_before_ms"], 1), _or_dash(r["itl_p50_during_ms"], 1), _or_dash(r["itl_p95_during_ms"], 1),
             f"{r['itl_p95_ratio']:.2f}x" if r["itl_p95_ratio"] else "-", _f(r["max_gap_during_ms"], 1),
             _f(r["long_ttft_s"]), r["long_new_tokens"], f"{r['running_outlasted']}/{r['running']}"] for r in lp["rows"]]
    parts.append(md_table(head, rows))
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma list of grpc, concurrency, gamma")
    p.add_argument("--target", help="target model dir (default: the real pair's target)")
    p.add_argument("--draft", help="draft model dir (default: the real pair's draft)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--draft-quant", default="auto", choices=["auto", "none", "int8"])
    p.add_argument("--questions", type=Path, default=None,
                   help="Spec-Bench question.jsonl (default: the built-in prompt set, orchestrator/measure/data/prompts.jsonl)")
    p.add_argument("--prompts", type=int, default=8, help="grpc section: prompts (spread over categories)")
    p.add_argument("--concurrency-prompts", type=int, default=None, help="requests per level (default --prompts)")
    p.add_argument("--levels", default="1,4,8", help="concurrent clients per level")
    p.add_argument("--gamma-categories", default="math_reasoning,translation")
    p.add_argument("--gamma-prompts", type=int, default=4, help="prompts per gamma category")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-prompt-tokens", type=int, default=200, help="skip questions whose prompt is longer")
    p.add_argument("--target-threads", type=int, default=2)
    p.add_argument("--draft-threads", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=16, help="batched configuration's target.max_batch (16: the config's default)")
    p.add_argument("--batch-wait-ms", type=float, default=5.0)
    p.add_argument("--workers", type=int, default=1, help="front.workers (orchestrator actors) of the Ray fronts")
    p.add_argument("--no-ray-grpc", action="store_true", help="grpc section: skip the Ray front mode")
    p.add_argument("--skip-one-at-a-time", action="store_true",
                   help="concurrency section: leave out the one-verify-at-a-time configuration (one target "
                        "service instead of two, for machines where two copies do not fit)")
    p.add_argument("--pin", action="store_true",
                   help="run the target service under taskset -c 0 and the draft under taskset -c 1, 1 torch thread each")
    p.add_argument("--batch-gather", type=float, default=None,
                   help="draft.batch_gather and target.batch_gather of every service (default: the config's)")
    p.add_argument("--round-log", action="store_true",
                   help="concurrency section: each row (target_only too) gets round_split and round_log (every round's "
                        "timings, batch sizes and tree from the traces) in the JSON")
    p.add_argument("--in-step", action="store_true",
                   help="concurrency section: add batched_in_step (a front in step at every load: "
                        "front.cost_aware.in_step_max_load 64)")
    p.add_argument("--front-variant", action="append", default=[], type=front_variant, metavar="NAME=JSON",
                   help="concurrency section: add configuration NAME, a Ray front whose front config has JSON "
                        "merged in (e.g. 'no_ctx={\"cost_aware\": {\"ngram_tokens\": 0}}'); repeatable")
    p.add_argument("--target-only-variant", action="append", default=[], type=target_only_variant, metavar="NAME=JSON",
                   help="concurrency section: add configuration NAME, no_spec requests (as target_only) on a Ray "
                        "front whose front config has JSON merged in; repeatable")
    p.add_argument("--mixed-variant", action="append", default=[], type=mixed_variant, metavar="NAME=JSON",
                   help="concurrency section: add configuration NAME, mixed traffic (even-numbered requests no_spec, "
                        "the others speculating) on a Ray front whose front config has JSON merged in; repeatable")
    p.add_argument("--open-loop", action="store_true",
                   help="concurrency section: --levels are request rates (requests per second): request i is sent at "
                        "i / rate s, not when a client is free")
    p.add_argument("--pipeline", action="store_true",
                   help="concurrency section: add speculative_pipelined (a front with front.pipeline: true)")
    p.add_argument("--long-prompt-tokens", type=int, default=2000, help="longprompt section: the long prompt's length")
    p.add_argument("--long-running", type=int, default=4, help="longprompt section: requests decoding meanwhile")
    p.add_argument("--long-running-tokens", type=int, default=1024,
                   help="longprompt section: max_new_tokens (ignore_eos) of each running request")
    p.add_argument("--long-window-s", type=float, default=10.0,
                   help="longprompt section: seconds of steady decoding measured before the long request")
    p.add_argument("--longprompt-configs", default="speculative",
                   help=f"longprompt section: comma list of {', '.join(LONGPROMPT_CONFIGS)}")
    p.add_argument("--longprompt-unchunked", action="store_true",
                   help="longprompt section: each configuration again with the long prompt prefilled in one forward")
    p.add_argument("--prefill-chunk-tokens", type=int, default=None,
                   help="longprompt section: target.prefill_chunk_tokens of the chunked rows (default: the config default)")
    p.add_argument("--prefill-busy-chunk-tokens", type=int, default=None,
                   help="longprompt section: target.prefill_busy_chunk_tokens of the chunked rows (chunks that ride in "
                        "the running requests' verify forwards; default: the config default; 0 = no riding)")
    p.add_argument("--out", type=Path, default=ROOT / "bench_out" / "serving")
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in args.sections if s not in SECTIONS]
    if bad:
        p.error(f"--sections: unknown {bad} (choose from {', '.join(SECTIONS)})")
    if args.open_loop:  # request rates (requests per second)
        try:
            args.levels = [float(x) for x in args.levels.split(",") if x.strip()]
        except ValueError:
            p.error(f"--levels: with --open-loop, request rates (requests per second), got {args.levels!r}")
        if not args.levels or min(args.levels) <= 0:
            p.error(f"--levels: with --open-loop, rates > 0, got {args.levels}")
        if "concurrency" not in args.sections:
            p.error("--open-loop: sets the concurrency section's request rates; --sections has no concurrency")
    else:
        args.levels = [int(x) for x in args.levels.split(",") if x.strip()]
        if args.concurrency_prompts is not None and args.concurrency_prompts < max(args.levels):
            p.error(f"--concurrency-prompts: {args.concurrency_prompts} requests leave clients of level "
                    f"{max(args.levels)} idle (give at least the largest of --levels)")
    args.gamma_categories = [c.strip() for c in args.gamma_categories.split(",") if c.strip()]
    args.concurrency_prompts = args.concurrency_prompts or (args.prompts if args.open_loop else max(args.prompts, *args.levels))
    if bool(args.target) != bool(args.draft):
        p.error("--target and --draft go together")
    check_longprompt_args(p, args)
    check_front_variants(p, args)
    if args.pin:  # one torch thread per pinned core
        args.target_threads = args.draft_threads = 1
    return args


def check_longprompt_args(p: argparse.ArgumentParser, args) -> None:
    """--longprompt-configs names, the long request's sizes, and the pipeline key where it is asked for."""
    from specdec.config import FrontConfig

    args.longprompt_configs = [c.strip() for c in args.longprompt_configs.split(",") if c.strip()]
    bad = [c for c in args.longprompt_configs if c not in LONGPROMPT_CONFIGS]
    if bad or not args.longprompt_configs:
        p.error(f"--longprompt-configs: unknown {bad} (choose from {', '.join(LONGPROMPT_CONFIGS)})")
    for name in ("long_prompt_tokens", "long_running", "long_running_tokens", "prefill_chunk_tokens",
                 "prefill_busy_chunk_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    if args.long_window_s <= 0:
        p.error(f"--long-window-s: must be > 0, got {args.long_window_s}")
    wants_pipeline = args.pipeline or "speculative_pipelined" in args.longprompt_configs
    if wants_pipeline and "pipeline" not in FrontConfig.model_fields:
        p.error("--pipeline / --longprompt-configs speculative_pipelined: this specdec's FrontConfig has no "
                "'pipeline' key (draft/verify pipelining is not in this build)")


def pin_plan(enabled: bool) -> dict | None:
    """--pin: the taskset core list per service kind (PIN_CORES), once taskset and those CPUs are
    known to be there; None without --pin. Raises SystemExit naming what is missing."""
    if not enabled:
        return None
    if shutil.which("taskset") is None:
        raise SystemExit("--pin: the taskset command (util-linux) is not on PATH; install util-linux or drop --pin")
    usable = os.sched_getaffinity(0)
    wanted = {int(c) for c in PIN_CORES.values()}
    if not wanted <= usable:
        raise SystemExit(f"--pin: needs CPUs {sorted(wanted)} (target, draft) but this process may use only {sorted(usable)}")
    return dict(PIN_CORES)


def main(argv=None) -> int:
    args = parse_args(argv)
    pin = pin_plan(args.pin)
    started = time.perf_counter()
    from specdec.model_setup import resolve_draft_quant, resolve_dtype
    from specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model_dir
    from specdec.tree_spec import DEFAULT_SPEC

    args.target = resolve_model_dir(args.target, DEFAULT_TARGET, "--target")
    args.draft = resolve_model_dir(args.draft, DEFAULT_DRAFT, "--draft")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    all_prompts = load_prompts(args.questions, tokenizer, args.max_prompt_tokens)
    if not all_prompts:
        raise SystemExit(f"no question of {args.questions or 'the built-in prompt set'} fits in --max-prompt-tokens {args.max_prompt_tokens}")
    grpc_prompts = spread(all_prompts, args.prompts)
    conc_prompts = spread(all_prompts, args.concurrency_prompts)
    gamma_prompts = {c: [p for p in all_prompts if p["category"] == c][: args.gamma_prompts] for c in args.gamma_categories}
    gamma_prompts = {c: v for c, v in gamma_prompts.items() if v}
    if "gamma" in args.sections and not gamma_prompts:
        raise SystemExit(f"--gamma-categories: no short question in {args.gamma_categories}")

    want_grpc, want_conc, want_gamma, want_long = (s in args.sections for s in SECTIONS)
    ray_grpc = want_grpc and not args.no_ray_grpc
    need = 3 * weights_bytes(args.target) + 2 * weights_bytes(args.draft) + (4 << 30)
    early = want_conc and need < mem_available() and not args.skip_one_at_a_time
    log(f"sections {args.sections}; {len(all_prompts)} questions fit; concurrency services start "
        f"{'early' if early else 'after the grpc/gamma phase'}")

    workdir = Path(tempfile.mkdtemp(prefix="serving-bench-"))
    result: dict = {}
    with SpanCollector() as collector:
        services = Services(workdir, collector.env(), pin)
        try:
            fronts: dict[str, str] = {}
            one, draft = None, None
            want_one = want_grpc or (want_conc and not args.skip_one_at_a_time)
            if want_grpc or want_conc or want_long:
                draft = services.launch("draft", "bench-draft", service_config(args, args.draft_threads))
            if want_one:
                one = services.launch("target", "bench-target-one", service_config(args, args.target_threads, {"max_batch": 1}))
            batched = front_batched = front_local = front_ray_one = None

            def launch_batched():
                nonlocal batched
                batched = services.launch("target", "bench-target-batched", service_config(
                    args, args.target_threads, {"max_batch": args.max_batch, "batch_wait_ms": args.batch_wait_ms}))

            if early:
                launch_batched()
            services.wait(draft) if draft else None
            services.wait(one) if one else None
            if early:  # loaded before any front connects: each front times the services then, nothing else computing
                services.wait(batched)
            if want_grpc:
                # each front measures the services when it connects (its cost model's start): one at a time
                front_local = services.wait(services.launch(
                    "front", "bench-front-local", service_config(args, front={"use_ray": False}),
                    draft_address=draft.address, target_address=one.address, no_ray=True))
            if ray_grpc or (want_conc and want_one):
                front_ray_one = services.wait(services.launch(
                    "front", "bench-front-ray-one", service_config(args, front={"use_ray": True}),
                    draft_address=draft.address, target_address=one.address))
            if early:
                # each front measures the services when it connects (its cost model's start): one at a
                # time, and before this process loads the embedded pair, so nothing else computes then
                front_batched = services.wait(services.launch(
                    "front", "bench-front-ray-batched", service_config(args, front={"use_ray": True}),
                    draft_address=draft.address, target_address=batched.address))
            pipe = mem_exporter = None
            if want_grpc or want_gamma:
                from orchestrator.loop.embedded import build_pipeline, set_threads

                mem_exporter = install_memory_tracing()
                set_threads(args.target_threads)
                pipe = build_pipeline(str(args.target), str(args.draft), dtype=args.dtype, draft_quant=args.draft_quant)
                log(f"embedded pair loaded ({pipe.target_model.dtype})")
            if want_grpc:
                fronts["grpc_local"] = services.wait(front_local).address
                if ray_grpc:
                    fronts["grpc_ray"] = services.wait(front_ray_one).address
                log(f"grpc section: {len(grpc_prompts)} prompts x {len(fronts) + 1} modes")
                result["grpc"] = section_grpc(args, pipe, grpc_prompts, fronts, collector, mem_exporter)
            if want_gamma:
                log(f"gamma section: {sum(map(len, gamma_prompts.values()))} prompts x 2 modes")
                result["gamma"] = section_gamma(args, pipe, gamma_prompts)
            dtype = str(pipe.target_model.dtype).removeprefix("torch.") if pipe is not None else resolve_dtype(args.dtype, "cpu")
            del pipe
            gc.collect()
            if want_conc:
                if front_local is not None:
                    services.stop(front_local)
                if one is not None and args.skip_one_at_a_time:  # one target copy at a time
                    if front_ray_one is not None:
                        services.stop(front_ray_one)
                    services.stop(one)
                    front_ray_one = one = None
                if not early:
                    launch_batched()
                    services.wait(batched)
                    front_batched = services.wait(services.launch(  # fronts one at a time: see above
                        "front", "bench-front-ray-batched", service_config(args, front={"use_ray": True}),
                        draft_address=draft.address, target_address=batched.address))
                front_pipelined = None
                if args.pipeline:
                    front_pipelined = services.wait(services.launch(
                        "front", "bench-front-ray-pipelined", service_config(args, front={"use_ray": True, "pipeline": True}),
                        draft_address=draft.address, target_address=batched.address))
                front_in_step = None
                if args.in_step:
                    front_in_step = services.wait(services.launch(
                        "front", "bench-front-ray-in-step",
                        service_config(args, front={"use_ray": True,
                                                    "cost_aware": {"in_step": True, "in_step_max_load": 64.0}}),
                        draft_address=draft.address, target_address=batched.address))
                variants = {name: services.wait(services.launch(
                                "front", f"bench-front-variant-{name}", service_config(args, front={"use_ray": True, **front}),
                                draft_address=draft.address, target_address=batched.address))
                            for name, front in args.front_variant + args.target_only_variant + args.mixed_variant}
                kinds = {**{name: True for name, _ in args.target_only_variant},
                         **{name: MIXED for name, _ in args.mixed_variant}}
                services.wait(front_batched)
                configs = {"batched": (front_batched.address, batched.address, False)}
                for name, front in variants.items():
                    configs[name] = (services.wait(front).address, batched.address, kinds.get(name, False))
                if front_in_step is not None:
                    configs["batched_in_step"] = (services.wait(front_in_step).address, batched.address, False)
                if front_ray_one is not None:
                    configs["one_at_a_time"] = (services.wait(front_ray_one).address, one.address, False)
                if front_pipelined is not None:
                    configs["speculative_pipelined"] = (services.wait(front_pipelined).address, batched.address, False)
                configs["target_only"] = (front_batched.address, batched.address, True)
                log(f"concurrency section: levels {args.levels} x {len(conc_prompts)} requests x {len(configs)} configs")
                result["concurrency"] = section_concurrency(args, conc_prompts, configs, collector, draft.address,
                                                                    services)
            if want_long:
                for service in [s for s in services.running if s is not draft]:  # one target service at a time
                    services.stop(service)
                services.wait(draft)
                log(f"longprompt section: {args.long_prompt_tokens}-token prompt beside {args.long_running} running "
                    f"requests x {len(args.longprompt_configs)} configs")
                result["longprompt"] = section_longprompt(args, services, draft, tokenizer, conc_prompts)
        finally:
            services.stop_all()
            shutil.rmtree(workdir, ignore_errors=True)
    dq = resolve_draft_quant(args.draft_quant, "cpu")
    result["meta"] = {
        "target": str(args.target), "draft": str(args.draft), "target_name": Path(args.target).name,
        "draft_name": Path(args.draft).name, "dtype_arg": args.dtype, "dtype": dtype, "draft_quant_arg": args.draft_quant,
        "draft_quant": dq, "bf16_note": BF16_NOTE if args.dtype == "auto" and dtype == "float32" else None,
        "target_threads": args.target_threads, "draft_threads": args.draft_threads,
        "tree": DEFAULT_SPEC.to_json(), "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
        "max_batch": args.max_batch, "batch_wait_ms": args.batch_wait_ms, "batch_gather": args.batch_gather,
        "workers": args.workers,
        "sections": args.sections, "levels": args.levels, "questions": str(args.questions or "built-in"),
        "machine": platform.platform(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "concurrency_services_started_early": early, "wall_s": time.perf_counter() - started,
        "peak_rss_mb": services.peak_rss_mb, "front_start_costs": services.start_costs, "pipeline": args.pipeline, "front_variants": dict(args.front_variant),
        "target_only_variants": dict(args.target_only_variant), "mixed_variants": dict(args.mixed_variant),
        "open_loop": args.open_loop,
        "pinning": {"pinned": pin is not None, "cores": {**pin, "front": "unpinned"} if pin else None,
                    "affinity": services.affinity},
    }
    result = {"meta": result.pop("meta"), **result}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serving.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (args.out / "serving.md").write_text(md)
    print(md)
    log(f"wrote {args.out / 'serving.json'} and {args.out / 'serving.md'} in {result['meta']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
