"""One thread per service process does all the model's torch work (``specdec.model_worker``).

libgomp keeps an OpenMP team per thread that starts a parallel region; once two threads have one,
the process manages more OpenMP threads than CPUs and libgomp stops spinning between regions, which
slowed every target forward of the services (module docstring of specdec.model_worker). So the
services set the thread count, load the model and run every runtime call on the ModelWorker's one
thread, never on the main thread.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import threading
import time

import grpc
import pytest

from specdec.harness.servers import launch_command, stop_service, wait_ready
from specdec.model_worker import ModelWorker
from specdec.service_errors import ShuttingDownError
from specdec.v1 import target_pb2, target_pb2_grpc
from specdec.harness.tiny_pair import save_tiny_pair, write_config


# ----------------------------------------------------------------------------------------------
# ModelWorker
# ----------------------------------------------------------------------------------------------

def test_call_and_run_share_one_daemon_thread_in_submission_order():
    worker = ModelWorker("w")
    seen = []

    async def main():
        return await asyncio.gather(*(worker.run(lambda k=k: seen.append((k, threading.get_ident())) or k * k)
                                      for k in range(5)))

    try:
        first = worker.call(threading.get_ident)
        assert first != threading.get_ident()  # not the caller's thread
        assert asyncio.run(main()) == [0, 1, 4, 9, 16]
        assert [k for k, _ in seen] == [0, 1, 2, 3, 4]
        assert {ident for _, ident in seen} == {first}
        assert worker._thread.daemon and worker._thread.name == "w"
        with pytest.raises(ZeroDivisionError):
            worker.call(lambda: 1 / 0)
        assert worker.call(threading.get_ident) == first  # an error does not cost the thread
        with pytest.raises(RuntimeError, match="its own thread"):  # it would wait for itself
            worker.call(lambda: worker.call(int))
        assert worker.busy()
    finally:
        worker.close()
    assert not worker.busy()
    worker.submit(int)  # after close: nothing to run, no error


def test_close_finishes_the_running_call_drops_queued_ones_and_refuses_later_ones():
    worker = ModelWorker("w")
    started, ran = threading.Event(), []

    def slow():
        started.set()
        time.sleep(0.3)
        ran.append("slow")

    worker.submit(slow)
    worker.submit(ran.append, "queued")
    started.wait(5)
    worker.close()
    assert ran == ["slow"]  # the call in progress finished, the queued one never ran
    assert not worker._thread.is_alive()
    with pytest.raises(ShuttingDownError):
        worker.call(ran.append, "late")

    async def late():
        await worker.run(ran.append, "late")

    with pytest.raises(ShuttingDownError):
        asyncio.run(late())
    worker.close()  # idempotent
    assert ran == ["slow"]


def test_a_cancelled_run_that_has_not_started_never_runs():
    worker = ModelWorker("w")
    gate, ran = threading.Event(), []

    async def main():
        blocker = asyncio.ensure_future(worker.run(gate.wait, 5))
        victim = asyncio.ensure_future(worker.run(ran.append, "victim"))
        await asyncio.sleep(0.05)
        victim.cancel()
        await asyncio.sleep(0.05)  # the loop passes the cancel on to the worker's future before the gate opens
        gate.set()
        await blocker
        await worker.run(ran.append, "after")
        return victim.cancelled()

    try:
        assert asyncio.run(main())
        assert ran == ["after"]
    finally:
        worker.close()


# ----------------------------------------------------------------------------------------------
# The services: set-up, load and forwards on the worker's thread
# ----------------------------------------------------------------------------------------------

# Runs a service's real ``serve`` with its load, its servicer's worker and its runtime calls wrapped
# to record the thread each ran on; writes them as JSON to argv[3] when serve returns (SIGTERM).
RECORDER = textwrap.dedent("""
    import json, os, sys, threading
    sys.path.insert(0, os.getcwd())  # the checkout's root: launch_command runs this there
    import torch
    kind, config_path, out = sys.argv[1:4]
    seen = {"main": threading.get_ident(), "set_num_threads": [], "load": [], "worker": [], "runtime": []}

    def wrap(owner, name, key):
        original = getattr(owner, name)
        def wrapped(*args, **kwargs):
            seen[key].append(threading.get_ident())
            return original(*args, **kwargs)
        setattr(owner, name, wrapped)

    wrap(torch, "set_num_threads", "set_num_threads")
    if len(sys.argv) > 4:  # slow load: say so on stderr, then load for a long time
        import time
        import specdec.model_setup as setup
        def slow(*args, **kwargs):  # native torch work, the GIL released, as a real load's
            print("LOADING", file=sys.stderr, flush=True)
            a, end = torch.randn(256, 256), time.monotonic() + float(sys.argv[4])
            while time.monotonic() < end:
                a = torch.tanh(a @ a)
        setup.load_target = slow
    if kind == "target":
        import target_service.server as server
        from target_service.runtime import TargetRuntime as Runtime
        wrap(server, "load_target", "load")
        servicer, calls = server.TargetServicer, ("start", "verify", "verify_batch")
    else:
        import draft_service.server as server
        from draft_service.runtime import DraftRuntime as Runtime
        wrap(server, "load_draft", "load")
        servicer, calls = server.DraftServicer, ("start", "prefill", "propose", "propose_batch")
    for name in calls:
        wrap(Runtime, name, "runtime")
    init = servicer.__init__
    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen["worker"].append(self.worker.call(threading.get_ident))
    servicer.__init__ = recording_init
    from specdec.config import load_config
    code = server.serve(load_config(config_path, {}))
    json.dump(seen, open(out, "w"))
    sys.exit(code)
""")


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_a_service_loads_and_computes_on_its_model_worker_thread_only(kind, tmp_path):
    pair = save_tiny_pair(tmp_path / "models")
    config = write_config(tmp_path / "serve.yaml", pair, models={"threads": 2})
    script, out = tmp_path / "recorder.py", tmp_path / "seen.json"
    script.write_text(RECORDER)
    service = launch_command(kind, [sys.executable, str(script), kind, str(config), str(out)])
    try:
        wait_ready(service)
        if kind == "target":
            with grpc.insecure_channel(service.address) as channel:
                stub = target_pb2_grpc.TargetServiceStub(channel)
                stub.Prefill(target_pb2.PrefillRequest(session_id="s", prompt_ids=[5, 6, 7]), timeout=30)
                stub.Verify(target_pb2.VerifyRequest(session_id="s"), timeout=30)
        else:
            asyncio.run(_draft_round(service.address, pair))
    finally:
        code = stop_service(service)
    assert code == 0, service.stderr[-3000:]
    seen = json.loads(out.read_text())
    (worker,) = seen["worker"]
    assert worker != seen["main"]
    assert seen["set_num_threads"] and set(seen["set_num_threads"]) == {worker}
    assert seen["load"] and set(seen["load"]) == {worker}
    # the target's Prefill and Verify; the draft's start, prefill and proposal
    assert len(seen["runtime"]) >= 2 and set(seen["runtime"]) == {worker}


async def _draft_round(address: str, pair) -> None:
    """Open a draft session and take one proposal from it over gRPC."""
    from transformers import AutoConfig

    from orchestrator.loop.clients import DraftClient
    from specdec.sampling import GREEDY
    from specdec.tree_spec import TreeSpec

    async with grpc.aio.insecure_channel(address) as channel:
        draft = DraftClient(channel, AutoConfig.from_pretrained(pair.draft).vocab_size)
        await draft.start("s", [5, 6, 7], GREEDY)
        tree = await draft.propose("s", TreeSpec.chain(2), 2)
        assert tree.size == 2
        await draft.release("s")


def test_a_sigterm_while_the_target_loads_exits_zero_at_once(tmp_path):
    """The load runs on the worker's thread; a SIGTERM meanwhile ends the process with exit 0 without
    waiting for the load (here a 120 s one) and without an abort."""
    pair = save_tiny_pair(tmp_path / "models")
    config = write_config(tmp_path / "serve.yaml", pair)
    script, out = tmp_path / "recorder.py", tmp_path / "seen.json"
    script.write_text(RECORDER)
    service = launch_command("target", [sys.executable, str(script), "target", str(config), str(out), "120"])
    try:
        deadline = time.monotonic() + 60
        while "LOADING" not in service.stderr and service.returncode is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "LOADING" in service.stderr, service.stderr[-3000:]
        started = time.monotonic()
        code = stop_service(service, timeout_s=20)
        took = time.monotonic() - started
    finally:
        if service.returncode is None:
            service.proc.kill()
    assert code == 0 and took < 15, (code, took, service.stderr[-3000:])
    assert "SIGTERM while loading" in service.stderr
    assert "terminate called" not in service.stderr and "Fatal Python error" not in service.stderr

