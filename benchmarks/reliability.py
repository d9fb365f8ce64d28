"""Reliability harness: load, soak, chaos and fuzz runs against a specdec deployment (docs/benchmarks.md).

    python benchmarks/reliability.py load  --clients 64 --out bench_out/reliability      # tiny models, own deployment
    python benchmarks/reliability.py soak  --requests 1000 --concurrency 4 --abort-rate 0.2 --deadline-rate 0.2
    python benchmarks/reliability.py chaos --clients 8
    python benchmarks/reliability.py fuzz  --stateful --messages 300 --out bench_out/reliability  # reliability_fuzz.py
    python benchmarks/reliability.py load  --front HOST:PORT [--target HOST:PORT --draft HOST:PORT --http HOST:PORT] \\
        [--tls-ca ca.pem --tls-cert client.pem --tls-key client.key --auth-token-file tokens]   # your deployment

Writes ``reliability_<part>.json`` and ``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import socket
import ssl
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import psutil  # noqa: E402

from specdec.harness.pki import make_pki  # noqa: E402
from specdec.harness.report import machine, md_table, nested_table, percentile, write_record  # noqa: E402
from specdec.harness.servers import Service, launch_service, stop_service, wait_address, wait_ready  # noqa: E402
from specdec.v1 import (draft_pb2, draft_pb2_grpc, generation_pb2, generation_pb2_grpc, target_pb2,  # noqa: E402
                        target_pb2_grpc, tree_pb2)

OK = "OK"
HUNG = "HUNG"  # no end by the request's deadline + the hang grace
SAMPLED_TEMPERATURE = 0.8
WORKERS = 2  # the own deployment's orchestrator actors (chaos kills one)


def log(msg: str) -> None:
    print(f"[reliability {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

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
    via: str = "grpc"  # "grpc" (GenerationService) or "http" (the OpenAI-compatible /v1/completions)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def key(self) -> tuple:
        """What fixes the output: the prompt and the token budget; for a sampled request its temperature and seed too."""
        return tuple(self.prompt_ids), self.max_new_tokens, self.temperature, None if self.greedy else self.seed


@dataclass
class Outcome:
    """How one request ended (status: OK, a gRPC code name, HTTP_<code> or HUNG); times in s from part start / from send."""

    request_id: str
    greedy: bool
    status: str = OK
    tokens: list[int] = field(default_factory=list)
    start_s: float = 0.0
    end_s: float = 0.0
    latency_s: float = 0.0
    ttft_s: float | None = None
    stop_reason: str = ""
    fallback_rounds: int = 0  # FinalStats: rounds without the draft (it failed, was full or was opening)
    failovers: int = 0  # FinalStats: moves to another orchestrator actor after its own died
    via: str = "grpc"

    def finish(self, t0: float) -> "Outcome":
        self.end_s = time.monotonic() - t0
        self.latency_s = self.end_s - self.start_s
        return self

    def took(self, tokens: list[int], stats: dict, t0: float) -> None:
        """Add one reply's tokens (the first ones set the TTFT) and the final statistics, once they come."""
        if tokens and self.ttft_s is None:
            self.ttft_s = time.monotonic() - t0 - self.start_s
        self.tokens += tokens
        if stats:
            self.stop_reason = stats.get("stop_reason", "")
            self.fallback_rounds, self.failovers = stats.get("fallback_rounds", 0), stats.get("failovers", 0)


def make_plans(rng: random.Random, n: int, args, tag: str) -> list[Plan]:
    """n requests over ``--prompts-per-length`` random prompts of each length: a share sampled with a seed in
    0..seeds-1 (so each prompt and seed has one solo run to equal), and (soak) some aborted or with a short deadline."""
    pool = [[rng.randrange(1, args.vocab) for _ in range(length)] for length in args.prompt_lengths
            for _ in range(args.prompts_per_length)]
    plans = []
    for i in range(n):
        sampled = rng.random() < args.sampled_share
        plan = Plan(f"{tag}-{i}", list(rng.choice(pool)), args.max_new_tokens, SAMPLED_TEMPERATURE if sampled else 0.0,
                    seed=rng.randrange(args.seeds), deadline_s=args.deadline_s)
        if rng.random() < getattr(args, "abort_rate", 0.0):
            plan.abort = "rpc" if rng.random() < 0.5 else "cancel"
            plan.abort_after_s = rng.uniform(0.0, args.abort_within_s)
        elif rng.random() < getattr(args, "deadline_rate", 0.0):
            plan.deadline_s = rng.uniform(0.2, 1.0) * args.short_deadline_s
        plans.append(plan)
    return plans


def aio_channel(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(address, credentials) if credentials else grpc.aio.insecure_channel(address)


class Client:
    """The front's clients: its GenerationService over one grpc.aio channel, and its OpenAI-compatible
    ``/v1/completions`` (streamed, token ids included: the ``specdec`` extension) by blocking urllib calls on
    ``http_threads`` threads. Outcome times count from monotonic ``t0``."""

    def __init__(self, endpoints: Endpoints, hang_grace_s: float = 10.0, http_threads: int = 1):
        self.channel = aio_channel(endpoints.front, endpoints.credentials)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {endpoints.token}"),) if endpoints.token else None
        self.url = f"{'https' if endpoints.ssl_context else 'http'}://{endpoints.http}/v1/completions"
        self.ssl_context = endpoints.ssl_context
        self.headers = {"Content-Type": "application/json",
                        **({"Authorization": f"Bearer {endpoints.http_token}"} if endpoints.http_token else {})}
        self.pool = ThreadPoolExecutor(max(http_threads, 1), thread_name_prefix="http-client")
        self.hang_grace_s = hang_grace_s
        self.t0 = time.monotonic()

    async def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        await self.channel.close()

    async def run(self, plan: Plan, no_spec: bool = False) -> Outcome:
        """Send ``plan`` (over HTTP if its ``via`` says so; no abort or deadline there); never raises (status goes in
        the Outcome); HUNG past deadline + ``hang_grace_s``."""
        out = Outcome(plan.request_id, plan.greedy, start_s=time.monotonic() - self.t0, via=plan.via)
        limit_s = plan.deadline_s + self.hang_grace_s
        if plan.via == "http":
            read = asyncio.get_running_loop().run_in_executor(self.pool, self._post, plan, out)
            try:
                out.status = await asyncio.wait_for(read, limit_s)
            except asyncio.TimeoutError:
                out.status = HUNG
            return out.finish(self.t0)
        request = generation_pb2.GenerateRequest(
            request_id=plan.request_id, prompt_ids=plan.prompt_ids, max_new_tokens=plan.max_new_tokens,
            sampling=tree_pb2.SamplingParams(temperature=plan.temperature, seed=plan.seed), no_spec=no_spec)
        call = self.stub.Generate(request, timeout=plan.deadline_s, metadata=self.metadata)
        stopper = asyncio.ensure_future(self._stop_later(plan, call)) if plan.abort else None
        try:
            await asyncio.wait_for(self._read(call, out), limit_s)
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
        return out.finish(self.t0)

    async def _read(self, call, out: Outcome) -> None:
        async for reply in call:
            stats = {k: getattr(reply.stats, k) for k in ("stop_reason", "fallback_rounds", "failovers")}
            out.took(list(reply.token_ids), stats if reply.HasField("stats") else None, self.t0)

    async def _stop_later(self, plan: Plan, call) -> None:
        await asyncio.sleep(plan.abort_after_s)
        if plan.abort == "cancel":
            return call.cancel()
        try:
            await self.stub.Abort(generation_pb2.AbortRequest(request_id=plan.request_id), timeout=10,
                                  metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            log(f"Abort {plan.request_id}: {exc.code().name}: {exc.details()}")

    async def references(self, plans: list[Plan]) -> dict[tuple, Outcome]:
        """Each distinct request's solo run, one at a time, over gRPC: a greedy one with speculation off (the
        target alone), a sampled one as planned (its seeded draws follow its trees); RuntimeError when one fails."""
        refs: dict[tuple, Outcome] = {}
        for plan in plans:
            if plan.key not in refs:
                solo = replace(plan, request_id=f"{plan.request_id}-solo", deadline_s=300.0, abort=None, via="grpc")
                refs[plan.key] = await self.run(solo, no_spec=plan.greedy)
                if refs[plan.key].status != OK:
                    raise RuntimeError(f"the solo reference run of {plan.request_id} failed: {refs[plan.key].status}")
        return refs

    def _post(self, plan: Plan, out: Outcome) -> str:
        """Stream ``plan`` over HTTP into ``out`` (tokens, TTFT, the last ``specdec`` statistics); its status."""
        body = {"prompt": plan.prompt_ids, "max_tokens": plan.max_new_tokens, "temperature": plan.temperature,
                "stream": True, "specdec": {"return_token_ids": True}, **({} if plan.greedy else {"seed": plan.seed})}
        request = urllib.request.Request(self.url, json.dumps(body).encode(), self.headers)
        try:
            with urllib.request.urlopen(request, timeout=plan.deadline_s + self.hang_grace_s,
                                        context=self.ssl_context) as response:
                for chunk in (json.loads(line[6:]) for line in response if line.startswith(b"data: {")):
                    if "error" in chunk:  # an error after the headers: an event of the stream
                        return f"HTTP_STREAM_{chunk['error'].get('code') or chunk['error'].get('type')}"
                    out.took([t for choice in chunk.get("choices", []) for t in choice.get("token_ids", [])],
                             chunk.get("specdec"), self.t0)
        except urllib.error.HTTPError as exc:
            return f"HTTP_{exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            return f"HTTP_{type(getattr(exc, 'reason', exc)).__name__}"
        return OK


def status_of(out: Outcome) -> str:
    """The outcome's status, "aborted" for one that completed by an Abort."""
    return "aborted" if out.status == OK and out.stop_reason == "aborted" else out.status


def status_counts(outcomes: list[Outcome]) -> dict[str, int]:
    return dict(sorted(Counter(map(status_of, outcomes)).items()))


def wrong_outputs(plans: list[Plan], outcomes: list[Outcome], refs: dict[tuple, Outcome]) -> list[str]:
    """Request ids whose output differs from its solo run or, cut short, is no prefix of it (HUNG ones skipped)."""
    wrong = []
    for plan, out in zip(plans, outcomes):
        ref = refs[plan.key].tokens
        complete = out.status == OK and out.stop_reason != "aborted"
        if out.status != HUNG and ((complete and out.tokens != ref) or out.tokens != ref[: len(out.tokens)]):
            wrong.append(plan.request_id)
    return wrong


def output_figures(plans: list[Plan], outcomes: list[Outcome], refs: dict[tuple, Outcome]) -> dict:
    """Greedy and sampled mismatches against the solo runs, each with its route; a sampled request that failed over
    or ran another number of rounds without the draft than alone draws differently by design: ``sampled_rerouted``."""
    wrong = set(wrong_outputs(plans, outcomes, refs))
    detail = [{"id": p.request_id, "greedy": p.greedy, "via": o.via, "status": status_of(o), "tokens": len(o.tokens),
               "fallback_rounds": o.fallback_rounds, "solo_fallback_rounds": refs[p.key].fallback_rounds,
               "failovers": o.failovers} for p, o in zip(plans, outcomes) if p.request_id in wrong]
    rerouted = [d for d in detail if not d["greedy"] and (d["failovers"] or d["fallback_rounds"] != d["solo_fallback_rounds"])]
    return {"reference": "greedy: the prompt's solo run with no_spec (the target alone); sampled (temperature "
                         f"{SAMPLED_TEMPERATURE}, seeded): the same request's solo run",
            "greedy_mismatches": sum(d["greedy"] for d in detail),
            "sampled_mismatches": sum(not d["greedy"] for d in detail) - len(rerouted),
            "sampled_rerouted": len(rerouted), "mismatches": detail[:20]}


def allowed_statuses(plan: Plan, deadline_s: float) -> set[str]:
    """OK always; "aborted" after its Abort RPC, CANCELLED after its own cancel, DEADLINE_EXCEEDED with a deadline
    shorter than the run's ``deadline_s``."""
    by_abort = {"rpc": "aborted", "cancel": grpc.StatusCode.CANCELLED.name}.get(plan.abort)
    short = grpc.StatusCode.DEADLINE_EXCEEDED.name if plan.deadline_s < deadline_s else None
    return {OK} | {status for status in (by_abort, short) if status}


def unexpected_statuses(plans: list[Plan], outcomes: list[Outcome], deadline_s: float) -> dict[str, str]:
    """{request id: status} of the requests that ended as their plan does not allow."""
    return {p.request_id: status_of(o) for p, o in zip(plans, outcomes) if status_of(o) not in allowed_statuses(p, deadline_s)}


def latency_figures(outcomes: list[Outcome]) -> dict:
    done = [o for o in outcomes if o.status == OK]
    latencies, ttfts = [o.latency_s for o in done], [o.ttft_s for o in done if o.ttft_s is not None]
    return {"latency_p50_s": percentile(latencies, 50), "latency_p95_s": percentile(latencies, 95),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tls(ca, cert, key) -> tuple[grpc.ChannelCredentials, ssl.SSLContext]:
    """gRPC channel credentials (presenting ``cert`` if given) and an HTTPS context, both trusting ``ca``."""
    read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert)), ssl.create_default_context(cafile=str(ca))


@dataclass
class Endpoints:
    """Where the parts send requests (front, http) and read session counts (target, draft; None = not read)."""

    front: str
    target: str | None = None
    draft: str | None = None
    credentials: grpc.ChannelCredentials | None = None
    token: str | None = None
    http: str | None = None  # "host:port" of the front's HTTP API (None: gRPC only)
    http_token: str | None = None
    ssl_context: ssl.SSLContext | None = None  # HTTPS, trusting the deployment's CA (None: plain HTTP)


async def service_counts(endpoints: Endpoints) -> dict:
    """Session and cached-token counts from the services' Info RPCs; a service not given is left out."""
    counts: dict = {}
    if endpoints.target:
        async with aio_channel(endpoints.target, endpoints.credentials) as channel:
            t = await target_pb2_grpc.TargetServiceStub(channel).Info(target_pb2.InfoRequest(), timeout=30,
                                                                       wait_for_ready=True)
        counts.update(target_sessions=t.sessions, target_cached_tokens=t.cached_tokens)
    if endpoints.draft:
        async with aio_channel(endpoints.draft, endpoints.credentials) as channel:
            d = await draft_pb2_grpc.DraftServiceStub(channel).Info(draft_pb2.DraftInfoRequest(), timeout=30,
                                                                     wait_for_ready=True)
        counts.update(draft_streams=d.sessions, draft_runtime_sessions=d.cached_sessions,
                      draft_cached_tokens=d.cached_tokens)
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
    pki: dict[str, Path] | None = None  # TLS on every port, mutual between the services (None: plaintext)
    tokens: list[str] = field(default_factory=list)  # the front's bearer tokens: gRPC sends the first, HTTP the second
    token_file: Path | None = None  # front.auth_token_file: the tokens, one a line
    http: str | None = None  # "host:port" of the front's HTTP API

    @classmethod
    def start(cls, workdir: Path, args) -> "LocalDeployment":
        from specdec.harness.tiny_pair import ModelPair, save_tiny_pair, write_config  # torch: own deployment only

        dep = cls(workdir / "serve.yaml", free_port(), free_port())
        if not args.plaintext:
            dep.pki = make_pki(workdir / "pki")
            dep.tokens, dep.token_file = [secrets.token_urlsafe(24) for _ in range(2)], workdir / "tokens.txt"
            dep.token_file.write_text("\n".join(dep.tokens) + "\n")
        models = (ModelPair(Path(args.target_model), Path(args.draft_model)) if args.target_model and args.draft_model
                  else save_tiny_pair(workdir / "models", max_pos=1024, noise=0.03))
        write_config(dep.config_path, models, **dep.sections(args))
        try:
            dep.services.update(draft=dep._launch("draft"), target=dep._launch("target"))  # their start-ups overlap
            wait_ready(dep.services["draft"]), wait_ready(dep.services["target"])
            dep.services["front"] = wait_ready(launch_service("front", dep.config_path), timeout_s=300)
            dep.http = wait_address(dep.services["front"], "http")
        except BaseException:  # a service that did not start: stop the others, leave nothing running
            dep.stop()
            raise
        return dep

    def sections(self, args) -> dict:
        """serve.yaml over write_config's (float32, one thread): fixed service ports, the front's HTTP API on an
        ephemeral port, idle sessions released after ``--idle-s``; TLS and tokens unless ``--plaintext``."""
        service = {"host": "127.0.0.1", "session_idle_s": args.idle_s}
        config = {
            "grpc": {"shutdown_grace_s": 2.0},
            "draft": {**service, "port": self.draft_port},
            "target": {**service, "port": self.target_port, "max_batch": 16, "batch_wait_ms": 2.0},
            "front": {"host": "127.0.0.1", "port": 0, "http_port": 0, "use_ray": True, "workers": WORKERS,
                      "ray_num_cpus": 2, "max_new_tokens": args.max_new_tokens, "fallback": {"reconnect_s": 0.5},
                      "draft_address": f"127.0.0.1:{self.draft_port}",
                      "target_address": f"127.0.0.1:{self.target_port}"},
        }
        if self.pki is not None:
            config["grpc"].update({f"tls_{name}": str(self.pki[name]) for name in ("cert", "key", "ca")})
            config["front"]["auth_token_file"] = str(self.token_file)
        return config

    @property
    def endpoints(self) -> Endpoints:
        ep = Endpoints(self.services["front"].address, self.services["target"].address, self.services["draft"].address,
                       http=self.http)
        if self.pki is not None:
            ep.credentials, ep.ssl_context = tls(self.pki["ca"], self.pki["cert"], self.pki["key"])
            ep.token, ep.http_token = self.tokens
        return ep

    def describe(self, args) -> str:
        security = ("TLS on every port (throwaway CA, mutual between the services), bearer tokens (gRPC and HTTP "
                    "each its own)" if self.pki else "plaintext, no tokens")
        return (f"own: tiny models, Ray, {WORKERS} actors, HTTP API on, {security}; session_idle_s {args.idle_s:g} on "
                "draft and target")

    def _launch(self, kind: str) -> Service:
        return launch_service(kind, self.config_path, port=self.draft_port if kind == "draft" else self.target_port)

    def reaped_sessions(self) -> int:
        """Sessions the running target's idle reaper released (its log; a client that never released them)."""
        return self.services["target"].stderr.count("(target.session_idle_s)")

    def actor_pids(self) -> list[int]:
        """Pids of the front's ray::OrchestratorActor workers."""
        pids = []
        for proc in psutil.Process(self.services["front"].proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "OrchestratorActor" in " ".join(proc.cmdline()):
                    pids.append(proc.pid)
        return sorted(pids)

    def rss_bytes(self) -> dict[str, int]:
        """Resident memory of the front, its actor workers (summed), the draft and the target."""
        rss = {kind: psutil.Process(self.services[kind].proc.pid).memory_info().rss
               for kind in ("front", "draft", "target")}
        rss["actors"] = sum(psutil.Process(pid).memory_info().rss for pid in self.actor_pids())
        return rss

    def stop(self) -> None:
        for kind in ("front", "draft", "target"):
            if kind in self.services:
                stop_service(self.services[kind], timeout_s=60)


async def run_load(args, endpoints: Endpoints, deployment: LocalDeployment | None) -> dict:
    """``args.clients`` streaming requests at once (a share over HTTP); failures, latency, TTFT, equal outputs."""
    rng = random.Random(args.seed)
    plans = make_plans(rng, args.clients, args, "load")
    for i in rng.sample(range(len(plans)), round(args.http_share * len(plans)) if endpoints.http else 0):
        plans[i].via = "http"
    client = Client(endpoints, args.hang_grace_s, http_threads=sum(p.via == "http" for p in plans))
    try:
        refs = await client.references(plans)
        client.t0 = time.monotonic()
        outcomes = await asyncio.gather(*(client.run(p) for p in plans))
    finally:
        await client.close()
    wall = max(o.end_s for o in outcomes)
    failed = [o for o in outcomes if o.status != OK]
    outputs = output_figures(plans, outcomes, refs)
    return {"clients": args.clients, "greedy": sum(p.greedy for p in plans), "sampled": sum(not p.greedy for p in plans),
            "via": {v: sum(p.via == v for p in plans) for v in ("grpc", "http")},
            "prompt_lengths": args.prompt_lengths, "max_new_tokens": args.max_new_tokens, **outputs,
            "failures": len(failed), "statuses": status_counts(outcomes),
            "statuses_http": status_counts([o for o in outcomes if o.via == "http"]),
            **latency_figures(outcomes), "wall_s": wall,
            "tokens_per_s": sum(len(o.tokens) for o in outcomes) / wall if wall else 0.0,
            "ok": not failed and not outputs["greedy_mismatches"] and not outputs["sampled_mismatches"]}


async def run_soak(args, endpoints: Endpoints, deployment: LocalDeployment | None) -> dict:
    """``args.requests`` requests, ``args.concurrency`` at a time, some aborted or short; statuses, leaks and RSS."""
    plans = make_plans(random.Random(args.seed), args.requests, args, "soak")
    client = Client(endpoints, args.hang_grace_s)
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
    rss = {"rss_baseline_bytes": rss_before, "rss_end_bytes": deployment.rss_bytes() if deployment else None,
           "rss_samples": rss_samples}
    return soak_figures(args, plans, outcomes, refs, {"counts_baseline": base, "counts_end": after, "settle_s": settle_s,
                        "reaped_sessions": deployment.reaped_sessions() if deployment else None}, rss)

def soak_figures(args, plans: list[Plan], outcomes: list[Outcome], refs: dict, leaks: dict, rss: dict) -> dict:
    """The soak's figures and its verdict: statuses its plans allow, outputs equal to their solo runs, nothing
    left on the services (nor released by the target's reaper), RSS growth within the bound."""
    unexpected = unexpected_statuses(plans, outcomes, args.deadline_s)
    outputs = output_figures(plans, outcomes, refs)
    before, end = rss["rss_baseline_bytes"], rss["rss_end_bytes"]
    growth = {k: end[k] - before[k] for k in before} if before else None
    samples, second_half = rss["rss_samples"], None  # growth from the run's middle to its end (a leak: half the total)
    if samples and end is not None:
        middle = min(samples, key=lambda s: abs(s["t_s"] - samples[-1]["t_s"] / 2))
        second_half = {k: end[k] - middle[k] for k in end}
    over = None if second_half is None else {k: v for k, v in second_half.items() if v > args.max_rss_growth_mib * 2**20}
    checks = {"statuses_as_planned": not unexpected,
              "outputs_equal_solo": not outputs["greedy_mismatches"] and not outputs["sampled_mismatches"],
              "sessions_and_kv_back_to_0": not any(leaks["counts_end"].values()),
              "none_reaped_idle": None if leaks["reaped_sessions"] is None else leaks["reaped_sessions"] == 0,
              "rss_growth_within_bound": None if over is None else not over}
    return {"requests": args.requests, "concurrency": args.concurrency, "abort_rate": args.abort_rate,
            "deadline_rate": args.deadline_rate, "short_deadline_s": args.short_deadline_s,
            "planned_aborts": {"rpc": sum(p.abort == "rpc" for p in plans), "cancel": sum(p.abort == "cancel" for p in plans)},
            "short_deadlines": sum(p.deadline_s < args.deadline_s for p in plans),
            "greedy": sum(p.greedy for p in plans), "sampled": sum(not p.greedy for p in plans),
            "statuses": status_counts(outcomes), "unexpected": len(unexpected),
            "unexpected_statuses": dict(list(unexpected.items())[:20]),
            "hung": sum(o.status == HUNG for o in outcomes), **outputs, **latency_figures(outcomes),
            "wall_s": max(o.end_s for o in outcomes), **leaks, "rss_growth_bytes": growth,
            "rss_growth_second_half_bytes": second_half, "rss_bound_mib": args.max_rss_growth_mib,
            "rss_bound_rule": "each process's RSS growth from the run's middle to its end (caches warm by then; "
                              "a leak grows it by about half its total)",
            "rss_over_bound_bytes": over, **rss, "checks": checks,
            "ok": all(v is not False for v in checks.values())}


async def rss_trace(deployment: LocalDeployment, client: Client, every_s: float, stop: asyncio.Event) -> list[dict]:
    """RSS of each process every ``every_s`` seconds until ``stop`` is set: [{"t_s": ..., kind: bytes}]."""
    samples: list[dict] = []
    while not stop.is_set():
        samples.append({"t_s": time.monotonic() - client.t0, **deployment.rss_bytes()})
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
    return samples


async def run_closed_loop(client: Client, plans: list[Plan], concurrency: int,
                          done: asyncio.Event | None = None) -> list[Outcome | None]:
    """Send ``plans`` in order, ``concurrency`` at a time, until all are sent or ``done`` is set (None: not sent)."""
    outcomes: list[Outcome | None] = [None] * len(plans)
    queue = list(enumerate(plans))[::-1]

    async def worker():
        while queue and not (done and done.is_set()):
            i, plan = queue.pop()
            outcomes[i] = await client.run(plan)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes


@dataclass
class Disruption:
    """A window during which a part was down: [start_s, end_s] on the part's clock."""

    kind: str  # "draft" | "actor" | "target"
    start_s: float
    end_s: float
    restart_s: float  # seconds until it was back (a service restarted here; an actor worker restarted by Ray)


# The actor is killed last: the target sessions its requests held stay on the (not restarted) target for the leak check.
CHAOS_KILLS = ("draft", "target", "actor")
_EQUAL = {"greedy_equal", "sampled_equal"}
# What a request may be by the disruption it overlapped ("sampled_rerouted": chaos_verdict; docs/benchmarks.md).
CHAOS_ALLOWED = {"none": _EQUAL, "draft": _EQUAL | {"sampled_rerouted"}, "target": _EQUAL | {"UNAVAILABLE"},
                 "actor": _EQUAL | {"sampled_rerouted"}}
RECONNECT_GRACE_S = 1.5  # the front's channels retry a restarted service within ~1 s (clients.channel_options)


async def chaos_script(args, dep: LocalDeployment, clock) -> list[Disruption]:
    """Kill (and restart) the draft, the target, then one actor worker, ``settle_s`` of load apart."""
    windows = []
    for kind in CHAOS_KILLS:
        await asyncio.sleep(args.settle_s)
        start = clock()
        restart_s = await (kill_actor(dep) if kind == "actor" else kill_service(args, dep, kind))
        await asyncio.sleep(RECONNECT_GRACE_S)
        windows.append(Disruption(kind, start, clock(), restart_s))
    await asyncio.sleep(args.settle_s)
    return windows


async def kill_service(args, dep: LocalDeployment, kind: str) -> float:
    """SIGKILL the draft or target (a crash), wait ``down_s``, start it again on its port; seconds until ready."""
    log(f"chaos: SIGKILL the {kind} service")
    dep.services[kind].proc.kill()
    dep.services[kind].proc.wait()
    await asyncio.sleep(args.down_s)
    started = time.monotonic()
    dep.services[kind] = await asyncio.to_thread(lambda: wait_ready(dep._launch(kind)))
    log(f"chaos: {kind} restarted in {time.monotonic() - started:.1f} s")
    return time.monotonic() - started


async def kill_actor(dep: LocalDeployment, timeout_s: float = 120.0) -> float:
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


def overlapped(out: Outcome, windows: list[Disruption]) -> tuple[str, set[str]]:
    """The disruption this request is counted under ("target" first, then "actor", "draft", or "none") and what it
    may be: what any disruption it overlapped allows."""
    hit = {w.kind for w in windows if out.start_s < w.end_s and out.end_s > w.start_s}
    allowed = set().union(*(CHAOS_ALLOWED[k] for k in hit or {"none"}))
    return next((k for k in ("target", "actor", "draft") if k in hit), "none"), allowed


def chaos_verdict(out: Outcome, ref: Outcome) -> str:
    """A status name, or for a completed request how it compares with its solo run ``ref``: greedy_ / sampled_equal,
    _different, or sampled_rerouted (different after a fail-over or more rounds without the draft than alone)."""
    if out.status != OK:
        return out.status
    kind = "greedy" if out.greedy else "sampled"
    if out.tokens == ref.tokens:
        return f"{kind}_equal"
    if not out.greedy and (out.failovers or out.fallback_rounds != ref.fallback_rounds):
        return "sampled_rerouted"
    return f"{kind}_different"


async def run_chaos(args, endpoints: Endpoints, deployment: LocalDeployment | None) -> dict:
    """Closed-loop clients while the draft, the target and an actor are killed; outcomes by window; leaks after."""
    if deployment is None:
        raise SystemExit("chaos: kills processes, so it runs only on its own deployment (drop --front)")
    plans = make_plans(random.Random(args.seed), 4096, args, "chaos")
    client, done = Client(endpoints, args.hang_grace_s), asyncio.Event()
    try:
        refs = await client.references(plans)
        client.t0 = time.monotonic()
        loop = asyncio.ensure_future(run_closed_loop(client, plans, args.clients, done))  # until the script ends
        try:
            windows = await chaos_script(args, deployment, lambda: time.monotonic() - client.t0)
        finally:
            done.set()
            outcomes = [o for o in await loop if o is not None]
        plan, started, tries = next(p for p in plans if p.greedy), time.monotonic(), 0
        while True:  # a fresh greedy request until it equals its solo run (or --recovery-timeout-s)
            tries += 1
            out = await client.run(Plan(f"recovery-{tries}", plan.prompt_ids, plan.max_new_tokens, deadline_s=60.0))
            equal = out.status == OK and out.tokens == refs[plan.key].tokens
            if equal or time.monotonic() - started > args.recovery_timeout_s:
                break
            await asyncio.sleep(0.5)
        recovery = {"serves_again": equal, "tries": tries, "seconds": time.monotonic() - started,
                    "last_status": out.status}
    finally:
        await client.close()
    at_once = await service_counts(endpoints)
    end, waited = await counts_back_to_zero(endpoints, args.leak_timeout_s)
    leaks = {"at_once": at_once, "end": end, "zero_after_s": None if any(end.values()) else round(waited, 1),
             "reaped_idle": deployment.reaped_sessions()}  # what the killed left to the target's idle reaper
    by_plan, table, not_allowed = {p.request_id: p for p in plans}, defaultdict(Counter), defaultdict(set)
    for out in outcomes:
        (window, allowed), verdict = overlapped(out, windows), chaos_verdict(out, refs[by_plan[out.request_id].key])
        table[window][verdict] += 1
        if verdict not in allowed:
            not_allowed[window].add(verdict)
    count = lambda *verdicts: sum(row.get(v, 0) for row in table.values() for v in verdicts)  # noqa: E731
    return {"clients": args.clients, "deadline_s": args.deadline_s, "down_s": args.down_s, "settle_s": args.settle_s,
            "requests": len(outcomes), "windows": [asdict(w) for w in windows],
            "outcomes_by_window": {w: dict(row) for w, row in table.items()},
            "allowed_by_window": {w: sorted(v) for w, v in CHAOS_ALLOWED.items()},
            "not_allowed": {w: sorted(v) for w, v in not_allowed.items()},
            "hung": sum(o.status == HUNG for o in outcomes),
            "wrong_outputs": count("greedy_different", "sampled_different"),
            "sampled_checked": count("sampled_equal", "sampled_different", "sampled_rerouted"),
            "sampled_rerouted": count("sampled_rerouted"),
            "max_latency_s": max((o.latency_s for o in outcomes), default=0.0),
            "recovery": recovery, "leaks_after": leaks,
            "ok": not not_allowed and recovery["serves_again"] and not any(end.values())}


def markdown(part: str, result: dict) -> str:
    """A table of the part's scalar figures (and, for chaos, outcomes per disruption window)."""
    meta = result["meta"]
    rows = []
    for key, value in result[part].items():
        if isinstance(value, float):
            value = f"{value:.3f}"
        elif isinstance(value, dict) and key.endswith("_bytes"):
            key, value = key[: -len("_bytes")] + "_mib", ", ".join(f"{k}: {v / 2**20:.1f}" for k, v in value.items()) or "none"
        elif isinstance(value, dict) and key not in ("outcomes_by_window", "allowed_by_window"):
            value = ", ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in value.items()) or "none"
        elif isinstance(value, (list, dict)):
            continue
        rows.append([key, value])
    lines = [f"# Reliability: {part}", "", f"{meta['date']}, commit {meta.get('commit')}, {meta.get('cpu_model')} "
             f"({meta.get('cpus')} CPUs); {meta['deployment']}", ""] + md_table(["figure", "value"], rows)
    if part == "chaos":
        figures = result[part]
        lines += ["", "Outcomes by the disruption a request overlapped (allowed: "
                  + "; ".join(f"{w}: {', '.join(v)}" for w, v in figures["allowed_by_window"].items()) + "):", ""]
        lines += nested_table("window", figures["outcomes_by_window"]) + [""] + md_table(
            ["disruption", "start_s", "end_s", "restart_s"],
            [[w["kind"], *(f"{w[k]:.1f}" for k in ("start_s", "end_s", "restart_s"))] for w in figures["windows"]])
    return "\n".join(lines) + "\n"


# Parts: name -> runner(args, endpoints, deployment or None) -> figures; ``fuzz`` is reliability_fuzz.py.
PARTS = {"load": run_load, "soak": run_soak, "chaos": run_chaos}


def positive_ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]  # a ValueError: argparse names the option and value
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False)  # the options every part but fuzz shares
    p.add_argument("--out", type=Path, default=Path("bench_out/reliability"), help="folder for reliability_<part>.json/.md")
    p.add_argument("--front", help="HOST:PORT of a running front (default: start a tiny deployment here)")
    p.add_argument("--target", help="HOST:PORT of its target service (session and KV counts)")
    p.add_argument("--draft", help="HOST:PORT of its draft service (session and KV counts)")
    p.add_argument("--http", help="HOST:PORT of its HTTP API (load sends --http-share of the requests there)")
    p.add_argument("--tls-ca", help="PEM CA bundle: TLS to the front (gRPC and HTTPS) and services")
    p.add_argument("--tls-cert", help="PEM client certificate (services with mutual TLS)")
    p.add_argument("--tls-key", help="PEM client key (with --tls-cert)")
    p.add_argument("--auth-token-file", help="bearer token for the front (first line; $SPECDEC_TOKEN wins)")
    p.add_argument("--target-model", help="model dir for the own deployment's target (default: tiny random)")
    p.add_argument("--draft-model", help="model dir for the own deployment's draft (default: tiny random)")
    p.add_argument("--plaintext", action="store_true", help="own deployment: no TLS and no bearer tokens")
    p.add_argument("--idle-s", type=float, default=30.0, help="own deployment: draft and target session_idle_s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=250, help="prompt token ids are drawn from 1..vocab-1")
    p.add_argument("--prompt-lengths", type=positive_ints, default=[4, 16, 48, 96])
    p.add_argument("--prompts-per-length", type=int, default=2, help="distinct prompts of each length")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--sampled-share", type=float, default=0.5, help="share of sampled (seeded) requests")
    p.add_argument("--seeds", type=int, default=2, help="sampled requests take seeds 0..N-1 (a solo run each)")
    p.add_argument("--deadline-s", type=float, default=120.0, help="every request's deadline")
    p.add_argument("--hang-grace-s", type=float, default=10.0, help="a request with no end by deadline + this hung")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="part", required=True)
    sub.add_parser("fuzz", help="random and mutated messages against every RPC, or --stateful sequences "
                   "(benchmarks/reliability_fuzz.py; `fuzz --help` for its options)", add_help=False)
    load = sub.add_parser("load", parents=[p], help="concurrent streaming clients")
    load.add_argument("--clients", type=int, default=64)
    load.add_argument("--http-share", type=float, default=0.25, help="share of the clients on the HTTP API (if any)")
    soak = sub.add_parser("soak", parents=[p], help="requests back to back with aborts and short deadlines")
    soak.add_argument("--requests", type=int, default=1000)
    soak.add_argument("--concurrency", type=int, default=4)
    soak.add_argument("--abort-rate", type=float, default=0.2)
    soak.add_argument("--abort-within-s", type=float, default=0.5, help="aborts come 0..this seconds after the send")
    soak.add_argument("--deadline-rate", type=float, default=0.2)
    soak.add_argument("--short-deadline-s", type=float, default=0.5, help="short deadlines: 0.2..1 x this")
    soak.add_argument("--settle-s", type=float, default=10.0, help="time for sessions to drain to 0 at the end")
    soak.add_argument("--rss-every-s", type=float, default=5.0, help="RSS sampled this often (own deployment)")
    soak.add_argument("--max-rss-growth-mib", type=float, default=32.0,
                      help="fail when a process's RSS grows more than this from the run's middle to its end")
    chaos = sub.add_parser("chaos", parents=[p], help="kill, restart the draft, the target and an actor under load")
    chaos.add_argument("--clients", type=int, default=8)
    chaos.add_argument("--down-s", type=float, default=1.0, help="a killed service stays down this long")
    chaos.add_argument("--settle-s", type=float, default=3.0, help="load before, between and after the kills")
    chaos.add_argument("--recovery-timeout-s", type=float, default=60.0)
    chaos.add_argument("--leak-timeout-s", type=float, default=75.0,
                       help="sessions and KV must be back to 0 this long after the chaos (the reaper's 1-1.5 x --idle-s)")
    args = parser.parse_args(argv)
    if args.part == "chaos":
        args.deadline_s = min(args.deadline_s, 30.0)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["fuzz"]:  # the fuzz part: benchmarks/reliability_fuzz.py (hypothesis: imported only for it)
        from benchmarks.reliability_fuzz import main as fuzz_main

        return fuzz_main(argv[1:])
    args = parse_args(argv)
    deployment = None
    with tempfile.TemporaryDirectory(prefix="reliability-") as workdir:
        try:
            if args.front:
                from orchestrator.cli.remote import client_token  # imports torch (specdec.sampling): only with --front

                credentials, context = tls(args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca else (None, None)
                token = client_token(args.auth_token_file)
                endpoints = Endpoints(args.front, args.target, args.draft, credentials, token, args.http, token,
                                      context)
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
            "deployment": f"front {args.front}" if args.front else deployment.describe(args), "argv": argv, **machine()}
    result = {"meta": meta, args.part: figures}
    write_record(args.out, f"reliability_{args.part}", result, markdown(args.part, result))
    log(f"{args.part}: ok={figures['ok']}; wrote {args.out}/reliability_{args.part}.json and .md")
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
