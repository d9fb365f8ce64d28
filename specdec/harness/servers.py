"""The project's own servers as subprocesses (on loopback ports unless given a host), for tests and benchmarks.

    draft, target = launch_service("draft", config), launch_service("target", config)
    wait_ready(draft), wait_ready(target)                      # start-ups overlap; ServiceNotReady if not
    stop_service(target)                                       # SIGTERM, wait; returns the exit code
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

MODULES = {"draft": ["draft_service"], "target": ["target_service"], "front": ["orchestrator", "front"]}  # python -m ...
# The repository root: servers run from it, so ``python -m draft_service`` finds the sources imported here.
SOURCE_ROOT = Path(__file__).resolve().parents[2]
_READY = re.compile(r"^(?P<name>\S+) ready on (?P<host>\S+):(?P<port>\d+)$")


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
    addresses: dict[str, str] = field(default_factory=dict)  # name -> "host:port" of every ready line so far

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


def launch_service(kind: str, config_path, env: dict | None = None, prefix: list[str] = (), **flags) -> Service:
    """Start a server subprocess without waiting (call ``wait_ready``), so several start-ups overlap. ``prefix``: argv
    put before the command, one that execs it (e.g. ``ip netns exec NS taskset -c 0``: the pid stays the server's)."""
    return launch_command(kind, [*prefix, *server_command(kind, config_path, **flags)], env)


def launch_command(kind: str, argv: list[str], env: dict | None = None) -> Service:
    """Like ``launch_service`` for any command line that prints the ready line (e.g. a console
    script). Tracing is off unless ``env`` sets OTEL_TRACES_EXPORTER; stderr goes to a temp file."""
    stderr_file = tempfile.NamedTemporaryFile("w", prefix=f"{kind}-", suffix=".log", delete=False)
    proc = subprocess.Popen(argv, cwd=SOURCE_ROOT, stdout=subprocess.PIPE, stderr=stderr_file, text=True,
                            env={**os.environ, "OTEL_TRACES_EXPORTER": "none", **(env or {})})
    stderr_file.close()
    service = Service(kind, "", 0, proc, Path(stderr_file.name))
    threading.Thread(target=_pump_stdout, args=(service,), daemon=True).start()
    return service


def _pump_stdout(service: Service) -> None:
    """Reads the server's stdout to the end (so it never blocks on a full pipe); finds the ready line."""
    for line in service.proc.stdout:
        service.stdout_lines.append(line.rstrip("\n"))
        match = _READY.match(service.stdout_lines[-1])
        if match:
            service.addresses[match["name"]] = f"{match['host']}:{match['port']}"
        if match and not service.ready.is_set():
            service.host, service.port = match["host"], int(match["port"])
            service.ready.set()
    service.ready.set()  # stdout closed: the process is exiting


class ServiceNotReady(RuntimeError):
    """A server exited, or did not print its ready line in time; the message holds its stdout and stderr."""


def wait_ready(service: Service, timeout_s: float = 120.0) -> Service:
    """Wait for the ready line; on timeout or early exit stop the server and raise ServiceNotReady."""
    service.ready.wait(timeout_s)
    if not service.port:
        stop_service(service, timeout_s=5.0)
        code = service.proc.returncode
        what = f"exited with {code}" if code is not None else f"not ready after {timeout_s:.0f} s"
        raise ServiceNotReady(f"{service.kind} server {what}; stdout: {service.stdout_lines}; "
                              f"stderr:\n{service.stderr[-4000:]}")
    return service


def wait_address(service: Service, name: str, timeout_s: float = 30.0) -> str:
    """The "host:port" of the server's ready line ``<name> ready on ...`` (e.g. "http"), once printed.
    Raises ServiceNotReady when it does not come in time or the server exits."""
    deadline = time.monotonic() + timeout_s
    while name not in service.addresses:
        if service.proc.poll() is not None or time.monotonic() > deadline:
            raise ServiceNotReady(f"{service.kind} server printed no '{name} ready on' line; stdout: "
                                  f"{service.stdout_lines}; stderr:\n{service.stderr[-4000:]}")
        time.sleep(0.05)
    return service.addresses[name]


def start_service(kind: str, config_path, timeout_s: float = 120.0, env: dict | None = None, prefix: list[str] = (),
                  **flags) -> Service:
    """Start a server subprocess (``launch_service``) and wait for its ready line (see ``wait_ready``)."""
    return wait_ready(launch_service(kind, config_path, env, prefix, **flags), timeout_s)


def stop_service(service: Service, timeout_s: float = 30.0) -> int:
    """SIGTERM, wait up to ``timeout_s`` (then SIGKILL); returns the exit code."""
    if service.proc.poll() is None:
        service.proc.send_signal(signal.SIGTERM)
    try:
        return service.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        service.proc.kill()
        return service.proc.wait()


def wait_for_exit(service: Service, timeout_s: float) -> tuple[int | None, float]:
    """(exit code or None if still running, seconds waited)."""
    started = time.monotonic()
    try:
        code = service.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    return code, time.monotonic() - started


@contextlib.contextmanager
def draft_and_target(config):
    """A draft and a target service from ``config`` (a serve.yaml path), started side by side; yields their
    addresses (draft, target). On exit both are stopped; each must exit 0 with no traceback in its log
    (AssertionError otherwise). Raises ServiceNotReady as ``wait_ready``."""
    draft, target = launch_service("draft", config), launch_service("target", config)
    try:
        wait_ready(draft), wait_ready(target)
        yield draft.address, target.address
    finally:
        codes = [stop_service(s) for s in (draft, target)]
    assert codes == [0, 0], codes
    for service in (draft, target):
        assert "Traceback" not in service.stderr, service.stderr[-4000:]
