"""Serving benchmark on one model pair, its services started here as subprocesses; the parts run
side by side in one run, so the figures are ratios taken under the same noise.

Sections (``--sections``): concurrency, longprompt; docs/benchmarks.md gives each one's method (and the retired ones).

    python benchmarks/serving.py --sections concurrency --levels 1,4,8 --max-new-tokens 32

Writes serving.json and serving.md under ``--out``; flags are in ``--help``.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import functools
import itertools
import json
import os
import platform
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import psutil  # noqa: E402
import yaml  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from orchestrator.loop.embedded import encode_prompt  # noqa: E402
from orchestrator.measure.bench import BUILTIN_QUESTIONS, parse_questions  # noqa: E402
from orchestrator.measure.eval_report import peak_rss_mb  # noqa: E402
from orchestrator.measure.trace_report import Span  # noqa: E402
from specdec.config import ClientLimitsConfig, ConfigError, TargetServerConfig, load_config  # noqa: E402
from specdec.harness.otlp import OtlpReceiver, attribute_value  # noqa: E402
from specdec.harness.report import machine, md_table, percentile, write_record  # noqa: E402
from specdec.harness.servers import Service, launch_service, stop_service, wait_ready  # noqa: E402
from specdec.harness.topology import SplitTopology  # noqa: E402
from specdec.model_setup import resolve_draft_quant, resolve_dtype  # noqa: E402
from specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model_dir  # noqa: E402
from specdec.tree_spec import DEFAULT_SPEC  # noqa: E402
from specdec.v1 import (draft_pb2, draft_pb2_grpc, generation_pb2, generation_pb2_grpc, target_pb2,  # noqa: E402
                        target_pb2_grpc)

SECTIONS = ("concurrency", "longprompt")
LONGPROMPT_CONFIGS = ("speculative", "speculative_pipelined", "target_only")
SPLIT_RTT_MS = [0.2, 30.0, 300.0]  # --topology split: the draft link's round trips (ms) unless --rtt-ms
PIN_CORES = {"target": "0", "draft": "1"}  # --pin: taskset -c cores per service kind (fronts unpinned)
PIPELINE_STATS = ("pipeline_ahead_hits", "pipeline_ahead_misses", "predraft_hits", "pipelined_rounds", "predrafted_rounds")
FINAL_STATS = ("rounds", "fallback_rounds", "proposed_tokens", "cost_plain_rounds", *PIPELINE_STATS)  # kept FinalStats
BF16_NOTE = ("On a CPU `models.dtype: auto` resolves to float32 (exact, and faster than bf16 for tree "
             "verification there), which is what is measured, not bf16.")


def log(msg: str) -> None:
    print(f"[serving {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class SpanCollector(OtlpReceiver):
    """OtlpReceiver keeping trace_report's Span (wall-clock start / end, comparable across this machine's processes)."""

    def keep(self, service: str, span) -> Span:
        return Span(span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), span.name, service,
                    span.start_time_unix_nano, span.end_time_unix_nano,
                    {a.key: attribute_value(a.value) for a in span.attributes})


def client_id(rid: str) -> str:
    """The client's request_id of a span's request.id: the front runs it as ``ID~SUFFIX``, sessions add ``/...``."""
    return rid.split("/")[0].split("~")[0]


def request_rounds(spans: list[Span], request_ids: set[str]) -> dict[str, list[Span]]:
    """Each request's ``round`` spans, by request.id (``client_id``) or by their ``generate`` parent."""
    generate = {s.span_id: client_id(str(s.attributes.get("request.id", ""))) for s in spans if s.name == "generate"}
    out: dict[str, list[Span]] = defaultdict(list)
    for s in (s for s in spans if s.name == "round"):
        rid = str(s.attributes.get("request.id", ""))
        key = next((k for k in (rid, client_id(rid), generate.get(s.parent_id)) if k in request_ids), None)
        if key is not None:
            out[key].append(s)
    return out


def round_children(spans: list[Span], request_ids: set[str], names: tuple[str, ...]) -> list[tuple[Span, dict[str, Span]]]:
    """These requests' ``round`` spans, each with its children named in ``names`` (name -> span)."""
    rounds = [s for group in request_rounds(spans, request_ids).values() for s in group]
    ids = {s.span_id for s in rounds}
    children: dict[str, dict[str, Span]] = defaultdict(dict)
    for s in spans:
        if s.parent_id in ids and s.name in names:
            children[s.parent_id][s.name] = s
    return [(r, children[r.span_id]) for r in rounds]


def mean(values) -> float | None:
    return sum(values) / len(values) if values else None


ROUND_ATTRIBUTES = {"gamma": "gamma", "nodes": "tree.nodes", "drafted": "tree.drafted", "accepted": "accepted_length",
                    "fallback": "fallback.reason"}  # round_log key -> the round span's attribute


def round_log(spans: list[Span], request_ids: set[str]) -> list[dict]:
    """One row per round of these requests, in start order (times in s and ms, batch sizes, gamma, accepted)."""
    rounds = sorted(round_children(spans, request_ids, ("draft", "verify")), key=lambda rk: rk[0].start_ns)
    t0 = rounds[0][0].start_ns if rounds else 0
    out = []
    for r, kids in rounds:
        draft, verify = kids.get("draft"), kids.get("verify")
        d, v = (draft.attributes if draft else {}), (verify.attributes if verify else {})
        out.append({"request": client_id(str(r.attributes.get("request.id", ""))),
                    "t_s": round((r.start_ns - t0) / 1e9, 3), "round_ms": round(r.ms, 1),
                    "draft_ms": round(draft.ms, 1) if draft else None, "draft_server_ms": d.get("draft.draft_ms"),
                    "draft_batch": d.get("draft.batch_size"), "verify_ms": round(verify.ms, 1) if verify else None,
                    "verify_server_ms": v.get("target.verify_ms"), "verify_batch": v.get("target.batch_size"),
                    **{key: r.attributes.get(name) for key, name in ROUND_ATTRIBUTES.items()}})
    return out


def round_split(spans: list[Span], request_ids: set[str]) -> dict:
    """Mean ms per phase over the round spans of these requests (and their children)."""
    rounds = round_children(spans, request_ids, ("draft", "verify", "commit"))
    rows = defaultdict(list)
    tree_bytes = []
    for r, kids in rounds:
        phase = {name: kids[name].ms if name in kids else 0.0 for name in ("draft", "verify", "commit")}
        draft_ms = kids["draft"].attributes.get("draft.draft_ms", phase["draft"]) if "draft" in kids else None
        verify_ms = kids["verify"].attributes.get("target.verify_ms", phase["verify"]) if "verify" in kids else None
        if "verify" in kids and r.attributes.get("tree.nodes", 0) and "tree.bytes" in kids["verify"].attributes:
            tree_bytes.append(kids["verify"].attributes["tree.bytes"])
        for key, ms in (("round", r.ms), *phase.items(), ("draft_server", draft_ms or 0.0),
                        ("verify_server", verify_ms or 0.0),
                        ("transfer", r.ms - (draft_ms or 0.0) - (verify_ms or 0.0)),
                        ("other", r.ms - sum(phase.values()))):
            rows[key].append(ms)
    out = {"rounds": len(rounds), **{f"{key}_ms": mean(values) for key, values in rows.items()}}
    out["draft_wire_ms"] = out.get("draft_ms", 0.0) - out.get("draft_server_ms", 0.0)
    out["verify_wire_ms"] = out.get("verify_ms", 0.0) - out.get("verify_server_ms", 0.0)
    if tree_bytes:
        out["tree_bytes_mean"], out["tree_bytes_max"] = mean(tree_bytes), max(tree_bytes)
    return out


def wait_for_rounds(collector: SpanCollector, expected: dict[str, int], timeout_s: float = 30.0) -> bool:
    """Wait for each request's ``round`` spans (request id -> count); False with a warning after timeout_s."""
    deadline = time.monotonic() + timeout_s
    got: dict[str, int] = {}
    while time.monotonic() < deadline:
        got = {k: len(v) for k, v in request_rounds(collector.spans(), set(expected)).items()}
        if all(got.get(k, 0) >= v for k, v in expected.items()):
            return True
        time.sleep(0.3)
    seen = Counter((s.service, s.name) for s in collector.spans())
    log(f"warning: round spans missing after {timeout_s:.0f} s (got {dict(got)}, expected {expected}); spans seen: {dict(seen)}")
    return False


def pipeline_overlap(spans: list[Span], request_ids: set[str]) -> dict:
    """Each round's ``draft.ahead`` span against its ``verify`` span; hidden_share: the hits' share inside it."""
    rounds = round_children(spans, request_ids, ("draft", "verify", "draft.ahead"))
    aheads = ahead_ns = hidden_ns = adopted_with_draft = 0
    hit_ms, waits, adopted_ms, drafted_ms, drafted_draft = [], [], [], [], []
    for r, kids in rounds:
        ahead, verify, draft = kids.get("draft.ahead"), kids.get("verify"), kids.get("draft")
        aheads += ahead is not None and verify is not None
        if ahead is not None and verify is not None and r.attributes.get("ahead.outcome") == "hit":
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
    return {"rounds": len(rounds), "aheads": aheads, "hits": len(hit_ms), "hit_ahead_ms_mean": mean(hit_ms),
            "hidden_share": hidden_ns / ahead_ns if ahead_ns else None, "wait_ms_mean": mean(waits),
            "adopted_rounds": len(adopted_ms), "adopted_with_draft_span": adopted_with_draft,
            "adopted_round_ms_mean": mean(adopted_ms), "drafted_rounds": len(drafted_ms),
            "drafted_round_ms_mean": mean(drafted_ms), "drafted_draft_ms_mean": mean(drafted_draft)}


async def grpc_generate(stub, request_id: str, ids: list[int], max_new: int, no_spec: bool = False,
                        ignore_eos: bool = False, chunks: list | None = None) -> dict:
    """One streamed request; ``chunks`` gets (perf_counter s, tokens) of each message as it arrives."""
    tokens, first, stats = [], None, None
    start = time.perf_counter()
    request = generation_pb2.GenerateRequest(request_id=request_id, prompt_ids=list(ids), max_new_tokens=max_new,
                                             no_spec=no_spec, ignore_eos=ignore_eos)
    async for reply in stub.Generate(request, timeout=1800.0):
        if reply.token_ids:
            now = time.perf_counter()
            first = now if first is None else first
            if chunks is not None:
                chunks.append((now, len(reply.token_ids)))
        tokens += reply.token_ids
        if reply.HasField("stats"):
            stats = reply.stats
    wall = time.perf_counter() - start
    return {"tokens": tokens, "new_tokens": len(tokens), "wall_s": wall, "ttft_s": (first or time.perf_counter()) - start,
            "draft_link_rtt_ms": stats.draft_link_rtt_ms if stats.HasField("draft_link_rtt_ms") else None,
            **{key: getattr(stats, key) for key in FINAL_STATS}}


@contextlib.asynccontextmanager
async def generation_stub(address: str):
    """A GenerationService stub on a ready grpc.aio channel to a front."""
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 60)
        yield generation_pb2_grpc.GenerationServiceStub(channel)


def merged_forwards(address: dict[str, str]) -> tuple[int, int]:
    """The target's verify forwards and the draft's proposals that merged sessions so far (address: kind -> address)."""
    with grpc.insecure_channel(address["target"]) as target, grpc.insecure_channel(address["draft"]) as draft:
        return (target_pb2_grpc.TargetServiceStub(target).Info(target_pb2.InfoRequest(), timeout=30).batched_forwards,
                draft_pb2_grpc.DraftServiceStub(draft).Info(draft_pb2.DraftInfoRequest(), timeout=30).batched_forwards)


PER_REQUEST = ("client", "started_s", "prompt_tokens", "wall_s", "ttft_s", "new_tokens", "rounds", "proposed_tokens",
               "cost_plain_rounds", "fallback_rounds", "no_spec")  # each request's row in a level's JSON (per_request)
MIXED = "mixed"  # a configuration's no_spec value for mixed traffic: even-numbered requests no_spec, the others speculate


def run_level(address: str, prompts: list[list[int]], clients: int, max_new: int, no_spec: bool | str, tag: str,
              rate: float | None = None) -> dict:
    """``clients`` closed-loop clients sharing the prompts (or, with ``rate`` req/s, open loop); wall and rows."""
    async def run():
        async with generation_stub(address) as stub:
            queue = list(enumerate(prompts))
            results: list = [None] * len(prompts)

            async def send(i: int, ids: list[int], c: int):
                began = time.perf_counter() - start
                plain = i % 2 == 0 if no_spec == MIXED else bool(no_spec)
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


@dataclass
class Services:
    """The server subprocesses of a run (stopped in reverse order of launch)."""

    workdir: Path
    env: dict
    pin: dict | None = None  # kind -> taskset core list ("0"); kinds not named run unpinned
    topology: SplitTopology | None = None  # --topology split: each kind in its namespace, on its address
    running: list = field(default_factory=list)
    peak_rss_mb: dict = field(default_factory=dict)  # name -> peak resident MB (VmHWM), read as each stops
    affinity: dict = field(default_factory=dict)  # name -> CPUs its process may run on, read once ready
    start_costs: dict = field(default_factory=dict)  # front name -> the cost model it started from (front_start_costs)
    relays: dict = field(default_factory=dict)  # draft name -> its relay's address (split topology)
    measured_rtt_ms: float | None = None  # through the first relay (SplitTopology.measure_rtt)

    def launch(self, kind: str, name: str, config: dict, **flags) -> Service:
        """Start a service from ``config`` (written to the workdir), under ``taskset -c`` where ``pin`` names its
        kind; on a split topology in its kind's namespace, on its address."""
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        env = {**self.env, "OTEL_SERVICE_NAME": name}
        cores = (self.pin or {}).get(kind)
        prefix = ["taskset", "-c", cores] if cores is not None else []  # it execs the server: the pid stays its own
        if self.topology is not None:
            prefix, flags["host"] = self.topology.prefix(kind), self.topology.hosts[kind]
            env.update(self.topology.env(kind))
        service = launch_service(kind, path, env, prefix, **flags)
        service.name = name
        self.running.append(service)
        return service

    def wait(self, service: Service) -> Service:
        """Wait for its ready line (ServiceNotReady if none comes), then note the CPUs it may run on."""
        wait_ready(service, 600.0)
        self.affinity.setdefault(service.name, sorted(os.sched_getaffinity(service.proc.pid)))
        return service

    def dial(self, service: Service) -> str:
        """Where others dial ``service``: on a split topology a draft's relay (started, its round trip measured,
        on first use)."""
        if self.topology is None or service.kind != "draft":
            return service.address
        if service.name not in self.relays:
            self.relays[service.name] = self.topology.relay(service.address)
            self.measured_rtt_ms = self.measured_rtt_ms or self.topology.measure_rtt(self.relays[service.name])
        return self.relays[service.name]

    def stop(self, *services: Service, timeout_s: float = 30.0) -> None:
        """Note each one's peak RSS (a front's starting costs too), SIGTERM them all, then ``stop_service`` each."""
        services = tuple(s for s in services if s in self.running)
        for service in services:
            self.running.remove(service)
            with contextlib.suppress(ValueError, OSError):  # already gone, or no /proc here
                self.peak_rss_mb[service.name] = peak_rss_mb(service.proc.pid)
            with contextlib.suppress(OSError):
                costs = front_start_costs(service.stderr) if service.kind == "front" else None
                if costs is not None:
                    self.start_costs[service.name] = costs
            if service.proc.poll() is None:
                service.proc.send_signal(signal.SIGTERM)
        for service in services:
            stop_service(service, timeout_s)
            service.stderr_path.unlink(missing_ok=True)

    def stop_all(self) -> None:
        self.stop(*reversed(self.running), timeout_s=60)


_MEASURED = re.compile(r"cost model measured through the services: V\(n\) (\{[^}]*\}) ms, D\(p\) (\{[^}]*\}) ms")


def front_start_costs(log_text: str) -> dict | None:
    """A front's starting cost model from its log; {"failed": warning} if measuring failed, None if not measured."""
    found = _MEASURED.search(log_text)
    if found:
        return {"verify_ms": ast.literal_eval(found.group(1)), "draft_step_ms": ast.literal_eval(found.group(2))}
    for line in log_text.splitlines():
        if "cost model: measuring through the services failed" in line:
            return {"failed": line.split("cost model: ", 1)[1]}
    return None


def front_variant(text: str, flag: str = "--front-variant") -> tuple[str, dict]:
    """``NAME=JSON`` -> (NAME, object). Raises argparse.ArgumentTypeError on a bad name or non-object JSON."""
    name, sep, body = text.partition("=")
    reserved = ("batched", "speculative_pipelined", "target_only")
    if not sep or not name.isidentifier() or name in reserved:
        raise argparse.ArgumentTypeError(f"{flag}: need NAME=JSON with NAME an identifier other than "
                                         f"{', '.join(reserved)}, got {text!r}")
    try:
        front = json.loads(body)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{flag} {name}: not JSON ({exc})") from exc
    if not isinstance(front, dict):
        raise argparse.ArgumentTypeError(f"{flag} {name}: need a JSON object, got {body!r}")
    return name, front


def deep_merge(base: dict, over: dict) -> dict:
    """A new dict: base with over's keys set, nested mappings merged."""
    out = dict(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# flag -> (no_spec of its configurations, what they run: serving.md)
VARIANTS = {"--front-variant": (False, "a Ray front on the batched target"),
            "--target-only-variant": (True, "`no_spec` requests (as target_only) on a Ray front on the batched target"),
            "--mixed-variant": (MIXED, "mixed traffic, the even-numbered requests `no_spec` and the others "
                                       "speculating, on a Ray front on the batched target")}


def variants(args) -> list[tuple[str, str, dict]]:
    """Every variant configuration asked for: (flag, NAME, front JSON), in flag order."""
    return [(flag, name, front) for flag in VARIANTS for name, front in getattr(args, flag[2:].replace("-", "_"))]


def check_front_variants(p: argparse.ArgumentParser, args) -> None:
    """Check the variant flags (distinct names, concurrency selected, valid front configs) before any model loads."""
    given = variants(args)
    if not given:
        return
    twice = sorted(name for name, n in Counter(name for _, name, _ in given).items() if n > 1)
    if twice:
        p.error(f"{'/'.join(VARIANTS)}: {', '.join(twice)} given more than once")
    if "concurrency" not in args.sections:
        flags = sorted({flag for flag, _, _ in given})
        p.error(f"{'/'.join(flags)}: adds concurrency configurations; --sections has no concurrency")
    for flag, name, front in given:
        try:  # through load_config, so a retired key names itself (RETIRED_KEYS)
            load_config(None, {"front": deep_merge({"use_ray": True}, front)})
        except ConfigError as exc:
            p.error(f"{flag} {name}: not a valid front config ({exc})")


def service_config(args, threads: int | None = None, target: dict | None = None, front: dict | None = None) -> dict:
    data: dict = {
        "models": {"target": str(args.target), "draft": str(args.draft), "dtype": args.dtype, "draft_quant": args.draft_quant},
        "grpc": {"shutdown_grace_s": 2.0},
        "draft": {"port": 0},
        "target": {"port": 0, **(target or {})},
    }
    if args.batch_gather is not None:  # both services' batchers
        data["draft"]["batch_gather"] = data["target"]["batch_gather"] = args.batch_gather
    if threads:
        data["models"]["threads"] = threads
    if front is not None:
        # admit every stream the run opens at once
        level = args.concurrency_prompts if args.open_loop else max(args.levels)
        streams = max(level, args.long_running + 1, ClientLimitsConfig().max_running)
        data["front"] = deep_merge({"port": 0, "max_new_tokens": args.max_new_tokens,
                                    "ray_num_cpus": 2, "limits": {"max_running": streams}}, front)
    return data


def start_target(services: Services, args, name: str, **target) -> Service:
    """A target with --max-batch, --batch-wait-ms and these ``target`` config keys (not waited for)."""
    target = {"max_batch": args.max_batch, "batch_wait_ms": args.batch_wait_ms, **target}
    return services.launch("target", name, service_config(args, args.target_threads, target))


def start_front(services: Services, args, name: str, front: dict, draft: Service, target: Service) -> Service:
    """A front on these services, waited for (one at a time: each times the services as it connects)."""
    config = service_config(args, front=front)
    return services.wait(services.launch("front", name, config, draft_address=services.dial(draft),
                                         target_address=target.address))


CPU_ROLES = ("target", "draft", "front", "front_ray", "other_fronts", "benchmark", "other")


def cpu_snapshot(services: dict[int, tuple[str, str]]) -> dict[int, tuple[str, str, float, float]]:
    """Every process's CPU time so far: pid -> (owner service, part "process"/"ray"/"", CPU s, start time)."""
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
    """CPU seconds between two ``cpu_snapshot`` calls by role (CPU_ROLES); a process that ended is lost."""
    split = dict.fromkeys(CPU_ROLES, 0.0)
    for pid, (owner, part, seconds, started) in after.items():
        old = before.get(pid)
        same = old is not None and (old[0], old[1], old[3]) == (owner, part, started)
        spent = seconds - old[2] if same else seconds
        if owner == front:
            role = "front" if part == "process" else "front_ray"
        else:
            role = {"front": "other_fronts", "target": "target", "draft": "draft"}.get(
                kinds.get(owner), "benchmark" if owner == "benchmark" else "other")
        split[role] += max(spent, 0.0)
    return split


def ratio(a: float, b: float | None, default: float | None = None) -> float | None:
    """a / b; ``default`` when b is 0 or None (no reference to compare with)."""
    return a / b if b else default


def measure_level(args, ids: list[list[int]], name: str, level, front: str, no_spec,
                  services: Services) -> tuple[dict, dict]:
    """One level of one configuration on the running services (one draft, one target, the fronts):
    ``run_level``'s result plus merged forwards and CPU by role."""
    owners = {svc.proc.pid: (svc.name, svc.kind) for svc in services.running}
    address = {svc.kind: services.dial(svc) for svc in services.running}
    verify_before, draft_before = merged_forwards(address)
    began = time.perf_counter()
    cpu_before = cpu_snapshot(owners)
    out = run_level(front, ids, int(level), args.max_new_tokens, no_spec, f"conc-{name}-{level}",
                    rate=level if args.open_loop else None)
    cpu = cpu_split(cpu_before, cpu_snapshot(owners), dict(owners.values()),
                    {svc.address: svc.name for svc in services.running}.get(front))
    # the window spans both snapshots whole: CPU time a process spends while they walk the processes counts
    window = time.perf_counter() - began
    verify_after, draft_after = merged_forwards(address)
    counters = {"merged_verify_forwards": verify_after - verify_before,
                "merged_draft_calls": draft_after - draft_before, "cpu_s": cpu, "cpu_window_s": window,
                "cpu_busy_share": sum(cpu.values()) / (window * len(os.sched_getaffinity(0)))}
    return out, counters


def level_row(name: str, level, no_spec, out: dict, counters: dict, run_order: int, level_run: int) -> dict:
    """A concurrency row from a level's requests: throughput, latency and TTFT percentiles, counters."""
    reqs, wall_s = out["requests"], out["wall_s"]
    lat, ttft = [r["wall_s"] for r in reqs], [r["ttft_s"] for r in reqs]
    tokens, rounds = sum(r["new_tokens"] for r in reqs), sum(r["rounds"] for r in reqs)
    rows_verified = sum(r["proposed_tokens"] for r in reqs) + rounds  # each round verifies its tree + 1 row
    row = {"config": name, "clients": level, "requests": len(reqs), "new_tokens": tokens, "wall_s": wall_s,
           "tokens_per_s": tokens / wall_s, "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
           "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
           "mean_accepted_length": ratio(tokens, rounds, 0.0), "mean_tree_rows": ratio(rows_verified, rounds, 0.0),
           "cost_plain_round_share": ratio(sum(r["cost_plain_rounds"] for r in reqs), rounds, 0.0),
           "fallback_round_share": ratio(sum(r["fallback_rounds"] for r in reqs), rounds, 0.0),
           "run_order": run_order, "level_run": level_run, **counters,
           "per_request": [{key: r[key] for key in PER_REQUEST} for r in reqs],
           **{key: sum(r[key] for r in reqs) for key in PIPELINE_STATS}}
    row["ahead_round_share"] = ratio(row["pipelined_rounds"] + row["predrafted_rounds"], rounds, 0.0)
    rtts = [r["draft_link_rtt_ms"] for r in reqs if r["draft_link_rtt_ms"] is not None]
    row["draft_link_rtt_ms"] = percentile(rtts, 50) if rtts else None
    if no_spec == MIXED:
        for kind, plain in (("no_spec", True), ("spec", False)):
            kind_lat = [r["wall_s"] for r in reqs if r["no_spec"] is plain]
            row[f"{kind}_latency_p50_s"] = percentile(kind_lat, 50) if kind_lat else None
            row[f"{kind}_latency_p95_s"] = percentile(kind_lat, 95) if kind_lat else None
    return row


def add_traces(rows: list[dict], collector: SpanCollector, round_logs: bool) -> None:
    """Add ``pipeline_trace`` to rows with ahead hits and, with ``round_logs``, round_split/round_log to every row."""
    for row in rows:  # a repeated level reuses its request ids
        expected = {f"conc-{row['config']}-{row['clients']}-{i}": r["rounds"] for i, r in enumerate(row["per_request"])}
        if row["pipeline_ahead_hits"]:
            complete = wait_for_rounds(collector, expected)
            row["pipeline_trace"] = {**pipeline_overlap(collector.spans(), set(expected)), "complete": complete}
        if round_logs:
            wait_for_rounds(collector, expected)
            row["round_split"] = round_split(collector.spans(), set(expected))
            row["round_log"] = round_log(collector.spans(), set(expected))


def section_concurrency(args, prompts, configs: dict, collector: SpanCollector, services: Services) -> dict:
    """Every level of ``--levels`` per configuration (name -> (front, no_spec)), order rotated per level; each row
    against the target_only row of the same level run."""
    ids = [p["ids"] for p in prompts]
    for name, (front, no_spec) in configs.items():  # warm-up
        run_level(front, ids[:1], 1, 4, no_spec is True, f"warm-conc-{name}")
    names = list(configs)
    rows, outputs = [], defaultdict(dict)
    for li, level in enumerate(args.levels):
        order = names[li % len(names):] + names[:li % len(names)]  # so no configuration always goes first
        for name in order:
            out, counters = measure_level(args, ids, name, level, *configs[name], services)
            for i, r in enumerate(out["requests"]):
                outputs[i][(name, level)] = r.pop("tokens")
            rows.append(level_row(name, level, configs[name][1], out, counters, order.index(name), li))
            log(f"concurrency {name} x{level}: {rows[-1]['tokens_per_s']:.2f} tok/s, p50 {rows[-1]['latency_p50_s']:.2f} s, "
                f"p95 {rows[-1]['latency_p95_s']:.2f} s, merged forwards {counters['merged_verify_forwards']}")
    add_traces(rows, collector, args.round_log)
    base = {r["level_run"]: r for r in rows if r["config"] == "target_only"}
    for r in rows:
        ref = base.get(r["level_run"]) or {}
        r["speedup_vs_target_only"] = ratio(r["tokens_per_s"], ref.get("tokens_per_s"))
        r["latency_p95_vs_target_only"] = ratio(r["latency_p95_s"], ref.get("latency_p95_s"))
        if r.get("no_spec_latency_p95_s") is not None:
            r["no_spec_latency_p95_vs_target_only"] = ratio(r["no_spec_latency_p95_s"], ref.get("latency_p95_s"))
    same = [all(v == out[("target_only", args.levels[0])] for v in out.values()) for out in outputs.values()]
    return {"levels": args.levels, "configs": names, "rows": rows, "identical_outputs": all(same),
            "identical_prompts": sum(same), "prompts": len(prompts)}


def long_prompt_ids(tokenizer, n_tokens: int) -> list[int]:
    """``n_tokens`` prompt ids from the built-in prompts' first turns, repeated and cut (deterministic)."""
    questions = parse_questions(BUILTIN_QUESTIONS.read_text(encoding="utf-8"), "built-in")
    text = "\n\n".join(q["turns"][0] for q in questions)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return (ids * (n_tokens // len(ids) + 1))[:n_tokens]


def itl_samples(chunks: list[tuple[float, int]], start_s: float, end_s: float,
                close_after_end: bool = False) -> tuple[list[float], float]:
    """Per-token inter-token latencies (s) of chunks ``[(arrival s, tokens)]`` closing in (start_s, end_s].

    Each gap counts as gap / tokens once per token of its closing chunk; ``close_after_end`` also takes
    the first chunk after end_s. Returns (samples, largest gap s).
    Example: chunks at 1.0 s (2 tokens) and 1.3 s (3 tokens), window (1.0, 2.0]: [0.1, 0.1, 0.1], 0.3.
    """
    samples, largest = [], 0.0
    for (t0, _), (t1, k) in zip(chunks, chunks[1:]):
        if t1 > start_s and (t1 <= end_s or close_after_end):
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
    """Send the long request after ``args.long_window_s`` of steady decoding; chunk arrivals, window bounds, result."""
    async with generation_stub(address) as stub:
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


def longprompt_row(config: str, chunk_tokens: int, busy_tokens: int, run: dict, args) -> dict:
    """One table row: p50 / p95 ITL (ms) of the running requests before vs during the long prefill."""
    row = {"config": config, "prefill_chunk_tokens": chunk_tokens, "prefill_busy_chunk_tokens": busy_tokens,
           "chunked": min(chunk_tokens, busy_tokens) < args.long_prompt_tokens,
           "long_prompt_tokens": args.long_prompt_tokens, "running": len(run["chunks"]),
           "running_max_new_tokens": args.long_running_tokens, "window_before_s": run["sent"] - run["window_start"],
           "window_during_s": run["long_first"] - run["sent"]}
    for when, bounds in (("before", (run["window_start"], run["sent"])), ("during", (run["sent"], run["long_first"]))):
        each = [itl_samples(chunks, *bounds, close_after_end=when == "during") for chunks in run["chunks"]]
        samples = [x for s, _ in each for x in s]
        for q in (50, 95):
            row[f"itl_p{q}_{when}_ms"] = percentile(samples, q) * 1e3 if samples else None
        row[f"max_gap_{when}_ms"] = max((gap for _, gap in each), default=0.0) * 1e3
        row[f"itl_tokens_{when}"] = len(samples)
    row.update(long_ttft_s=run["long"]["ttft_s"], long_new_tokens=run["long"]["new_tokens"],
               long_wall_s=run["long"]["wall_s"], running_outlasted=run["outlasted"])
    b, d = row["itl_p95_before_ms"], row["itl_p95_during_ms"]
    row["itl_p95_ratio"] = d / b if b and d is not None else None
    return row


def prefill_chunk_setting(args) -> tuple[int, int]:
    """(prefill_chunk_tokens, prefill_busy_chunk_tokens) of the section's target: the flags', else the config's."""
    chunk = args.prefill_chunk_tokens or TargetServerConfig().prefill_chunk_tokens
    busy_arg = args.prefill_busy_chunk_tokens  # 0: no riding (the busy chunk is the chunk)
    busy = chunk if busy_arg == 0 else min(busy_arg or TargetServerConfig().prefill_busy_chunk_tokens or chunk, chunk)
    return chunk, busy


LONGPROMPT_FRONTS = {"speculative": "plain", "target_only": "plain", "speculative_pipelined": "pipelined"}


def section_longprompt(args, services: Services, draft: Service, tokenizer, prompts: list[dict]) -> dict:
    """Start a target with the prefill chunk setting and its fronts, run each configuration once, stop them."""
    long_ids = long_prompt_ids(tokenizer, args.long_prompt_tokens)
    running_ids = [prompts[i % len(prompts)]["ids"] for i in range(args.long_running)]
    chunk_tokens, busy_tokens = prefill_chunk_setting(args)
    target = services.wait(start_target(services, args, f"bench-target-long-{chunk_tokens}",
                                        prefill_chunk_tokens=chunk_tokens, prefill_busy_chunk_tokens=busy_tokens))
    fronts = {key: start_front(services, args, f"bench-front-long-{key}-{chunk_tokens}",
                               {"use_ray": True, "pipeline": key == "pipelined"}, draft, target)
              for key in dict.fromkeys(LONGPROMPT_FRONTS[c] for c in args.longprompt_configs)}
    rows = []
    for config in args.longprompt_configs:
        front, no_spec = fronts[LONGPROMPT_FRONTS[config]], config == "target_only"
        run_level(front.address, running_ids[:1], 1, 4, no_spec, f"warm-long-{config}-{chunk_tokens}")
        run = asyncio.run(longprompt_run(front.address, running_ids, long_ids, args, no_spec,
                                         f"long-{config}-{chunk_tokens}"))
        rows.append(longprompt_row(config, chunk_tokens, busy_tokens, run, args))
        log(f"longprompt {config} chunk {chunk_tokens}: ITL p95 before {_or_dash(rows[-1]['itl_p95_before_ms'], 1)} ms, "
            f"during {_or_dash(rows[-1]['itl_p95_during_ms'], 1)} ms, long TTFT {rows[-1]['long_ttft_s']:.2f} s")
    services.stop(*fronts.values(), target)
    return {"long_prompt_tokens": len(long_ids), "running": args.long_running,
            "running_max_new_tokens": args.long_running_tokens, "window_s": args.long_window_s,
            "configs": args.longprompt_configs, "prefill_chunk_settings": [[chunk_tokens, busy_tokens]], "rows": rows}


def _or_dash(x, nd=2) -> str:
    """A table cell: '-' for None, floats with nd decimals, anything else as str."""
    if x is None:
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _times(x) -> str:
    return f"{x:.2f}x" if x else "-"


def _pct(x) -> str:
    return f"{x or 0:.0%}"


DASH1 = functools.partial(_or_dash, nd=1)


def col(head: str, key: str, fmt=_or_dash) -> tuple:
    """A table column: header and cell function (``fmt`` of ``row[key]``)."""
    return head, lambda row: fmt(row.get(key))


def columns_table(columns: list[tuple], rows: list[dict]) -> str:
    """A markdown table of (header, cell function) columns, one line per row dict (first the RTT where rows have one)."""
    if any("rtt_ms" in r for r in rows):
        columns = [col("RTT ms", "rtt_ms", lambda x: f"{x:g}"), *columns]
    return "\n".join(md_table([head for head, _ in columns], [[cell(r) for _, cell in columns] for r in rows])) + "\n"


CONFIG_COLUMNS = [col("config", "config"), col("clients", "clients", str)]
CONCURRENCY_COLUMNS = CONFIG_COLUMNS + [
    col("tok/s", "tokens_per_s"), col("vs target only", "speedup_vs_target_only", _times),
    col("p50 latency s", "latency_p50_s"), col("p95 latency s", "latency_p95_s"),
    col("p95 latency vs target only", "latency_p95_vs_target_only", _times), col("p50 TTFT s", "ttft_p50_s"),
    col("p95 TTFT s", "ttft_p95_s"), col("mean acc len", "mean_accepted_length"), col("tree rows / round", "mean_tree_rows"),
    col("plain rounds (cost)", "cost_plain_round_share", _pct), col("fallback rounds", "fallback_round_share", _pct),
    col("merged", "merged_verify_forwards"), col("draft merged", "merged_draft_calls"),
    col("ahead hits", "pipeline_ahead_hits"), col("pre-draft hits", "predraft_hits"),
    col("ahead misses", "pipeline_ahead_misses"), col("rounds from aheads", "ahead_round_share", _pct),
    col("draft link ms", "draft_link_rtt_ms", DASH1)]
MIXED_COLUMNS = CONFIG_COLUMNS + [
    col("tok/s", "tokens_per_s"), col("no_spec p50 s", "no_spec_latency_p50_s"), col("no_spec p95 s", "no_spec_latency_p95_s"),
    col("no_spec p95 vs target only", "no_spec_latency_p95_vs_target_only", _times),
    col("speculating p50 s", "spec_latency_p50_s"), col("speculating p95 s", "spec_latency_p95_s")]
PIPELINE_COLUMNS = CONFIG_COLUMNS + [
    col("rounds", "rounds"), col("aheads", "aheads"), col("hits", "hits"), col("hit ahead ms", "hit_ahead_ms_mean", DASH1),
    col("hidden behind verify", "hidden_share", lambda x: "-" if x is None else f"{x:.0%}"),
    col("wait after verify ms", "wait_ms_mean", DASH1), col("adopted rounds", "adopted_rounds"),
    col("their round ms", "adopted_round_ms_mean", DASH1), col("with a draft span", "adopted_with_draft_span"),
    col("in-line drafted rounds", "drafted_rounds"), col("their round ms", "drafted_round_ms_mean", DASH1),
    col("their draft ms", "drafted_draft_ms_mean", DASH1), col("all spans", "complete", lambda x: "no" if x is False else "yes")]
CPU_COLUMNS = CONFIG_COLUMNS + [col(f"{head} %", role, DASH1) for head, role in zip(
    ("target", "draft", "front", "front's Ray", "other fronts", "benchmark", "other"), CPU_ROLES)] + [
    col("busy", "cpu_busy_share", _pct)]
LONGPROMPT_COLUMNS = [
    col("config", "config"), col("prefill chunk", "prefill_chunk_tokens"), col("busy chunk", "prefill_busy_chunk_tokens"),
    col("chunked", "chunked"), col("ITL p50 before ms", "itl_p50_before_ms", DASH1),
    col("ITL p95 before ms", "itl_p95_before_ms", DASH1), col("ITL p50 during ms", "itl_p50_during_ms", DASH1),
    col("ITL p95 during ms", "itl_p95_during_ms", DASH1), col("p95 during / before", "itl_p95_ratio", _times),
    col("max gap during ms", "max_gap_during_ms", DASH1), col("long TTFT s", "long_ttft_s"),
    col("long new tokens", "long_new_tokens"), ("running outlasted", lambda r: f"{r['running_outlasted']}/{r['running']}")]


def markdown(result: dict) -> str:
    """serving.md: the run's setting, then each section's tables with what their columns mean."""
    parts = meta_markdown(result["meta"])
    if result.get("concurrency"):
        parts += concurrency_markdown(result["concurrency"], result["meta"])
    if lp := result.get("longprompt"):
        parts += [f"## Long prompt beside running requests: {lp['long_prompt_tokens']}-token prompt, "
                  f"{lp['running']} running requests\n",
                  f"The running requests (ignore_eos, up to {lp['running_max_new_tokens']} new tokens) decode for "
                  f"{lp['window_s']:.1f} s (before), then the long request arrives; during = until its first token. "
                  "ITL per token: chunk gap / tokens in the chunk (`itl_samples`). busy chunk: the prefill chunk that "
                  "rides in the running requests' verify forwards.\n", columns_table(LONGPROMPT_COLUMNS, lp["rows"])]
    return "\n".join(parts)


def meta_markdown(meta: dict) -> list[str]:
    """The run's setting: models, threads, machine, memory, starting cost models, pinning and topology."""
    parts = [f"# Serving benchmark ({meta['target_name']} target, {meta['draft_name']} draft)\n",
             f"- dtype: `{meta['dtype']}` (requested `{meta['dtype_arg']}`), draft quantization: `{meta['draft_quant']}` "
             f"(requested `{meta['draft_quant_arg']}`)",
             f"- threads: target {meta['target_threads']}, draft {meta['draft_threads']} (`models.threads`); "
             f"{meta['cpus']} CPUs ({meta['cpu_model']}), {meta['machine']}, commit `{meta['commit']}`",
             f"- greedy, TreeSpec `{meta['tree']}`, {meta['max_new_tokens']} new tokens, prompts <= "
             f"{meta['max_prompt_tokens']} tokens (first turns, chat template, sent as `prompt_ids`)",
             "- tracing on (OTLP to a receiver in the benchmark process)",
             f"- wall time of the run: {meta['wall_s']:.0f} s"]
    if meta.get("peak_rss_mb"):
        parts.append("- peak resident memory per service process (VmHWM, MB; a Ray front's actors not included): "
                     + ", ".join(f"{name} {mb:,.0f}" for name, mb in meta["peak_rss_mb"].items()))
    if meta.get("front_start_costs"):
        parts.append("- cost model each front started from, measured through the services when it connected "
                     "(fronts not named started from the prior figures or given ones): "
                     + "; ".join(start_costs_text(name, costs) for name, costs in meta["front_start_costs"].items()))
    if meta.get("bf16_note"):
        parts.append(f"- {meta['bf16_note']}")
    pinning, topology = meta.get("pinning"), meta.get("topology")
    if not pinning or not pinning["pinned"]:
        parts.append("- CPU pinning: none (every process may run on every CPU)")
    else:
        parts.append(f"- CPU pinning (`--pin`, taskset -c, 1 torch thread per pinned service): "
                     f"{', '.join(f'{kind} {core}' for kind, core in pinning['cores'].items())}; observed affinity: "
                     + "; ".join(f"{name} {cpus}" for name, cpus in pinning["affinity"].items()))
    if not topology or topology["kind"] == "local":
        return parts + ["- topology: local (every service on loopback)", ""]
    links = ", ".join(f"{rtt:g} ms (measured {_or_dash(ms, 1)} ms)"
                      for rtt, ms in zip(topology["rtt_ms"], topology["measured_rtt_ms"]))
    return parts + [
        "- topology: split (`--topology split`): front, target and draft each in a network namespace of its own, "
        "each service on its own address; the draft behind a delaying TCP relay, round trips set per table row: "
        f"{links} (measured: median gRPC health check through the relay), {topology['bandwidth_mbit']:g} Mbit/s "
        "(tc tbf); target and draft pinned", ""]


def start_costs_text(name: str, costs: dict) -> str:
    if "failed" in costs:
        return f"{name} prior figures ({costs['failed']})"
    v, d = costs["verify_ms"], costs["draft_step_ms"]
    return (f"{name} V({', '.join(map(str, v))}) = {', '.join(f'{ms:.0f}' for ms in v.values())} ms, "
            f"D({', '.join(map(str, d))}) = {', '.join(f'{ms:.1f}' for ms in d.values())} ms")


def concurrency_markdown(c: dict, meta: dict) -> list[str]:
    """The concurrency table, then mixed traffic, pipelining and CPU by process for the rows that have them."""
    parts = [f"## Concurrency: {c['prompts']} requests per level, Ray front\n"]
    for flag, (_, text) in VARIANTS.items():
        for name, front in (meta.get(flag[2:].replace("-", "_") + "s") or {}).items():
            parts.append(f"Configuration `{name}` (`{flag}`): {text} with `{json.dumps(front)}` "
                         "merged into its front config.\n")
    parts.append(f"batched: target `max_batch` {meta['max_batch']}, `batch_wait_ms` {meta['batch_wait_ms']}; "
                 "target_only: `no_spec` requests on the batched target. tok/s = "
                 "generated tokens / wall time of the level; latency: send to final message. merged: forwards "
                 "that held more than one request; plain rounds (cost): rounds the control ran without the draft "
                 "because no draft step paid; fallback rounds: without the draft because it failed.\n")
    if meta.get("open_loop"):
        parts.append("Open loop (`--open-loop`): the clients column is the request rate (requests per second); "
                     "request i is sent at i / rate s whether or not the earlier ones have finished.\n")
    parts += [columns_table(CONCURRENCY_COLUMNS, by_config(c, c["rows"], "clients")),
              "p95 latency vs target only: against target_only in the same level run. ahead hits / misses: draft "
              "rounds started ahead of the verify outcome that were used / discarded.\n"]
    rows = c["rows"]
    mixed = by_config(c, [r for r in rows if "no_spec_latency_p95_s" in r], "level_run")
    traced = [{**r, **r["pipeline_trace"]} for r in by_config(c, [r for r in rows if r.get("pipeline_trace")], "clients")]
    timed = [{**r, **{role: 100 * sec / (r.get("cpu_window_s") or r["wall_s"]) for role, sec in r["cpu_s"].items()}}
             for r in by_config(c, [r for r in rows if r.get("cpu_s")], "level_run")]
    for text, columns, some in (
            ("Mixed traffic (`--mixed-variant`): latency per kind of request; no_spec p95 vs target only: against "
             "target_only's p95 in the same level run.\n", MIXED_COLUMNS, mixed),
            ("Pipelining from the traces (rows with ahead hits; see `pipeline_overlap`): hit aheads' ms, the share "
             "hidden behind their round's verify and the wait after it; adopted rounds against in-line drafted ones.\n",
             PIPELINE_COLUMNS, traced),
            ("CPU by process over each level (psutil user + system time, % of one CPU): the services, the row's front "
             "and its local Ray, the other fronts, this benchmark (clients, OTLP receiver) and the rest. busy: their "
             "sum over the CPUs this benchmark may use.\n", CPU_COLUMNS, timed)):
        parts += [text, columns_table(columns, some)] if some else []
    return parts + [f"Outputs identical across configurations and levels: **{c['identical_outputs']}** "
                    f"({c['identical_prompts']}/{c['prompts']} prompts)\n"]


def by_config(c: dict, rows: list[dict], key: str) -> list[dict]:
    return sorted(rows, key=lambda r: (r.get("rtt_ms", 0), c["configs"].index(r["config"]), r[key]))


def comma_list(choices: tuple[str, ...]):
    """An argparse type: a non-empty comma list of ``choices``."""
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        bad = [item for item in items if item not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {bad} (choose from {', '.join(choices)})")
        return items
    return parse


def positive_list(text: str) -> list[float]:
    """An argparse type: a non-empty comma list of numbers > 0 ("0.2,30,300")."""
    try:
        values = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"need a comma list of numbers > 0, got {text!r}")
    return values


def positive(kind, zero_ok: bool = False):
    """An argparse type: a ``kind`` (int, float) > 0 (>= 0 with ``zero_ok``)."""
    def parse(text: str):
        value = kind(text)
        if value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"must be {'>=' if zero_ok else '>'} 0, got {value}")
        return value
    parse.__name__ = kind.__name__  # argparse's "invalid int value"
    return parse


# (flag, type, default, help): type bool is a switch, a tuple the choices, "variant" a repeatable NAME=JSON
OPTIONS = (
    ("--sections", comma_list(SECTIONS), ",".join(SECTIONS), f"comma list of {', '.join(SECTIONS)}"),
    ("--target", str, None, "target model dir (default: the real pair's target)"),
    ("--draft", str, None, "draft model dir (default: the real pair's draft)"),
    ("--dtype", ("auto", "float32", "bfloat16", "float16"), "auto", "models.dtype"),
    ("--draft-quant", ("auto", "none", "int8"), "auto", "models.draft_quant"),
    ("--questions", Path, None, "Spec-Bench question.jsonl (default: the built-in prompt set)"),
    ("--prompts", int, 8, "requests per level unless --concurrency-prompts (closed loop: at least the largest level)"),
    ("--concurrency-prompts", int, None, "requests per level, spread over the categories (default: --prompts)"),
    ("--levels", str, "1,4,8", "concurrency section: clients per level (--open-loop: requests per second)"),
    ("--max-new-tokens", int, 48, "new tokens per request"),
    ("--max-prompt-tokens", int, 200, "skip questions whose prompt is longer"),
    ("--target-threads", int, 2, "torch threads of the target service (models.threads)"),
    ("--draft-threads", int, 1, "torch threads of the draft service (models.threads)"),
    ("--max-batch", int, 16, "batched configuration's target.max_batch"),
    ("--batch-wait-ms", float, 5.0, "batched configuration's target.batch_wait_ms"),
    ("--batch-gather", float, None, "draft.batch_gather and target.batch_gather of every service (default: the config's)"),
    ("--pin", bool, False, "run the target service under taskset -c 0 and the draft under taskset -c 1, 1 torch "
                           "thread each, as if separate devices (fronts stay unpinned)"),
    ("--topology", ("local", "split"), "local", "local: every service on loopback; split: front, target and draft "
     "each in a network namespace of its own (needs root), the draft behind a delaying relay (--rtt-ms, "
     "--bandwidth-mbit), target and draft pinned as with --pin (specdec/harness/topology.py)"),
    ("--rtt-ms", positive_list, None, "--topology split: comma list of the draft link's round trips in ms, one "
                                      "topology each (rows carry rtt_ms; default: 0.2,30,300)"),
    ("--bandwidth-mbit", positive(float), None, "--topology split: the draft link's bandwidth, Mbit/s (tc tbf; "
                                                "default: 100)"),
    ("--round-log", bool, False, "concurrency section: each row (target_only too) gets round_split and round_log "
                                 "(every round's timings, batch sizes and tree from the traces) in the JSON"),
    ("--pipeline", bool, False, "concurrency section: add speculative_pipelined (a front with front.pipeline: true)"),
    ("--open-loop", bool, False, "concurrency section: --levels are request rates (requests per second): request i "
                                 "is sent at i / rate s, not when a client is free"),
    ("--front-variant", "variant", None, "concurrency section: add configuration NAME, a Ray front whose front config "
                                         "has JSON merged in (e.g. 'no_ctx={\"cost_aware\": {\"ngram_tokens\": 0}}')"),
    ("--target-only-variant", "variant", None, "concurrency section: add configuration NAME, no_spec requests (as "
                                               "target_only) on a Ray front whose front config has JSON merged in"),
    ("--mixed-variant", "variant", None, "concurrency section: add configuration NAME, mixed traffic (even-numbered "
                                         "requests no_spec, the others speculating) on such a front"),
    ("--long-prompt-tokens", positive(int), 2000, "longprompt section: the long prompt's length"),
    ("--long-running", positive(int), 4, "longprompt section: requests decoding meanwhile"),
    ("--long-running-tokens", positive(int), 1024,
     "longprompt section: max_new_tokens (ignore_eos) of each running request"),
    ("--long-window-s", positive(float), 10.0,
     "longprompt section: seconds of steady decoding measured before the long request"),
    ("--longprompt-configs", comma_list(LONGPROMPT_CONFIGS), "speculative",
     f"longprompt section: comma list of {', '.join(LONGPROMPT_CONFIGS)}"),
    ("--prefill-chunk-tokens", positive(int), None,
     "longprompt section: target.prefill_chunk_tokens (default: the config's)"),
    ("--prefill-busy-chunk-tokens", positive(int, zero_ok=True), None,
     "longprompt section: target.prefill_busy_chunk_tokens (chunks that ride in the running requests' verify "
     "forwards; default: the config's; 0 = no riding)"),
    ("--out", Path, ROOT / "bench_out" / "serving", "folder for serving.json and serving.md"),
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, kind, default, help_ in OPTIONS:
        if default not in (None, False) and "default" not in help_:
            help_ += f" (default: {default})"
        if kind is bool:
            p.add_argument(flag, action="store_true", help=help_)
        elif isinstance(kind, tuple):
            p.add_argument(flag, choices=kind, default=default, help=help_)
        elif kind == "variant":
            p.add_argument(flag, action="append", default=[], type=functools.partial(front_variant, flag=flag),
                           metavar="NAME=JSON", help=help_ + "; repeatable")
        else:
            p.add_argument(flag, type=kind, default=default, help=help_)
    args = p.parse_args(argv)
    args.levels = parse_levels(p, args)
    args.concurrency_prompts = args.concurrency_prompts or (args.prompts if args.open_loop else max(args.prompts, *args.levels))
    if bool(args.target) != bool(args.draft):
        p.error("--target and --draft go together")
    check_front_variants(p, args)
    if args.topology == "split":
        args.rtt_ms, args.bandwidth_mbit, args.pin = args.rtt_ms or SPLIT_RTT_MS, args.bandwidth_mbit or 100.0, True
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
            p.error("--topology split: needs root and iproute2 (ip, tc) to make network namespaces")
    elif args.rtt_ms or args.bandwidth_mbit:
        p.error("--rtt-ms/--bandwidth-mbit: set the split topology's draft link; add --topology split")
    if args.pin:  # one torch thread per pinned core
        args.target_threads = args.draft_threads = 1
    return args


def parse_levels(p: argparse.ArgumentParser, args) -> list:
    """--levels: clients per level, or with --open-loop request rates (requests per second)."""
    items = [x.strip() for x in args.levels.split(",") if x.strip()]
    if not args.open_loop:
        levels = [int(x) for x in items]
        if args.concurrency_prompts is not None and args.concurrency_prompts < max(levels):
            p.error(f"--concurrency-prompts: {args.concurrency_prompts} requests leave clients of level "
                    f"{max(levels)} idle (give at least the largest of --levels)")
        return levels
    try:
        levels = [float(x) for x in items]
    except ValueError:
        p.error(f"--levels: with --open-loop, request rates (requests per second), got {args.levels!r}")
    if not levels or min(levels) <= 0:
        p.error(f"--levels: with --open-loop, rates > 0, got {levels}")
    if "concurrency" not in args.sections:
        p.error("--open-loop: sets the concurrency section's request rates; --sections has no concurrency")
    return levels


def pin_plan(enabled: bool) -> dict | None:
    """--pin: taskset core list per service kind, or None; raises SystemExit if taskset or the CPUs are missing."""
    if not enabled:
        return None
    if shutil.which("taskset") is None:
        raise SystemExit("--pin: the taskset command (util-linux) is not on PATH; install util-linux or drop --pin")
    usable = os.sched_getaffinity(0)
    wanted = {int(c) for c in PIN_CORES.values()}
    if not wanted <= usable:
        raise SystemExit(f"--pin: needs CPUs {sorted(wanted)} (target, draft) but this process may use only {sorted(usable)}")
    return dict(PIN_CORES)


def level_prompts(args, tokenizer) -> list[dict]:
    """--concurrency-prompts questions within --max-prompt-tokens (first turns, chat template), round-robin over
    the categories: a level's requests (also the longprompt section's running ones)."""
    path = args.questions or BUILTIN_QUESTIONS
    by_cat: dict[str, list] = defaultdict(list)
    for q in parse_questions(path.read_text(encoding="utf-8"), str(path)):
        ids = encode_prompt(tokenizer, q["turns"][0], raw=False)
        if len(ids) <= args.max_prompt_tokens:
            by_cat[q["category"]].append({"question_id": q["question_id"], "category": q["category"], "ids": ids})
    if not by_cat:
        raise SystemExit(f"no question of {args.questions or 'the built-in prompt set'} fits in "
                         f"--max-prompt-tokens {args.max_prompt_tokens}")
    log(f"sections {args.sections}; {sum(map(len, by_cat.values()))} questions fit")
    turns = itertools.zip_longest(*by_cat.values())
    return [p for turn in turns for p in turn if p is not None][:args.concurrency_prompts]


def run_sections(args, services: Services, collector: SpanCollector, tokenizer, prompts: list[dict]) -> dict:
    """Every section asked for, on one draft service; one target service at a time (each section starts its own).
    The concurrency section's configurations: the batched target's Ray fronts, started one at a time."""
    result: dict = {}
    draft = services.launch("draft", "bench-draft", service_config(args, args.draft_threads))
    if "concurrency" in args.sections:
        target = start_target(services, args, "bench-target-batched")
        for service in (draft, target):  # their start-ups overlap
            services.wait(service)

        def front(name: str, config: dict | None = None) -> str:
            return start_front(services, args, name, {"use_ray": True, **(config or {})}, draft, target).address

        configs = {"batched": (front("bench-front-ray-batched"), False)}  # name -> (front, no_spec)
        pipelined = front("bench-front-ray-pipelined", {"pipeline": True}) if args.pipeline else None
        for flag, name, config in variants(args):
            configs[name] = (front(f"bench-front-variant-{name}", config), VARIANTS[flag][0])
        if pipelined is not None:
            configs["speculative_pipelined"] = (pipelined, False)
        configs["target_only"] = (configs["batched"][0], True)
        log(f"concurrency section: levels {args.levels} x {len(prompts)} requests x {len(configs)} configs")
        result["concurrency"] = section_concurrency(args, prompts, configs, collector, services)
    if "longprompt" in args.sections:
        services.wait(draft)
        services.stop(*(s for s in services.running if s is not draft))
        log(f"longprompt section: {args.long_prompt_tokens}-token prompt beside {args.long_running} "
            f"running requests x {len(args.longprompt_configs)} configs")
        result["longprompt"] = section_longprompt(args, services, draft, tokenizer, prompts)
    return result


def run_on(args, tokenizer, prompts: list[dict], pin: dict | None, rtt_ms: float | None) -> tuple[Services, dict]:
    """``run_sections`` on its own services (and, with rtt_ms, its own split topology, removed after)."""
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="serving-bench-")))
        topology = None
        if rtt_ms is not None:
            topology = stack.enter_context(SplitTopology(rtt_ms, args.bandwidth_mbit, pin))
            log(f"split topology: draft link {rtt_ms} ms round trip, {args.bandwidth_mbit} Mbit/s")
        collector = stack.enter_context(SpanCollector(topology.root_address if topology else "127.0.0.1"))
        services = Services(workdir, collector.env(), pin, topology)
        try:
            return services, run_sections(args, services, collector, tokenizer, prompts)
        finally:
            services.stop_all()


def merge_runs(runs: list[tuple]) -> tuple[Services, dict]:
    """One record of the split topologies' runs [(rtt_ms, services, result)]: each row with its rtt_ms, outputs
    identical only if they were on every topology, service figures named ``NAME@RTTms``."""
    merged, result = Services(Path(), {}), {}
    for rtt, services, part in runs:
        for key in ("peak_rss_mb", "affinity", "start_costs"):
            getattr(merged, key).update({f"{name}@{rtt:g}ms": v for name, v in getattr(services, key).items()})
        for section, body in part.items():
            for row in body["rows"]:
                row["rtt_ms"] = rtt
            if section not in result:
                result[section] = body
                continue
            result[section]["rows"] += body["rows"]
            if "identical_outputs" in body:
                result[section]["identical_outputs"] &= body["identical_outputs"]
                result[section]["identical_prompts"] = min(result[section]["identical_prompts"], body["identical_prompts"])
    return merged, result


def run_meta(args, runs: list[tuple], services: Services, pin: dict | None, wall_s: float) -> dict:
    """The run's setting, as serving.json's ``meta`` (topology: local, or split with each draft link's set and
    measured round trip)."""
    dtype = resolve_dtype(args.dtype, "cpu")
    split = {"rtt_ms": args.rtt_ms, "bandwidth_mbit": args.bandwidth_mbit,
             "measured_rtt_ms": [run[1].measured_rtt_ms for run in runs]}
    return {
        "target": str(args.target), "draft": str(args.draft), "target_name": Path(args.target).name,
        "draft_name": Path(args.draft).name, "dtype_arg": args.dtype, "dtype": dtype, "draft_quant_arg": args.draft_quant,
        "draft_quant": resolve_draft_quant(args.draft_quant, "cpu"),
        "bf16_note": BF16_NOTE if args.dtype == "auto" and dtype == "float32" else None,
        **{key: getattr(args, key) for key in ("target_threads", "draft_threads", "max_new_tokens", "max_prompt_tokens",
                                               "max_batch", "batch_wait_ms", "batch_gather", "sections", "levels",
                                               "pipeline", "open_loop")},
        "tree": DEFAULT_SPEC.to_json(), "questions": str(args.questions or "built-in"),
        "machine": platform.platform(), **machine(), "python": platform.python_version(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "wall_s": wall_s,
        "peak_rss_mb": services.peak_rss_mb, "front_start_costs": services.start_costs,
        "front_variants": dict(args.front_variant), "target_only_variants": dict(args.target_only_variant),
        "mixed_variants": dict(args.mixed_variant),
        "pinning": {"pinned": pin is not None, "cores": {**pin, "front": "unpinned"} if pin else None,
                    "affinity": services.affinity},
        "topology": {"kind": args.topology, **(split if args.topology == "split" else {})},
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    pin = pin_plan(args.pin)
    started = time.perf_counter()
    args.target = resolve_model_dir(args.target, DEFAULT_TARGET, "--target")
    args.draft = resolve_model_dir(args.draft, DEFAULT_DRAFT, "--draft")
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = level_prompts(args, tokenizer)
    runs = [(rtt, *run_on(args, tokenizer, prompts, pin, rtt)) for rtt in (args.rtt_ms or [None])]
    services, result = merge_runs(runs) if args.topology == "split" else runs[0][1:]
    result = {"meta": run_meta(args, runs, services, pin, time.perf_counter() - started), **result}
    md = markdown(result)
    paths = write_record(args.out, "serving", result, md)
    print(md)
    log(f"wrote {paths[0]} and {paths[1]} in {result['meta']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
