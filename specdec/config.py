"""Service configuration: one YAML file for ``specdec serve`` and the Kubernetes ConfigMap; every key, its default and
meaning: docs/serving.md "Config reference". Errors raise ConfigError naming the field, e.g. ``target.port: Input should
be less than or equal to 65535``."""

from __future__ import annotations

import os

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specdec.tree_spec import DEFAULT_SPEC, TreeSpec, TreeSpecError, error_text, parse_tree_spec


class ConfigError(ValueError):
    """An invalid service config; the message names the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelsConfig(_Section):
    target: str | None = None        # model dir (None = the default real pair's target)
    draft: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    draft_quant: Literal["auto", "none", "int8"] = "auto"
    device: str = "cpu"                                   # both models' device where draft.device / target.device are unset
    max_context: int | None = Field(default=None, ge=2)
    threads: int | None = Field(default=None, ge=1)
    argmax_screen: bool = True


class GrpcConfig(_Section):
    max_message_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    shutdown_grace_s: float = Field(default=10.0, ge=0)   # SIGTERM: finish in-flight calls this long
    keepalive_s: float = Field(default=30.0, ge=0.5)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_client_auth: bool = True
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
    device: str | None = None                             # "cpu", "cuda:1", ...; None = models.device
    max_sessions: int = Field(default=256, ge=1)
    session_idle_s: float = Field(default=600.0, gt=0)    # a stream without a message this long is ended (its client died)
    max_kv_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    kv_memory_fraction: float = Field(default=0.2, gt=0, le=1)
    prefill_chunk_tokens: int = Field(default=256, ge=1)  # prompt tokens per prefill job: others' proposes get in between
    max_batch: int = Field(default=8, ge=1)               # sessions whose tree steps share one draft forward
    batch_wait_ms: float = Field(default=1.0, ge=0)       # how long a propose waits for company
    batch_gather: float = Field(default=0.25, ge=0, le=1)


class TargetServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=50062, ge=0, le=65535)
    tp: int = Field(default=1, ge=1)                      # tensor-parallel ranks
    device: str | list[str] | None = None
    max_batch: int = Field(default=16, ge=1)
    batch_wait_ms: float = Field(default=2.0, ge=0)       # how long a verify waits for company
    batch_gather: float = Field(default=0.25, ge=0, le=1)
    max_kv_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    kv_memory_fraction: float = Field(default=0.7, gt=0, le=1)
    max_tree_nodes: int = Field(default=512, ge=1)
    prefill_chunk_tokens: int = Field(default=256, ge=1)  # prompt tokens per prefill forward: an abort or others' verifies get in between
    prefill_busy_chunk_tokens: int | None = Field(default=16, ge=1)
    session_idle_s: float = Field(default=600.0, gt=0)    # a session untouched this long is released (its client died)
    max_sessions: int = Field(default=512, ge=1)          # open sessions (each holds a logits row even with no KV)


class FallbackConfig(_Section):
    draft_deadline_ms: float = Field(default=2000.0, gt=0)   # a slower draft reply falls back
    reconnect_s: float = Field(default=2.0, gt=0)         # wait before re-opening a failed draft


CONTROLS = ("cost-aware", "fixed")  # per-request controls of embedded mode (specdec generate/bench)


class CostAwareConfig(_Section):
    """The default per-request control (orchestrator.planning.cost_aware): trees shaped by measured costs."""

    enabled: bool = True                                  # false: the fixed tree (the request's TreeSpec every round)
    max_gamma: int = Field(default=10, ge=1, le=64)       # most draft steps a round may plan
    ngram_tokens: int = Field(default=8, ge=0, le=64)     # context (n-gram) branch length; 0 = no context branches
    max_ngram: int = Field(default=3, ge=1, le=8)         # longest suffix matched in the context
    probe_every: int = Field(default=16, ge=1)            # rounds without the draft before one draft step is tried
    first_round_plain: bool = True                        # the first round never drafts (TTFT = target-only TTFT)
    shared_compute: Literal["auto"] | bool = "auto"
    draft_cost_from: Literal["forward", "reply"] = "reply"
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
    """The context a draft session opens with: the first ``sink_tokens`` and the most recent tokens, ``max_tokens``
    in all (docs/control.md "Draft context window"; StreamingLLM, Xiao et al. 2024, §3; MagicDec, Chen et al. 2024)."""

    max_tokens: int | None = Field(default=256, ge=2)
    sink_tokens: int = Field(default=32, ge=0)
    full_after_tokens: int | None = Field(default=64, ge=1)
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
    """Admission limits of the front (orchestrator.serving.admission), per client and overall."""

    max_running: int = Field(default=256, ge=1)            # requests holding a running slot (prefill or decoding)
    max_waiting: int = Field(default=1024, ge=0)           # requests queued (FIFO) for a slot; 0 = refuse when full
    max_running_per_client: int | None = Field(default=None, ge=1)   # None = half of max_running
    max_waiting_per_client: int | None = Field(default=None, ge=0)   # None = half of max_waiting
    max_kv_tokens_per_request: int | None = Field(default=None, ge=2)  # prompt + max_new_tokens (None = no cap)
    max_new_tokens: int = Field(default=8192, ge=1)       # an explicit max_new_tokens above it is refused, not clamped
    max_prompt_bytes: int = Field(default=1 << 20, ge=1)   # a text prompt's UTF-8 bytes, checked before tokenizing
    max_body_bytes: int = Field(default=4 << 20, ge=1024)  # an HTTP body (Content-Length or read): over it, 413 unread
    request_timeout_s: float | None = Field(default=600.0, gt=0)


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
    pipeline: Literal["auto"] | bool = False              # draft round r+1 while round r verifies; auto: the control
    ahead_candidates: int = Field(default=2, ge=1, le=4)  # next trees per ahead (pre-drafting; 1 = path + guess only)
    draft_window: DraftWindowConfig = DraftWindowConfig()  # the context a draft session opens with (sinks + recent tokens)
    cost_aware: CostAwareConfig = CostAwareConfig()
    fallback: FallbackConfig = FallbackConfig()
    monitor: MonitorConfig = MonitorConfig()
    use_ray: bool = True                                  # False: requests run in the front process (no Ray)
    ray_address: str | None = None                        # None = start a local Ray; "auto" or ray://... = attach
    ray_num_cpus: int | None = Field(default=None, ge=1)
    workers: int = Field(default=1, ge=1)                 # orchestrator actors
    metrics_port: int | None = Field(default=None, ge=0, le=65535)   # Prometheus /metrics (None = off)
    http_port: int | None = Field(default=None, ge=0, le=65535)
    auth_token_file: str | None = None                    # GenerationService and HTTP /v1/*: bearer tokens, one a line (None = no auth)
    metrics_auth: bool = False
    served_model_name: str | None = None                  # HTTP "model" id (None = the tokenizer directory's name)
    limits: ClientLimitsConfig = ClientLimitsConfig()     # concurrent / queued requests and KV per request (RESOURCE_EXHAUSTED past them)

    @model_validator(mode="after")
    def _distinct_ports(self):
        taken = {}
        for name in ("port", "metrics_port", "http_port"):
            port = getattr(self, name)
            if port and port in taken:  # None = off, 0 = ephemeral: never a clash
                raise ValueError(f"{name}: {port} is already front.{taken[port]}")
            taken[port] = name
        if self.metrics_auth and self.auth_token_file is None:
            raise ValueError("metrics_auth: needs front.auth_token_file (the tokens the metrics require)")
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


def rank_devices(device: str | list[str], tp: int, key: str = "target.device") -> list[str]:
    """The device of each of ``tp`` ranks: a list as given, "cpu" for all, "cuda[:K]" for cuda:K, cuda:K+1, ...
    Raises ValueError naming ``key`` for a list of another length, a mix of device types, a GPU two ranks
    share, or tensor parallelism on a device that is neither cpu (gloo) nor cuda (nccl)."""
    if isinstance(device, list):
        devices = list(device)
    elif device == "cuda" or device.startswith("cuda:"):
        first = device.partition(":")[2] or "0"
        if not first.isdigit():
            raise ValueError(f"{key}: {device!r} is not a device (cuda or cuda:N)")
        devices = [f"cuda:{int(first) + r}" for r in range(tp)]
    else:
        devices = [device] * tp
    if len(devices) != tp:
        raise ValueError(f"{key}: {len(devices)} devices for target.tp {tp} ranks (one per rank)")
    kinds = {d.partition(":")[0] for d in devices}
    if tp > 1 and (len(kinds) > 1 or not kinds <= {"cpu", "cuda"}):
        raise ValueError(f"{key}: tensor-parallel ranks run all on cpu (gloo) or all on cuda (nccl), got {devices}")
    if kinds == {"cuda"} and len(set(devices)) < tp:
        raise ValueError(f"{key}: two ranks share one GPU in {devices} (one rank per GPU)")
    return devices


class ServeConfig(_Section):
    models: ModelsConfig = ModelsConfig()
    grpc: GrpcConfig = GrpcConfig()
    draft: DraftServerConfig = DraftServerConfig()
    target: TargetServerConfig = TargetServerConfig()
    front: FrontConfig = FrontConfig()

    @property
    def draft_device(self) -> str:
        """The draft's device: draft.device, else models.device."""
        return self.draft.device or self.models.device

    @property
    def target_devices(self) -> list[str]:
        """The device of each target rank (``rank_devices`` of target.device, else models.device)."""
        return rank_devices(self.target.device or self.models.device, self.target.tp,
                            "target.device" if self.target.device else "models.device")

    def models_on(self, device: str) -> ModelsConfig:
        """``models`` with ``device`` (a service's own device: ``draft_device`` or ``target_devices[0]``)."""
        return self.models.model_copy(update={"device": device})

    @model_validator(mode="after")
    def _devices(self):
        self.target_devices  # raises naming target.device (or models.device)
        if self.models.draft_quant == "int8" and not self.draft_device.startswith("cpu"):
            raise ValueError(f"models.draft_quant: int8 runs on a CPU only (fbgemm kernels), the draft is on "
                             f"{self.draft_device} (use none or auto)")
        return self

    @model_validator(mode="after")
    def _health_port_apart(self):
        """grpc.health_port differs from every port a service of this config serves (0 = ephemeral: no clash)."""
        health_port = self.grpc.health_port
        ports = {"draft.port": self.draft.port, "target.port": self.target.port, "front.port": self.front.port,
                 "front.metrics_port": self.front.metrics_port, "front.http_port": self.front.http_port}
        for name, port in ports.items():
            if health_port and port == health_port:
                raise ValueError(f"grpc.health_port: {health_port} is already {name} (the health port is a port of its own)")
        return self


# Removed or renamed keys: dotted path -> what to do instead (the error names it).
_LOW_ACCEPTANCE_GONE = ("the low-acceptance fallback was removed (docs/heuristics.md): the cost-aware control "
                        "drops the draft where it does not pay and probes every front.cost_aware.probe_every rounds")
_LOCKSTEP = "lock-step rounds were removed: they did not pay (docs/heuristics.md, row 4)"
RETIRED_KEYS: dict[str, str] = {
    "front.dynamic_gamma": ("dynamic gamma was removed (docs/heuristics.md): the cost-aware control sets each round's "
                            "depth from measured costs; front.cost_aware.enabled: false plays the request's tree "
                            "every round"),
    "front.fallback.window": _LOW_ACCEPTANCE_GONE,
    "front.fallback.min_acceptance": _LOW_ACCEPTANCE_GONE,
    "front.fallback.probe_every": _LOW_ACCEPTANCE_GONE,
    "front.cost_aware.in_step": _LOCKSTEP,
    "front.cost_aware.in_step_wait_ms": _LOCKSTEP,
    "front.cost_aware.in_step_max_load": _LOCKSTEP,
    "front.cost_aware.in_step_no_spec": _LOCKSTEP,
}


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
    if err["type"] != "extra_forbidden":
        return error_text(err)
    loc = ".".join(str(x) for x in err["loc"])
    if loc in RETIRED_KEYS:
        return f"{loc}: no longer a config key: {RETIRED_KEYS[loc]}"
    keys = _section_keys(err["loc"])
    return f"{loc}: unknown key" + (f" (known here: {', '.join(keys)})" if keys else "")


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> ServeConfig:
    """Read a YAML config (None = defaults) and apply dotted overrides, e.g. {"target.port": 0}.
    Raises ConfigError naming the field (or the file, when it is unreadable or not YAML)."""
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
