"""Service configuration: one YAML file drives ``specdec serve`` locally and the Kubernetes ConfigMap.

    specdec serve --config deploy/specdec.yaml

Every field has a default, so an empty file (or none) is a valid config; flags override fields.
Errors (unknown keys, bad values, a malformed tree) raise ConfigError naming the field, e.g.
``target.port: Input should be less than or equal to 65535``.
"""

from __future__ import annotations

import os

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specdec.tree_spec import DEFAULT_SPEC, TreeSpec, TreeSpecError, parse_tree_spec


class ConfigError(ValueError):
    """An invalid service config; the message names the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelsConfig(_Section):
    target: str | None = None        # model dir (None = the default real pair's target)
    draft: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    draft_quant: Literal["auto", "none", "int8"] = "auto"
    device: str = "cpu"
    max_context: int | None = Field(default=None, ge=2)
    threads: int | None = Field(default=None, ge=1)
    # float32 CPU target: greedy rows take their argmax from an int8 screen plus a float64 re-check
    # of the tokens that could still win (specdec.argmax_head: the float32 argmax but at near-ties
    # within float32 rounding; ~+1.2 GB for the default target's head copies). False = always the
    # full float32 LM head.
    argmax_screen: bool = True


class GrpcConfig(_Section):
    max_message_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    shutdown_grace_s: float = Field(default=10.0, ge=0)   # SIGTERM: finish in-flight calls this long
    # Transport security (specdec.security), PEM files. cert + key: every port serves TLS; + ca: the
    # services verify each other against it (mutual TLS: draft and target accept only clients whose
    # certificate chains to it; the front presents its certificate to them). ca alone: clients only.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    # A second, plaintext port that serves only grpc.health.v1.Health (the same statuses as the
    # service's own port): kubelet's gRPC probes speak plaintext and present no client certificate,
    # so with TLS the probes ask here. None = off; 0 = ephemeral. Set per server (--health-port):
    # one process per host binds it, so ``specdec serve`` refuses it.
    health_port: int | None = Field(default=None, ge=0, le=65535)

    @model_validator(mode="after")
    def _tls_files(self):
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert: tls_cert and tls_key go together (the certificate and its private key)")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path is not None and not os.access(path, os.R_OK):
                raise ValueError(f"{name}: cannot read {path}")
        return self


class DraftServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=50061, ge=0, le=65535)      # 0 = ephemeral
    max_sessions: int = Field(default=256, ge=1)
    prefill_chunk_tokens: int = Field(default=256, ge=1)  # prompt tokens per prefill job: others' proposes get in between
    max_batch: int = Field(default=8, ge=1)               # sessions whose tree steps share one draft forward
    batch_wait_ms: float = Field(default=1.0, ge=0)       # how long a propose waits for company
    # the longest wait for sessions expected back from their last proposal (specdec.batching), as a
    # fraction of the mean propose time; requests whose verifies merged then draft in the same
    # forwards too (0 = only batch_wait_ms)
    batch_gather: float = Field(default=0.25, ge=0, le=1)


class TargetServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=50062, ge=0, le=65535)
    tp: int = Field(default=1, ge=1)                      # tensor-parallel ranks
    # sessions merged into one verify forward. 16 clients of plain decoding on the 2-core CPU: 15.6-16.7
    # tok/s at 16 against 6.2-11.1 at 8 (two forwards of 8 rows per token cost more than one of 16:
    # V(8) = 418 ms, V(16) = 517 ms; benchmarks/records/serving_cpu_2core_2026-12-04_max_batch16/serving_cpu_2core_2026-12-04_max_batch16.md)
    max_batch: int = Field(default=16, ge=1)
    batch_wait_ms: float = Field(default=2.0, ge=0)       # how long a verify waits for company
    # the longest wait for sessions expected back from their last verify (specdec.batching), as a
    # fraction of the mean verify forward time; 0 = only batch_wait_ms
    batch_gather: float = Field(default=0.25, ge=0, le=1)
    # KV slots over all sessions (RESOURCE_EXHAUSTED past it); "auto": kv_memory_fraction of the memory
    # free once the weights are loaded, over the model's KV bytes per token (target_service.kv_budget)
    max_kv_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    kv_memory_fraction: float = Field(default=0.7, gt=0, le=1)
    max_tree_nodes: int = Field(default=512, ge=1)
    prefill_chunk_tokens: int = Field(default=256, ge=1)  # prompt tokens per prefill forward: an abort or others' verifies get in between
    # while other sessions are decoding, a prompt longer than prefill_chunk_tokens is fed this many tokens at
    # a time inside their next verify forward (null = off: chunks of prefill_chunk_tokens in forwards of their own). Packed forwards make a riding
    # chunk of C tokens cost its C + 1 rows; 16 keeps the decoders' forwards within ~2x on the 2-core CPU
    # (raise it where rows are cheap, e.g. on a GPU). Only on a target whose verify_batch packs rows.
    prefill_busy_chunk_tokens: int | None = Field(default=16, ge=1)
    session_idle_s: float = Field(default=600.0, gt=0)    # a session untouched this long is released (its client died)


class DynamicGammaConfig(_Section):
    enabled: bool = True
    min_gamma: int = Field(default=1, ge=1)
    max_gamma: int = Field(default=8, ge=1)

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_gamma > self.max_gamma:
            raise ValueError(f"min_gamma {self.min_gamma} > max_gamma {self.max_gamma}")
        return self


class FallbackConfig(_Section):
    window: int = Field(default=8, ge=1)                  # rounds in the sliding acceptance window
    min_acceptance: float = Field(default=0.1, ge=0, le=1)   # below it (full window) speculation is off
    probe_every: int = Field(default=16, ge=1)            # plain rounds before speculation is retried
    draft_deadline_ms: float = Field(default=2000.0, gt=0)   # a slower draft reply falls back
    reconnect_s: float = Field(default=2.0, gt=0)         # wait before re-opening a failed draft


CONTROLS = ("cost-aware", "dynamic-gamma", "fixed")  # per-request controls of embedded mode (specdec generate/bench)


class CostAwareConfig(_Section):
    """The default per-request control (orchestrator.planning.cost_aware): trees shaped by measured costs."""

    enabled: bool = True                                  # false: dynamic_gamma (when enabled) or the fixed tree
    max_gamma: int = Field(default=10, ge=1, le=64)       # most draft steps a round may plan
    ngram_tokens: int = Field(default=8, ge=0, le=64)     # context (n-gram) branch length; 0 = no context branches
    max_ngram: int = Field(default=3, ge=1, le=8)         # longest suffix matched in the context
    probe_every: int = Field(default=16, ge=1)            # rounds without the draft before one draft step is tried
    first_round_plain: bool = True                        # the first round never drafts (TTFT = target-only TTFT)
    # draft and target compute on the same hardware: under load a draft step is priced for the whole
    # batch (orchestrator.planning.cost_model.LoadedCost); "auto" = compare the two services' Info placements
    shared_compute: Literal["auto"] | bool = "auto"
    # under light load on shared compute (other requests run, fewer than in_step_max_load sessions per
    # verify forward) the requests draft or decode plain together, from front-wide figures
    # (orchestrator.planning.cost_aware.SharedState.in_step_applies), their rounds kept in step by a round
    # clock (orchestrator.planning.lockstep): at 2 clients on the 2-core CPU 1.25x and 1.51x of target-only
    # against 1.02x and 1.10x each request alone (benchmarks/records/serving_cpu_2core_2026-12-04_in_step_2clients/serving_cpu_2core_2026-12-04_in_step_2clients.md)
    in_step: bool = True
    # in step: at each of a round's two turns (start, verify) a request waits for the others at most
    # this long; the ones missing then are not waited for until they come back (orchestrator.planning.lockstep)
    in_step_wait_ms: float = Field(default=1000.0, gt=0)
    # in step only below this load (sessions per verify forward, a moving average): at or above it
    # each request plans alone and the round clock lets every turn pass. 8.5: in step up to 8
    # clients; on the 2-core AMD EPYC ahead of 2.5 (the cap until 2026-12-05, chosen on an Intel Xeon
    # where in step at 4 and 8 clients was no faster) in 5 of 5 side-by-side runs at 4 clients (mean
    # 1.10x of target-only against 1.00x), mostly plain rounds kept in step; no different at 8 (2 of
    # 4, 1.03x against 1.00x) (benchmarks/records/serving_cpu_2core_2026-12-05_amd_in_step_cap_confirm/serving_cpu_2core_2026-12-05_amd_in_step_cap_confirm.md)
    in_step_max_load: float = Field(default=8.5, gt=1.5)
    # requests without speculation (no_spec) keep in step too where the clock runs (beside speculating
    # ones they wait at each verify turn for those requests' drafts): they join it and
    # their verifies teach the load (false: they verify when ready, merged by the target's gather
    # window only). On the 2-core AMD EPYC target-only in step was 1.03x and 1.22x of that at 4
    # clients, 1.04x and 1.03x at 8 (benchmarks/records/serving_cpu_2core_2026-12-05_amd_plain_in_step/serving_cpu_2core_2026-12-05_amd_plain_in_step.md); again
    # 1.02x/1.03x and 1.11x/1.01x, p95 latency lower in 4 of 4 (..._amd_plain_in_step_confirm.md); in
    # mixed traffic (half no_spec) 1.02-1.16x the throughput, their p95 0.97-1.22x (..._amd_mixed.md)
    in_step_no_spec: bool = True
    # what a draft step's cost D is learnt from where the draft is a service: "reply", the reply's wall
    # time, transport and the wait behind other sessions' proposals and prefills included; "forward",
    # the draft call's own time its reply reports (as V learns the target forward's): it drafted more
    # under load and was no faster at 4 clients, slower at 8, than "reply" (the wait is a drafted
    # round's cost too; benchmarks/records/serving_cpu_2core_2026-12-05_amd_in_step_cap_ab/serving_cpu_2core_2026-12-05_amd_in_step_cap_ab.md). Only where
    # replies teach D: not on the draft's own device under load (they teach its queue share there),
    # nor for an in-process draft (the draft phase's time is the call's)
    draft_cost_from: Literal["forward", "reply"] = "reply"
    # the cost model's starting shape (orchestrator.planning.cost_model): V(n), the target's own forward time
    # in ms by verify rows, and D(p), ms per draft step by parents expanded, both or neither, 2 points
    # or more each (between and past them the curves are linear). None: measured through the two
    # services when the front connects (``measure_at_start``: a few verifies and proposals on a
    # session of its own, seconds; a front with Ray measures once and hands the figures to its
    # actors), else the prior figures of the 2-core CPU, whose shape may be far from this
    # deployment's (on a GPU extra verify rows are nearly free). Given figures are taken as this
    # deployment's: the rounds' timings then move their scale only
    measure_at_start: bool = True
    verify_ms: dict[Annotated[int, Field(ge=1)], Annotated[float, Field(gt=0, allow_inf_nan=False)]] | None = Field(
        default=None, min_length=2)
    draft_step_ms: dict[Annotated[int, Field(ge=1)], Annotated[float, Field(gt=0, allow_inf_nan=False)]] | None = Field(
        default=None, min_length=2)

    @model_validator(mode="after")
    def _costs_together(self):
        if (self.verify_ms is None) != (self.draft_step_ms is None):
            given, missing = ("verify_ms", "draft_step_ms") if self.verify_ms is not None else ("draft_step_ms", "verify_ms")
            raise ValueError(f"{missing}: required with {given} (the cost model starts from both or from neither)")
        return self


class DraftWindowConfig(_Section):
    """The context the draft session opens with (orchestrator.loop.controller): the first ``sink_tokens``
    committed tokens and the most recent ones, ``max_tokens`` in all (StreamingLLM's attention sinks
    plus a recent window, Xiao et al. 2024, section 3; MagicDec, Chen et al. 2024, section 4, drafts
    long contexts this way). A long prompt then costs the draft a short prefill; the target still
    sees every token, so the output is unchanged and only acceptance can move: a short answer after a
    long prompt (rag, extraction) no longer pays for the whole prompt's draft prefill. A long answer
    to a long prompt (a summary) drafts about half as well from the window, so once a request has
    generated ``full_after_tokens`` its draft re-opens with every committed token: one full prefill,
    as in ski rental (rent the window; buy the whole context once the answer has shown it is long;
    the loss is bounded by the window's prefill plus full_after_tokens drafted from the window; 64:
    Spec-Bench's rag and extraction answers, mostly under 64 tokens, keep the window's gain, where a
    re-open at 32 cost a 39-token rag answer 3.3 s; benchmarks/records/draft_window_cpu_2core_2026-12-01/draft_window_cpu_2core_2026-12-01.md).
    max_tokens None = every token from the start; full_after_tokens None = the window to the end."""

    max_tokens: int | None = Field(default=256, ge=2)
    sink_tokens: int = Field(default=32, ge=0)
    full_after_tokens: int | None = Field(default=64, ge=1)
    # also where the draft has its own hardware; by default only where it shares the target's compute
    # (embedded mode; services whose placements coincide, front.cost_aware.shared_compute): on its own
    # device the draft prefills beside the target's prefill, off the critical path, and a window
    # would only cost acceptance
    on_separate_hardware: bool = False

    @model_validator(mode="after")
    def _sink_fits(self):
        if self.max_tokens is not None and self.sink_tokens >= self.max_tokens:
            raise ValueError(f"sink_tokens: must be under max_tokens ({self.max_tokens}), got {self.sink_tokens}")
        return self

    def applies(self, shared_compute: bool) -> bool:
        """Whether the window is used for a draft that does (True) or does not share the target's compute."""
        return self.max_tokens is not None and (shared_compute or self.on_separate_hardware)

    def context(self, tokens: list[int]) -> list[int]:
        """tokens [N] -> the draft's context [min(N, max_tokens)]: the first sink_tokens and the
        last max_tokens - sink_tokens, in order, at draft positions 0.. (the gap closed)."""
        if self.max_tokens is None or len(tokens) <= self.max_tokens:
            return list(tokens)
        return [*tokens[: self.sink_tokens], *tokens[len(tokens) - (self.max_tokens - self.sink_tokens):]]


class MonitorConfig(_Section):
    window: int = Field(default=32, ge=1)                 # rounds per acceptance window
    alert_threshold: float = Field(default=0.5, ge=0, le=1)
    alert_windows: int = Field(default=3, ge=1)           # consecutive low windows before an alert


class ClientLimitsConfig(_Section):
    """Admission limits of the front (orchestrator.serving.admission), per client and overall. A client is its
    bearer token when ``front.auth_token_file`` is set, else its address (the peer's host)."""

    max_running: int = Field(default=256, ge=1)            # requests holding a running slot (prefill or decoding)
    max_waiting: int = Field(default=1024, ge=0)           # requests queued (FIFO) for a slot; 0 = refuse when full
    max_running_per_client: int | None = Field(default=None, ge=1)   # None = only max_running
    max_waiting_per_client: int | None = Field(default=None, ge=0)   # None = only max_waiting
    max_kv_tokens_per_request: int | None = Field(default=None, ge=2)  # prompt + max_new_tokens (None = no cap)


class FrontConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=50060, ge=0, le=65535)
    draft_address: str = "127.0.0.1:50061"
    target_address: str = "127.0.0.1:50062"
    tokenizer: str | None = None                          # model dir for the tokenizer (None = models.target)
    max_new_tokens: int = Field(default=256, ge=1)
    max_prompt_tokens: int = Field(default=8192, ge=1)
    tree: TreeSpec = DEFAULT_SPEC
    speculate: bool = True
    pipeline: bool = False                                # draft round r+1 while round r verifies (DESIGN.md "Pipelining")
    draft_window: DraftWindowConfig = DraftWindowConfig()  # the context a draft session opens with (sinks + recent tokens)
    cost_aware: CostAwareConfig = CostAwareConfig()
    dynamic_gamma: DynamicGammaConfig = DynamicGammaConfig()
    fallback: FallbackConfig = FallbackConfig()
    monitor: MonitorConfig = MonitorConfig()
    use_ray: bool = True                                  # False: requests run in the front process (no Ray)
    ray_address: str | None = None                        # None = start a local Ray; "auto" or ray://... = attach
    ray_num_cpus: int | None = Field(default=None, ge=1)
    workers: int = Field(default=1, ge=1)                 # orchestrator actors
    metrics_port: int | None = Field(default=None, ge=0, le=65535)   # Prometheus /metrics (None = off)
    # OpenAI-compatible HTTP API (orchestrator.serving.http_api) on front.host: /v1/completions,
    # /v1/chat/completions, /v1/models, /health, /metrics. None = off (the gRPC API only); 0 = ephemeral.
    http_port: int | None = Field(default=None, ge=0, le=65535)
    auth_token_file: str | None = None                    # GenerationService and HTTP /v1/*: bearer tokens, one a line (None = no auth)
    served_model_name: str | None = None                  # HTTP "model" id (None = the tokenizer directory's name)
    limits: ClientLimitsConfig = ClientLimitsConfig()     # concurrent / queued requests and KV per request (RESOURCE_EXHAUSTED past them)

    @model_validator(mode="after")
    def _distinct_ports(self):
        ports = {"port": self.port, "metrics_port": self.metrics_port, "http_port": self.http_port}
        taken = {}
        for name, port in ports.items():
            if port:  # None = off, 0 = ephemeral: never a clash
                if port in taken:
                    raise ValueError(f"{name}: {port} is already front.{taken[port]}")
                taken[port] = name
        return self

    @field_validator("tree", mode="before")
    @classmethod
    def _tree(cls, value):
        if isinstance(value, TreeSpec):
            return value
        try:
            return parse_tree_spec(value)
        except TreeSpecError as exc:
            raise ValueError(str(exc)) from exc


class ServeConfig(_Section):
    models: ModelsConfig = ModelsConfig()
    grpc: GrpcConfig = GrpcConfig()
    draft: DraftServerConfig = DraftServerConfig()
    target: TargetServerConfig = TargetServerConfig()
    front: FrontConfig = FrontConfig()

    @model_validator(mode="after")
    def _health_port_apart(self):
        """grpc.health_port differs from every port a service of this config serves (0 = ephemeral: no clash)."""
        health_port = self.grpc.health_port
        if not health_port:
            return self
        ports = {"draft.port": self.draft.port, "target.port": self.target.port, "front.port": self.front.port,
                 "front.metrics_port": self.front.metrics_port, "front.http_port": self.front.http_port}
        for name, port in ports.items():
            if port == health_port:
                raise ValueError(f"grpc.health_port: {health_port} is already {name} (the health port is a port of its own)")
        return self


# Keys that were removed or renamed: dotted path -> what to do instead. A config that still sets one
# fails naming it with this text rather than pydantic's generic "extra inputs" message.
RETIRED_KEYS: dict[str, str] = {}


def _section_keys(loc: tuple) -> list[str] | None:
    """The field names of the section that ``loc`` (a path ending in an unknown key) sits in, None
    where the path does not lead through sections."""
    model = ServeConfig
    for key in loc[:-1]:
        field = model.model_fields.get(str(key))
        model = field.annotation if field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
    return list(model.model_fields)


def _error_text(err: dict) -> str:
    """One validation error as ``dotted.key: message``; an unknown key names the retired key's
    replacement or the section's keys."""
    loc = ".".join(str(x) for x in err["loc"])
    if err["type"] == "extra_forbidden":
        if loc in RETIRED_KEYS:
            return f"{loc}: no longer a config key: {RETIRED_KEYS[loc]}"
        keys = _section_keys(err["loc"])
        return f"{loc}: unknown key" + (f" (known here: {', '.join(keys)})" if keys else "")
    message = err["msg"].removeprefix("Value error, ")
    return f"{loc}: {message}" if loc else message  # a check across sections names its field itself


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> ServeConfig:
    """Read a YAML config (None = defaults) and apply dotted overrides, e.g. {"target.port": 0}.

    Raises ConfigError naming the field (or the file, when it is unreadable or not YAML).
    """
    data: dict = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"--config: cannot read {path}: {exc.strerror or exc}") from exc
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config: {path} is not valid YAML ({exc})") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"--config: {path} must hold a mapping at the top level")
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("invalid config: " + "; ".join(_error_text(err) for err in exc.errors())) from exc


def dump_config(config: ServeConfig) -> str:
    """YAML of a config (TreeSpec in its JSON field names), loadable by ``load_config``."""
    data = config.model_dump(mode="json")
    data["front"]["tree"] = config.front.tree.model_dump(mode="json", by_alias=True)
    return yaml.safe_dump(data, sort_keys=False)
