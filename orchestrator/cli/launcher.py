"""``specdec serve``: draft service, target service and generation front on one machine.

Starts the three servers as child processes with one config file and prints each ready line. A child that
fails to start makes serve exit 2 with its last error lines; one that dies later is reported and the others
keep serving. SIGTERM/SIGINT stop the front first, then the draft and target.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from specdec.process_entry import fail

READY_TIMEOUT_S = 900.0  # the default pair is converted from GGUF on first use (minutes)


class LaunchError(RuntimeError):
    """A service failed to start."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    address: str | None = None
    stderr_tail: list[str] = field(default_factory=list)


def _pump(child: Child, lines: "queue.Queue[tuple[str, str | None]]") -> None:
    for line in child.proc.stdout:
        lines.put((child.name, line.rstrip("\n")))
    lines.put((child.name, None))


def _tail(child: Child) -> None:
    for line in child.proc.stderr:
        sys.stderr.write(f"[{child.name}] {line}")
        sys.stderr.flush()
        child.stderr_tail.append(line.rstrip("\n"))
        del child.stderr_tail[:-20]


def start_child(name: str, module: str, args: list[str], env=None) -> Child:
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=1, env=env)
    child = Child(name, proc)
    threading.Thread(target=_tail, args=(child,), daemon=True).start()
    return child


def wait_ready(child: Child, timeout: float = READY_TIMEOUT_S, stop: threading.Event | None = None,
               ready_lines: int = 1) -> str:
    """Print the child's ``ready_lines`` ready lines and return the first's ``host:port``.
    Raises LaunchError (also when ``stop`` is set meanwhile)."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(child, lines), daemon=True).start()
    deadline = time.monotonic() + timeout
    addresses = []
    while True:
        if stop is not None and stop.is_set():
            raise LaunchError(f"stopped while {child.name} was starting")
        try:
            _, line = lines.get(timeout=0.5)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise LaunchError(f"{child.name}: not ready after {timeout:.0f} s") from None
            continue
        if line is None:
            child.proc.wait()
            time.sleep(0.2)  # let the stderr thread catch the last lines
            tail = "\n".join(child.stderr_tail[-5:])
            raise LaunchError(f"{child.name} exited with code {child.proc.returncode} before it was ready:\n{tail}")
        if " ready on " in line:
            print(line, flush=True)
            addresses.append(line.rsplit(" ready on ", 1)[1].strip())
            if len(addresses) == ready_lines:
                child.address = addresses[0]
                return child.address
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


def serve(config_path: str | None, flags: list[str], tp: int | None = None, no_ray: bool = False,
          grace_s: float = 10.0, http_port: int | None = None, http: bool = False,
          security_flags: list[str] = (), front_flags: list[str] = ()) -> int:
    """Run the three services until SIGTERM/SIGINT; returns the exit code.

    flags: model flags, each passed to the children that take it; http_port: None = the config's;
    security_flags: --tls-* flags for all three; front_flags: more flags for the front alone.
    """
    config_args = ["--config", config_path] if config_path else []
    children: list[Child] = []
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    env = dict(os.environ)
    try:
        # the children run the same typer commands as ``specdec draft-server`` / ``target-server`` / ``front``
        draft = start_child("draft-service", "draft_service", [*config_args, *flags, *security_flags], env)
        children.append(draft)
        target_flags = _model_flags(flags, "--target", "--dtype")  # the target server takes no --draft
        target = start_child("target-service", "target_service",
                             [*config_args, *target_flags, *security_flags, *(["--tp", str(tp)] if tp else [])], env)
        children.append(target)
        draft_addr, target_addr = wait_ready(draft, stop=stop), wait_ready(target, stop=stop)
        front_model_flags = _model_flags(flags, "--target")  # the front loads only the tokenizer
        front = start_child("generation-front", "orchestrator",
                            ["front", *config_args, *front_model_flags, *security_flags, *front_flags, "--draft-address", draft_addr,
                             "--target-address", target_addr, *(["--no-ray"] if no_ray else []),
                             *(["--http-port", str(http_port)] if http_port is not None else [])], env)
        children.append(front)
        wait_ready(front, stop=stop, ready_lines=2 if http else 1)
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


def _model_flags(flags: list[str], *names: str) -> list[str]:
    """The ``name VALUE`` pairs of ``names`` present in flags, in the order of ``names``."""
    picked = []
    for name in names:
        for i, flag in enumerate(flags[:-1]):
            if flag == name:
                picked += [name, flags[i + 1]]
                break
    return picked
