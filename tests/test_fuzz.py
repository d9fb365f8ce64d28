"""The fuzzer of benchmarks/reliability_fuzz.py, short: a few hundred random and mutated messages against
real draft, target and front processes (tiny saved models, front without Ray, module fixture), checking
what the full run checks: only the allowed status codes, the servers stay up and log no traceback, no
session is leaked, greedy output unchanged. Plus the generator and the checker alone.
"""

from __future__ import annotations

import json
import math

import grpc
import pytest
from hypothesis import HealthCheck, find, settings

from benchmarks.reliability_fuzz import (Record, Shape, main, message_strategy, run_fuzz,
                                         spawned_services, summarize, token_tree)
from specdec.v1 import generation_pb2, generation_pb2_grpc, target_pb2, tree_pb2

MESSAGES = 250
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
    for rpc in ("Prefill", "Session", "Generate"):
        assert codes[rpc].get("OK", 0) + codes[rpc].get("CANCELLED", 0) > 0, (rpc, codes[rpc])
    assert codes["Verify"].get("FAILED_PRECONDITION", 0) > 0, codes["Verify"]  # unknown / unprefilled sessions
    assert sum(n for per in codes.values() for n in per.values()) + fuzzed["unsent_oversize"] == fuzzed["messages"]


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
    assert code == 0 and result["passed"] and result["seed"] == 3
    markdown = (tmp_path / "fuzz.md").read_text()
    assert "| only_allowed_codes | pass |" in markdown and "| Verify |" in markdown


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


def test_checker_counts_internal_and_transport_codes_as_faults():
    record = Record()
    record.add("Verify", grpc.StatusCode.INVALID_ARGUMENT, "tree.parents[0]: ...", "req")
    record.add("Verify", grpc.StatusCode.INTERNAL, "internal error: KeyError", "req")
    record.add("Commit", grpc.StatusCode.RESOURCE_EXHAUSTED, "Stream removed (received metadata size exceeds ...)", "req")
    record.add("Generate", grpc.StatusCode.CANCELLED, "", "req")  # not the fuzzer's own cancel: a fault
    assert record.fault_count == 3 and [f["code"] for f in record.faults] == ["INTERNAL", "RESOURCE_EXHAUSTED", "CANCELLED"]
    held = {"target_sessions": 1, "target_cached_tokens": 7, "draft_sessions": 0, "draft_cached_sessions": 0}
    result = summarize(Record(), 1, 1.0, 0, held, {"target": [1]}, {"target": [1]}, {})
    assert result["checks"]["no_sessions_leaked"] is False and result["passed"] is False
