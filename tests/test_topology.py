"""The split topology (specdec/harness/topology.py) on tiny models: front, target and draft each in a network
namespace of its own, the draft behind a delaying relay; each service reachable only on its own address, the
relay's round trip within 20% of the set one, greedy output through the front = the target alone, and
namespaces, links, relays and services removed afterwards (also when a service fails to start)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.harness.servers import ServiceNotReady, launch_command, launch_service, stop_service, wait_ready
from specdec.harness.tiny_pair import save_tiny_pair, write_config
from specdec.v1 import generation_pb2, generation_pb2_grpc
from tests.conftest import hf_greedy

if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
    pytest.skip("the split topology needs root and iproute2 (ip, tc) to make network namespaces",
                allow_module_level=True)

from specdec.harness.topology import SplitTopology

RTT_MS = 100.0
PIN = {"target": "0", "draft": "1"} if shutil.which("taskset") and {0, 1} <= os.sched_getaffinity(0) else None


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def connects(topo: SplitTopology, kind: str | None, address: str) -> bool:
    """Whether a TCP connection to ``address`` opens from ``kind``'s namespace (None: the root namespace)."""
    host, port = address.rsplit(":", 1)
    code = f"import socket; socket.create_connection(({host!r}, {port}), timeout=3).close()"
    prefix = topo.netns_exec(kind) if kind else []
    return subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, check=False).returncode == 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("models"), max_pos=512, noise=0.03)


@pytest.fixture(scope="module")
def split(pair, tmp_path_factory):
    """(topology, draft, target, relay address, front) on a 100 ms, 100 Mbit/s draft link; the draft is used
    every round (no cost-aware shaping: a 100 ms link would make it plain)."""
    config = write_config(tmp_path_factory.mktemp("cfg") / "serve.yaml", pair,
                          front={"port": 0, "cost_aware": {"enabled": False}})
    with SplitTopology(RTT_MS, 100, PIN) as topo:
        services = {kind: launch_service(kind, config, env=topo.env(kind), prefix=topo.prefix(kind),
                                         host=topo.hosts[kind]) for kind in ("draft", "target")}
        draft, target = (wait_ready(services[kind]) for kind in ("draft", "target"))
        relay = topo.relay(draft.address)
        front = wait_ready(launch_service("front", config, prefix=topo.prefix("front"), host=topo.hosts["front"],
                                          draft_address=relay, target_address=target.address, no_ray=True))
        yield topo, draft, target, relay, front
        for service in (front, draft, target):
            stop_service(service)


def test_three_namespaces_each_service_on_its_own_address(split):
    topo, draft, target, relay, front = split
    listed = namespaces()
    assert all(topo.ns[kind] in listed for kind in ("front", "target", "draft"))
    for kind, service in (("draft", draft), ("target", target), ("front", front)):
        assert service.host == topo.hosts[kind] and not service.host.startswith("127.")
        assert connects(topo, kind, service.address)
        assert not connects(topo, kind, f"127.0.0.1:{service.port}"), f"{kind} listens on loopback too"
    # the draft only through the relay: not from the root namespace, nor from the target's
    assert not connects(topo, None, draft.address) and not connects(topo, "target", draft.address)
    assert connects(topo, None, relay) and connects(topo, "front", relay)
    assert connects(topo, None, front.address) and connects(topo, "front", target.address)
    assert not connects(topo, "draft", target.address) and not connects(topo, "draft", front.address)
    if PIN:
        assert os.sched_getaffinity(draft.proc.pid) == {1} and os.sched_getaffinity(target.proc.pid) == {0}


def test_relay_round_trip_is_the_set_one(split):
    topo, _, _, relay, _ = split
    measured = topo.measure_rtt(relay)
    assert abs(measured - RTT_MS) <= 0.2 * RTT_MS, f"{measured:.1f} ms through the relay, set {RTT_MS} ms"


def test_greedy_through_the_split_front_equals_the_target_alone(split, pair):
    front = split[4]
    ids = torch.randint(1, 250, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    with grpc.insecure_channel(front.address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        replies = list(stub.Generate(generation_pb2.GenerateRequest(prompt_ids=ids, max_new_tokens=16,
                                                                    ignore_eos=True), timeout=120))
    tokens = [t for r in replies for t in r.token_ids]
    stats = [r.stats for r in replies if r.HasField("stats")][-1]
    target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    assert tokens == hf_greedy(target, ids, 16)
    assert stats.proposed_tokens > 0 and stats.fallback_rounds == 0, "the draft behind the relay was not used"


ECHO = """import socket, sys, threading
server = socket.create_server((sys.argv[1], 0))
print(f"echo ready on {sys.argv[1]}:{server.getsockname()[1]}", flush=True)
def serve(conn):
    while data := conn.recv(65536):
        conn.sendall(data)
    conn.close()
while True:
    threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()
"""


def test_relay_tcp_round_trip_and_bandwidth():
    """Through the relay to an echo server in the draft's namespace: a 1-byte ping-pong takes the set 20 ms; 1 MB
    there and back on an 8 Mbit/s link takes ~1 s (both directions shaped, in flight together)."""
    with SplitTopology(20, 8) as topo:
        echo = wait_ready(launch_command("echo", [*topo.netns_exec("draft"), sys.executable, "-c", ECHO,
                                                  topo.hosts["draft"]]), 30)
        host, port = topo.relay(echo.address).rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pings = []
            for _ in range(7):
                began = time.perf_counter()
                conn.sendall(b"x")
                assert conn.recv(1) == b"x"
                pings.append((time.perf_counter() - began) * 1e3)
            payload, got = os.urandom(1 << 20), bytearray()
            began = time.perf_counter()
            sender = threading.Thread(target=conn.sendall, args=(payload,))
            sender.start()
            while len(got) < len(payload):
                got += conn.recv(1 << 16)
            took = time.perf_counter() - began
            sender.join()
    assert abs(statistics.median(pings) - 20) <= 4, pings
    assert bytes(got) == payload
    assert 0.8 <= took / (len(payload) * 8 / 8e6) <= 1.6, f"1 MB there and back in {took:.2f} s at 8 Mbit/s"


def test_everything_removed_after_the_topology(pair, tmp_path):
    config = write_config(tmp_path / "serve.yaml", pair)
    with SplitTopology(30, None) as topo:
        draft = wait_ready(launch_service("draft", config, prefix=topo.prefix("draft"), host=topo.hosts["draft"]))
        topo.relay(draft.address)
        pids = [draft.proc.pid, topo.relays[0].proc.pid]
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
        assert f"sd{topo.slot}h0" in links
    # the draft was left running: the topology stops what runs in its namespaces
    assert not any(alive(pid) for pid in pids)
    assert not any(ns in namespaces() for ns in topo.ns.values())
    assert f"sd{topo.slot}h0" not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    assert topo.relay_host not in subprocess.run(["ip", "route"], capture_output=True, text=True, check=False).stdout


def test_everything_removed_when_a_service_fails_to_start(pair, tmp_path):
    bad = write_config(tmp_path / "bad.yaml", pair, draft={"max_sessions": -1})
    with pytest.raises(ServiceNotReady), SplitTopology(30, 10) as topo:
        wait_ready(launch_service("draft", bad, prefix=topo.prefix("draft"), host=topo.hosts["draft"]), 60)
    assert not any(ns in namespaces() for ns in topo.ns.values())
    assert f"sd{topo.slot}" not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout


def test_serving_bench_topology_flags(capsys):
    from benchmarks.serving import parse_args

    for argv, flag in ((["--rtt-ms", "30"], "--rtt-ms"), (["--bandwidth-mbit", "10"], "--bandwidth-mbit"),
                       (["--topology", "split", "--rtt-ms", "0,30"], "--rtt-ms"),
                       (["--topology", "split", "--rtt-ms", "fast"], "--rtt-ms"), (["--topology", "mesh"], "--topology")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert flag in capsys.readouterr().err
    args = parse_args(["--topology", "split"])
    assert (args.rtt_ms, args.bandwidth_mbit, args.pin, args.target_threads) == ([0.2, 30.0, 300.0], 100.0, True, 1)
    assert parse_args([]).topology == "local"


def test_serving_bench_on_split_topologies(pair, tmp_path):
    """benchmarks/serving.py --topology split: a topology per round trip, its rows (target_only too) carrying it,
    the measured round trip in the meta, outputs identical, nothing left."""
    before = set(namespaces().splitlines())
    argv = [sys.executable, "benchmarks/serving.py", "--target", str(pair.target), "--draft", str(pair.draft),
            "--prompts", "2", "--max-new-tokens", "6", "--max-prompt-tokens", "120", "--sections", "concurrency",
            "--levels", "1", "--topology", "split", "--rtt-ms", "0.2,50", "--bandwidth-mbit", "50", "--out", str(tmp_path)]
    proc = subprocess.run(argv, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "serving.json").read_text())
    topology = result["meta"]["topology"]
    assert topology["kind"] == "split" and topology["rtt_ms"] == [0.2, 50.0] and topology["bandwidth_mbit"] == 50.0
    assert abs(topology["measured_rtt_ms"][1] - 50) <= 10 and topology["measured_rtt_ms"][0] < 25
    rows = result["concurrency"]["rows"]
    assert sorted((r["rtt_ms"], r["config"]) for r in rows) == [(0.2, "batched"), (0.2, "target_only"),
                                                                 (50.0, "batched"), (50.0, "target_only")]
    assert result["concurrency"]["identical_outputs"]
    affinity = result["meta"]["pinning"]["affinity"]
    assert {name for name in affinity if "draft" in name} == {"bench-draft@0.2ms", "bench-draft@50ms"}
    assert all(cpus == [1] for name, cpus in affinity.items() if "draft" in name)
    assert "| RTT ms |" in (tmp_path / "serving.md").read_text()
    assert set(namespaces().splitlines()) <= before
