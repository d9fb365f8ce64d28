"""deploy/, checked offline: schemas, cross-checks between the files, and a local rehearsal.

What is checked, and against what:

- Kubernetes objects validate against the schemas that kubernetes-validate ships (strict: unknown
  fields are errors) for the pinned Kubernetes version ``K8S_VERSION``.
- The RayCluster validates against the KubeRay CRD's openAPIV3Schema read from
  ``../shared/data/kuberay`` (not copied into the repo), made strict the way the API server's
  strict field validation is (unknown fields are errors); skipped with a message where
  ``../shared`` is absent.
- Cross-checks (each a function returning the problems it finds; every one is shown to catch a
  broken manifest by a mutation test): Services select pods that exist and expose the ports they
  target; container ports and gRPC probe ports equal the ports of deploy/specdec.yaml and the
  probes ask the standard health service for the right service name; the front's
  --draft-address/--target-address name Services that reach the draft/target containers; the
  ConfigMap holds deploy/specdec.yaml byte for byte, is mounted where --config points, loads with
  ``specdec.config.load_config`` and its tree parses with ``parse_tree_spec``; every override flag
  maps to a config field and the overridden config is valid (file flags checked against a readable
  stand-in: the files live in the pods' Secrets); --tp equals the GPUs of the target pod;
  terminationGracePeriodSeconds exceeds preStop + grpc.shutdown_grace_s; every container has the
  OTEL_* variables; every server serves TLS with mutual TLS (--tls-cert/--tls-key/--tls-ca) and the
  front needs bearer tokens (--auth-token-file), each file a key of a Secret mounted read-only at its
  folder, every Secret volume mounted, the Ray workers holding the front's TLS files at the same
  paths (their orchestrator actors dial draft and target); with TLS, the probes ask the plaintext
  health port (--health-port = container port "health"), and the front's HTTP API has a probe of
  its own (GET /health over HTTPS); images are the ones the Dockerfile builds (its header's docker
  build lines: the CPU build, TORCH=cpu by default, for the front and Ray pods, the CUDA build,
  TORCH=cuXXX, for the pods with GPUs); the Dockerfile installs the package whose ``specdec``
  subcommands the manifests run, and they take the flags the manifests pass.
- GPUs: a pod with nvidia.com/gpu selects a GPU class (nodeSelector on GPU_CLASS_LABELS) and
  tolerates the GPU taint, a pod without does neither; the classes are the values docs/deploy.md
  tells to set; the GPU containers' args parse with the CLI's own parser and their --device puts one
  rank on each GPU of the pod.
- Security review (the same kind of cross-checks, each caught broken by a mutation): Pod Security
  Standards "restricted" on every pod template, Ray's included (non-root, no privilege escalation,
  capabilities dropped, RuntimeDefault seccomp, restricted volume types, no host namespaces, paths
  or ports), the namespace enforcing it, a read-only root filesystem with writable volumes where
  the processes write (/tmp, $HOME, $SPECDEC_CACHE of the image) and no service-account token;
  separate keys per service (each server's TLS files from its own Secret, no Secret of a service's
  key in another's pods); Ray token authentication on every Ray container (RAY_AUTH_MODE=token,
  the token a key of the Secret specdec-ray-token) and probes on the Ray workers; NetworkPolicies
  evaluated for every (peer, pod, port): only the front's Ray pods reach draft and target, only the
  ingress controller's namespace the front's public ports, only the Ray pods each other.
- A maintained policy checker: checkov (from PyPI, run offline) on the rendered manifests and a Pod
  for each Ray group; nothing fails but the image-digest checks (CHECKOV_SKIPS, with their reasons),
  and broken copies of the objects fail the checks they break. Skipped with the way to install it
  where checkov is absent ($SPECDEC_CHECKOV, PATH or /opt/checkov; it cannot share ray's environment).
- The manifests are what ``kubectl apply -k deploy/`` applies: ``render()`` builds them from
  deploy/kustomization.yaml (resources, namespace, configMapGenerator); where ``kubectl`` or
  ``kustomize`` is installed, the real kustomize output is checked too (equal up to the ConfigMaps'
  hash suffixes, every reference rewritten to the hashed names, and valid).
- Scripts: the Ray pods' bash scripts run against stand-ins for KubeRay's generated ``ray start`` and
  for ``specdec`` (the head starts Ray without --block, then execs the front with its flags);
  deploy/local.sh runs against stand-in servers (one exiting, or a SIGTERM, stops all three).
- Local rehearsal: deploy/local.sh (the manifests' entrypoints, the same config, loopback) serves a
  greedy request whose output equals target-only decoding (skipped until ``specdec front`` exists),
  run as the pods run: Ray token authentication on (its GCS refuses a call without the token) and,
  where this machine allows mount namespaces (root), a read-only root filesystem with only the
  emptyDirs' stand-ins writable.

Not checked here: building the image (no Docker daemon or base-image registry in CI), and anything
that needs a cluster (scheduling, GPUs, the KubeRay operator's own defaults, whether the cluster's
network plugin enforces NetworkPolicies).
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import functools
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import jsonschema
import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from specdec.config import ConfigError, ServeConfig, load_config
from specdec.tree_spec import parse_tree_spec

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
CONFIG_FILE = DEPLOY / "specdec.yaml"
KUBERAY_CRDS = REPO.parent / "shared" / "data" / "kuberay"
K8S_VERSION = "1.30.0"  # gRPC probes are GA since 1.27; PodDisruptionBudget policy/v1 since 1.21

# The `specdec` subcommands the manifests run, the config section whose port each serves, the
# health service name its readiness probe asks for, and the flags that may override the config
# (flag -> dotted config field). Kept here, not read from the CLI, so that the manifests can be
# checked before the subcommands exist; test_cli_takes_the_manifest_flags compares with the CLI.
SERVERS = {
    "draft-server": ("draft", "specdec.v1.DraftService"),
    "target-server": ("target", "specdec.v1.TargetService"),
    "front": ("front", "specdec.v1.GenerationService"),
}
SECURITY_FLAGS = {"--health-port": "grpc.health_port", "--tls-cert": "grpc.tls_cert", "--tls-key": "grpc.tls_key",
                  "--tls-ca": "grpc.tls_ca"}
OVERRIDES = {
    "draft-server": {"--host": "draft.host", "--device": "draft.device", **SECURITY_FLAGS},
    "target-server": {"--host": "target.host", "--device": "target.device", "--tp": "target.tp", **SECURITY_FLAGS},
    "front": {"--host": "front.host", "--draft-address": "front.draft_address",
              "--target-address": "front.target_address", "--ray-address": "front.ray_address",
              "--auth-token-file": "front.auth_token_file", **SECURITY_FLAGS},
}
# Flags naming files the pod must hold (each in a mounted Secret, check_secrets), and the keys the
# manifests' Secrets hold (docs/deploy.md; created by hand or cert-manager, not by kustomize).
TLS_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca")
FILE_FLAGS = (*TLS_FLAGS, "--auth-token-file")
TLS_KEYS = {"tls.crt", "tls.key", "ca.crt"}
SECRET_KEYS = {"specdec-draft-tls": TLS_KEYS, "specdec-target-tls": TLS_KEYS, "specdec-front-tls": TLS_KEYS,
               "specdec-auth": {"tokens"}, "specdec-ray-token": {"auth_token"}}
# Separate keys per service: the Secret each server's TLS files come from (and no other pod's).
SERVICE_TLS = {"draft-server": "specdec-draft-tls", "target-server": "specdec-target-tls", "front": "specdec-front-tls"}
OTEL_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES")
# The front's HTTP API is probed by this probe (GET /health); its other probes ask the gRPC health port.
HTTP_API_PROBE = "livenessProbe"
# Ray workers: readiness and liveness ask the raylet's health on the dashboard agent, as KubeRay's
# default probes do (a path Ray leaves open with token auth on).
RAYLET_HEALTH_PATH, RAYLET_AGENT_PORT = "/api/local_raylet_healthz", 52365
# Ray token authentication (Ray >= 2.52): on every Ray container, the token from a Secret's key.
RAY_AUTH_MIN_VERSION = "2.52.0"
RAY_TOKEN_SECRET, RAY_TOKEN_KEY = "specdec-ray-token", "auth_token"
GPU = "nvidia.com/gpu"
# GPU classes (docs/deploy.md#gpus): a GPU pod selects its class with a nodeSelector on one of these node labels
# (NVIDIA GPU feature discovery's; GKE's) and tolerates the taint GPU node pools commonly carry (GKE's value;
# other pools any value); a pod without GPUs does neither.
GPU_CLASS_LABELS = {"nvidia.com/gpu.product", "cloud.google.com/gke-accelerator"}
GPU_TAINT = {"key": GPU, "value": "present", "effect": "NoSchedule"}
SHELL_OPERATORS = {";", "&&", "||", "|", "&", "(", ")"}


# ---------------------------------------------------------------------------------------------
# Loading: kustomization -> resources
# ---------------------------------------------------------------------------------------------

KUSTOMIZE_FIELDS = {"apiVersion", "kind", "namespace", "resources", "configMapGenerator", "configurations", "images"}


def render(deploy: Path = DEPLOY) -> list[dict]:
    """The resources ``kubectl apply -k deploy/`` applies, minus the ConfigMaps' hash suffixes.

    Covers the kustomization fields deploy/ uses (KUSTOMIZE_FIELDS; another field fails here, so
    this cannot silently drift from kustomize): listed resource files, the namespace,
    configMapGenerator entries (``files`` keyed by file name, ``literals``) and ``images``
    (newName / newTag of the containers' images, RayCluster pods included, as kustomize does).
    """
    kustomization = yaml.safe_load((deploy / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZE_FIELDS
    assert not unknown, f"deploy/kustomization.yaml uses {sorted(unknown)}: teach render() about them"
    resources = []
    for name in kustomization["resources"]:
        resources += [doc for doc in yaml.safe_load_all((deploy / name).read_text()) if doc]
    for gen in kustomization.get("configMapGenerator", []):
        data = {}
        for entry in gen.get("files", []):
            key, _, path = entry.rpartition("=")
            data[key or PurePosixPath(path).name] = (deploy / path).read_text()
        for entry in gen.get("literals", []):
            key, _, value = entry.partition("=")
            data[key] = value
        resources.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    for res in resources:
        if res["kind"] != "Namespace" and "namespace" in kustomization:
            res["metadata"]["namespace"] = kustomization["namespace"]
    for pod in pod_templates(resources):
        for ctr in pod.containers:
            ctr["image"] = retag(ctr["image"], kustomization.get("images", []))
    return resources


def retag(image: str, rules: list[dict]) -> str:
    """kustomize's images transformer: NAME[:TAG] -> newName[:newTag] for the rule named NAME."""
    name, tag = (image.rsplit(":", 1) + [""])[:2] if ":" in image.rsplit("/", 1)[-1] else (image, "")
    for rule in rules:
        if rule["name"] == name:
            name, tag = rule.get("newName", name), rule.get("newTag", tag)
    return f"{name}:{tag}" if tag else name


@pytest.fixture(scope="module")
def resources() -> list[dict]:
    return render()


@pytest.fixture(scope="module")
def config() -> ServeConfig:
    return load_config(CONFIG_FILE)


def find(resources: list[dict], kind: str, name: str) -> dict:
    matches = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def container(pod_spec: dict, name: str) -> dict:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


# ---------------------------------------------------------------------------------------------
# Views: pod templates, specdec launches
# ---------------------------------------------------------------------------------------------


@dataclass
class PodTemplate:
    origin: str          # e.g. "StatefulSet/specdec-target", "RayCluster/specdec-front worker orchestrator"
    namespace: str | None
    template: dict

    @property
    def labels(self) -> dict:
        return self.template.get("metadata", {}).get("labels", {})

    @property
    def spec(self) -> dict:
        return self.template["spec"]

    @property
    def containers(self) -> list[dict]:
        return self.spec.get("containers", []) + self.spec.get("initContainers", [])


def pod_templates(resources: list[dict]) -> list[PodTemplate]:
    out = []
    for res in resources:
        kind, meta, spec = res["kind"], res["metadata"], res.get("spec", {})
        origin = f"{kind}/{meta['name']}"
        if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
            out.append(PodTemplate(origin, meta.get("namespace"), spec["template"]))
        elif kind == "RayCluster":
            out.append(PodTemplate(f"{origin} head", meta.get("namespace"), spec["headGroupSpec"]["template"]))
            for group in spec.get("workerGroupSpecs", []):
                out.append(PodTemplate(f"{origin} worker {group['groupName']}", meta.get("namespace"), group["template"]))
    return out


@dataclass
class Launch:
    """A ``specdec SUBCOMMAND --flag value ...`` found in a container's command and args."""

    subcommand: str
    flags: dict[str, str] = field(default_factory=dict)
    stray: list[str] = field(default_factory=list)   # words that are not --flag value pairs


def words(argv: list[str]) -> list[str]:
    """argv, with shell scripts (``bash -lc "a; b && exec c"``) split into words and operators."""
    out = []
    for arg in argv:
        if re.search(r"\s|;|&&", arg):
            lexer = shlex.shlex(arg, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            out += list(lexer)
        else:
            out.append(arg)
    return out


def parse_launch(argv: list[str]) -> Launch | None:
    tokens = words(argv)
    if "specdec" not in tokens:
        return None
    rest = []
    for token in tokens[tokens.index("specdec") + 1:]:
        if token in SHELL_OPERATORS:
            break
        rest.append(token)
    launch = Launch(rest[0] if rest else "")
    args, i = rest[1:], 0
    while i < len(args):
        if args[i].startswith("--") and "=" in args[i]:
            key, value = args[i].split("=", 1)
            launch.flags[key], i = value, i + 1
        elif args[i].startswith("--") and i + 1 < len(args):
            launch.flags[args[i]], i = args[i + 1], i + 2
        else:
            launch.stray.append(args[i])
            i += 1
    return launch


def launch_of(ctr: dict) -> Launch | None:
    return parse_launch([*ctr.get("command", []), *ctr.get("args", [])])


def launches(resources: list[dict]):
    """(pod template, container, Launch) for every container that runs ``specdec``."""
    for pod in pod_templates(resources):
        for ctr in pod.containers:
            launch = launch_of(ctr)
            if launch is not None:
                yield pod, ctr, launch


def selects(selector: dict, pod: PodTemplate, namespace: str | None) -> bool:
    return pod.namespace == namespace and all(pod.labels.get(k) == v for k, v in selector.items())


def resolve_port(pod: PodTemplate, target_port, ctr: dict | None = None) -> int | None:
    """The container port a Service targetPort (name or number) reaches in the pod, or None."""
    for c in [ctr] if ctr is not None else pod.spec["containers"]:
        for port in c.get("ports", []):
            if target_port in (port.get("name"), port["containerPort"]):
                return port["containerPort"]
    return None


# ---------------------------------------------------------------------------------------------
# Cross-checks: each returns a list of problems (empty = fine)
# ---------------------------------------------------------------------------------------------


def check_selectors(resources: list[dict]) -> list[str]:
    """Services, workload selectors, StatefulSet governing Services and PDBs select existing pods."""
    problems, pods = [], pod_templates(resources)
    for svc in (r for r in resources if r["kind"] == "Service"):
        name, ns = svc["metadata"]["name"], svc["metadata"].get("namespace")
        selector = svc["spec"].get("selector") or {}
        matched = [p for p in pods if selector and selects(selector, p, ns)]
        if not matched:
            problems.append(f"Service/{name}: selector {selector} selects no pods")
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            for pod in matched:
                if resolve_port(pod, target) is None:
                    problems.append(f"Service/{name}: {pod.origin} has no port {target!r} (targetPort of {port['port']})")
    for res in resources:
        kind, name = res["kind"], res["metadata"]["name"]
        if kind in ("Deployment", "StatefulSet"):
            match = res["spec"]["selector"].get("matchLabels", {})
            labels = res["spec"]["template"]["metadata"].get("labels", {})
            if any(labels.get(k) != v for k, v in match.items()):
                problems.append(f"{kind}/{name}: selector.matchLabels {match} do not match its template labels {labels}")
        if kind == "StatefulSet":
            governing = [s for s in resources if s["kind"] == "Service" and s["metadata"]["name"] == res["spec"].get("serviceName")]
            if not governing or governing[0]["spec"].get("clusterIP") != "None":
                problems.append(f"StatefulSet/{name}: serviceName {res['spec'].get('serviceName')!r} is not a headless Service")
        if kind == "PodDisruptionBudget":
            match = res["spec"]["selector"].get("matchLabels", {})
            if not any(selects(match, p, res["metadata"].get("namespace")) for p in pods):
                problems.append(f"PodDisruptionBudget/{name}: selector {match} selects no pods")
    return problems


def check_servers(resources: list[dict], config: ServeConfig) -> list[str]:
    """Container ports of each server equal the ports of the config; its gRPC probes ask the health
    port (--health-port, a container port named "health") when set, else the service port; TLS
    without a health port is a problem (kubelet probes speak plaintext)."""
    problems = []
    for pod, ctr, launch in launches(resources):
        where = f"{pod.origin} container {ctr['name']}"
        if launch.subcommand not in SERVERS:
            problems.append(f"{where}: runs `specdec {launch.subcommand}`, not one of {sorted(SERVERS)}")
            continue
        section, health_name = SERVERS[launch.subcommand]
        port = getattr(config, section).port
        ports = {p.get("name"): p["containerPort"] for p in ctr.get("ports", [])}
        if ports.get("grpc") != port:
            problems.append(f"{where}: containerPort 'grpc' is {ports.get('grpc')}, config {section}.port is {port}")
        if launch.subcommand == "front" and config.front.metrics_port is not None \
                and ports.get("front-metrics") != config.front.metrics_port:
            problems.append(f"{where}: containerPort 'front-metrics' is {ports.get('front-metrics')}, "
                            f"config front.metrics_port is {config.front.metrics_port}")
        if launch.subcommand == "front" and config.front.http_port is not None \
                and ports.get("http") != config.front.http_port:
            problems.append(f"{where}: containerPort 'http' is {ports.get('http')}, "
                            f"config front.http_port is {config.front.http_port}")
        probe_port, probe_port_is = port, f"config {section}.port is {port}"
        if "--health-port" in launch.flags:  # kubelet probes speak plaintext: with TLS only the health port answers them
            probe_port = int(launch.flags["--health-port"])
            probe_port_is = f"the health port (--health-port) is {probe_port}"
            if ports.get("health") != probe_port:
                problems.append(f"{where}: containerPort 'health' is {ports.get('health')}, --health-port is {probe_port}")
        elif "--tls-cert" in launch.flags:
            problems.append(f"{where}: TLS without --health-port: kubelet's plaintext gRPC probes cannot reach a TLS port")
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if launch.subcommand == "front" and kind == HTTP_API_PROBE and config.front.http_port is not None:
                problems += check_http_api_probe(where, kind, ctr, config.front.http_port, "--tls-cert" in launch.flags)
                continue
            grpc_probe = (ctr.get(kind) or {}).get("grpc")
            if grpc_probe is None:
                problems.append(f"{where}: {kind} is not a gRPC health probe")
                continue
            if grpc_probe["port"] != probe_port:
                problems.append(f"{where}: {kind} port {grpc_probe['port']}, {probe_port_is}")
            wanted = {"", health_name} if kind == "livenessProbe" else {health_name}
            if grpc_probe.get("service", "") not in wanted:
                problems.append(f"{where}: {kind} asks for health service {grpc_probe.get('service', '')!r}, "
                                f"expected one of {sorted(wanted)}")
    return problems


def http_get_port(ctr: dict, get: dict) -> int | None:
    """The container port an httpGet probe asks (by name or number)."""
    ports = {p.get("name"): p["containerPort"] for p in ctr.get("ports", [])}
    return ports.get(get.get("port")) if isinstance(get.get("port"), str) else get.get("port")


def check_http_api_probe(where: str, kind: str, ctr: dict, http_port: int, tls: bool) -> list[str]:
    """The front's HTTP API has a probe of its own: GET /health on front.http_port, HTTPS with TLS."""
    get = (ctr.get(kind) or {}).get("httpGet")
    if get is None:
        return [f"{where}: {kind} is not an HTTP probe of the HTTP API (GET /health on front.http_port)"]
    problems, port = [], http_get_port(ctr, get)
    if port != http_port:
        problems.append(f"{where}: {kind} asks port {get.get('port')!r} ({port}), config front.http_port is {http_port}")
    if get.get("path") != "/health":
        problems.append(f"{where}: {kind} asks {get.get('path')!r}, the HTTP API's health path is '/health'")
    scheme, wanted = get.get("scheme", "HTTP"), "HTTPS" if tls else "HTTP"
    if scheme != wanted:
        problems.append(f"{where}: {kind} scheme {scheme}, the HTTP API serves {wanted}")
    return problems


def reached_ports(resources: list[dict], svc: dict, svc_port: dict, server: str) -> list[tuple[str, int | None]]:
    """(pod, container port) that a Service port reaches in the pods running ``specdec <server>``."""
    selector = svc["spec"].get("selector") or {}
    reached = []
    for pod in pod_templates(resources):
        if not selector or not selects(selector, pod, svc["metadata"].get("namespace")):
            continue
        for ctr in pod.spec["containers"]:
            if (launch_of(ctr) or Launch("")).subcommand == server:
                reached.append((pod.origin, resolve_port(pod, svc_port.get("targetPort", svc_port["port"]), ctr)))
    return reached


def check_addresses(resources: list[dict], config: ServeConfig) -> list[str]:
    """The front's draft/target addresses name Services (of its namespace) that reach that server's port."""
    problems = []
    for pod, _, launch in launches(resources):
        if launch.subcommand != "front":
            continue
        for flag, server in (("--draft-address", "draft-server"), ("--target-address", "target-server")):
            where = f"{pod.origin} {flag}"
            if flag not in launch.flags:
                problems.append(f"{where}: missing (the config's loopback address would be used in the cluster)")
                continue
            host, _, port = launch.flags[flag].rpartition(":")
            name, _, namespace = host.partition(".")   # NAME or NAME.NAMESPACE[.svc...]
            namespace = namespace.split(".")[0] or pod.namespace
            services = [s for s in resources if s["kind"] == "Service" and s["metadata"]["name"] == name
                        and s["metadata"].get("namespace") == namespace]
            if not services:
                problems.append(f"{where}: no Service named {name!r} in namespace {namespace!r}")
                continue
            svc_ports = [p for p in services[0]["spec"]["ports"] if str(p["port"]) == port]
            if not svc_ports:
                problems.append(f"{where}: Service/{name} has no port {port}")
                continue
            reached = reached_ports(resources, services[0], svc_ports[0], server)
            if not reached:
                problems.append(f"{where}: Service/{name} selects no `specdec {server}` pods")
            wanted = getattr(config, SERVERS[server][0]).port
            problems += [f"{where}: reaches port {got} of {origin}, the server listens on {wanted}"
                         for origin, got in reached if got != wanted]
    return problems


def check_config_mounts(resources: list[dict], config_text: str) -> list[str]:
    """--config points into a mounted ConfigMap that holds deploy/specdec.yaml byte for byte."""
    problems = []
    configmaps = {(r["metadata"].get("namespace"), r["metadata"]["name"]): r for r in resources if r["kind"] == "ConfigMap"}
    for pod, ctr, launch in launches(resources):
        where = f"{pod.origin} container {ctr['name']}"
        path = launch.flags.get("--config")
        if path is None:
            problems.append(f"{where}: no --config")
            continue
        path = PurePosixPath(path)
        mounts = [m for m in ctr.get("volumeMounts", []) if PurePosixPath(m["mountPath"]) == path.parent]
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        sources = [volumes.get(m["name"], {}).get("configMap") for m in mounts]
        if not mounts or not sources[0]:
            problems.append(f"{where}: --config {path} is not in a mounted ConfigMap")
            continue
        cm = configmaps.get((pod.namespace, sources[0]["name"]))
        if cm is None:
            problems.append(f"{where}: ConfigMap {sources[0]['name']!r} does not exist")
            continue
        key = next((i["key"] for i in sources[0].get("items", []) if i["path"] == path.name), path.name)
        if cm.get("data", {}).get(key) != config_text:
            problems.append(f"{where}: ConfigMap {cm['metadata']['name']} key {key!r} differs from deploy/specdec.yaml")
    return problems


def check_overrides(resources: list[dict], config_file: Path = CONFIG_FILE) -> list[str]:
    """Every flag besides --config overrides a config field, and the overridden config is valid."""
    problems = []
    for pod, ctr, launch in launches(resources):
        where = f"{pod.origin} `specdec {launch.subcommand}`"
        allowed = OVERRIDES.get(launch.subcommand, {})
        if launch.stray:
            problems.append(f"{where}: unexpected words {launch.stray}")
        unknown = set(launch.flags) - set(allowed) - {"--config"}
        if unknown:
            problems.append(f"{where}: unknown flags {sorted(unknown)} (known: --config, {', '.join(sorted(allowed))})")
        overrides = {allowed[f]: v for f, v in launch.flags.items() if f in allowed}
        for flag in FILE_FLAGS:  # files of the pod (check_secrets): a readable stand-in here, for the validator
            if flag in launch.flags and flag in allowed:
                overrides[allowed[flag]] = str(config_file)
        try:
            load_config(config_file, overrides)
        except ConfigError as exc:
            problems.append(f"{where}: {exc}")
    return problems


def check_gpus(resources: list[dict], config: ServeConfig) -> list[str]:
    """--tp equals the pod's GPUs; GPU requests equal limits; --device cuda iff GPUs; /dev/shm for TP."""
    problems = []
    for pod, ctr, launch in launches(resources):
        where = f"{pod.origin} container {ctr['name']}"
        limits = ctr.get("resources", {}).get("limits", {})
        requests = ctr.get("resources", {}).get("requests", {})
        gpus = int(limits.get(GPU, 0))
        if GPU in requests and int(requests[GPU]) != gpus:
            problems.append(f"{where}: {GPU} request {requests[GPU]} != limit {gpus}")
        device = launch.flags.get("--device", config.draft_device if launch.subcommand == "draft-server"
                                  else config.target_devices[0])
        cuda = device.startswith("cuda")
        if cuda != (gpus > 0):
            problems.append(f"{where}: --device {device} with {gpus} {GPU}")
        if launch.subcommand == "target-server":
            tp = int(launch.flags.get("--tp", config.target.tp))
            if cuda and tp != gpus:
                problems.append(f"{where}: --tp {tp} but {GPU} limit {gpus} (one TP rank per GPU)")
            volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
            shm = [m for m in ctr.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"
                   and volumes.get(m["name"], {}).get("emptyDir", {}).get("medium") == "Memory"]
            if tp > 1 and not shm:
                problems.append(f"{where}: --tp {tp} without a memory-backed /dev/shm (NCCL)")
    return problems


def mounted_secret(pod: PodTemplate, ctr: dict, path: str) -> tuple[str | None, str | None, str]:
    """(Secret name, key, problem) of a file path in a container: the Secret volume mounted at the
    path's folder and the key the file is; a problem ("" = none) when no such volume is mounted there."""
    path = PurePosixPath(path)
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    mounts = [m for m in ctr.get("volumeMounts", []) if PurePosixPath(m["mountPath"]) == path.parent]
    if not mounts:
        return None, None, f"no volume is mounted at {path.parent}"
    if mounts[0]["name"] not in volumes:
        return None, None, f"volume {mounts[0]['name']!r} mounted at {path.parent} is not a volume of the pod"
    secret = volumes[mounts[0]["name"]].get("secret")
    if secret is None:
        return None, None, f"volume {mounts[0]['name']!r} at {path.parent} is not a Secret"
    key = next((i["key"] for i in secret.get("items", []) if i["path"] == path.name), path.name)
    if not mounts[0].get("readOnly"):
        return secret["secretName"], key, f"Secret volume {mounts[0]['name']!r} is not mounted readOnly"
    return secret["secretName"], key, ""


def check_file_flag(pod: PodTemplate, ctr: dict, flag: str, path: str, server: str | None = None) -> list[str]:
    """A file flag's path is a key of a mounted Secret that holds it (SECRET_KEYS); a TLS file of
    ``server`` comes from that server's own Secret (SERVICE_TLS)."""
    where = f"{pod.origin} container {ctr['name']} {flag} {path}"
    secret, key, problem = mounted_secret(pod, ctr, path)
    if problem:
        return [f"{where}: {problem}"]
    if secret not in SECRET_KEYS:
        return [f"{where}: Secret {secret!r} is none of {sorted(SECRET_KEYS)}"]
    if key not in SECRET_KEYS[secret]:
        return [f"{where}: Secret {secret} holds no key {key!r} (it holds {sorted(SECRET_KEYS[secret])})"]
    if flag in TLS_FLAGS and server in SERVICE_TLS and secret != SERVICE_TLS[server]:
        return [f"{where}: from Secret {secret}, not {SERVICE_TLS[server]} (each service has its own key)"]
    return []


def check_secrets(resources: list[dict]) -> list[str]:
    """TLS with mutual TLS on every server and bearer tokens on the front, from mounted Secrets;
    every Secret volume is mounted; Ray workers (orchestrator actors: the front's config dials draft
    and target) hold the front's TLS files at the same paths."""
    problems, front_files = [], {}
    for pod, ctr, launch in launches(resources):
        where = f"{pod.origin} `specdec {launch.subcommand}`"
        wanted = (*TLS_FLAGS, "--auth-token-file") if launch.subcommand == "front" else TLS_FLAGS
        problems += [f"{where}: no {flag} (TLS with mutual TLS between the services; bearer tokens on the front)"
                     for flag in wanted if flag not in launch.flags]
        for flag in FILE_FLAGS:
            if flag in launch.flags:
                problems += check_file_flag(pod, ctr, flag, launch.flags[flag], launch.subcommand)
        if launch.subcommand == "front":
            front_files[pod.origin.rsplit(" ", 1)[0]] = {f: launch.flags[f] for f in TLS_FLAGS if f in launch.flags}
    for pod in pod_templates(resources):
        mounted = {m["name"] for c in pod.containers for m in c.get("volumeMounts", [])}
        problems += [f"{pod.origin}: volume {v['name']!r} (Secret {v['secret'].get('secretName')}) is mounted by no container"
                     for v in pod.spec.get("volumes", []) if "secret" in v and v["name"] not in mounted]
        cluster, _, role = pod.origin.partition(" ")
        if role.startswith("worker") and cluster in front_files:
            for ctr in pod.spec["containers"]:
                problems += [f"{pod.origin} container {ctr['name']}: {flag} {path} of the front: {problem} "
                             "(orchestrator actors here dial draft and target with the front's config)"
                             for flag, path in front_files[cluster].items()
                             for problem in [mounted_secret(pod, ctr, path)[2]] if problem]
    return problems


def prestop_sleep_s(ctr: dict) -> float:
    hook = ctr.get("lifecycle", {}).get("preStop", {})
    command = hook.get("exec", {}).get("command", [])
    if command[:1] == ["sleep"]:
        return float(command[1])
    return float(hook.get("sleep", {}).get("seconds", 0))


def check_grace(resources: list[dict], config: ServeConfig) -> list[str]:
    """terminationGracePeriodSeconds > preStop sleep + grpc.shutdown_grace_s for every server pod."""
    problems = []
    for pod in pod_templates(resources):
        servers = [c for c in pod.spec["containers"] if launch_of(c) is not None]
        if not servers:
            continue
        grace = pod.spec.get("terminationGracePeriodSeconds", 30)
        needed = max(prestop_sleep_s(c) for c in servers) + config.grpc.shutdown_grace_s
        if grace <= needed:
            problems.append(f"{pod.origin}: terminationGracePeriodSeconds {grace} <= preStop + "
                            f"grpc.shutdown_grace_s = {needed}")
    return problems


def check_otel(resources: list[dict]) -> list[str]:
    """Every container has OTEL_*; configMapKeyRefs resolve; $(VAR) refers to an earlier variable."""
    problems = []
    configmaps = {(r["metadata"].get("namespace"), r["metadata"]["name"]): r for r in resources if r["kind"] == "ConfigMap"}
    for pod in pod_templates(resources):
        for ctr in pod.containers:
            where = f"{pod.origin} container {ctr['name']}"
            env = ctr.get("env", [])
            names = [e["name"] for e in env]
            for var in OTEL_VARS:
                if var not in names:
                    problems.append(f"{where}: no {var}")
            for i, entry in enumerate(env):
                ref = entry.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    cm = configmaps.get((pod.namespace, ref["name"]))
                    if cm is None or ref["key"] not in cm.get("data", {}):
                        problems.append(f"{where}: {entry['name']} from ConfigMap {ref['name']!r} key {ref['key']!r}, which does not exist")
                for var in re.findall(r"\$\((\w+)\)", entry.get("value", "")):
                    if var not in names[:i]:
                        problems.append(f"{where}: {entry['name']} uses $({var}), not defined before it")
    return problems


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, args = pending.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


def dockerfile_facts(text: str) -> dict:
    facts = {"args": {}, "labels": {}, "copied": [], "runs": [], "expose": set(), "env": {}, "user": None}
    for keyword, args in dockerfile_instructions(text):
        if keyword == "ARG":
            name, _, default = args.partition("=")
            facts["args"][name] = default
        elif keyword == "ENV":
            facts["env"].update(word.split("=", 1) for word in shlex.split(args))
        elif keyword == "USER":
            facts["user"] = args
        elif keyword == "LABEL":
            facts["labels"].update(word.split("=", 1) for word in shlex.split(args))
        elif keyword == "COPY":
            facts["copied"] += shlex.split(args)[:-1]
        elif keyword == "RUN":
            facts["runs"].append(args)
        elif keyword == "EXPOSE":
            facts["expose"] |= {int(p.split("/")[0]) for p in args.split()}
    return facts


def dockerfile_builds(text: str) -> dict[str, tuple[str, dict[str, str]]]:
    """The ``docker build`` lines of the Dockerfile's header: {"cpu" | "cuda": (image, build args)}, by the
    torch wheel index each selects (build arg TORCH: cpu by default, cuXXX for CUDA)."""
    builds = {}
    for line in text.splitlines():
        if match := re.match(r"#\s+docker build ([^#]*)", line):
            argv = shlex.split(match.group(1))
            args = dict(argv[i + 1].split("=", 1) for i, word in enumerate(argv) if word == "--build-arg")
            builds["cuda" if args.get("TORCH", "cpu").startswith("cu") else "cpu"] = (argv[argv.index("-t") + 1], args)
    return builds


def pod_gpus(pod: PodTemplate) -> int:
    return sum(int(ctr.get("resources", {}).get("limits", {}).get(GPU, 0)) for ctr in pod.containers)


def check_images(resources: list[dict], dockerfile_text: str) -> list[str]:
    """The Dockerfile builds a CPU image (title:version of its labels) and a CUDA one of the same version; every
    container runs the CUDA image where its pod has GPUs, the CPU image elsewhere."""
    labels = dockerfile_facts(dockerfile_text)["labels"]
    version = labels["org.opencontainers.image.version"]
    builds = {kind: image for kind, (image, _) in dockerfile_builds(dockerfile_text).items()}
    if builds.get("cpu") != f"{labels['org.opencontainers.image.title']}:{version}" or \
            not builds.get("cuda", "").endswith(f":{version}"):
        return [f"the Dockerfile's docker build lines build {builds}: a CPU image "
                f"{labels['org.opencontainers.image.title']}:{version} and a CUDA one (TORCH=cuXXX) expected"]
    return [f"{pod.origin} container {ctr['name']}: image {ctr.get('image')!r}, the Dockerfile builds {image!r} for it"
            for pod in pod_templates(resources) for ctr in pod.containers
            if ctr.get("image", "").rsplit("/", 1)[-1] != (image := builds["cuda" if pod_gpus(pod) else "cpu"])]


def tolerates(toleration: dict, taint: dict) -> bool:
    """Kubernetes' rule: the key equal (or empty with Exists), the effect equal (or empty), Exists or an equal value."""
    exists = toleration.get("operator", "Equal") == "Exists"
    if toleration.get("key", "") not in ("", taint["key"]) or (not toleration.get("key") and not exists):
        return False
    effect = toleration.get("effect", "") in ("", taint["effect"])
    return effect and (exists or toleration.get("value", "") == taint["value"])


def check_gpu_classes(resources: list[dict]) -> list[str]:
    """A pod with GPUs selects a GPU class (nodeSelector on a GPU_CLASS_LABELS label) and tolerates the GPU taint;
    a pod without GPUs (front, Ray) does neither, so it stays off the GPU nodes."""
    problems = []
    for pod in pod_templates(resources):
        gpus = pod_gpus(pod)
        classes = sorted(set(pod.spec.get("nodeSelector", {})) & GPU_CLASS_LABELS)
        tolerated = any(tolerates(t, GPU_TAINT) for t in pod.spec.get("tolerations", []))
        if gpus and not classes:
            problems.append(f"{pod.origin}: {gpus} {GPU} but no nodeSelector on a GPU class label "
                            f"({', '.join(sorted(GPU_CLASS_LABELS))})")
        if gpus and not tolerated:
            problems.append(f"{pod.origin}: {gpus} {GPU} but no toleration of the GPU taint {GPU_TAINT}")
        if not gpus and (classes or tolerated):
            problems.append(f"{pod.origin}: no {GPU} but selects GPU nodes ({classes}) or tolerates their taint")
    return problems


# ---------------------------------------------------------------------------------------------
# Security review: Pod Security Standards, writable paths, probes, Ray token, keys, network
# ---------------------------------------------------------------------------------------------

# Pod Security Standards, Kubernetes v1.30 (https://kubernetes.io/docs/concepts/security/pod-security-standards/)
PSS_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                    "secret"}
PSS_SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                    "net.ipv4.tcp_keepalive_probes"}
PSS_SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
PSS_SECCOMP = {"RuntimeDefault", "Localhost"}
WRITABLE_VOLUME_TYPES = {"emptyDir", "ephemeral", "persistentVolumeClaim"}


def _context_problems(where: str, sc: dict) -> list[str]:
    """Baseline controls a pod or container securityContext shares: SELinux, AppArmor, seccomp not Unconfined."""
    problems = []
    selinux = sc.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in PSS_SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        problems.append(f"{where}: seLinuxOptions {selinux} (baseline allows only the container types)")
    if (sc.get("appArmorProfile") or {}).get("type", "RuntimeDefault") not in ("RuntimeDefault", "Localhost"):
        problems.append(f"{where}: appArmorProfile {sc['appArmorProfile']}")
    if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        problems.append(f"{where}: seccompProfile Unconfined")
    return problems


def check_pod_security(resources: list[dict]) -> list[str]:
    """Pod Security Standards "restricted" (v1.30, baseline's controls included) on every pod template,
    Ray's included, and what the review asks beyond it: a read-only root filesystem and no
    service-account token in every pod; and the namespace enforces "restricted" itself."""
    problems = []
    for ns in (r for r in resources if r["kind"] == "Namespace"):
        if ns["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce") != "restricted":
            problems.append(f"Namespace/{ns['metadata']['name']}: pod-security.kubernetes.io/enforce is not 'restricted'")
    accounts = {(r["metadata"].get("namespace"), r["metadata"]["name"]): r for r in resources if r["kind"] == "ServiceAccount"}
    for pod in pod_templates(resources):
        spec, where = pod.spec, pod.origin
        psc = spec.get("securityContext") or {}
        problems += [f"{where}: {key}" for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
        for vol in spec.get("volumes", []):
            kinds = set(vol) - {"name"}
            if not kinds <= PSS_VOLUME_TYPES:
                problems.append(f"{where}: volume {vol['name']!r} is {sorted(kinds - PSS_VOLUME_TYPES)}, not a restricted type")
        problems += [f"{where}: sysctl {c['name']} is not a safe sysctl" for c in psc.get("sysctls", [])
                     if c["name"] not in PSS_SAFE_SYSCTLS]
        problems += _context_problems(where, psc)
        problems += [f"{where}: AppArmor annotation {k}: {v}" for k, v in pod.template.get("metadata", {}).get("annotations", {}).items()
                     if k.startswith("container.apparmor.security.beta.kubernetes.io/") and v != "runtime/default"
                     and not v.startswith("localhost/")]
        if psc.get("runAsUser") == 0:
            problems.append(f"{where}: runAsUser 0 (root)")
        account = accounts.get((pod.namespace, spec.get("serviceAccountName", "default")), {})
        if spec.get("automountServiceAccountToken", account.get("automountServiceAccountToken", True)) is not False:
            problems.append(f"{where}: the service-account token is mounted (nothing here calls the Kubernetes API: "
                            "automountServiceAccountToken: false)")
        for ctr in pod.containers + spec.get("ephemeralContainers", []):
            csc, cwhere = ctr.get("securityContext") or {}, f"{where} container {ctr['name']}"
            problems += _context_problems(cwhere, csc)
            if csc.get("privileged"):
                problems.append(f"{cwhere}: privileged")
            if csc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{cwhere}: allowPrivilegeEscalation is not false")
            caps = csc.get("capabilities") or {}
            if "ALL" not in caps.get("drop", []):
                problems.append(f"{cwhere}: capabilities: ALL is not dropped")
            if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
                problems.append(f"{cwhere}: adds capabilities {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
            if csc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
                problems.append(f"{cwhere}: runAsNonRoot is not true")
            if csc.get("runAsUser") == 0:
                problems.append(f"{cwhere}: runAsUser 0 (root)")
            seccomp = (csc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
            if seccomp not in PSS_SECCOMP:
                problems.append(f"{cwhere}: seccompProfile {seccomp}, not one of {sorted(PSS_SECCOMP)}")
            if csc.get("procMount", "Default") != "Default":
                problems.append(f"{cwhere}: procMount {csc['procMount']}")
            problems += [f"{cwhere}: hostPort {p['hostPort']}" for p in ctr.get("ports", []) if p.get("hostPort")]
            if csc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{cwhere}: the root filesystem is writable (readOnlyRootFilesystem)")
    return problems


def check_writable_paths(resources: list[dict], dockerfile_text: str) -> list[str]:
    """Under a read-only root filesystem a process writes only where a writable volume is mounted:
    every container needs one at /tmp (temporary files; Ray's /tmp/ray) and at $HOME (~/.cache,
    CUDA's ~/.nv, Triton), a ``specdec`` server also at $SPECDEC_CACHE (converted models); HOME and
    SPECDEC_CACHE as the image sets them (deploy/Dockerfile ENV) or the container's env."""
    problems, image_env = [], dockerfile_facts(dockerfile_text)["env"]
    for pod in pod_templates(resources):
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        for ctr in pod.containers:
            if not (ctr.get("securityContext") or {}).get("readOnlyRootFilesystem"):
                continue
            env = {**image_env, **{e["name"]: e["value"] for e in ctr.get("env", []) if "value" in e}}
            needed = {"/tmp": "temporary files, Ray's /tmp/ray", env.get("HOME", "/root"): "$HOME: ~/.cache, ~/.nv, ~/.triton"}
            if launch_of(ctr) is not None:
                needed[env.get("SPECDEC_CACHE", "~/.cache/specdec")] = "$SPECDEC_CACHE: converted models"
            for path, why in needed.items():
                where = f"{pod.origin} container {ctr['name']}: {path} ({why})"
                mounts = [m for m in ctr.get("volumeMounts", []) if PurePosixPath(m["mountPath"]) == PurePosixPath(path)]
                if not mounts:
                    problems.append(f"{where}: no writable volume mounted there under a read-only root filesystem")
                elif mounts[0].get("readOnly") or not set(volumes.get(mounts[0]["name"], {})) & WRITABLE_VOLUME_TYPES:
                    problems.append(f"{where}: volume {mounts[0]['name']!r} is not writable "
                                    f"(one of {sorted(WRITABLE_VOLUME_TYPES)}, not readOnly)")
    return problems


def check_ray_probes(resources: list[dict]) -> list[str]:
    """Ray worker containers have readiness and liveness probes on the raylet's health."""
    problems = []
    for pod in pod_templates(resources):
        if " worker " not in pod.origin:
            continue
        for ctr in pod.spec["containers"]:
            for kind in ("readinessProbe", "livenessProbe"):
                get = (ctr.get(kind) or {}).get("httpGet") or {}
                if get.get("path") != RAYLET_HEALTH_PATH or http_get_port(ctr, get) != RAYLET_AGENT_PORT:
                    problems.append(f"{pod.origin} container {ctr['name']}: {kind} does not ask the raylet's health "
                                    f"(GET {RAYLET_HEALTH_PATH} on port {RAYLET_AGENT_PORT})")
    return problems


def check_ray_auth(resources: list[dict]) -> list[str]:
    """Ray token authentication in every RayCluster: rayVersion >= RAY_AUTH_MIN_VERSION, and on
    every Ray container (head, workers) RAY_AUTH_MODE=token with the token from the Secret
    RAY_TOKEN_SECRET's key RAY_TOKEN_KEY, as a file (RAY_AUTH_TOKEN_PATH in that Secret, mounted
    read-only) or RAY_AUTH_TOKEN from a secretKeyRef (a literal token would sit in the manifest);
    or spec.authOptions {mode: token, secretName: RAY_TOKEN_SECRET} (KubeRay >= 1.5.1 sets both)."""
    problems = []
    for ray in (r for r in resources if r["kind"] == "RayCluster"):
        name, spec = ray["metadata"]["name"], ray["spec"]
        if Version(spec.get("rayVersion", "0")) < Version(RAY_AUTH_MIN_VERSION):
            problems.append(f"RayCluster/{name}: rayVersion {spec.get('rayVersion')} has no token authentication "
                            f"(Ray >= {RAY_AUTH_MIN_VERSION})")
        options = spec.get("authOptions") or {}
        if options.get("mode") == "token":
            if options.get("secretName") != RAY_TOKEN_SECRET:
                problems.append(f"RayCluster/{name}: authOptions.secretName {options.get('secretName')!r}, not {RAY_TOKEN_SECRET}")
            continue
        for pod in pod_templates([ray]):
            for ctr in pod.spec["containers"]:
                where = f"{pod.origin} container {ctr['name']}"
                env = {e["name"]: e for e in ctr.get("env", [])}
                if env.get("RAY_AUTH_MODE", {}).get("value") != "token":
                    problems.append(f"{where}: no RAY_AUTH_MODE=token (Ray's GCS, dashboard and client port take anyone)")
                if "RAY_AUTH_TOKEN" in env:
                    ref = (env["RAY_AUTH_TOKEN"].get("valueFrom") or {}).get("secretKeyRef") or {}
                    if (ref.get("name"), ref.get("key")) != (RAY_TOKEN_SECRET, RAY_TOKEN_KEY):
                        problems.append(f"{where}: RAY_AUTH_TOKEN is not key {RAY_TOKEN_KEY} of Secret {RAY_TOKEN_SECRET}")
                elif "RAY_AUTH_TOKEN_PATH" in env:
                    path = env["RAY_AUTH_TOKEN_PATH"].get("value", "")
                    secret, key, problem = mounted_secret(pod, ctr, path)
                    if problem or (secret, key) != (RAY_TOKEN_SECRET, RAY_TOKEN_KEY):
                        problems.append(f"{where}: RAY_AUTH_TOKEN_PATH {path}: "
                                        f"{problem or f'key {key} of Secret {secret}'}, not key {RAY_TOKEN_KEY} of Secret {RAY_TOKEN_SECRET}")
                else:
                    problems.append(f"{where}: no Ray token (RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN)")
    return problems


def _secret_names(volume: dict) -> list[str]:
    if "secret" in volume:
        return [volume["secret"].get("secretName")]
    return [src["secret"].get("name") for src in (volume.get("projected") or {}).get("sources", []) if "secret" in src]


def check_separate_keys(resources: list[dict]) -> list[str]:
    """Each service's TLS key is mounted only by that service's pods (the front's by its Ray head
    and workers): a pod broken into yields one service's key, not every service's."""
    owners: dict[str, set[str]] = {}
    for pod in pod_templates(resources):
        for volume in pod.spec.get("volumes", []):
            for secret in _secret_names(volume):
                owners.setdefault(secret, set()).add(pod.origin.split(" ")[0])
    return [f"Secret {secret} (a service's key) is mounted by pods of {sorted(owners[secret])}"
            for secret in sorted(set(SERVICE_TLS.values())) if len(owners.get(secret, ())) > 1]


# Who may connect to what (deploy/k8s/network-policies.yaml): the ingress controller's and
# Prometheus' namespaces as the policies name them, a Ray worker port (Ray picks them), and the
# peers tried besides the pods of the manifests.
INGRESS_NAMESPACE, MONITORING_NAMESPACE, RAY_WORKER_PORT = "ingress-nginx", "monitoring", 10002


@dataclass
class Peer:
    name: str
    namespace: str
    labels: dict
    pod: PodTemplate | None = None


def label_selector_matches(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector ({} selects everything)."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and key in labels and labels[key] in values) \
                or (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):
            return False
    return True


def namespace_labels(resources: list[dict], name: str) -> dict:
    ns = next((r for r in resources if r["kind"] == "Namespace" and r["metadata"]["name"] == name), None)
    return {**((ns or {}).get("metadata", {}).get("labels") or {}), "kubernetes.io/metadata.name": name}


def ingress_allowed(resources: list[dict], src: Peer, dst: PodTemplate, port: int) -> bool:
    """Whether the NetworkPolicies let ``src`` open a TCP connection to ``port`` of ``dst`` (no
    policy selecting the pod for Ingress: allowed; else any rule of a selecting policy)."""
    policies = [p for p in resources if p["kind"] == "NetworkPolicy" and p["metadata"].get("namespace") == dst.namespace
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                and label_selector_matches(p["spec"].get("podSelector") or {}, dst.labels)]
    if not policies:
        return True

    def peer_matches(peer: dict, policy_ns: str) -> bool:
        if "ipBlock" in peer:
            return False  # the peers tried are pods
        ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
        ns_ok = src.namespace == policy_ns if ns_sel is None else label_selector_matches(ns_sel, namespace_labels(resources, src.namespace))
        return ns_ok and (pod_sel is None or label_selector_matches(pod_sel, src.labels))

    def port_matches(rule_port: dict) -> bool:
        want = rule_port.get("port")
        if rule_port.get("protocol", "TCP") != "TCP":
            return False
        if isinstance(want, str):
            return resolve_port(dst, want) == port and any(p.get("name") == want for c in dst.spec["containers"] for p in c.get("ports", []))
        return want is None or want <= port <= rule_port.get("endPort", want)

    for policy in policies:
        for rule in policy["spec"].get("ingress") or []:
            if rule.get("from") and not any(peer_matches(peer, policy["metadata"].get("namespace")) for peer in rule["from"]):
                continue
            if rule.get("ports") and not any(port_matches(p) for p in rule["ports"]):
                continue
            return True
    return False


def network_peers(resources: list[dict]) -> list[Peer]:
    pods = pod_templates(resources)
    namespace = pods[0].namespace if pods else None
    return [Peer(pod.origin, pod.namespace, pod.labels, pod) for pod in pods] + [
        Peer("another pod of the namespace", namespace, {"app.kubernetes.io/name": "other"}),
        Peer("a pod labelled specdec of no component", namespace, {"app.kubernetes.io/name": "specdec"}),
        Peer("the ingress controller", INGRESS_NAMESPACE, {"app.kubernetes.io/name": "ingress-nginx"}),
        Peer("Prometheus", MONITORING_NAMESPACE, {"app.kubernetes.io/name": "prometheus"}),
        Peer("a pod of another namespace", "default", {"app.kubernetes.io/name": "specdec", "app.kubernetes.io/component": "front"}),
    ]


def expected_reach(src: Peer, dst: PodTemplate, port: int) -> bool:
    """The intended policy: draft and target (their gRPC port) only from the front's Ray pods; the
    front's public ports from the ingress controller, its metrics from Prometheus; the Ray pods of a
    cluster from each other on any port; nothing else."""
    named = {p.get("name"): p["containerPort"] for c in dst.spec["containers"] for p in c.get("ports", [])}
    servers = {(launch_of(c) or Launch("")).subcommand for c in dst.spec["containers"]}
    cluster = dst.origin.split(" ")[0] if dst.origin.startswith("RayCluster/") else None
    same_cluster = src.pod is not None and src.namespace == dst.namespace and src.pod.origin.split(" ")[0] == cluster
    from_front = src.pod is not None and src.namespace == dst.namespace and src.pod.origin.startswith("RayCluster/")
    if servers & {"draft-server", "target-server"}:
        return from_front and port == named.get("grpc")
    if cluster is None:
        return False
    if same_cluster:
        return True
    if "front" in servers and src.pod is None and src.namespace == INGRESS_NAMESPACE:
        return port in (named.get("grpc"), named.get("http"))
    if "front" in servers and src.pod is None and src.namespace == MONITORING_NAMESPACE:
        return port == named.get("front-metrics")
    return False


def check_network_policies(resources: list[dict]) -> list[str]:
    """Every (peer, pod, port) the NetworkPolicies allow is one expected_reach intends, and the
    other way round; the ports tried: every container port, and a Ray worker port on Ray pods."""
    problems = []
    for dst in pod_templates(resources):
        ports = {p["containerPort"] for c in dst.spec["containers"] for p in c.get("ports", [])}
        if dst.origin.startswith("RayCluster/"):
            ports.add(RAY_WORKER_PORT)
        for src in network_peers(resources):
            for port in sorted(ports):
                got, want = ingress_allowed(resources, src, dst, port), expected_reach(src, dst, port)
                if got != want:
                    problems.append(f"{src.name} {'reaches' if got else 'cannot reach'} {dst.origin} port {port}"
                                    f" ({'it must not' if got else 'it must'})")
    return problems


def all_problems(resources: list[dict], config: ServeConfig, config_text: str) -> list[str]:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    return (check_selectors(resources) + check_servers(resources, config) + check_addresses(resources, config)
            + check_config_mounts(resources, config_text) + check_overrides(resources) + check_gpus(resources, config)
            + check_grace(resources, config) + check_otel(resources) + check_secrets(resources)
            + check_images(resources, dockerfile) + check_gpu_classes(resources) + check_pod_security(resources)
            + check_writable_paths(resources, dockerfile)
            + check_ray_probes(resources) + check_ray_auth(resources) + check_separate_keys(resources)
            + check_network_policies(resources))


# ---------------------------------------------------------------------------------------------
# Schemas
# ---------------------------------------------------------------------------------------------


def strict_crd_schema(schema):
    """The CRD schema with unknown fields rejected, as the API server does under strict field
    validation (kubectl apply's default): objects with ``properties`` get additionalProperties: false
    unless they preserve unknown fields."""
    if isinstance(schema, list):
        return [strict_crd_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_crd_schema(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.cache
def kuberay_validators() -> dict[tuple[str, str, str], jsonschema.protocols.Validator]:
    """(group, kind, version) -> validator of the strict openAPIV3Schema, for every served CRD version."""
    validators = {}
    for path in sorted(KUBERAY_CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 1 MB each
        for v in crd["spec"]["versions"]:
            if v.get("served", True):
                key = (crd["spec"]["group"], crd["spec"]["names"]["kind"], v["name"])
                validators[key] = jsonschema.Draft7Validator(strict_crd_schema(v["schema"]["openAPIV3Schema"]))
    return validators


def crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    if not KUBERAY_CRDS.is_dir():
        pytest.skip(f"KubeRay CRDs not found at {KUBERAY_CRDS} (../shared is absent): {kind} not validated")
    group, _, version = api_version.partition("/")
    validator = kuberay_validators().get((group, kind, version))
    assert validator is not None, f"no served CRD for {kind} {api_version} in {KUBERAY_CRDS}"
    return validator


def schema_errors(res: dict) -> list[str]:
    """Schema errors of one resource: Kubernetes kinds via kubernetes-validate (strict), ray.io via the CRD."""
    if res["apiVersion"].startswith("ray.io/"):
        validator = crd_validator(res["apiVersion"], res["kind"])
        return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(res)]
    try:
        kubernetes_validate.validate(res, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'.'.join(map(str, exc.path))}: {exc.message}"]
    return []


def names(resources):
    return [f"{r['kind']}/{r['metadata']['name']}" for r in resources]


# ---------------------------------------------------------------------------------------------
# Tests: schemas
# ---------------------------------------------------------------------------------------------


def test_manifests_are_the_expected_set(resources):
    kinds = {f"{r['kind']}/{r['metadata']['name']}" for r in resources}
    assert {"Namespace/specdec", "ConfigMap/specdec-config", "ConfigMap/specdec-otel",
            "Deployment/specdec-draft", "Service/specdec-draft", "StatefulSet/specdec-target",
            "Service/specdec-target", "RayCluster/specdec-front", "Service/specdec-front"} <= kinds
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):  # every manifest file is listed (or is kustomize config)
        listed = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
        assert f"k8s/{path.name}" in listed["resources"] + listed.get("configurations", []), path


@pytest.mark.parametrize("index", range(len(render())), ids=names(render()))
def test_schema(resources, index):
    res = resources[index]
    assert schema_errors(res) == []


def test_kubernetes_schema_rejects_unknown_and_wrong_fields(resources):
    deployment = copy.deepcopy(find(resources, "Deployment", "specdec-draft"))
    container(deployment["spec"]["template"]["spec"], "draft")["readinesProbe"] = {"grpc": {"port": 50061}}
    assert schema_errors(deployment)
    service = copy.deepcopy(find(resources, "Service", "specdec-draft"))
    service["spec"]["ports"][0]["port"] = "fifty"
    assert schema_errors(service)


def test_kuberay_schema_rejects_unknown_and_missing_fields(resources):
    ray = copy.deepcopy(find(resources, "RayCluster", "specdec-front"))
    ray["spec"]["headGroupSpec"]["rayStartParam"] = {}
    assert any("rayStartParam" in e for e in schema_errors(ray))
    ray = copy.deepcopy(find(resources, "RayCluster", "specdec-front"))
    del ray["spec"]["workerGroupSpecs"][0]["groupName"]
    assert any("groupName" in e for e in schema_errors(ray))
    ray = copy.deepcopy(find(resources, "RayCluster", "specdec-front"))
    ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    assert schema_errors(ray)


# ---------------------------------------------------------------------------------------------
# Tests: config (one source of truth)
# ---------------------------------------------------------------------------------------------


def test_configmap_is_the_config_file(resources, tmp_path):
    cm = find(resources, "ConfigMap", "specdec-config")
    assert cm["data"] == {"specdec.yaml": CONFIG_FILE.read_text()}
    mounted = tmp_path / "specdec.yaml"  # what a pod reads at /etc/specdec/specdec.yaml
    mounted.write_text(cm["data"]["specdec.yaml"])
    loaded = load_config(mounted)
    assert parse_tree_spec(yaml.safe_load(mounted.read_text())["front"]["tree"]) == loaded.front.tree
    # Local addresses are the loopback ones the local launch uses; the cluster overrides them.
    assert loaded.front.draft_address == f"127.0.0.1:{loaded.draft.port}"
    assert loaded.front.target_address == f"127.0.0.1:{loaded.target.port}"


def test_config_file_is_complete_about_what_the_cluster_relies_on():
    raw = yaml.safe_load(CONFIG_FILE.read_text())
    for section, key in [("draft", "port"), ("target", "port"), ("front", "port"), ("front", "tree"),
                         ("grpc", "shutdown_grace_s"), ("front", "metrics_port"),
                         ("front", "http_port")]:
        assert key in raw[section], f"deploy/specdec.yaml: write {section}.{key} out (the manifests depend on it)"


# ---------------------------------------------------------------------------------------------
# Tests: cross-checks pass, and each catches what it checks
# ---------------------------------------------------------------------------------------------


def test_cross_checks_pass(resources, config):
    assert all_problems(resources, config, CONFIG_FILE.read_text()) == []


def _head(res):
    return container(find(res, "RayCluster", "specdec-front")["spec"]["headGroupSpec"]["template"]["spec"], "ray-head")


def _draft(res):
    return container(find(res, "Deployment", "specdec-draft")["spec"]["template"]["spec"], "draft")


def _target(res):
    return container(find(res, "StatefulSet", "specdec-target")["spec"]["template"]["spec"], "target")


def _set_flag(ctr, flag, value):
    """Replace ``flag``'s value in a container's args (list form or the head's shell script)."""
    args = ctr["args"]
    if len(args) == 1 and " " in args[0]:
        args[0] = re.sub(rf"{flag} \S+", f"{flag} {value}", args[0])
        assert f"{flag} {value}" in args[0]
    else:
        args[args.index(flag) + 1] = value


def _port(ctr, name):
    return next(p for p in ctr["ports"] if p["name"] == name)


def _drop_env(ctr, name):
    ctr["env"] = [e for e in ctr["env"] if e["name"] != name]


def _drop_flag(ctr, flag):
    """Remove ``flag`` and its value from a container's args (list form or the head's shell script)."""
    args = ctr["args"]
    if len(args) == 1 and " " in args[0]:
        args[0], count = re.subn(rf" {flag} \S+", "", args[0])
        assert count == 1
    else:
        i = args.index(flag)
        del args[i:i + 2]


def _worker(res):
    return find(res, "RayCluster", "specdec-front")["spec"]["workerGroupSpecs"][0]["template"]["spec"]


def _pod(res, kind, name):
    return find(res, kind, name)["spec"]["template"]["spec"]


def _head_pod(res):
    return find(res, "RayCluster", "specdec-front")["spec"]["headGroupSpec"]["template"]["spec"]


def _replace_volume(pod_spec, volume):
    pod_spec["volumes"] = [volume if v["name"] == volume["name"] else v for v in pod_spec["volumes"]]


def _drop_mount(ctr, name):
    ctr["volumeMounts"] = [m for m in ctr["volumeMounts"] if m["name"] != name]


MUTATIONS = {
    "draft Service selects nothing": (
        lambda r: find(r, "Service", "specdec-draft")["spec"]["selector"].update({"app.kubernetes.io/component": "drafts"}),
        "selects no pods"),
    "front Service also selects other pods": (
        lambda r: find(r, "Service", "specdec-front")["spec"]["selector"].pop("app.kubernetes.io/component"),
        "has no port 'front-metrics'"),
    "Service targets a port the pods lack": (
        lambda r: find(r, "Service", "specdec-target")["spec"]["ports"][0].update(targetPort="grpc-x"),
        "has no port 'grpc-x'"),
    "Deployment selector misses its template": (
        lambda r: find(r, "Deployment", "specdec-draft")["spec"]["selector"]["matchLabels"].update(tier="x"),
        "matchLabels"),
    "StatefulSet governed by a missing Service": (
        lambda r: find(r, "StatefulSet", "specdec-target")["spec"].update(serviceName="nope"),
        "serviceName"),
    "PDB selects nothing": (
        lambda r: find(r, "PodDisruptionBudget", "specdec-target")["spec"]["selector"]["matchLabels"].update(x="y"),
        "PodDisruptionBudget/specdec-target"),
    "draft containerPort differs from config": (
        lambda r: _port(_draft(r), "grpc").update(containerPort=50071),
        "containerPort 'grpc' is 50071"),
    "target readiness probe on a wrong port": (
        lambda r: _target(r)["readinessProbe"]["grpc"].update(port=50061),
        "readinessProbe port 50061"),
    "front readiness probe asks the whole server": (
        lambda r: _head(r)["readinessProbe"]["grpc"].pop("service"),
        "readinessProbe asks for health service ''"),
    "draft liveness is an exec probe": (
        lambda r: _draft(r).update(livenessProbe={"exec": {"command": ["true"]}}),
        "livenessProbe is not a gRPC health probe"),
    "front metrics port differs from config": (
        lambda r: _port(_head(r), "front-metrics").update(containerPort=9090),
        "front-metrics"),
    "front http port differs from config": (
        lambda r: _port(_head(r), "http").update(containerPort=8080),
        "containerPort 'http' is 8080"),
    "front Service lacks the http port": (
        lambda r: find(r, "Service", "specdec-front")["spec"]["ports"][2].update(targetPort="https"),
        "has no port 'https'"),
    "front points at a missing Service": (
        lambda r: _set_flag(_head(r), "--draft-address", "specdec-drafts:50061"),
        "no Service named 'specdec-drafts'"),
    "front points at a wrong port": (
        lambda r: _set_flag(_head(r), "--target-address", "specdec-target:50061"),
        "has no port 50061"),
    "front's draft address reaches the target": (
        lambda r: _set_flag(_head(r), "--draft-address", "specdec-target:50062"),
        "selects no `specdec draft-server` pods"),
    "ConfigMap drifted from deploy/specdec.yaml": (
        lambda r: find(r, "ConfigMap", "specdec-config")["data"].update({"specdec.yaml": CONFIG_FILE.read_text() + "# edited\n"}),
        "differs from deploy/specdec.yaml"),
    "--config outside the mount": (
        lambda r: _set_flag(_draft(r), "--config", "/etc/other/specdec.yaml"),
        "not in a mounted ConfigMap"),
    "unknown flag": (
        lambda r: _draft(r)["args"].extend(["--prot", "1"]),
        "unknown flags ['--prot']"),
    "invalid override": (
        lambda r: _set_flag(_target(r), "--tp", "0"),
        "target.tp"),
    "--tp differs from the pod's GPUs": (
        lambda r: _set_flag(_target(r), "--tp", "4"),
        "--tp 4 but nvidia.com/gpu limit 2"),
    "GPU request differs from limit": (
        lambda r: _target(r)["resources"]["requests"].update({GPU: 1}),
        "request 1 != limit 2"),
    "cuda without a GPU": (
        lambda r: _draft(r)["resources"]["limits"].pop(GPU) and _draft(r)["resources"]["requests"].pop(GPU),
        "--device cuda with 0"),
    "TP without /dev/shm": (
        lambda r: _target(r).update(volumeMounts=[m for m in _target(r)["volumeMounts"] if m["mountPath"] != "/dev/shm"]),
        "/dev/shm"),
    "grace shorter than the drain": (
        lambda r: find(r, "StatefulSet", "specdec-target")["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=12),
        "terminationGracePeriodSeconds 12"),
    "worker without OTEL_SERVICE_NAME": (
        lambda r: _drop_env(container(find(r, "RayCluster", "specdec-front")["spec"]["workerGroupSpecs"][0]["template"]["spec"], "ray-worker"), "OTEL_SERVICE_NAME"),
        "no OTEL_SERVICE_NAME"),
    "OTLP endpoint from a missing key": (
        lambda r: next(e for e in _draft(r)["env"] if e["name"] == "OTEL_EXPORTER_OTLP_ENDPOINT")["valueFrom"]["configMapKeyRef"].update(key="ENDPOINT"),
        "key 'ENDPOINT'"),
    "resource attributes use an undefined variable": (
        lambda r: next(e for e in _target(r)["env"] if e["name"] == "OTEL_RESOURCE_ATTRIBUTES").update(value="k8s.pod.uid=$(POD_UID)"),
        "$(POD_UID)"),
    "image the Dockerfile does not build": (
        lambda r: _target(r).update(image="registry.example/specdec:0.0.9"),
        "image 'registry.example/specdec:0.0.9'"),
    "GPU pod on the CPU image": (
        lambda r: _draft(r).update(image="specdec:0.1.0"),
        "image 'specdec:0.1.0', the Dockerfile builds 'specdec-cuda:0.1.0' for it"),
    "Ray pod on the CUDA image": (
        lambda r: _head(r).update(image="specdec-cuda:0.1.0"),
        "image 'specdec-cuda:0.1.0', the Dockerfile builds 'specdec:0.1.0' for it"),
    "draft without a GPU class": (
        lambda r: _pod(r, "Deployment", "specdec-draft").pop("nodeSelector"),
        "Deployment/specdec-draft: 1 nvidia.com/gpu but no nodeSelector on a GPU class label"),
    "target selecting an unknown label": (
        lambda r: _pod(r, "StatefulSet", "specdec-target").update(nodeSelector={"gpu": "big"}),
        "StatefulSet/specdec-target: 2 nvidia.com/gpu but no nodeSelector"),
    "target not tolerating the GPU taint": (
        lambda r: _pod(r, "StatefulSet", "specdec-target").update(
            tolerations=[{"key": GPU, "operator": "Equal", "value": "absent", "effect": "NoSchedule"}]),
        "StatefulSet/specdec-target: 2 nvidia.com/gpu but no toleration"),
    "draft tolerating another effect only": (
        lambda r: _pod(r, "Deployment", "specdec-draft")["tolerations"][0].update(effect="NoExecute"),
        "Deployment/specdec-draft: 1 nvidia.com/gpu but no toleration"),
    "Ray worker tolerating GPU nodes": (
        lambda r: _worker(r).update(tolerations=[{"operator": "Exists"}]),
        "RayCluster/specdec-front worker orchestrator: no nvidia.com/gpu but selects GPU nodes"),
    "probe on the TLS port": (
        lambda r: _target(r)["readinessProbe"]["grpc"].update(port=50062),
        "readinessProbe port 50062, the health port (--health-port) is 50070"),
    "startup probe on the front's TLS port": (
        lambda r: _head(r)["startupProbe"]["grpc"].update(port=50060),
        "startupProbe port 50060, the health port"),
    "front's HTTP API unprobed": (
        lambda r: _head(r).update(livenessProbe={"grpc": {"port": 50070}}),
        "livenessProbe is not an HTTP probe of the HTTP API"),
    "HTTP API probe on the metrics port": (
        lambda r: _head(r)["livenessProbe"]["httpGet"].update(port="front-metrics"),
        "livenessProbe asks port 'front-metrics' (9464), config front.http_port is 8000"),
    "HTTP API probe in plaintext": (
        lambda r: _head(r)["livenessProbe"]["httpGet"].pop("scheme"),
        "livenessProbe scheme HTTP, the HTTP API serves HTTPS"),
    "HTTP API probe on an authenticated path": (
        lambda r: _head(r)["livenessProbe"]["httpGet"].update(path="/v1/models"),
        "livenessProbe asks '/v1/models'"),
    "health containerPort differs from --health-port": (
        lambda r: _set_flag(_draft(r), "--health-port", "50071"),
        "containerPort 'health' is 50070, --health-port is 50071"),
    "TLS without a health port": (
        lambda r: _drop_flag(_draft(r), "--health-port"),
        "TLS without --health-port"),
    "health port clashes with a service port": (
        lambda r: _set_flag(_target(r), "--health-port", "50061"),
        "grpc.health_port: 50061 is already draft.port"),
    "TLS flag points where no volume is mounted": (
        lambda r: _set_flag(_draft(r), "--tls-ca", "/etc/tls/ca.crt"),
        "--tls-ca /etc/tls/ca.crt: no volume is mounted at /etc/tls"),
    "TLS flag points into the ConfigMap": (
        lambda r: _set_flag(_target(r), "--tls-cert", "/etc/specdec/tls.crt"),
        "volume 'config' at /etc/specdec is not a Secret"),
    "TLS key the Secret does not hold": (
        lambda r: _set_flag(_target(r), "--tls-key", "/etc/specdec-tls/tls.pem"),
        "holds no key 'tls.pem'"),
    "Secret volume no container mounts": (
        lambda r: _drop_mount(_target(r), "tls"),
        "volume 'tls' (Secret specdec-target-tls) is mounted by no container"),
    "Secret mounted writable": (
        lambda r: next(m for m in _draft(r)["volumeMounts"] if m["name"] == "tls").pop("readOnly"),
        "not mounted readOnly"),
    "target without mutual TLS": (
        lambda r: _drop_flag(_target(r), "--tls-ca"),
        "`specdec target-server`: no --tls-ca"),
    "front without --auth-token-file": (
        lambda r: _drop_flag(_head(r), "--auth-token-file"),
        "`specdec front`: no --auth-token-file"),
    "tokens from a Secret volume the pod lacks": (
        lambda r: find(r, "RayCluster", "specdec-front")["spec"]["headGroupSpec"]["template"]["spec"].update(
            volumes=[v for v in find(r, "RayCluster", "specdec-front")["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]
                     if v["name"] != "auth"]),
        "--auth-token-file /etc/specdec-auth/tokens: volume 'auth' mounted at /etc/specdec-auth is not a volume of the pod"),
    "Ray worker without the TLS Secret": (
        lambda r: _drop_mount(container(_worker(r), "ray-worker"), "tls"),
        "--tls-cert /etc/specdec-tls/tls.crt of the front: no volume is mounted at /etc/specdec-tls"),
    "a container runs another subcommand": (
        lambda r: _draft(r).update(command=["specdec", "serve"]),
        "runs `specdec serve`"),
    # Pod Security Standards "restricted" and beyond
    "namespace does not enforce restricted": (
        lambda r: find(r, "Namespace", "specdec")["metadata"]["labels"].pop("pod-security.kubernetes.io/enforce"),
        "Namespace/specdec: pod-security.kubernetes.io/enforce is not 'restricted'"),
    "draft root filesystem writable": (
        lambda r: _draft(r)["securityContext"].pop("readOnlyRootFilesystem"),
        "Deployment/specdec-draft container draft: the root filesystem is writable"),
    "target may escalate privileges": (
        lambda r: _target(r)["securityContext"].update(allowPrivilegeEscalation=True),
        "StatefulSet/specdec-target container target: allowPrivilegeEscalation is not false"),
    "front keeps its capabilities": (
        lambda r: _head(r)["securityContext"].pop("capabilities"),
        "head container ray-head: capabilities: ALL is not dropped"),
    "Ray worker adds a capability": (
        lambda r: container(_worker(r), "ray-worker")["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
        "adds capabilities ['SYS_ADMIN']"),
    "draft without a seccomp profile": (
        lambda r: _pod(r, "Deployment", "specdec-draft")["securityContext"].pop("seccompProfile"),
        "container draft: seccompProfile None"),
    "Ray worker unconfined": (
        lambda r: container(_worker(r), "ray-worker")["securityContext"].update(seccompProfile={"type": "Unconfined"}),
        "container ray-worker: seccompProfile Unconfined"),
    "target runs as root": (
        lambda r: _pod(r, "StatefulSet", "specdec-target")["securityContext"].update(runAsUser=0),
        "StatefulSet/specdec-target: runAsUser 0"),
    "head may run as root": (
        lambda r: _head_pod(r)["securityContext"].pop("runAsNonRoot"),
        "container ray-head: runAsNonRoot is not true"),
    "privileged draft": (
        lambda r: _draft(r)["securityContext"].update(privileged=True),
        "container draft: privileged"),
    "head on the host network": (
        lambda r: _head_pod(r).update(hostNetwork=True),
        "head: hostNetwork"),
    "draft mounts a host path": (
        lambda r: _pod(r, "Deployment", "specdec-draft")["volumes"].append({"name": "host", "hostPath": {"path": "/"}}),
        "volume 'host' is ['hostPath'], not a restricted type"),
    "draft on a host port": (
        lambda r: _port(_draft(r), "grpc").update(hostPort=50061),
        "hostPort 50061"),
    "draft gets a service-account token": (
        lambda r: [_pod(r, "Deployment", "specdec-draft").pop(k) for k in ("serviceAccountName", "automountServiceAccountToken")],
        "Deployment/specdec-draft: the service-account token is mounted"),
    "worker asks for its token back": (
        lambda r: _worker(r).update(automountServiceAccountToken=True),
        "worker orchestrator: the service-account token is mounted"),
    # what a read-only root filesystem leaves writable
    "Ray head without /tmp": (
        lambda r: _drop_mount(_head(r), "tmp"),
        "container ray-head: /tmp (temporary files, Ray's /tmp/ray): no writable volume"),
    "Ray worker without a writable HOME": (
        lambda r: _drop_mount(container(_worker(r), "ray-worker"), "home"),
        "container ray-worker: /home/specdec ($HOME"),
    "model cache mounted read-only": (
        lambda r: next(m for m in _target(r)["volumeMounts"] if m["name"] == "model-cache").update(readOnly=True),
        "container target: /var/cache/specdec ($SPECDEC_CACHE: converted models): volume 'model-cache' is not writable"),
    "/tmp from a ConfigMap": (
        lambda r: _replace_volume(_pod(r, "Deployment", "specdec-draft"), {"name": "tmp", "configMap": {"name": "specdec-config"}}),
        "container draft: /tmp (temporary files, Ray's /tmp/ray): volume 'tmp' is not writable"),
    # probes on the Ray workers
    "Ray worker without a readiness probe": (
        lambda r: container(_worker(r), "ray-worker").pop("readinessProbe"),
        "container ray-worker: readinessProbe does not ask the raylet's health"),
    "Ray worker liveness asks the dashboard port": (
        lambda r: container(_worker(r), "ray-worker")["livenessProbe"]["httpGet"].update(port=8265),
        "container ray-worker: livenessProbe does not ask the raylet's health"),
    # Ray token authentication
    "Ray older than token authentication": (
        lambda r: find(r, "RayCluster", "specdec-front")["spec"].update(rayVersion="2.51.0"),
        "rayVersion 2.51.0 has no token authentication"),
    "Ray worker without RAY_AUTH_MODE": (
        lambda r: _drop_env(container(_worker(r), "ray-worker"), "RAY_AUTH_MODE"),
        "container ray-worker: no RAY_AUTH_MODE=token"),
    "Ray head without a token": (
        lambda r: _drop_env(_head(r), "RAY_AUTH_TOKEN_PATH"),
        "container ray-head: no Ray token"),
    "a literal Ray token in the manifest": (
        lambda r: _head(r)["env"].append({"name": "RAY_AUTH_TOKEN", "value": "0123456789abcdef"}),
        "container ray-head: RAY_AUTH_TOKEN is not key auth_token of Secret specdec-ray-token"),
    "Ray token file outside its Secret": (
        lambda r: next(e for e in container(_worker(r), "ray-worker")["env"] if e["name"] == "RAY_AUTH_TOKEN_PATH").update(
            value="/tmp/auth_token"),
        "RAY_AUTH_TOKEN_PATH /tmp/auth_token: volume 'tmp' at /tmp is not a Secret"),
    "KubeRay authOptions with another Secret": (
        lambda r: find(r, "RayCluster", "specdec-front")["spec"].update(authOptions={"mode": "token", "secretName": "ray"}),
        "authOptions.secretName 'ray', not specdec-ray-token"),
    # one key per service
    "draft serves with the front's key": (
        lambda r: next(v for v in _pod(r, "Deployment", "specdec-draft")["volumes"] if v["name"] == "tls")["secret"].update(
            secretName="specdec-front-tls"),
        "--tls-key /etc/specdec-tls/tls.key: from Secret specdec-front-tls, not specdec-draft-tls"),
    "Ray workers hold the target's key too": (
        lambda r: (_worker(r)["volumes"].append({"name": "target-tls", "secret": {"secretName": "specdec-target-tls"}}),
                   container(_worker(r), "ray-worker")["volumeMounts"].append({"name": "target-tls", "mountPath": "/etc/t", "readOnly": True})),
        "Secret specdec-target-tls (a service's key) is mounted by pods of ['RayCluster/specdec-front', 'StatefulSet/specdec-target']"),
    # network policies
    "draft open to the whole namespace": (
        lambda r: find(r, "NetworkPolicy", "specdec-draft")["spec"]["ingress"][0].update({"from": [{"podSelector": {}}]}),
        "another pod of the namespace reaches Deployment/specdec-draft port 50061 (it must not)"),
    "target open on every port": (
        lambda r: find(r, "NetworkPolicy", "specdec-target")["spec"]["ingress"][0].pop("ports"),
        "RayCluster/specdec-front head reaches StatefulSet/specdec-target port 50070 (it must not)"),
    "front's public ports open to every namespace": (
        lambda r: find(r, "NetworkPolicy", "specdec-front")["spec"]["ingress"][0]["from"][0].update(namespaceSelector={}),
        "a pod of another namespace reaches RayCluster/specdec-front head port 50060 (it must not)"),
    "metrics open to the ingress": (
        lambda r: find(r, "NetworkPolicy", "specdec-front")["spec"]["ingress"][1]["from"][0]["namespaceSelector"].update(
            matchLabels={"kubernetes.io/metadata.name": "ingress-nginx"}),
        "the ingress controller reaches RayCluster/specdec-front head port 9464 (it must not)"),
    "Ray workers unprotected": (
        lambda r: [r.remove(find(r, "NetworkPolicy", n)) for n in ("specdec-default-deny", "specdec-orchestrator-worker")],
        "another pod of the namespace reaches RayCluster/specdec-front worker orchestrator port 10002 (it must not)"),
    "Ray pods cut off from each other": (
        lambda r: find(r, "NetworkPolicy", "specdec-front")["spec"]["ingress"].pop(2),
        "RayCluster/specdec-front worker orchestrator cannot reach RayCluster/specdec-front head port 6379 (it must)"),
    "draft cut off from the Ray workers": (
        lambda r: find(r, "NetworkPolicy", "specdec-draft")["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][1].update(
            values=["front"]),
        "RayCluster/specdec-front worker orchestrator cannot reach Deployment/specdec-draft port 50061 (it must)"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_cross_checks_catch(resources, config, mutation):
    mutate, expected = MUTATIONS[mutation]
    broken = copy.deepcopy(resources)
    mutate(broken)
    problems = all_problems(broken, config, CONFIG_FILE.read_text())
    assert any(expected in p for p in problems), problems


def test_config_change_breaks_the_port_checks(resources):
    """The ports are compared with the config file, not with constants."""
    moved = load_config(CONFIG_FILE, {"draft.port": 50071, "grpc.shutdown_grace_s": 30})
    problems = all_problems(resources, moved, CONFIG_FILE.read_text())
    assert any("config draft.port is 50071" in p for p in problems)
    assert any("reaches port 50061" in p for p in problems)
    assert any("terminationGracePeriodSeconds 30" in p for p in problems)


def test_parse_launch_reads_the_head_script():
    launch = parse_launch(["/bin/bash", "-lc", "--", "ulimit -n 65536; ${X/--block/} && exec specdec front --config /c.yaml --host 0.0.0.0; echo done"])
    assert launch == Launch("front", {"--config": "/c.yaml", "--host": "0.0.0.0"})
    assert parse_launch(["ray", "start", "--block"]) is None


# ---------------------------------------------------------------------------------------------
# Tests: the real kustomize, where installed
# ---------------------------------------------------------------------------------------------


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def test_kustomize_output_equals_render_and_checks_out(resources, config):
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed: the real kustomize output is not checked")
    proc = subprocess.run([*command, str(DEPLOY)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    built = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
    # Generated ConfigMaps carry a content hash; every reference must name the hashed ConfigMap.
    generated = {gen["name"] for gen in yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["configMapGenerator"]}
    hashed = {}
    for res in built:
        if res["kind"] == "ConfigMap":
            base = re.sub(r"-[a-z0-9]{10}$", "", res["metadata"]["name"])
            assert base in generated and base != res["metadata"]["name"], res["metadata"]["name"]
            hashed[res["metadata"]["name"]] = base
    assert all_problems(built, config, CONFIG_FILE.read_text()) == []   # references resolve to the hashed names
    for res in built:
        if res["apiVersion"].startswith("ray.io/") and not KUBERAY_CRDS.is_dir():
            continue  # reported as a skip by test_schema
        assert schema_errors(res) == [], names([res])

    def unhash(node):
        if isinstance(node, dict):
            return {k: unhash(v) for k, v in node.items()}
        if isinstance(node, list):
            return [unhash(v) for v in node]
        return hashed.get(node, node)

    key = lambda r: (r["kind"], r["metadata"]["name"])  # noqa: E731
    assert sorted(map(unhash, built), key=key) == sorted(resources, key=key)


# ---------------------------------------------------------------------------------------------
# Tests: a maintained policy checker, checkov, on the rendered manifests
# ---------------------------------------------------------------------------------------------

# checkov (PyPI, Prisma Cloud's; offline with --skip-download) runs from an environment of its own:
# it pins packaging<24, which ray>=2.52 (packaging>=24.2) cannot share, so it cannot be a [test]
# extra. Its path: $SPECDEC_CHECKOV, else `checkov` on PATH, else /opt/checkov. Install (docs/deploy.md):
#   python -m venv /opt/checkov && /opt/checkov/bin/pip install checkov==3.3.30
CHECKOV_INSTALL = "python -m venv /opt/checkov && /opt/checkov/bin/pip install checkov==3.3.30"
# Checks the manifests fail on purpose, and why. Nothing else may fail.
CHECKOV_SKIPS = {
    "CKV_K8S_43": "images are named by version tag (deploy/kustomization.yaml images:); a release pins the digest "
                  "(kustomize edit set image specdec=REGISTRY/specdec@sha256:...), which passes this and CKV_K8S_15",
    "CKV_K8S_15": "imagePullPolicy IfNotPresent: with a digest-pinned image (CKV_K8S_43) checkov passes it as it is",
}


CHECKOV_VENV = Path("/opt/checkov/bin/checkov")


def checkov_path() -> str | None:
    """$SPECDEC_CHECKOV, else `checkov` on PATH, else the environment CHECKOV_INSTALL makes."""
    return os.environ.get("SPECDEC_CHECKOV") or shutil.which("checkov") or (str(CHECKOV_VENV) if CHECKOV_VENV.exists() else None)


def checker_pods(resources: list[dict]) -> list[dict]:
    """A Pod for each Ray group's template: what KubeRay makes of it, and what checkov can check
    (its Kubernetes checks read the pod specs of Kubernetes' own kinds, not of a RayCluster)."""
    pods = []
    for pod in pod_templates(resources):
        if pod.origin.startswith("RayCluster/"):
            cluster, role, *group = pod.origin.removeprefix("RayCluster/").split(" ")
            pods.append({"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": "-".join([cluster, *(group or [role])]), "namespace": pod.namespace,
                                      "labels": dict(pod.labels)},
                         "spec": copy.deepcopy(pod.spec)})
    return pods


def _pod_spec(obj: dict) -> dict:
    return obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]


def _first(obj: dict) -> dict:
    return _pod_spec(obj)["containers"][0]


# A broken copy of one object, checked in the same run: (object, mutation, checks that must fail, checks that must pass).
# (Not here: checkov's NetworkPolicy check, CKV2_K8S_6, links pods and policies across namespaces, so
# next to the default-deny policy it passes any pod; check_network_policies checks who reaches what.)
CHECKER_MUTATIONS = {
    "draft root filesystem writable": (("Deployment", "specdec-draft"),
                                       lambda o: _first(o)["securityContext"].pop("readOnlyRootFilesystem"), {"CKV_K8S_22"}, set()),
    "target may escalate privileges": (("StatefulSet", "specdec-target"),
                                       lambda o: _first(o)["securityContext"].update(allowPrivilegeEscalation=True), {"CKV_K8S_20"}, set()),
    "Ray head keeps its capabilities": (("Pod", "specdec-front-head"),
                                        lambda o: _first(o)["securityContext"].pop("capabilities"), {"CKV_K8S_28", "CKV_K8S_37"}, set()),
    "Ray worker without a seccomp profile": (("Pod", "specdec-front-orchestrator"),
                                             lambda o: _pod_spec(o)["securityContext"].pop("seccompProfile"), {"CKV_K8S_31"}, set()),
    "draft mounts its service-account token": (("Deployment", "specdec-draft"),
                                               lambda o: _pod_spec(o).update(automountServiceAccountToken=True), {"CKV_K8S_38"}, set()),
    "target runs as root": (("StatefulSet", "specdec-target"),
                            lambda o: _pod_spec(o)["securityContext"].update(runAsUser=0, runAsNonRoot=False), {"CKV_K8S_23", "CKV_K8S_40"}, set()),
    "privileged Ray head": (("Pod", "specdec-front-head"),
                            lambda o: _first(o)["securityContext"].update(privileged=True), {"CKV_K8S_16"}, set()),
    "draft on the host network": (("Deployment", "specdec-draft"),
                                  lambda o: _pod_spec(o).update(hostNetwork=True), {"CKV_K8S_19"}, set()),
    "Ray worker without probes": (("Pod", "specdec-front-orchestrator"),
                                  lambda o: [_first(o).pop(k) for k in ("readinessProbe", "livenessProbe")], {"CKV_K8S_8", "CKV_K8S_9"}, set()),
    "draft image pinned by digest": (("Deployment", "specdec-draft"),
                                     lambda o: _first(o).update(image="registry.example/specdec@sha256:" + "0" * 64),
                                     set(), {"CKV_K8S_43", "CKV_K8S_15"}),
}


@dataclass
class CheckerRun:
    failed: dict[str, set[str]]   # object name -> check ids failed
    passed: dict[str, set[str]]
    summary: dict
    mutants: dict[str, str]        # mutation -> the name of its broken copy


@pytest.fixture(scope="module")
def checker_run(resources, tmp_path_factory) -> CheckerRun:
    """checkov over the rendered manifests, the Ray pods and one broken copy per CHECKER_MUTATIONS, in one run."""
    path = checkov_path()
    if path is None:
        pytest.skip(f"checkov not found ($SPECDEC_CHECKOV, `checkov` on PATH, {CHECKOV_VENV}); its pins conflict with "
                    f"ray's, so it lives in an environment of its own: {CHECKOV_INSTALL}")
    documents = copy.deepcopy(resources) + checker_pods(resources)
    mutants = {}
    for i, (mutation, ((kind, name), mutate, _, _)) in enumerate(CHECKER_MUTATIONS.items()):
        broken = copy.deepcopy(find(documents, kind, name))
        broken["metadata"]["name"] = mutants[mutation] = f"mutant-{i}"
        mutate(broken)
        documents.append(broken)
    manifest = tmp_path_factory.mktemp("checkov") / "manifests.yaml"
    manifest.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    env = {**os.environ, "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true", "BC_SKIP_MAPPING": "TRUE"}
    proc = subprocess.run([path, "--file", str(manifest), "--framework", "kubernetes", "--skip-download",
                           "--compact", "--output", "json"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode in (0, 1) and proc.stdout.strip(), proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    report = report[0] if isinstance(report, list) else report
    failed, passed = {}, {}
    for out, key in ((failed, "failed_checks"), (passed, "passed_checks")):
        for check in report["results"][key]:
            # "Kind.namespace.name" (graph checks append the pod labels after the name)
            out.setdefault(check["resource"].split(".")[2], set()).add(check["check_id"])
    return CheckerRun(failed, passed, report["summary"], mutants)


def test_policy_checker_passes_the_manifests(resources, checker_run):
    assert checker_run.summary["parsing_errors"] == 0, checker_run.summary
    # every workload and Ray pod was checked
    checked = set(checker_run.failed) | set(checker_run.passed)
    workloads = {r["metadata"]["name"] for r in resources if r["kind"] in ("Deployment", "StatefulSet")}
    assert workloads | {p["metadata"]["name"] for p in checker_pods(resources)} <= checked, checked
    failures = {name: sorted(ids - set(CHECKOV_SKIPS)) for name, ids in checker_run.failed.items()
                if name not in checker_run.mutants.values() and ids - set(CHECKOV_SKIPS)}
    assert failures == {}


@pytest.mark.parametrize("mutation", list(CHECKER_MUTATIONS))
def test_policy_checker_catches(checker_run, mutation):
    _, _, must_fail, must_pass = CHECKER_MUTATIONS[mutation]
    name = checker_run.mutants[mutation]
    assert must_fail <= checker_run.failed.get(name, set()), checker_run.failed.get(name)
    assert must_pass <= checker_run.passed.get(name, set()) and not must_pass & checker_run.failed.get(name, set())


# ---------------------------------------------------------------------------------------------
# Tests: image and entrypoints
# ---------------------------------------------------------------------------------------------


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_dockerfile_builds_what_the_manifests_run(resources, config):
    facts = dockerfile_facts((DEPLOY / "Dockerfile").read_text())
    project = pyproject()
    # The package (and with it the `specdec` console script) is installed from the copied sources.
    assert project["project"]["scripts"]["specdec"] == "orchestrator.cli.main:main"
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {PurePosixPath(src).parts[0] for src in facts["copied"]}
    assert {"pyproject.toml", "README.md"} | packages <= copied, copied
    assert any(re.search(r"pip install .*\"\.(\$\{EXTRAS[^\"]*\})?\"", run) for run in facts["runs"]), facts["runs"]
    # The image the manifests name is the Dockerfile's title:version, the package's version.
    assert facts["labels"]["org.opencontainers.image.version"] == project["project"]["version"]
    # Ports it exposes are the config's.
    assert facts["expose"] == {config.front.port, config.draft.port, config.target.port, config.front.metrics_port,
                               config.front.http_port}
    # Ray: the image's Ray is the RayCluster's rayVersion and satisfies the package's requirement.
    ray_version = facts["args"]["RAY_VERSION"]
    assert find(resources, "RayCluster", "specdec-front")["spec"]["rayVersion"] == ray_version
    ray_req = next(Requirement(d) for d in project["project"]["dependencies"] if Requirement(d).name == "ray")
    assert ray_req.specifier.contains(ray_version), (ray_req, ray_version)
    # The manifests turn Ray's token authentication on: the package admits no Ray without it.
    floors = [Version(spec.version) for spec in ray_req.specifier if spec.operator in (">=", "==", "~=", ">")]
    assert floors and max(floors) >= Version(RAY_AUTH_MIN_VERSION), (ray_req, RAY_AUTH_MIN_VERSION)
    # The image's user is every pod's runAsUser and runAsGroup (files it owns; the UID the pods' policies admit).
    for pod in pod_templates(resources):
        context = pod.spec["securityContext"]
        assert facts["user"] == str(context["runAsUser"]) == str(context["runAsGroup"]), (pod.origin, facts["user"])
    # The KubeRay annotation that makes the head run our command (see front.yaml).
    ray = find(resources, "RayCluster", "specdec-front")
    assert ray["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    assert "KUBERAY_GEN_RAY_START_CMD" in " ".join(_head(resources)["args"])


def test_dockerfile_builds_cpu_by_default_and_cuda_by_build_arg():
    """The torch wheel index comes from build arg TORCH (cpu by default: the CPU image stays buildable as it
    was); the header's CUDA build line selects a CUDA index for the draft and target image."""
    text = (DEPLOY / "Dockerfile").read_text()
    facts = dockerfile_facts(text)
    assert facts["args"]["TORCH"] == "cpu"
    assert facts["args"]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/${TORCH}"
    installs = [run for run in facts["runs"] if re.search(r"pip install \"torch[^\"]*\"", run)]
    assert len(installs) == 1 and '--index-url "${TORCH_INDEX_URL}"' in installs[0], facts["runs"]
    builds = dockerfile_builds(text)
    assert re.fullmatch(r"cu1\d\d", builds["cuda"][1]["TORCH"]) and "TORCH" not in builds["cpu"][1], builds
    # the CPU image is the one the README and docs/deploy.md build too
    assert f"-t {builds['cpu'][0]} ." in (REPO / "docs" / "deploy.md").read_text()
    assert f"-t {builds['cuda'][0]} --build-arg TORCH={builds['cuda'][1]['TORCH']} ." in (
        REPO / "docs" / "deploy.md").read_text()


@pytest.mark.parametrize("edit,expected", [
    (lambda t: re.sub(r"(?m)^#.*docker build .*TORCH=cu.*$", "#", t), "a CPU image specdec:0.1.0 and a CUDA one"),
    (lambda t: t.replace("-t specdec-cuda:0.1.0", "-t specdec-cuda:0.0.9"), "a CPU image specdec:0.1.0 and a CUDA one"),
    (lambda t: t.replace("--build-arg TORCH=cu128", "--build-arg TORCH=cpu"), "a CPU image specdec:0.1.0 and a CUDA one"),
])
def test_image_check_needs_the_cuda_build(resources, edit, expected):
    """A Dockerfile whose header builds no CUDA image of the package's version fails check_images."""
    text = edit((DEPLOY / "Dockerfile").read_text())
    assert text != (DEPLOY / "Dockerfile").read_text()
    assert any(expected in problem for problem in check_images(resources, text)), check_images(resources, text)


def test_gpu_classes_are_the_documented_ones(resources):
    """The GPU pods' nodeSelector and tolerations are the values docs/deploy.md#gpus tells to set."""
    docs = (REPO / "docs" / "deploy.md").read_text()
    section = docs[docs.index("## GPUs"):]
    section = section[:section.index("\n## ", 1)]
    gpu_pods = [pod for pod in pod_templates(resources) if pod_gpus(pod)]
    assert {pod.origin for pod in gpu_pods} == {"Deployment/specdec-draft", "StatefulSet/specdec-target"}
    for pod in gpu_pods:
        for label, value in pod.spec["nodeSelector"].items():
            assert f"{label}: {value}" in section, (pod.origin, label, value)
        for toleration in pod.spec["tolerations"]:
            assert f"key: {toleration['key']}" in section and f"effect: {toleration['effect']}" in section
    assert check_gpu_classes(resources) == []


@pytest.mark.parametrize("subcommand", ["draft-server", "target-server"])
def test_gpu_pods_device_flags_are_ones_the_cli_accepts(resources, subcommand):
    """Each GPU container's arguments parse with the CLI's own parser (click refuses an unknown flag or a bad
    value), and its --device, through the config it overrides, puts one rank on each GPU of the pod: CUDA
    devices torch parses, distinct, as many as the pod's nvidia.com/gpu limit."""
    import torch
    import typer

    from orchestrator.cli.main import app
    from specdec.process_entry import device_option

    command = typer.main.get_command(app).commands[subcommand]
    found = 0
    for _, ctr, launch in launches(resources):
        if launch.subcommand != subcommand:
            continue
        found += 1
        argv = words([*ctr["command"], *ctr["args"]])
        params = command.make_context(subcommand, argv[argv.index(subcommand) + 1:]).params
        if subcommand == "draft-server":
            devices = [load_config(CONFIG_FILE, {"draft.device": params["device"]}).draft_device]
        else:
            devices = load_config(CONFIG_FILE, {"target.device": device_option(params["device"]),
                                                "target.tp": params["tp"]}).target_devices
        assert {torch.device(d).type for d in devices} == {"cuda"} and len(set(devices)) == len(devices), devices
        assert len(devices) == int(ctr["resources"]["limits"][GPU]), (devices, ctr["resources"])
    assert found == 1


def test_dockerignore_keeps_the_sources():
    facts = dockerfile_facts((DEPLOY / "Dockerfile").read_text())
    patterns = [p.strip().removeprefix("**/") for p in (REPO / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    for src in facts["copied"]:
        assert not [p for p in patterns if fnmatch.fnmatch(src, p)], src


def local_launches() -> list[Launch]:
    """The ``$specdec SUBCOMMAND ...`` lines of deploy/local.sh."""
    out = []
    for line in (DEPLOY / "local.sh").read_text().splitlines():
        if line.startswith("$specdec "):
            command = line.split("&", 1)[0].replace("$specdec", "specdec", 1)
            out.append(parse_launch(shlex.split(command)))
    return out


def test_local_launch_runs_the_manifests_entrypoints(resources):
    cluster = {launch.subcommand for _, _, launch in launches(resources)}
    local = local_launches()
    assert {launch.subcommand for launch in local} == cluster == set(SERVERS)
    # Locally nothing is overridden: the config file alone decides.
    assert all(set(launch.flags) == {"--config"} for launch in local), local


RECORDER = """#!/bin/sh
echo "$(basename "$0") $*" >> "$RECORD"
"""


def test_ray_pod_scripts_start_ray_then_the_front(resources, tmp_path):
    """The Ray containers' bash scripts, run with stand-ins for KubeRay's generated ``ray start``
    and for ``specdec``: the head starts Ray without --block and then execs the front with its
    flags; a worker runs ``ray start`` as generated (blocking)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("ray", "specdec"):
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(0o755)
    ray = find(resources, "RayCluster", "specdec-front")
    pods = {"head": ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0],
            "worker": ray["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]}
    generated = "ray start --address=specdec-front-head-svc:6379 --block --num-cpus=2"
    expected = {
        "head": ["ray start --address=specdec-front-head-svc:6379 --num-cpus=2",
                 "specdec front --config /etc/specdec/specdec.yaml --host 0.0.0.0 --ray-address auto "
                 "--draft-address specdec-draft:50061 --target-address specdec-target:50062 --health-port 50070 "
                 "--tls-cert /etc/specdec-tls/tls.crt --tls-key /etc/specdec-tls/tls.key --tls-ca /etc/specdec-tls/ca.crt "
                 "--auth-token-file /etc/specdec-auth/tokens"],
        "worker": [generated],
    }
    for role, ctr in pods.items():
        record = tmp_path / f"{role}.log"
        env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(record), "KUBERAY_GEN_RAY_START_CMD": generated}
        assert ctr["command"] == ["/bin/bash", "-lc", "--"] and len(ctr["args"]) == 1
        # bash -c, not -lc: a login shell here would read this machine's profile (in the image,
        # /etc/profile's PATH holds /usr/local/bin, where pip puts `specdec` and `ray`).
        proc = subprocess.run(["/bin/bash", "-c", "--", ctr["args"][0]], env=env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert record.read_text().splitlines() == expected[role]


def cli_options() -> dict[str, set[str]]:
    import typer

    from orchestrator.cli.main import app

    group = typer.main.get_command(app)
    return {name: {opt for param in cmd.params for opt in [*param.opts, *param.secondary_opts]}
            for name, cmd in group.commands.items()}


@pytest.mark.parametrize("subcommand", sorted(SERVERS))
def test_cli_takes_the_manifest_flags(resources, subcommand):
    options = cli_options()
    used = {flag for _, _, launch in launches(resources) if launch.subcommand == subcommand for flag in launch.flags}
    if subcommand not in options:
        pytest.skip(f"specdec {subcommand} not available yet (orchestrator/cli/main.py); the manifests run it with {sorted(used)}")
    assert used <= options[subcommand], f"specdec {subcommand} lacks {sorted(used - options[subcommand])}"


STUB_SERVER = """
import os, pathlib, signal, sys, time
sub, out = sys.argv[1], pathlib.Path(os.environ["STUB_DIR"])
def term(*_):
    (out / f"{sub}.term").write_text("")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
(out / f"{sub}.args").write_text(" ".join(sys.argv[1:]))
if sub == os.environ.get("STUB_EXITS"):
    time.sleep(1)
    sys.exit(3)
while True:
    time.sleep(0.05)
"""


@pytest.mark.parametrize("how", ["one exits", "SIGTERM"])
def test_local_sh_runs_three_and_stops_them_together(tmp_path, how):
    """deploy/local.sh with stand-in servers: each gets the config, and one exiting (or a SIGTERM
    to the launcher) stops the other two with SIGTERM."""
    (tmp_path / "stub.py").write_text(STUB_SERVER)
    env = {**os.environ, "SPECDEC": f"{sys.executable} {tmp_path / 'stub.py'}", "STUB_DIR": str(tmp_path),
           "STUB_EXITS": "front" if how == "one exits" else ""}
    proc = subprocess.Popen(["bash", str(DEPLOY / "local.sh"), "cfg.yaml"], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("*.args"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        if how == "SIGTERM":
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    for sub in SERVERS:
        assert (tmp_path / f"{sub}.args").read_text() == f"{sub} --config cfg.yaml"
    stopped = {p.stem for p in tmp_path.glob("*.term")}
    if how == "one exits":
        assert rc == 3 and stopped == {"draft-server", "target-server"}
    else:
        assert rc == 143 and stopped == set(SERVERS)


# ---------------------------------------------------------------------------------------------
# Local rehearsal: deploy/local.sh serves greedy output equal to target-only
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_serving(address: str, service: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    return False


def generate(address: str, prompt: str, max_new_tokens: int, no_spec: bool = False) -> tuple[list[int], str]:
    import grpc

    from specdec.v1 import generation_pb2, generation_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = generation_pb2.GenerateRequest(prompt=prompt, raw=True, max_new_tokens=max_new_tokens, no_spec=no_spec)
        tokens, text = [], ""
        for reply in stub.Generate(request, timeout=300):
            tokens += reply.token_ids
            text += reply.text_delta
    return tokens, text


def read_only_root(writable: list[Path]) -> list[str] | None:
    """A command prefix that runs what follows as the pods run it: in a mount namespace of its own,
    the root filesystem read-only but for ``writable`` (bind mounts of themselves, as the pods'
    emptyDirs); it exits 97 if the root is still writable. None where this machine cannot make one
    (not root, or no unshare)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return None
    if subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True).returncode != 0:
        return None
    binds = "".join(f"mount --bind {shlex.quote(str(p))} {shlex.quote(str(p))} && " for p in writable)
    probe = shlex.quote(str(REPO / ".read-only-probe"))
    script = (f"{binds}mount -o remount,bind,ro / && "
              f"if touch {probe} 2>/dev/null; then rm -f {probe}; echo 'the root is writable' >&2; exit 97; fi; "
              'exec "$@"')
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"]


def test_read_only_root_leaves_writable_only_what_it_names(tmp_path):
    """The rehearsal's harness: in it the given folders take writes, a sibling folder and the
    repository do not (so a service writing anywhere else fails there as in a pod)."""
    writable, other = tmp_path / "writable", tmp_path / "other"
    writable.mkdir()
    other.mkdir()
    prefix = read_only_root([writable])
    if prefix is None:
        pytest.skip("mount namespaces need root and unshare")
    script = ("touch \"$1/x\" && ! touch \"$2/x\" 2>/dev/null && ! touch \"$3/.read-only-x\" 2>/dev/null")
    proc = subprocess.run([*prefix, "sh", "-c", script, "sh", str(writable), str(other), str(REPO)],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert (writable / "x").exists() and not (other / "x").exists() and not (REPO / ".read-only-x").exists()


def ray_gcs_call(port: int, token: str | None):
    """A GCS call (NodeInfoGcsService.GetClusterId) on 127.0.0.1:port: its status code, OK or the refusal's."""
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId",
                                   request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            call(b"", timeout=10, metadata=[("authorization", f"Bearer {token}")] if token else None)
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()


def test_local_rehearsal_greedy_equals_target_only(tmp_path):
    """deploy/local.sh with deploy/specdec.yaml, changed only where a test must: tiny models in
    float32 (the real pair takes minutes and GBs) and free ports (this machine is shared).

    Run as the pods run: Ray's token authentication on (RAY_AUTH_MODE=token, the token from a file
    as from the Secret specdec-ray-token), and where this machine can (root, unshare) on a
    read-only root filesystem, writable only the folders that stand for the pods' emptyDirs (/tmp,
    HOME, SPECDEC_CACHE; Ray's /tmp/ray via RAY_TMPDIR). Ray's GCS then refuses a call without
    the token and takes one with it."""
    if "front" not in cli_options():
        pytest.skip("specdec front not available")
    from specdec.harness.tiny_pair import save_tiny

    target, draft = save_tiny(tmp_path / "target", 0), save_tiny(tmp_path / "draft", 1)
    raw = yaml.safe_load(CONFIG_FILE.read_text())
    ports = {section: free_port() for section in ("draft", "target", "front")}
    raw["models"].update(target=str(target), draft=str(draft), dtype="float32", draft_quant="none")
    for section, port in ports.items():
        raw[section]["port"] = port
    raw["front"].update(draft_address=f"127.0.0.1:{ports['draft']}", target_address=f"127.0.0.1:{ports['target']}",
                        metrics_port=None, http_port=None)
    config_path = tmp_path / "specdec.yaml"
    config_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    load_config(config_path)

    # short: Ray's socket paths (RAY_TMPDIR/ray/session_.../sockets/...) must stay under 108 bytes
    scratch = Path(tempfile.mkdtemp(prefix="sd-"))
    writable = {name: scratch / name for name in ("tmp", "home", "cache")}
    for folder in writable.values():
        folder.mkdir()
    token = tmp_path / "secret" / RAY_TOKEN_KEY  # as the pods mount it
    token.parent.mkdir()
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "SPECDEC": f"{sys.executable} -m orchestrator.cli", "OTEL_SDK_DISABLED": "true",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           "HOME": str(writable["home"]), "SPECDEC_CACHE": str(writable["cache"]),
           "TMPDIR": str(writable["tmp"]), "RAY_TMPDIR": str(writable["tmp"])}
    env.pop("RAY_AUTH_TOKEN", None)
    prefix = read_only_root(list(writable.values()))
    if prefix is None:
        warnings.warn("local rehearsal on a writable root filesystem: mount namespaces need root and unshare")
    log = open(tmp_path / "local.log", "w")
    proc = subprocess.Popen([*(prefix or []), "bash", str(DEPLOY / "local.sh"), str(config_path)], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        front = f"127.0.0.1:{ports['front']}"
        assert wait_serving(front, "specdec.v1.GenerationService", proc, timeout_s=240), (tmp_path / "local.log").read_text()
        prompt = "the quick brown fox"
        spec_tokens, spec_text = generate(front, prompt, 12)
        plain_tokens, _ = generate(front, prompt, 12, no_spec=True)
        # The front's Ray wrote its session where the pods' /tmp emptyDir stands, and its GCS wants the token.
        port_files = list((writable["tmp"] / "ray" / "session_latest").glob("gcs_server_port_*"))
        assert len(port_files) == 1, sorted(p.name for p in (writable["tmp"] / "ray").rglob("*"))[:20]
        gcs_port = int(port_files[0].read_text())
        import grpc

        assert ray_gcs_call(gcs_port, None) == grpc.StatusCode.UNAUTHENTICATED
        assert ray_gcs_call(gcs_port, "0" * 64) == grpc.StatusCode.UNAUTHENTICATED
        assert ray_gcs_call(gcs_port, token.read_text()) == grpc.StatusCode.OK
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone already where local.sh stopped by itself
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        shutil.rmtree(scratch, ignore_errors=True)

    # Target-only reference, independent of the services: the embedded CLI with --no-spec.
    baseline = subprocess.run([sys.executable, "-m", "orchestrator.cli", "generate", prompt, "--target", str(target),
                               "--draft", str(draft), "--dtype", "float32", "--raw", "--max-new-tokens", "12", "--no-spec"],
                              capture_output=True, text=True, timeout=300)
    assert baseline.returncode == 0, baseline.stderr
    assert spec_tokens and spec_tokens == plain_tokens
    assert spec_text.strip() and spec_text == baseline.stdout.removesuffix("\n")
