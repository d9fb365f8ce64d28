"""Test helpers for real servers: tiny saved models, config files, server subprocesses on loopback.

    pair = save_tiny_pair(tmp_path)                        # target + draft dirs (seeded, tokenizer included)
    config = write_config(tmp_path / "serve.yaml", pair, target={"max_batch": 4})
    with running_service("target", config) as target:      # python -m target_service, port 0
        channel = grpc.aio.insecure_channel(target.address)  # e.g. "127.0.0.1:43817"
    # leaving the block sends SIGTERM and waits for the exit (target.returncode)

Kinds: "draft" (python -m draft_service), "target" (python -m target_service), "front" (python -m
orchestrator front). A server that does not print its ready line in time, or exits first, fails the
test with its stderr.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

CORPUS = ["the quick brown fox jumps over the lazy dog", "def add(a, b):\n    return a + b", "hello world"]
MODULES = {"draft": ["draft_service"], "target": ["target_service"], "front": ["orchestrator", "front"]}  # python -m ...
ROOT = Path(__file__).resolve().parent.parent
_READY = re.compile(r"^(?P<name>\S+) ready on (?P<host>\S+):(?P<port>\d+)$")


def save_tiny(path, seed: int, corpus=CORPUS, max_pos: int = 64, noise_of: int | None = None, noise: float = 0.0):
    """Save a tiny random Qwen2 model with a small byte-level BPE tokenizer trained on ``corpus``.

    The weights come from ``seed``; with ``noise_of`` set they are instead those of seed ``noise_of``
    plus N(0, noise^2) drawn from ``seed`` (a draft close to that target: partial acceptance).
    Returns ``path``.
    """
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=1, special_tokens=["<eos>"], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>")
    tok.save_pretrained(path)
    torch.manual_seed(seed if noise_of is None else noise_of)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      initializer_range=0.5, eos_token_id=0, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    if noise_of is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * noise)
    model.save_pretrained(path)
    return path


@dataclass(frozen=True)
class ModelPair:
    target: Path
    draft: Path


def save_tiny_pair(root, max_pos: int = 256, noise: float = 0.03) -> ModelPair:
    """A tiny target (seed 0) and a draft close to it (target + noise, seed 1) under ``root``."""
    root = Path(root)
    return ModelPair(save_tiny(root / "target", 0, max_pos=max_pos),
                     save_tiny(root / "draft", 1, max_pos=max_pos, noise_of=0, noise=noise))


def write_config(path, pair: ModelPair | None = None, **sections) -> Path:
    """Write a service config YAML for tests: float32, no draft quantization, one torch thread,
    ephemeral ports; ``sections`` (e.g. target={"max_kv_tokens": 64}, grpc={...}) are merged in.
    Returns ``path``."""
    data: dict = {
        "models": {"dtype": "float32", "draft_quant": "none", "threads": 1},
        "grpc": {"shutdown_grace_s": 5.0},
        "draft": {"port": 0},
        "target": {"port": 0},
    }
    if pair is not None:
        data["models"].update(target=str(pair.target), draft=str(pair.draft))
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
    return Path(path)


@dataclass
class Service:
    """A running server subprocess. address: "host:port" to dial; stderr: its log so far."""

    kind: str
    host: str  # from the ready line
    port: int  # the bound port (0 until ready)
    proc: subprocess.Popen
    stderr_path: Path
    stdout_lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def server_command(kind: str, config_path, **flags) -> list[str]:
    """argv of ``python -m <server> --config FILE --port 0 [--flag value ...]`` (flags: port, host, target, draft, dtype)."""
    flags.setdefault("port", 0)
    argv = [sys.executable, "-m", *MODULES[kind], "--config", str(config_path)]
    for name, value in flags.items():
        name = name.replace("_", "-")
        if value is True:
            argv.append(f"--{name}")
        elif value is not None and value is not False:
            argv += [f"--{name}", str(value)]
    return argv


def launch_service(kind: str, config_path, env: dict | None = None, **flags) -> Service:
    """Start a server subprocess without waiting (call ``wait_ready``); launch several, then wait,
    to overlap their start-up."""
    stderr_file = tempfile.NamedTemporaryFile("w", prefix=f"{kind}-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        server_command(kind, config_path, **flags), cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr_file,
        text=True, env={**os.environ, "OTEL_TRACES_EXPORTER": "none", **(env or {})},
    )
    stderr_file.close()
    service = Service(kind, "", 0, proc, Path(stderr_file.name))
    threading.Thread(target=_pump_stdout, args=(service,), daemon=True).start()
    return service


def _pump_stdout(service: Service) -> None:
    """Reads the server's stdout to the end (so it never blocks on a full pipe); finds the ready line."""
    for line in service.proc.stdout:
        service.stdout_lines.append(line.rstrip("\n"))
        match = _READY.match(service.stdout_lines[-1])
        if match and not service.ready.is_set():
            service.host, service.port = match["host"], int(match["port"])
            service.ready.set()
    service.ready.set()  # stdout closed: the process is exiting


def wait_ready(service: Service, timeout_s: float = 120.0) -> Service:
    """Wait for the ready line; fails the test (with the server's stderr) on timeout or early exit."""
    import pytest

    service.ready.wait(timeout_s)
    if not service.port:
        stop_service(service, timeout_s=5.0)
        code = service.proc.returncode
        what = f"exited with {code}" if code is not None else f"not ready after {timeout_s:.0f} s"
        pytest.fail(f"{service.kind} server {what}; stdout: {service.stdout_lines}; stderr:\n{service.stderr[-4000:]}")
    return service


def start_service(kind: str, config_path, timeout_s: float = 120.0, env: dict | None = None, **flags) -> Service:
    """Start a server subprocess and wait for its ready line (see ``wait_ready``)."""
    return wait_ready(launch_service(kind, config_path, env, **flags), timeout_s)


def stop_service(service: Service, timeout_s: float = 30.0) -> int:
    """SIGTERM, wait up to ``timeout_s`` (then SIGKILL); returns the exit code."""
    if service.proc.poll() is None:
        service.proc.send_signal(signal.SIGTERM)
    try:
        return service.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        service.proc.kill()
        return service.proc.wait()


@contextmanager
def running_service(kind: str, config_path, timeout_s: float = 120.0, env: dict | None = None, **flags):
    """Context manager: a ready server subprocess (Service); SIGTERM and wait on exit."""
    service = start_service(kind, config_path, timeout_s, env, **flags)
    try:
        yield service
    finally:
        stop_service(service)


def wait_for_exit(service: Service, timeout_s: float) -> tuple[int | None, float]:
    """(exit code or None if still running, seconds waited)."""
    started = time.monotonic()
    try:
        code = service.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    return code, time.monotonic() - started
