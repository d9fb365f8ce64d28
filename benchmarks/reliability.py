"""Reliability harness: load, soak and chaos runs against a specdec deployment.

    python benchmarks/reliability.py load  --clients 64 --out bench_out/reliability      # tiny models, own deployment
    python benchmarks/reliability.py soak  --requests 1000 --concurrency 4 --abort-rate 0.2 --deadline-rate 0.2
    python benchmarks/reliability.py chaos --clients 8
    python benchmarks/reliability.py fuzz  --messages 10000 --out bench_out/reliability  # reliability_fuzz.py
    python benchmarks/reliability.py load  --front HOST:PORT [--target HOST:PORT --draft HOST:PORT] \\
        [--tls-ca ca.pem --tls-cert client.pem --tls-key client.key --auth-token-file tokens]   # your deployment

By default each run starts its own deployment on loopback ports (tiny seeded models, a draft
service, a target service and a front on a local Ray); ``--front`` drives a running one instead
(``chaos`` kills processes, so it only runs on its own). Requests go through the public
GenerationService; greedy output must equal the prompt's solo run with speculation off. Each part
writes ``reliability_<part>.json`` and ``.md`` under ``--out``:

- ``load``: ``--clients`` streaming requests at once: failures, latency and TTFT p50/p95, equal outputs.
- ``soak``: ``--requests`` back to back, some aborted or with a short deadline; afterwards every
  session and cached token must be released, and RSS growth per process is reported.
- ``chaos``: closed-loop clients while the draft service, an orchestrator actor and the target
  service are killed and restarted in turn; no request may hang or return wrong output, and a
  fresh request must succeed afterwards with no manual step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import psutil  # noqa: E402
import yaml  # noqa: E402

from specdec.harness.servers import Service, launch_service, stop_service, wait_ready  # noqa: E402
from specdec.v1 import (draft_pb2, draft_pb2_grpc, generation_pb2, generation_pb2_grpc, target_pb2,  # noqa: E402
                        target_pb2_grpc, tree_pb2)

OK = "OK"
HUNG = "HUNG"  # no end by the request's deadline + the hang grace


def log(msg: str) -> None:
    print(f"[reliability {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0.0 for no values."""
    v = sorted(values)
    if not v:
        return 0.0
    pos = (len(v) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


# ----------------------------------------------------------------------------------------- requests

@dataclass
class Plan:
    """One request to send (temperature 0 = greedy); abort: None, "rpc" or "cancel" after ``abort_after_s``."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    deadline_s: float = 120.0
    abort: str | None = None
    abort_after_s: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def key(self) -> tuple:
        """What fixes a greedy output: the prompt and the token budget."""
        return tuple(self.prompt_ids), self.max_new_tokens


@dataclass
class Outcome:
    """How one request ended (status: OK, a gRPC code name or HUNG); times in s from part start / from send."""

    request_id: str
    greedy: bool
    prompt_tokens: int
    status: str
    tokens: list[int]
    start_s: float
    end_s: float
    latency_s: float
    ttft_s: float | None
    stop_reason: str = ""
    abort: str | None = None
    deadline_s: float = 0.0


def prompt_pool(rng: random.Random, lengths: list[int], per_length: int, vocab: int) -> list[list[int]]:
    """``per_length`` random prompts (ids 1..vocab-1) of each length."""
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths for _ in range(per_length)]


def make_plans(rng: random.Random, n: int, pool: list[list[int]], args, tag: str) -> list[Plan]:
    """n requests over the prompt pool, a share sampled and (soak) some aborted or with a short deadline."""
    plans = []
    for i in range(n):
        sampled = rng.random() < args.sampled_share
        plan = Plan(f"{tag}-{i}", list(rng.choice(pool)), args.max_new_tokens, 0.8 if sampled else 0.0,
                    seed=rng.randrange(1 << 30), deadline_s=args.deadline_s)
        if rng.random() < getattr(args, "abort_rate", 0.0):
            plan.abort = "rpc" if rng.random() < 0.5 else "cancel"
            plan.abort_after_s = rng.uniform(0.0, args.abort_within_s)
        elif rng.random() < getattr(args, "deadline_rate", 0.0):
            plan.deadline_s = rng.uniform(0.2, 1.0) * args.short_deadline_s
        plans.append(plan)
    return plans


def request_message(plan: Plan, no_spec: bool = False) -> generation_pb2.GenerateRequest:
    sampling = tree_pb2.SamplingParams(temperature=plan.temperature, seed=plan.seed)
    return generation_pb2.GenerateRequest(request_id=plan.request_id, prompt_ids=plan.prompt_ids,
                                          max_new_tokens=plan.max_new_tokens, sampling=sampling, no_spec=no_spec)


class Client:
    """GenerationService client over one grpc.aio channel; outcome times count from monotonic ``t0``."""

    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None, token: str | None,
                 hang_grace_s: float = 10.0):
        self.channel = (grpc.aio.secure_channel(address, credentials) if credentials
                        else grpc.aio.insecure_channel(address))
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.hang_grace_s = hang_grace_s
        self.t0 = time.monotonic()

    async def close(self) -> None:
        await self.channel.close()

    async def run(self, plan: Plan, no_spec: bool = False) -> Outcome:
        """Send ``plan``; never raises (status goes in the Outcome); HUNG past deadline + ``hang_grace_s``."""
        call = self.stub.Generate(request_message(plan, no_spec), timeout=plan.deadline_s, metadata=self.metadata)
        out = Outcome(plan.request_id, plan.greedy, len(plan.prompt_ids), OK, [], time.monotonic() - self.t0, 0.0, 0.0,
                      None, abort=plan.abort, deadline_s=plan.deadline_s)
        stopper = asyncio.ensure_future(self._stop_later(plan, call)) if plan.abort else None
        try:
            await asyncio.wait_for(self._read(call, out), plan.deadline_s + self.hang_grace_s)
        except asyncio.TimeoutError:
            out.status = HUNG
            call.cancel()
        except grpc.aio.AioRpcError as exc:
            out.status = exc.code().name
        except asyncio.CancelledError:  # grpc.aio raises it on reading a call we cancelled ("cancel" abort)
            if plan.abort != "cancel" or not call.cancelled() or asyncio.current_task().cancelling():
                raise
            out.status = grpc.StatusCode.CANCELLED.name
        finally:
            if stopper is not None:
                stopper.cancel()
        out.end_s = time.monotonic() - self.t0
        out.latency_s = out.end_s - out.start_s
        return out

    async def _read(self, call, out: Outcome) -> None:
        async for reply in call:
            if reply.token_ids and out.ttft_s is None:
                out.ttft_s = time.monotonic() - self.t0 - out.start_s
            out.tokens += reply.token_ids
            if reply.HasField("stats"):
                out.stop_reason = reply.stats.stop_reason

    async def _stop_later(self, plan: Plan, call) -> None:
        await asyncio.sleep(plan.abort_after_s)
        if plan.abort == "cancel":
            call.cancel()
            return
        try:
            await self.stub.Abort(generation_pb2.AbortRequest(request_id=plan.request_id), timeout=10,
                                  metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            log(f"Abort {plan.request_id}: {exc.code().name}: {exc.details()}")

    async def references(self, plans: list[Plan]) -> dict[tuple, list[int]]:
        """The solo no_spec output of each distinct greedy prompt; raises RuntimeError when one fails."""
        refs: dict[tuple, list[int]] = {}
        for plan in plans:
            if plan.greedy and plan.key not in refs:
                solo = Plan(f"{plan.request_id}-solo", plan.prompt_ids, plan.max_new_tokens, deadline_s=300.0)
                out = await self.run(solo, no_spec=True)
                if out.status != OK:
                    raise RuntimeError(f"the solo reference run of {plan.request_id} failed: {out.status}")
                refs[plan.key] = out.tokens
        return refs


def wrong_outputs(plans: list[Plan], outcomes: list[Outcome], refs: dict[tuple, list[int]]) -> list[str]:
    """Request ids of greedy outputs that differ from (or, if cut short, are no prefix of) their solo run."""
    wrong = []
    for plan, out in zip(plans, outcomes):
        if not plan.greedy or out.status == HUNG:
            continue
        ref = refs[plan.key]
        complete = out.status == OK and out.stop_reason != "aborted"
        if (complete and out.tokens != ref) or out.tokens != ref[: len(out.tokens)]:
            wrong.append(plan.request_id)
    return wrong


def status_counts(outcomes: list[Outcome]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for out in outcomes:
        key = "aborted" if out.status == OK and out.stop_reason == "aborted" else out.status
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def latency_figures(outcomes: list[Outcome]) -> dict:
    done = [o for o in outcomes if o.status == OK]
    ttfts = [o.ttft_s for o in done if o.ttft_s is not None]
    return {"latency_p50_s": percentile([o.latency_s for o in done], 50),
            "latency_p95_s": percentile([o.latency_s for o in done], 95),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95)}


# ----------------------------------------------------------------------------------------- services

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Endpoints:
    """Where the parts send requests (front) and read session counts (target, draft; None = not read)."""

    front: str
    target: str | None = None
    draft: str | None = None
    credentials: grpc.ChannelCredentials | None = None
    token: str | None = None


async def service_counts(endpoints: Endpoints) -> dict:
    """Session and cached-token counts from the services' Info RPCs; a service not given is left out."""
    counts: dict = {}
    for address, stub_cls, request in ((endpoints.target, target_pb2_grpc.TargetServiceStub, target_pb2.InfoRequest()),
                                       (endpoints.draft, draft_pb2_grpc.DraftServiceStub, draft_pb2.DraftInfoRequest())):
        if address is None:
            continue
        channel = (grpc.aio.secure_channel(address, endpoints.credentials) if endpoints.credentials
                   else grpc.aio.insecure_channel(address))
        async with channel:
            info = await stub_cls(channel).Info(request, timeout=30, wait_for_ready=True)
        if stub_cls is target_pb2_grpc.TargetServiceStub:
            counts.update(target_sessions=info.sessions, target_cached_tokens=info.cached_tokens)
        else:
            counts.update(draft_streams=info.sessions, draft_runtime_sessions=info.cached_sessions,
                          draft_cached_tokens=info.cached_tokens)
    return counts


async def counts_back_to_zero(endpoints: Endpoints, timeout_s: float) -> tuple[dict, float]:
    """Poll ``service_counts`` until all 0 or ``timeout_s``: (last counts, seconds waited)."""
    started = time.monotonic()
    while True:
        counts = await service_counts(endpoints)
        if not any(counts.values()) or time.monotonic() - started > timeout_s:
            return counts, time.monotonic() - started
        await asyncio.sleep(0.2)


@dataclass
class LocalDeployment:
    """Draft, target and front subprocesses on loopback (fixed ports, so a restarted service is found again)."""

    config_path: Path
    draft_port: int
    target_port: int
    services: dict[str, Service] = field(default_factory=dict)

    @classmethod
    def start(cls, workdir: Path, args) -> "LocalDeployment":
        models = tiny_models(workdir, args)
        dep = cls(workdir / "serve.yaml", free_port(), free_port())
        config = {
            "models": {"target": str(models[0]), "draft": str(models[1]), "dtype": "float32", "draft_quant": "none",
                       "threads": 1},
            "grpc": {"shutdown_grace_s": 2.0},
            "draft": {"host": "127.0.0.1", "port": dep.draft_port},
            "target": {"host": "127.0.0.1", "port": dep.target_port, "max_batch": 16, "batch_wait_ms": 2.0},
            "front": {"host": "127.0.0.1", "port": 0, "use_ray": not args.no_ray, "workers": args.workers,
                      "ray_num_cpus": 2, "max_new_tokens": args.max_new_tokens,
                      "draft_address": f"127.0.0.1:{dep.draft_port}", "target_address": f"127.0.0.1:{dep.target_port}",
                      "fallback": {"reconnect_s": 0.5}},
        }
        dep.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        launched = []
        try:
            launched += [dep._launch("draft"), dep._launch("target")]
            dep.services.update(draft=wait_ready(launched[0]), target=wait_ready(launched[1]))
            launched.append(launch_service("front", dep.config_path))
            dep.services["front"] = wait_ready(launched[-1], timeout_s=300)
        except BaseException:  # a service that did not start: stop the others, leave nothing running
            for service in launched:
                stop_service(service, timeout_s=30)
            raise
        return dep

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints(self.services["front"].address, self.services["target"].address, self.services["draft"].address)

    def kill(self, kind: str) -> None:
        """SIGKILL the draft or target service (no drain, no release: a crash)."""
        self.services[kind].proc.kill()
        self.services[kind].proc.wait()

    def restart(self, kind: str) -> float:
        """Start the draft or target again on its port; returns the seconds until it was ready."""
        started = time.monotonic()
        self.services[kind] = wait_ready(self._launch(kind))
        return time.monotonic() - started

    def _launch(self, kind: str) -> Service:
        return launch_service(kind, self.config_path, port=self.draft_port if kind == "draft" else self.target_port)

    def actor_pids(self) -> list[int]:
        """Pids of the front's ray::OrchestratorActor workers."""
        front = psutil.Process(self.services["front"].proc.pid)
        pids = []
        for proc in front.children(recursive=True):
            try:
                if "OrchestratorActor" in " ".join(proc.cmdline()):
                    pids.append(proc.pid)
            except psutil.Error:
                continue
        return sorted(pids)

    def rss_bytes(self) -> dict[str, int]:
        """Resident memory of the front, its actor workers (summed), the draft and the target."""
        rss = {}
        for kind in ("front", "draft", "target"):
            rss[kind] = psutil.Process(self.services[kind].proc.pid).memory_info().rss
        rss["actors"] = sum(psutil.Process(pid).memory_info().rss for pid in self.actor_pids())
        return rss

    def stop(self) -> None:
        for kind in ("front", "draft", "target"):
            if kind in self.services:
                stop_service(self.services[kind], timeout_s=60)


def tiny_models(workdir: Path, args) -> tuple[Path, Path]:
    """(target dir, draft dir): ``--target-model`` / ``--draft-model``, else a tiny seeded pair."""
    if args.target_model and args.draft_model:
        return Path(args.target_model), Path(args.draft_model)
    from specdec.harness.tiny_pair import save_tiny_pair  # torch and transformers: only for an own deployment

    pair = save_tiny_pair(workdir / "models", max_pos=1024, noise=0.03)
    return pair.target, pair.draft


# ----------------------------------------------------------------------------------------- parts

async def run_load(args, endpoints: Endpoints, deployment: LocalDeployment | None) -> dict:
    """``args.clients`` streaming requests at once; failures, latency, TTFT, greedy equality."""
    rng = random.Random(args.seed)
    pool = prompt_pool(rng, args.prompt_lengths, args.prompts_per_length, args.vocab)
    plans = make_plans(rng, args.clients, pool, args, "load")
    client = Client(endpoints.front, endpoints.credentials, endpoints.token, args.hang_grace_s)
    try:
        refs = await client.references(plans)
        client.t0 = time.monotonic()
        outcomes = await asyncio.gather(*(client.run(p) for p in plans))
    finally:
        await client.close()
    wall = max(o.end_s for o in outcomes)
    failed = [o for o in outcomes if o.status != OK]
    wrong = wrong_outputs(plans, outcomes, refs)
    return {"clients": args.clients, "greedy": sum(p.greedy for p in plans), "sampled": sum(not p.greedy for p in plans),
            "prompt_lengths": args.prompt_lengths, "max_new_tokens": args.max_new_tokens,
            "reference": "solo run of each distinct greedy prompt with no_spec (the target alone)",
            "failures": len(failed), "statuses": status_counts(outcomes), "greedy_mismatches": len(wrong),
            "mismatched_ids": wrong, **latency_figures(outcomes), "wall_s": wall,
            "tokens_per_s": sum(len(o.tokens) for o in outcomes) / wall if wall else 0.0,
            "ok": not failed and not wrong}


async def run_soak(args, endpoints: Endpoints, deployment: LocalDeployment | None) -> dict:
    """``args.requests`` requests, ``args.concurrency`` at a time, some aborted or short; leaks and RSS."""
    rng = random.Random(args.seed)
    pool = prompt_pool(rng, args.prompt_lengths, args.prompts_per_length, args.vocab)
    plans = make_plans(rng, args.requests, pool, args, "soak")
    client = Client(endpoints.front, endpoints.credentials, endpoints.token, args.hang_grace_s)
    trace, stop = None, asyncio.Event()
    try:
        refs = await client.references(plans)  # also the warm-up
        rss_before = deployment.rss_bytes() if deployment else None
        base = await service_counts(endpoints)
        client.t0 = time.monotonic()
        if deployment:
            trace = asyncio.ensure_future(rss_trace(deployment, client, args.rss_every_s, stop))
        outcomes = await run_closed_loop(client, plans, args.concurrency)
    finally:
        stop.set()
        rss_samples = await trace if trace is not None else []
        await client.close()
    after, settle_s = await counts_back_to_zero(endpoints, args.settle_s)
    rss_after = deployment.rss_bytes() if deployment else None
    wrong = wrong_outputs(plans, outcomes, refs)
    growth = {k: rss_after[k] - rss_before[k] for k in rss_before} if rss_before else None
    return {"requests": args.requests, "concurrency": args.concurrency, "abort_rate": args.abort_rate,
            "deadline_rate": args.deadline_rate, "short_deadline_s": args.short_deadline_s,
            "planned_aborts": {"rpc": sum(p.abort == "rpc" for p in plans), "cancel": sum(p.abort == "cancel" for p in plans)},
            "short_deadlines": sum(p.deadline_s < args.deadline_s for p in plans),
            "statuses": status_counts(outcomes), "hung": sum(o.status == HUNG for o in outcomes),
            "greedy_mismatches": len(wrong), "mismatched_ids": wrong, **latency_figures(outcomes),
            "wall_s": max(o.end_s for o in outcomes), "counts_baseline": base, "counts_end": after,
            "settle_s": settle_s, "rss_baseline_bytes": rss_before, "rss_end_bytes": rss_after,
            "rss_growth_bytes": growth, "rss_growth_second_half_bytes": second_half_growth(rss_samples, rss_after),
            "rss_samples": rss_samples,
            "ok": not any(after.values()) and not wrong and not any(o.status == HUNG for o in outcomes)}


async def rss_trace(deployment: LocalDeployment, client: Client, every_s: float, stop: asyncio.Event) -> list[dict]:
    """RSS of each process every ``every_s`` seconds until ``stop`` is set: [{"t_s": ..., kind: bytes}]."""
    samples: list[dict] = []
    while not stop.is_set():
        samples.append({"t_s": time.monotonic() - client.t0, **deployment.rss_bytes()})
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass
    return samples


def second_half_growth(samples: list[dict], end: dict | None) -> dict | None:
    """RSS growth from the run's middle to its end (near 0 once caches warm; about half the total for a leak)."""
    if not samples or end is None:
        return None
    middle = min(samples, key=lambda s: abs(s["t_s"] - samples[-1]["t_s"] / 2))
    return {k: end[k] - middle[k] for k in end}


async def run_closed_loop(client: Client, plans: list[Plan], concurrency: int) -> list[Outcome]:
    """Send ``plans`` in order, ``concurrency`` at a time."""
    outcomes: list[Outcome | None] = [None] * len(plans)
    queue = list(enumerate(plans))[::-1]

    async def worker():
        while queue:
            i, plan = queue.pop()
            outcomes[i] = await client.run(plan)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------- chaos

@dataclass
class Disruption:
    """A window during which a part was down: [start_s, end_s] on the part's clock."""

    kind: str  # "draft" | "actor" | "target"
    start_s: float
    end_s: float
    restart_s: float  # seconds until it was back (a service restarted here; an actor worker restarted by Ray)


async def chaos_script(args, dep: LocalDeployment, clock) -> list[Disruption]:
    """Kill (and restart) the draft, one actor worker, then the target, ``settle_s`` of load apart."""
    windows = []
    for kind in ("draft", "actor", "target"):
        if kind == "actor" and args.no_ray:
            continue
        await asyncio.sleep(args.settle_s)
        start = clock()
        restart_s = await (kill_actor(dep) if kind == "actor" else kill_service(args, dep, kind))
        await asyncio.sleep(RECONNECT_GRACE_S)
        windows.append(Disruption(kind, start, clock(), restart_s))
    await asyncio.sleep(args.settle_s)
    return windows


RECONNECT_GRACE_S = 1.5  # the front's channels retry a restarted service within ~1 s (clients.channel_options)


async def kill_service(args, dep: LocalDeployment, kind: str) -> float:
    """SIGKILL the draft or target, wait ``down_s``, restart it; returns the restart's seconds."""
    log(f"chaos: SIGKILL the {kind} service")
    dep.kill(kind)
    await asyncio.sleep(args.down_s)
    restart_s = await asyncio.to_thread(dep.restart, kind)
    log(f"chaos: {kind} restarted in {restart_s:.1f} s")
    return restart_s


async def kill_actor(dep: LocalDeployment, timeout_s: float = 60.0) -> float:
    """SIGKILL one orchestrator actor worker; returns the seconds until Ray had as many workers again."""
    pids = dep.actor_pids()
    if not pids:
        raise RuntimeError("no ray::OrchestratorActor worker found under the front process")
    log(f"chaos: SIGKILL actor worker {pids[0]} (of {pids})")
    started = time.monotonic()
    os.kill(pids[0], signal.SIGKILL)
    while (now := dep.actor_pids()) == pids or len(now) < len(pids):
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"Ray did not restart the killed actor worker in {timeout_s:.0f} s")
        await asyncio.sleep(0.1)
    log(f"chaos: actor worker back after {time.monotonic() - started:.1f} s")
    return time.monotonic() - started


def overlapped(out: Outcome, windows: list[Disruption]) -> str:
    """The disruption this request overlapped ("target" first, then "actor", "draft"), or "none"."""
    hit = {w.kind for w in windows if out.start_s < w.end_s and out.end_s > w.start_s}
    return next((k for k in ("target", "actor", "draft") if k in hit), "none")


def chaos_verdict(out: Outcome, ref: list[int] | None) -> str:
    """completed_equal / completed_different / a status name (completed sampled requests count as equal)."""
    if out.status != OK:
        return out.status
    return "completed_equal" if ref is None or out.tokens == ref else "completed_different"


async def run_chaos(args, endpoints: Endpoints, deployment: LocalDeployment | None) -> dict:
    """Closed-loop clients while the draft, an actor and the target are killed; outcomes by window."""
    if deployment is None:
        raise SystemExit("chaos: kills processes, so it runs only on its own deployment (drop --front)")
    rng = random.Random(args.seed)
    pool = prompt_pool(rng, args.prompt_lengths, args.prompts_per_length, args.vocab)
    plans = make_plans(rng, 4096, pool, args, "chaos")
    client = Client(endpoints.front, endpoints.credentials, endpoints.token, args.hang_grace_s)
    try:
        refs = await client.references(plans[: args.clients * 8])
        plans = [p for p in plans if not p.greedy or p.key in refs]
        client.t0 = time.monotonic()
        outcomes, windows = await chaos_loop(args, deployment, client, plans)
        recovery = await serves_again(client, plans, refs, args.recovery_timeout_s)
    finally:
        await client.close()
    by_plan = {p.request_id: p for p in plans}
    table: dict[str, dict[str, int]] = {}
    for out in outcomes:
        plan = by_plan[out.request_id]
        verdict = chaos_verdict(out, refs.get(plan.key) if plan.greedy else None)
        row = table.setdefault(overlapped(out, windows), {})
        row[verdict] = row.get(verdict, 0) + 1
    return chaos_figures(args, outcomes, windows, table, recovery)


async def chaos_loop(args, dep: LocalDeployment, client: Client, plans: list[Plan]):
    """Clients send plans in turn until the chaos script ends: (outcomes, disruption windows)."""
    done = asyncio.Event()
    outcomes: list[Outcome] = []
    queue = plans[::-1]

    async def worker():
        while not done.is_set() and queue:
            outcomes.append(await client.run(queue.pop()))

    workers = [asyncio.ensure_future(worker()) for _ in range(args.clients)]
    try:
        windows = await chaos_script(args, dep, lambda: time.monotonic() - client.t0)
    finally:
        done.set()
        await asyncio.gather(*workers)
    return outcomes, windows


async def serves_again(client: Client, plans: list[Plan], refs: dict, timeout_s: float) -> dict:
    """Retry a fresh greedy request until it equals its solo run (or ``timeout_s``): tries and seconds."""
    plan = next(p for p in plans if p.greedy)
    started, tries = time.monotonic(), 0
    while True:
        tries += 1
        out = await client.run(Plan(f"recovery-{tries}", plan.prompt_ids, plan.max_new_tokens, deadline_s=60.0))
        equal = out.status == OK and out.tokens == refs[plan.key]
        if equal or time.monotonic() - started > timeout_s:
            return {"serves_again": equal, "tries": tries, "seconds": time.monotonic() - started, "last_status": out.status}
        await asyncio.sleep(0.5)


def chaos_figures(args, outcomes: list[Outcome], windows: list[Disruption], table: dict, recovery: dict) -> dict:
    verdicts = {v for row in table.values() for v in row}
    clean = {"completed_equal"}
    ok = ("HUNG" not in verdicts and "completed_different" not in verdicts
          and set(table.get("none", {})) <= clean and set(table.get("draft", {})) <= clean
          and set(table.get("actor", {})) <= clean  # a killed actor's requests fail over (orchestrator.serving.failover)
          and set(table.get("target", {})) <= clean | {"UNAVAILABLE"} and recovery["serves_again"])
    return {"clients": args.clients, "deadline_s": args.deadline_s, "down_s": args.down_s, "settle_s": args.settle_s,
            "requests": len(outcomes), "windows": [asdict(w) for w in windows], "outcomes_by_window": table,
            "hung": sum(o.status == HUNG for o in outcomes),
            "wrong_outputs": sum(row.get("completed_different", 0) for row in table.values()),
            "max_latency_s": max((o.latency_s for o in outcomes), default=0.0),
            "recovery": recovery, "ok": ok}


# ----------------------------------------------------------------------------------------- reports

def markdown(part: str, result: dict) -> str:
    """A table of the part's scalar figures (and, for chaos, outcomes per disruption window)."""
    lines = [f"# Reliability: {part}", "", f"{result['meta']['date']}, {result['meta']['deployment']}", "",
             "| figure | value |", "|---|---|"]
    for key, value in result[part].items():
        if isinstance(value, float):
            value = f"{value:.3f}"
        elif isinstance(value, dict) and key.endswith("_bytes"):
            key, value = key[: -len("_bytes")] + "_mib", ", ".join(f"{k}: {v / 2**20:.1f}" for k, v in value.items())
        elif isinstance(value, dict) and key != "outcomes_by_window":
            value = ", ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in value.items())
        elif isinstance(value, (list, dict)):
            continue
        lines.append(f"| {key} | {value} |")
    if part == "chaos":
        verdicts = sorted({v for row in result[part]["outcomes_by_window"].values() for v in row})
        lines += ["", "Outcomes by the disruption a request overlapped:", "",
                  "| window | " + " | ".join(verdicts) + " |", "|---|" + "---|" * len(verdicts)]
        for window, row in result[part]["outcomes_by_window"].items():
            lines.append(f"| {window} | " + " | ".join(str(row.get(v, 0)) for v in verdicts) + " |")
        lines += ["", "| disruption | start_s | end_s | restart_s |", "|---|---|---|---|"]
        for w in result[part]["windows"]:
            lines.append(f"| {w['kind']} | {w['start_s']:.1f} | {w['end_s']:.1f} | {w['restart_s']:.1f} |")
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, part: str, result: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"reliability_{part}.json").write_text(json.dumps(result, indent=2))
    (out_dir / f"reliability_{part}.md").write_text(markdown(part, result))


# ----------------------------------------------------------------------------------------- CLI

# Parts: name -> runner(args, endpoints, deployment or None) -> figures; ``fuzz`` is reliability_fuzz.py.
PARTS = {"load": run_load, "soak": run_soak, "chaos": run_chaos}


def positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("bench_out/reliability"), help="folder for reliability_<part>.json/.md")
    p.add_argument("--front", help="HOST:PORT of a running front (default: start a tiny deployment here)")
    p.add_argument("--target", help="HOST:PORT of its target service (session and KV counts)")
    p.add_argument("--draft", help="HOST:PORT of its draft service (session and KV counts)")
    p.add_argument("--tls-ca", help="PEM CA bundle: TLS to the front and services")
    p.add_argument("--tls-cert", help="PEM client certificate (services with mutual TLS)")
    p.add_argument("--tls-key", help="PEM client key (with --tls-cert)")
    p.add_argument("--auth-token-file", help="bearer token for the front (first line; $SPECDEC_TOKEN wins)")
    p.add_argument("--target-model", help="model dir for the own deployment's target (default: tiny random)")
    p.add_argument("--draft-model", help="model dir for the own deployment's draft (default: tiny random)")
    p.add_argument("--no-ray", action="store_true", help="own deployment: front without Ray")
    p.add_argument("--workers", type=int, default=2, help="own deployment: orchestrator Ray actors")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=250, help="prompt token ids are drawn from 1..vocab-1")
    p.add_argument("--prompt-lengths", type=positive_ints, default=[4, 16, 48, 96])
    p.add_argument("--prompts-per-length", type=int, default=2, help="distinct prompts of each length")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--sampled-share", type=float, default=0.5, help="share of sampled (seeded) requests")
    p.add_argument("--deadline-s", type=float, default=120.0, help="every request's deadline")
    p.add_argument("--hang-grace-s", type=float, default=10.0, help="a request with no end by deadline + this hung")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="part", required=True)
    sub.add_parser("fuzz", help="random and mutated messages against every RPC (benchmarks/reliability_fuzz.py; "
                   "`fuzz --help` for its options)", add_help=False)
    load = sub.add_parser("load", help="concurrent streaming clients")
    load.add_argument("--clients", type=int, default=64)
    soak = sub.add_parser("soak", help="requests back to back with aborts and short deadlines")
    soak.add_argument("--requests", type=int, default=1000)
    soak.add_argument("--concurrency", type=int, default=4)
    soak.add_argument("--abort-rate", type=float, default=0.2)
    soak.add_argument("--abort-within-s", type=float, default=0.5, help="aborts come 0..this seconds after the send")
    soak.add_argument("--deadline-rate", type=float, default=0.2)
    soak.add_argument("--short-deadline-s", type=float, default=0.5, help="short deadlines: 0.2..1 x this")
    soak.add_argument("--settle-s", type=float, default=30.0, help="time for sessions to drain to 0 at the end")
    soak.add_argument("--rss-every-s", type=float, default=5.0, help="RSS sampled this often (own deployment)")
    chaos = sub.add_parser("chaos", help="kill and restart the draft, an actor and the target under load")
    chaos.add_argument("--clients", type=int, default=8)
    chaos.add_argument("--down-s", type=float, default=1.0, help="a killed service stays down this long")
    chaos.add_argument("--settle-s", type=float, default=3.0, help="load before, between and after the kills")
    chaos.add_argument("--recovery-timeout-s", type=float, default=60.0)
    for p in (load, soak, chaos):
        common_options(p)
    args = parser.parse_args(argv)
    if args.part == "chaos":
        args.deadline_s = min(args.deadline_s, 30.0)
    return args


def endpoints_from(args) -> Endpoints:
    from orchestrator.cli.remote import client_token  # imports torch (specdec.sampling): only with --front

    credentials = None
    if args.tls_ca:
        read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
        credentials = grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key), read(args.tls_cert))
    return Endpoints(args.front, args.target, args.draft, credentials, client_token(args.auth_token_file))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["fuzz"]:  # the fuzz part: benchmarks/reliability_fuzz.py, beside this script
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import reliability_fuzz

        return reliability_fuzz.main(argv[1:])
    args = parse_args(argv)
    deployment = None
    with tempfile.TemporaryDirectory(prefix="reliability-") as workdir:
        try:
            if args.front:
                endpoints = endpoints_from(args)
            else:
                log("starting a deployment (draft, target, front) on loopback")
                deployment = LocalDeployment.start(Path(workdir), args)
                endpoints = deployment.endpoints
            started = time.monotonic()
            figures = asyncio.run(PARTS[args.part](args, endpoints, deployment))
        finally:
            if deployment is not None:
                deployment.stop()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": time.monotonic() - started,
            "deployment": f"front {args.front}" if args.front else
            f"own: tiny models, {'no Ray' if args.no_ray else f'Ray, {args.workers} actors'}",
            "argv": sys.argv[1:] if argv is None else list(argv), "cpus": os.cpu_count()}
    result = {"meta": meta, args.part: figures}
    write_report(args.out, args.part, result)
    log(f"{args.part}: ok={figures['ok']}; wrote {args.out}/reliability_{args.part}.json and .md")
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
