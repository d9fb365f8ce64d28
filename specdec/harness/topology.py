"""An emulated split deployment on one Linux machine (root, iproute2; docs/benchmarks.md "The split topology").

    with SplitTopology(rtt_ms=100, bandwidth_mbit=100, pin={"target": "0", "draft": "1"}) as topo:
        draft = launch_service("draft", cfg, prefix=topo.prefix("draft"), env=topo.env("draft"),
                               host=topo.hosts["draft"])
        relay = topo.relay(wait_ready(draft).address)        # "10.58.S+2.1:PORT": the front dials the draft here
        topo.measure_rtt(relay)                               # ms, median gRPC health check through the relay

Links (S = 4 * slot): root 10.58.S.1 <-> front 10.58.S.2, front 10.58.S+1.1 <-> target 10.58.S+1.2, front
10.58.S+2.1 <-> draft 10.58.S+2.2 (``tc`` tbf on both ends). Errors: ValueError on a round trip or bandwidth <= 0,
RuntimeError naming a failed ``ip``/``tc`` command, ServiceNotReady from a relay that does not start.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

from specdec.harness.servers import launch_command, stop_service, wait_ready

KINDS = ("front", "target", "draft")
_LINKS = {"front": (0, "h"), "target": (1, "t"), "draft": (2, "d")}  # kind -> (subnet offset, veth letter)


def _ip(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"topology: `{' '.join(argv)}` failed: {proc.stderr.strip()}")


def _free_slot() -> int:
    """A slot (0..63) whose names and 10.58.4*slot.0/22 addresses are not in use, starting from this pid's."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=False).stdout
    for slot in ((os.getpid() + i) % 64 for i in range(64)):
        if f"sd{slot}-" not in names and f"10.58.{4 * slot}." not in addrs:
            return slot
    raise RuntimeError("topology: no free slot (64 topologies exist)")


class SplitTopology:
    """Three namespaces joined as the module docstring draws; ``rtt_ms`` > 0, ``bandwidth_mbit`` > 0 or None."""

    def __init__(self, rtt_ms: float, bandwidth_mbit: float | None = None, pin: dict | None = None):
        if rtt_ms <= 0 or (bandwidth_mbit is not None and bandwidth_mbit <= 0):
            raise ValueError(f"topology: rtt_ms and bandwidth_mbit must be > 0, got {rtt_ms}, {bandwidth_mbit}")
        self.rtt_ms, self.bandwidth_mbit, self.pin = rtt_ms, bandwidth_mbit, pin or {}
        self.slot = _free_slot()
        s = 4 * self.slot
        self.ns = {kind: f"sd{self.slot}-{kind}" for kind in KINDS}
        self.root_address = f"10.58.{s}.1"  # the root namespace's end of the front's link (clients, OTLP receiver)
        self.hosts = {kind: f"10.58.{s + off}.2" for kind, (off, _) in _LINKS.items()}  # each service binds its own
        self.relay_host = f"10.58.{s + 2}.1"
        self.relays: list = []
        self._closed, self._old_term = True, None

    def __enter__(self) -> SplitTopology:
        self._closed = False
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_term = signal.signal(signal.SIGTERM, _exit_on_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        s, front = 4 * self.slot, self.ns["front"]
        for ns in self.ns.values():
            _ip("ip", "netns", "add", ns)
            _ip("ip", "-n", ns, "link", "set", "lo", "up")
        for kind, (off, letter) in _LINKS.items():  # veth: a = the front's side (root's for the front's own link)
            a, b = f"sd{self.slot}{letter}0", f"sd{self.slot}{letter}1"
            _ip("ip", "link", "add", a, "type", "veth", "peer", "name", b, "netns", self.ns[kind])
            if kind != "front":
                _ip("ip", "link", "set", a, "netns", front)
            side = [] if kind == "front" else ["-n", front]
            _ip("ip", *side, "addr", "add", f"10.58.{s + off}.1/24", "dev", a)
            _ip("ip", *side, "link", "set", a, "up")
            _ip("ip", "-n", self.ns[kind], "addr", "add", f"{self.hosts[kind]}/24", "dev", b)
            _ip("ip", "-n", self.ns[kind], "link", "set", b, "up")
            if kind == "draft" and self.bandwidth_mbit:
                burst = str(max(32768, int(self.bandwidth_mbit * 1e6 / 8 / 250)))  # >= a 4 ms tick of bytes
                for ns, dev in ((front, a), (self.ns["draft"], b)):
                    _ip("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                        f"{self.bandwidth_mbit}mbit", "burst", burst, "latency", "1s")
        _ip("ip", "netns", "exec", front, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        _ip("ip", "-n", front, "route", "add", "default", "via", self.root_address)
        _ip("ip", "-n", self.ns["target"], "route", "add", "default", "via", f"10.58.{s + 1}.1")
        _ip("ip", "route", "add", f"10.58.{s + 1}.0/24", "via", self.hosts["front"])
        _ip("ip", "route", "add", f"{self.relay_host}/32", "via", self.hosts["front"])

    def netns_exec(self, kind: str) -> list[str]:
        """argv prefix that runs a command in ``kind``'s namespace (``ip netns exec`` execs: the pid is the command's)."""
        return ["ip", "netns", "exec", self.ns[kind]]

    def prefix(self, kind: str) -> list[str]:
        """``netns_exec`` plus ``taskset -c CORES`` where ``pin`` names the kind."""
        cores = self.pin.get(kind)
        return self.netns_exec(kind) + (["taskset", "-c", str(cores)] if cores is not None else [])

    def env(self, kind: str) -> dict[str, str]:
        """Environment overrides: the draft's namespace reaches no OTLP receiver, so its exporter is off."""
        return {"OTEL_TRACES_EXPORTER": "none"} if kind == "draft" else {}

    def relay(self, upstream: str) -> str:
        """Start a delaying relay in the front's namespace to ``upstream`` ("host:port", the draft); its address."""
        argv = [*self.netns_exec("front"), sys.executable, "-m", "specdec.harness.topology", "relay",
                f"{self.relay_host}:0", upstream, str(self.rtt_ms)]
        self.relays.append(launch_command("relay", argv))
        return wait_ready(self.relays[-1], 30.0).address

    def measure_rtt(self, address: str, calls: int = 7) -> float:
        """Median ms of gRPC health checks on a ready channel to ``address`` (e.g. a relay's), from here."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=30 + self.rtt_ms / 100)
            stub, times = health_pb2_grpc.HealthStub(channel), []
            for _ in range(calls):
                began = time.perf_counter()
                stub.Check(health_pb2.HealthCheckRequest(), timeout=30 + self.rtt_ms / 100)
                times.append((time.perf_counter() - began) * 1e3)
        return statistics.median(times)

    def close(self) -> None:
        """Stop the relays and whatever still runs in the namespaces, delete them (their veths go with them)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
        for relay in self.relays:
            stop_service(relay, 5.0)
        for ns in self.ns.values():
            _kill_all(ns)
        s = 4 * self.slot
        for args in (["route", "del", f"10.58.{s + 1}.0/24"], ["route", "del", f"{self.relay_host}/32"],
                     ["link", "del", f"sd{self.slot}h0"], *(["netns", "del", ns] for ns in self.ns.values())):
            subprocess.run(["ip", *args], capture_output=True, check=False)


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds ``with`` blocks, then atexit


def _kill_all(ns: str) -> None:
    """SIGTERM the processes in namespace ``ns`` (all started through this topology), SIGKILL any left after 5 s."""
    def pids() -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout
        return [int(p) for p in out.split()]

    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        for pid in pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids() and time.monotonic() < deadline:
            time.sleep(0.05)


# ----------------------------------------------------------------------------------------- the relay

def _pump(src: socket.socket, dst: socket.socket, hold_s: float) -> None:
    """Copy src -> dst, each chunk released hold_s after it arrived, in order (a reader thread stamps and queues,
    this thread sleeps until each is due: time.sleep, finer than an event loop's millisecond timers); EOF passed
    on the same way. A full queue (256 chunks, ~ a socket buffer) stops the reading."""
    chunks: queue.Queue = queue.Queue(maxsize=256)

    def read() -> None:
        with contextlib.suppress(OSError):
            while chunk := src.recv(65536):
                chunks.put((time.monotonic() + hold_s, chunk))
        chunks.put((time.monotonic() + hold_s, b""))

    threading.Thread(target=read, daemon=True).start()
    with contextlib.suppress(OSError):  # a reset: the other direction ends as its peer closes
        while True:
            due, chunk = chunks.get()
            time.sleep(max(0.0, due - time.monotonic()))
            if not chunk:
                dst.shutdown(socket.SHUT_WR)
                return
            dst.sendall(chunk)


def _connection(client: socket.socket, upstream: tuple[str, int], hold_s: float) -> None:
    """One relayed connection: a pump per direction, so neither direction waits for the other."""
    with client, contextlib.suppress(OSError), socket.create_connection(upstream, timeout=30) as up:
        up.settimeout(None)
        for sock in (client, up):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        back = threading.Thread(target=_pump, args=(up, client, hold_s), daemon=True)
        back.start()
        _pump(client, up, hold_s)
        back.join()


def relay(listen: str, upstream: str, rtt_ms: float) -> None:
    """Serve until killed: each connection to ``listen`` ("host:port") relayed to ``upstream``, each direction
    holding its bytes for rtt_ms / 2. Prints ``relay ready on HOST:PORT`` once listening."""
    host, port = listen.rsplit(":", 1)
    up_host, up_port = upstream.rsplit(":", 1)
    server = socket.create_server((host, int(port)))
    print(f"relay ready on {host}:{server.getsockname()[1]}", flush=True)
    while True:
        client, _ = server.accept()
        threading.Thread(target=_connection, args=(client, (up_host, int(up_port)), rtt_ms / 2e3), daemon=True).start()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.harness.topology")
    sub = p.add_subparsers(dest="command", required=True)
    parser = sub.add_parser("relay", help="a delaying TCP relay: LISTEN host:port -> UPSTREAM host:port")
    parser.add_argument("listen")
    parser.add_argument("upstream")
    parser.add_argument("rtt_ms", type=float, help="round trip added (each direction holds rtt/2)")
    args = p.parse_args(argv)
    relay(args.listen, args.upstream, args.rtt_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
