"""The fuzzer of benchmarks/reliability_fuzz.py, short: a few hundred random and mutated messages, and a few
dozen stateful sequences (open, verify, replay, commit, release, reuse; Generate, its id again, Abort, reuse;
draft streams), against real draft, target and front processes (tiny saved models, front without Ray, module
fixture), checking what the full runs check: only the allowed status codes among the servers' answers (the
calls that ended on the client's side counted apart), every stateful answer as the model says, the servers stay
up and log no traceback, no session is leaked, greedy output unchanged. Plus the generator and the checker alone
(against a real in-process gRPC server for where a status came from).
"""

from __future__ import annotations

import json
import math
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, find, settings

from benchmarks.reliability_fuzz import (Fuzzer, Record, Shape, Slot, Stateful, main, message_strategy,
                                         origin, run_fuzz, spawned_services, summarize, token_tree)
from specdec.v1 import generation_pb2, generation_pb2_grpc, target_pb2, tree_pb2

MESSAGES = 250
SEQUENCES = 40
FIND = settings(database=None, max_examples=2000, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with spawned_services(tmp_path_factory.mktemp("fuzz")) as (addresses, services):
        yield addresses, services
    codes = {name: s.returncode for name, s in services.items()}
    assert codes == dict.fromkeys(services, 0), {n: s.stderr[-2000:] for n, s in services.items()}
    for name, service in services.items():  # every fuzzed call was answered with a status, none crashed
        assert "Traceback" not in service.stderr, (name, service.stderr[-4000:])


@pytest.fixture(scope="module")
def fuzzed(deployment):
    addresses, services = deployment
    return run_fuzz(addresses, MESSAGES, seed=0, alive=lambda: {n: s.returncode is None for n, s in services.items()})


@pytest.fixture(scope="module")
def stateful(deployment, fuzzed):  # after the random run: both share the module's servers
    addresses, services = deployment
    return run_fuzz(addresses, SEQUENCES, seed=0, stateful=True,
                    alive=lambda: {n: s.returncode is None for n, s in services.items()})


def test_fuzz_gets_only_allowed_codes_and_leaves_the_servers_as_they_were(fuzzed):
    assert fuzzed["faults"] == 0, fuzzed["fault_examples"]
    assert fuzzed["processes_alive"] == {"draft": True, "target": True, "front": True}
    assert fuzzed["sessions_after"] == {"target_sessions": 0, "target_cached_tokens": 0, "draft_sessions": 0,
                                        "draft_cached_sessions": 0}
    assert fuzzed["greedy_after"] == fuzzed["greedy_before"]
    assert len(fuzzed["greedy_after"]["front"]) == len(fuzzed["greedy_after"]["target"]) == 12
    assert fuzzed["passed"] and fuzzed["messages"] >= MESSAGES


def test_fuzz_reached_every_rpc_both_accepted_and_refused(fuzzed):
    codes = fuzzed["codes_per_rpc"]
    assert set(codes) == {"Prefill", "Verify", "VerifyBatch", "Commit", "Release", "TargetInfo", "DraftInfo",
                          "Session", "Generate", "Abort"}
    for rpc in ("Prefill", "Verify", "VerifyBatch", "Session", "Generate"):
        assert codes[rpc].get("INVALID_ARGUMENT", 0) > 0, (rpc, codes[rpc])
    # Accepted calls: a fuzzed Verify succeeds only on a session some earlier fuzzed Prefill opened and
    # nothing released (about 1 in 100 in the 10,000-message run), too rare for this short run to
    # promise; the well-formed Prefill / Verify / Commit after the run (greedy_after) covers them.
    for rpc in ("Prefill", "Session"):
        assert codes[rpc].get("OK", 0) > 0, (rpc, codes[rpc])
    # a Generate the fuzzer cancelled after a reply was accepted too; its CANCELLED is no server answer
    own = fuzzed["client_side_per_rpc"].get("Generate", {})
    assert codes["Generate"].get("OK", 0) + own.get("own_cancel", 0) > 0, (codes["Generate"], own)
    assert "CANCELLED" not in codes["Generate"], codes["Generate"]
    assert codes["Verify"].get("FAILED_PRECONDITION", 0) > 0, codes["Verify"]  # unknown / unprefilled sessions
    answered = sum(n for per in codes.values() for n in per.values())
    assert answered == fuzzed["server_answers"] and answered + fuzzed["client_side"] == fuzzed["messages"]


def test_stateful_sequences_get_the_answers_the_model_expects(stateful):
    assert stateful["violations"] == 0 and stateful["faults"] == 0, stateful["fault_examples"]
    assert stateful["sequences"] >= SEQUENCES and stateful["steps"] >= 2 * SEQUENCES  # hypothesis may run a few more
    assert set(stateful["ops"]) == set(Stateful.OPS), stateful["ops"]
    codes = stateful["codes_per_rpc"]
    # every path of the model was taken: opened, reopened after a release (OK) and twice (ALREADY_EXISTS); verified,
    # replayed, refused (unknown session / another tree pending); committed and refused; the id of a running
    # Generate sent again; draft streams to their end and cut by a misplaced message
    assert {"OK", "ALREADY_EXISTS", "INVALID_ARGUMENT"} <= set(codes["Prefill"]), codes["Prefill"]
    assert {"OK", "FAILED_PRECONDITION", "INVALID_ARGUMENT"} <= set(codes["Verify"]), codes["Verify"]
    assert {"OK", "FAILED_PRECONDITION", "INVALID_ARGUMENT"} <= set(codes["Commit"]), codes["Commit"]
    assert {"OK", "ALREADY_EXISTS"} <= set(codes["Generate"]) and {"OK", "INVALID_ARGUMENT"} <= set(codes["Session"])
    assert stateful["cross_checked"]["greedy"] > 0 and stateful["cross_checked"]["draft"] > 0, stateful["cross_checked"]
    assert stateful["checks"]["answers_as_modelled"] is True
    assert stateful["sessions_after"] == dict.fromkeys(stateful["sessions_after"], 0)
    assert stateful["greedy_after"] == stateful["greedy_before"] and stateful["passed"]


def test_stateful_model_flags_answers_it_did_not_expect(deployment):
    """The checks can fail: a Verify of a session the model wrongly thinks open, and greedy tokens unlike
    those seen before on the same context, are violations (faults) of a real server's answers."""
    addresses, _ = deployment
    fuzzer = Fuzzer(addresses, Shape(vocab=300, context_limit=256, max_tree_nodes=64), pool=["unused"])
    try:
        machine = Stateful(fuzzer)
        slot = Slot("st-never-opened", open=True, context=(5, 6))
        assert machine._verify_expect(slot, tree_pb2.TokenTree()) is grpc.StatusCode.OK
        request = target_pb2.VerifyRequest(session_id=slot.sid, tree=tree_pb2.TokenTree())
        assert fuzzer.call("Verify", fuzzer.target.Verify, request, {grpc.StatusCode.OK}) is None
        machine._learn((5, 6), (7, 8), "Verify", request)
        machine._learn((5, 6), (7, 8, 9), "Verify", request)  # agrees: no violation, the longer kept
        machine._learn((5, 6), (7, 9), "Verify", request)
    finally:
        fuzzer.close()
    record = fuzzer.record
    assert record.violations == 2 and record.fault_count == 2 and machine.known[(5, 6)] == (7, 8, 9)
    assert [f["code"] for f in record.faults] == ["MODEL", "MODEL"]
    assert record.faults[0]["details"].startswith("FAILED_PRECONDITION where the model expects ['OK']")
    assert record.codes[("Verify", "FAILED_PRECONDITION")] == 1  # still counted as the server's answer


def test_a_huge_request_id_is_refused_at_once_naming_the_field(deployment):
    """A 70,000-character id was once served and echoed in every chunk (issue 57); now request_id is bounded
    (orchestrator.serving.requests.check_call) and the refusal quotes none of it."""
    addresses, _ = deployment
    request = generation_pb2.GenerateRequest(request_id="r" * 70_000, prompt_ids=[1, 2], max_new_tokens=200,
                                             ignore_eos=True)
    with grpc.insecure_channel(addresses.front) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith("request_id: 1 to 128 characters") and len(info.value.details()) < 200


def test_cli_on_a_running_deployment_writes_json_and_markdown(deployment, tmp_path):
    addresses, _ = deployment
    code = main(["--messages", "30", "--seed", "3", "--out", str(tmp_path), "--front", addresses.front,
                 "--draft", addresses.draft, "--target", addresses.target])
    result = json.loads((tmp_path / "fuzz.json").read_text())
    assert code == 0 and result["passed"] and result["seed"] == 3 and result["machine"]["cpu_model"]
    markdown = (tmp_path / "fuzz.md").read_text()
    assert "| only_allowed_codes | pass |" in markdown
    assert len(result["codes_per_rpc"]) >= 3  # every RPC answered has its row (which ones: the seed's draw)
    for rpc, codes in result["codes_per_rpc"].items():
        assert any(line.startswith(f"| {rpc} |") and all(f"| {n} |" in line + " |" for n in codes.values())
                   for line in markdown.splitlines()), rpc
    assert result["machine"]["cpu_model"] in markdown
    code = main(["--stateful", "--messages", "3", "--out", str(tmp_path), "--front", addresses.front,
                 "--draft", addresses.draft, "--target", addresses.target])
    result = json.loads((tmp_path / "fuzz_stateful.json").read_text())
    assert code == 0 and result["mode"] == "stateful" and result["sequences"] == 3
    assert "| answers_as_modelled | pass |" in (tmp_path / "fuzz_stateful.md").read_text()


def test_descriptor_strategy_reaches_nan_huge_repeats_and_nested_messages():
    trees = message_strategy(tree_pb2.TokenTree.DESCRIPTOR)
    assert math.isnan(find(trees, lambda t: any(math.isnan(x) for x in t.draft_logprobs), settings=FIND).draft_logprobs[0])
    assert len(find(trees, lambda t: len(t.tokens) > 8, settings=FIND).tokens) == 129  # the smallest "huge" repeat
    nested = find(message_strategy(target_pb2.VerifyBatchRequest.DESCRIPTOR),
                  lambda m: any(len(item.tree.proposals) for item in m.items), settings=FIND)
    assert isinstance(nested.items[0], target_pb2.VerifyRequest)


def test_mutated_trees_include_cycles_and_ids_outside_the_vocabulary():
    shape = Shape(vocab=300, context_limit=256, max_tree_nodes=64)
    cycle = find(token_tree(shape), lambda t: any(p >= i for i, p in enumerate(t.parents)), settings=FIND)
    assert any(p >= i for i, p in enumerate(cycle.parents))
    assert 300 in find(token_tree(shape), lambda t: 300 in t.tokens, settings=FIND).tokens


def test_checker_counts_internal_and_transport_codes_as_faults_and_own_ends_apart():
    record = Record()
    record.add("Verify", grpc.StatusCode.INVALID_ARGUMENT, "tree.parents[0]: ...", "req")
    record.add("Verify", grpc.StatusCode.INTERNAL, "internal error: KeyError", "req")
    record.add("Commit", grpc.StatusCode.RESOURCE_EXHAUSTED, "Stream removed (received metadata size exceeds ...)", "req")
    record.add("Generate", grpc.StatusCode.CANCELLED, "", "req")  # not the fuzzer's own cancel: a fault
    record.add("Generate", grpc.StatusCode.CANCELLED, "Locally cancelled by application!", "req", own_cancel=True)
    record.add("VerifyBatch", grpc.StatusCode.RESOURCE_EXHAUSTED, "CLIENT: Sent message larger than max (5 vs. 4)", "req")
    record.add("Prefill", grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", "req")  # no answer in time: a fault
    assert record.fault_count == 4 and [f["code"] for f in record.faults] == [
        "INTERNAL", "RESOURCE_EXHAUSTED", "CANCELLED", "DEADLINE_EXCEEDED"]
    assert record.codes == {("Verify", "INVALID_ARGUMENT"): 1, ("Verify", "INTERNAL"): 1, ("Generate", "CANCELLED"): 1}
    assert record.client_side == {("Commit", "transport"): 1, ("Generate", "own_cancel"): 1,
                                  ("VerifyBatch", "client_refused"): 1, ("Prefill", "no_answer"): 1}
    held = {"target_sessions": 1, "target_cached_tokens": 7, "draft_sessions": 0, "draft_cached_sessions": 0}
    result = summarize(Record(), 1, 1.0, 0, held, {"target": [1]}, {"target": [1]}, {})
    assert result["checks"]["no_sessions_leaked"] is False and result["passed"] is False


class _Health(health_pb2_grpc.HealthServicer):
    def Check(self, request, context):
        if request.service == "slow":
            time.sleep(1.0)
        elif request.service:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"service: {request.service}")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    def Watch(self, request, context):
        for _ in range(50):
            yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
            time.sleep(0.05)


def test_origin_tells_a_server_answer_from_what_the_client_side_ended():
    """Against a real in-process gRPC server: its INVALID_ARGUMENT is an answer; our deadline passing, a message
    our channel refused to send and our own cancel are not (the old fuzz record counted the refusal as one)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(_Health(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ends = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 100)]) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service, timeout in (("bad", 5.0), ("slow", 0.2), ("x" * 200, 5.0)):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
                ends.append(origin(info.value.code(), info.value.details() or ""))
            call = stub.Watch(health_pb2.HealthCheckRequest(), timeout=5.0)
            next(call)
            call.cancel()
            with pytest.raises(grpc.RpcError) as info:
                next(call)
            ends.append(origin(info.value.code(), info.value.details() or "", own_cancel=True))
    finally:
        server.stop(None)
    assert ends == [None, "no_answer", "client_refused", "own_cancel"]
