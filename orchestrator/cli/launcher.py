"""``specdec serve``: draft service, target service and generation front as child processes on one machine. A child
that fails to start makes serve exit 2 with its last error lines; one that dies later is reported.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from specdec.process_entry import fail

READY_TIMEOUT_S = 900.0  # the default pair is converted from GGUF on first use (minutes)


class LaunchError(RuntimeError):
    """A service failed to start."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))


def _pump(child: Child, lines: "queue.Queue[str | None]") -> None:
    for line in child.proc.stdout:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _tail(child: Child) -> None:
    for line in child.proc.stderr:
        print(f"[{child.name}] {line}", end="", file=sys.stderr, flush=True)
        child.stderr_tail.append(line.rstrip("\n"))


def start_child(name: str, module: str, args: list[str]) -> Child:
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=1)
    child = Child(name, proc)
    threading.Thread(target=_tail, args=(child,), daemon=True).start()
    return child


def wait_ready(child: Child, stop: threading.Event, ready_lines: int = 1) -> str:
    """Print the child's ``ready_lines`` ready lines and return the first's ``host:port``; LaunchError."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(child, lines), daemon=True).start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    addresses = []
    while True:
        if stop.is_set():
            raise LaunchError(f"stopped while {child.name} was starting")
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise LaunchError(f"{child.name}: not ready after {READY_TIMEOUT_S:.0f} s") from None
            continue
        if line is None:
            child.proc.wait()
            time.sleep(0.2)  # let the stderr thread catch the last lines
            tail = "\n".join(list(child.stderr_tail)[-5:])
            raise LaunchError(f"{child.name} exited with code {child.proc.returncode} before it was ready:\n{tail}")
        if " ready on " in line:
            print(line, flush=True)
            addresses.append(line.rsplit(" ready on ", 1)[1].strip())
            if len(addresses) == ready_lines:
                return addresses[0]
            continue
        print(f"[{child.name}] {line}", flush=True)


def stop_children(children: list[Child], grace_s: float) -> None:
    for child in children:  # front first (reverse start order), so no new rounds reach the workers
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
            try:
                child.proc.wait(timeout=grace_s + 15)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()


def serve(config_path: str | None, target: str | None = None, draft: str | None = None, dtype: str | None = None,
          tp: int | None = None, no_ray: bool = False, device: str | None = None, draft_device: str | None = None, grace_s: float = 10.0, http_port: int | None = None,
          http: bool = False, security_flags: list[str] = (), auth_token_file: str | None = None) -> int:
    """Run the three services until SIGTERM/SIGINT (the front stops first); returns the exit code. The arguments:
    flags for the children that take them (None = the config's); security_flags: --tls-* flags for all three."""
    config_args = ["--config", config_path] if config_path else []
    children: list[Child] = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        # the children run the same typer commands as ``specdec draft-server`` / ``target-server`` / ``front``
        children.append(start_child("draft-service", "draft_service",
                                    [*config_args, *_flags(target=target, draft=draft, dtype=dtype, device=draft_device),
                                     *security_flags]))
        children.append(start_child("target-service", "target_service",  # the target server takes no --draft
                                    [*config_args, *_flags(target=target, dtype=dtype, tp=tp, device=device),
                                     *security_flags]))
        draft_addr, target_addr = (wait_ready(child, stop) for child in children)
        front_flags = _flags(target=target, auth_token_file=auth_token_file, draft_address=draft_addr,
                             target_address=target_addr, http_port=http_port)  # the front loads only the tokenizer
        front_args = ["front", *config_args, *front_flags, *security_flags, *(["--no-ray"] if no_ray else [])]
        children.append(start_child("generation-front", "orchestrator", front_args))
        wait_ready(children[-1], stop, ready_lines=2 if http else 1)
    except LaunchError as exc:
        stop_children(children[::-1], grace_s)
        if stop.is_set():
            return 0
        return fail(str(exc))
    print("specdec serve: all services ready (SIGTERM or Ctrl-C stops them)", flush=True)
    reported = set()
    while not stop.wait(0.5):
        for child in children:
            if child.proc.poll() is not None and child.name not in reported:
                reported.add(child.name)
                print(f"specdec serve: {child.name} exited with code {child.proc.returncode}", file=sys.stderr, flush=True)
        if len(reported) == len(children):
            return 1
    stop_children(children[::-1], grace_s)
    return 0


def _flags(**values) -> list[str]:
    """``--name VALUE`` for each value that is set (None: the child's default), ``_`` in names as ``-``."""
    return [arg for name, value in values.items() if value is not None
            for arg in (f"--{name.replace('_', '-')}", str(value))]
