"""Tensor-parallel target (target_service.tp): 2 ranks, gloo, CPU, a tiny float32 Qwen2 saved to disk
(4 attention heads, 2 kv heads: 2 heads and 1 kv head per rank).

- tree logits of random trees equal the unsharded TargetRuntime's within 1e-4;
- greedy speculative generation through the sharded target equals the target alone (transformers
  ``generate``), with real acceptance (perturbed draft), and after every commit each rank's KV
  equals its heads of a fresh prefill of the committed tokens;
- sampled seeded generation (both tree types) equals the unsharded seeded run token for token, and
  the ranks' own acceptance decisions agreed with rank 0's; when rank 1 is made to draw other random
  numbers, rank 0's broadcast decision still wins (same tokens, same KV on every rank);
- ``verify_batch`` (any TargetRuntime method) is mirrored on every rank;
- ordinary errors pass through and leave the ranks usable; bad ``tp`` values are refused;
- pre-packed local shards (the CPU service's fast path) on a model with tied embeddings match too;
- a SIGKILLed rank, or a rank stuck (SIGSTOP) inside a collective, gives RankFailureError within a
  deadline, never a hang, and every later call fails fast.

Each TensorParallelTarget spawns its ranks (~10 s on the 2-core machine): one shared target for the
equality tests, one for the killed rank, one for pre-packed shards followed by the stuck rank.

The target service with ``--tp 2`` (real subprocesses, tiny saved pair of specdec/harness/tiny_pair.py; both
entry points, started together, ~15 s): ``python -m target_service`` serves a greedy
speculative generation over gRPC equal to the target alone, Info reports tensor_parallel 2, then a
SIGKILLed rank makes the next Verify UNAVAILABLE within a deadline, health turns NOT_SERVING and
SIGTERM still exits 0; ``specdec target-server --tp 2`` (spawn from the console script) verifies
and on SIGTERM exits 0 leaving no rank behind. Bad ``--tp`` / ``--device`` values exit 2 naming the
field, no traceback.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from draft_service.runtime import DraftRuntime
from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.engine import SpeculativeEngine
from specdec.harness.servers import Service, launch_command, stop_service, wait_for_exit, wait_ready
from specdec.interfaces import UnknownSessionError
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, MalformedTreeError
from specdec.tree_spec import SEED_SPEC, TreeSpec
from target_service.runtime import SessionStateError, TargetRuntime
from target_service.tp import RankFailureError, TensorParallelTarget, check_tp_compatible
from specdec.kv_budget import free_memory_bytes
from tests.conftest import (
    assert_kv_equal, forbid_cuda, cache_kv, causal_logits, hf_greedy, perturbed_copy, prefill_kv, random_prompt, tiny_model,
)
from specdec.harness.tiny_pair import save_tiny_pair, write_config

ROOT = Path(__file__).resolve().parents[1]  # the repository root
TP = 2
N_NEW = 24
CONTEXT = 256
FAILURE_DEADLINE_S = 20.0


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=0)


@pytest.fixture(scope="module")
def model_dir(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tp_target(model_dir):
    with pytest.MonkeyPatch.context() as patch:
        forbid_cuda(patch)  # CUDA "available" but never touched: CPU ranks still take gloo, the coordinator no context
        target = TensorParallelTarget(model_dir, tp=TP, threads_per_rank=1, collective_timeout_s=10, call_timeout_s=60)
    yield target
    target.close()


def test_cpu_ranks_report_their_device_and_memory_and_send_cpu_tensors(tp_target, monkeypatch):
    assert (tp_target.backend, tp_target.device) == ("gloo", "cpu")
    assert tp_target.free_kv_bytes == pytest.approx(free_memory_bytes("cpu"), rel=0.2)  # shared host memory, not x2
    forbid_cuda(monkeypatch)
    tp_target.start("dev", [1, 2, 3])
    logits = tp_target.tree_logits("dev", DraftTree((4, 5), (-1, 0)))
    tp_target.release("dev")
    assert type(logits) is torch.Tensor and logits.device.type == "cpu" and logits.shape[0] == 3


def random_tree(gen: torch.Generator, nodes: int, vocab: int) -> DraftTree:
    """A random tree of ``nodes`` nodes (random parents, breadth-first order is not required)."""
    tokens = torch.randint(0, vocab, (nodes,), generator=gen).tolist()
    parents = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(nodes)]
    return DraftTree(tuple(tokens), tuple(parents))


def _session_kv(runtime, rank, session_id):
    """This rank's KV of a session (runs on the ranks): per layer (keys, values), each (1, H / P, S, D)."""
    return cache_kv(runtime.sessions[session_id].cache)


def _session_ids(runtime, rank):
    """The sessions this rank holds (runs on the ranks)."""
    return sorted(runtime.sessions)


def assert_shards_match_prefill(target: TensorParallelTarget, session_id: str, committed: list[int], model) -> None:
    """Each rank's KV = its kv heads of a fresh causal prefill of all committed tokens but the root."""
    expected = prefill_kv(model, committed[:-1])  # per layer (1, H, L, D)
    shards = target.on_ranks(_session_kv, session_id)
    assert len(shards) == TP
    per_rank = model.config.num_key_value_heads // TP
    for rank, kv in enumerate(shards):
        heads = slice(rank * per_rank, (rank + 1) * per_rank)
        want = [(k[:, heads], v[:, heads]) for k, v in expected]
        assert_kv_equal(kv, want, atol=1e-4, rtol=1e-4, what=f"rank {rank} after {len(committed)} committed tokens")


class CheckedTarget:
    """Forwards to a TensorParallelTarget; after every commit checks each rank's KV against a prefill."""

    def __init__(self, target, model):
        self.target, self.model = target, model
        self.committed: dict[str, list[int]] = {}
        self.pending = {}
        self.checks = 0

    def start(self, session_id, prompt_ids, sampling):
        self.committed[session_id] = list(prompt_ids)
        self.target.start(session_id, prompt_ids, sampling)

    def verify(self, session_id, tree):
        self.pending[session_id] = self.target.verify(session_id, tree)
        return self.pending[session_id]

    def commit(self, session_id, num_tokens):
        self.target.commit(session_id, num_tokens)
        self.committed[session_id].extend(self.pending.pop(session_id).tokens[:num_tokens])
        assert_shards_match_prefill(self.target, session_id, self.committed[session_id], self.model)
        self.checks += 1

    def release(self, session_id):
        self.target.release(session_id)


# ------------------------------------------------------------------------------------------------
# Equality with the unsharded target
# ------------------------------------------------------------------------------------------------

def test_tree_logits_match_unsharded(tp_target, model):
    reference = TargetRuntime(model)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for case, nodes in enumerate([0, 1, 3, 8, 17, 32]):
        prompt = random_prompt(seed=100 + case, length=2 + 3 * case)
        tree = random_tree(gen, nodes, vocab)
        sid = f"logits-{case}"
        tp_target.start(sid, prompt)
        reference.start(sid, prompt)
        got = tp_target.tree_logits(sid, tree)
        want = reference.tree_logits(sid, tree)
        assert got.shape == want.shape == (nodes + 1, vocab)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=lambda m: f"{nodes} nodes: {m}")
        tp_target.release(sid)
    assert tp_target.on_ranks(_session_ids) == [[]] * TP


@pytest.mark.parametrize("spec", [TreeSpec.chain(4), SEED_SPEC], ids=["chain4", "seed"])
def test_greedy_generation_equals_target_only(tp_target, model, spec):
    prompt = random_prompt(seed=7, length=6)
    checked = CheckedTarget(tp_target, model)
    draft = DraftRuntime(perturbed_copy(model, seed=3, scale=0.05))
    engine = SpeculativeEngine(checked, draft, eos_token_ids=[], context_limit=CONTEXT)
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=N_NEW, spec=spec))
    assert out.tokens == hf_greedy(model, prompt, N_NEW)
    assert out.stats.accepted_tokens > 0, "the draft never agreed: the test would not exercise acceptance"
    assert out.stats.rounds < N_NEW  # some rounds committed several tokens (compaction of accepted paths)
    assert checked.checks == out.stats.rounds
    assert tp_target.on_ranks(_session_ids) == [[]] * TP


@pytest.mark.parametrize("tree_type", [0, 1])
def test_sampled_seeded_generation_equals_unsharded(tp_target, model, tree_type):
    spec = SEED_SPEC.model_copy(update={"tree_type": tree_type})
    draft_model = perturbed_copy(model, seed=3, scale=0.05)
    request = GenerationRequest([5, 17, 42, 9], N_NEW, spec=spec,
                                sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=7))
    before = tp_target.stats()["decision_mismatches"]
    sharded = SpeculativeEngine(tp_target, DraftRuntime(draft_model), eos_token_ids=[], context_limit=CONTEXT)
    plain = SpeculativeEngine(TargetRuntime(model), DraftRuntime(draft_model), eos_token_ids=[], context_limit=CONTEXT)
    got = sharded.generate(request)
    want = plain.generate(request)
    assert got.tokens == want.tokens
    assert got.stats.accepted_tokens == want.stats.accepted_tokens > 0
    # Rank 1's own decisions (same logits up to the all-reduce, same seeded draws) agreed with rank 0's.
    assert tp_target.stats()["decision_mismatches"] == before


def _reseed_rank1(runtime, rank, session_id):
    """Give rank 1's copy of a session other random draws than rank 0's (runs on the ranks)."""
    if rank == 1:
        runtime.sessions[session_id].rng = np.random.default_rng(12345)


class Rank1Reseeded:
    """Forwards to a TensorParallelTarget; right after each start, rank 1 draws from another stream."""

    def __init__(self, target):
        self.target = target

    def start(self, session_id, prompt_ids, sampling):
        self.target.start(session_id, prompt_ids, sampling)
        self.target.on_ranks(_reseed_rank1, session_id)

    def __getattr__(self, name):
        return getattr(self.target, name)


def test_rank0_decision_wins_when_a_rank_draws_differently(tp_target, model):
    """Rank 1 samples with other random numbers, so its own acceptance decisions differ; the
    broadcast of rank 0's decision (and generator state) keeps the output and every rank's KV exactly
    those of the unsharded run."""
    spec = SEED_SPEC.model_copy(update={"tree_type": 1})
    draft_model = perturbed_copy(model, seed=3, scale=0.05)
    request = GenerationRequest([8, 6, 7, 5], N_NEW, spec=spec, sampling=SamplingParams(temperature=1.0, seed=11))
    before = tp_target.stats()["decision_mismatches"][1]
    checked = CheckedTarget(Rank1Reseeded(tp_target), model)
    got = SpeculativeEngine(checked, DraftRuntime(draft_model), eos_token_ids=[], context_limit=CONTEXT).generate(request)
    want = SpeculativeEngine(TargetRuntime(model), DraftRuntime(draft_model), eos_token_ids=[],
                             context_limit=CONTEXT).generate(request)
    assert got.tokens == want.tokens
    assert tp_target.stats()["decision_mismatches"][1] > before  # rank 1 really decided differently
    assert checked.checks == got.stats.rounds  # and its KV still matched a fresh prefill every round


def test_unseeded_sampling_keeps_ranks_in_step(tp_target, model):
    """No seed: one random seed is drawn for the session and shared by the ranks (no divergence)."""
    before = tp_target.stats()["decision_mismatches"]
    engine = SpeculativeEngine(tp_target, DraftRuntime(perturbed_copy(model, seed=3, scale=0.05)),
                               eos_token_ids=[], context_limit=CONTEXT)
    out = engine.generate(GenerationRequest([3, 1, 4], 12, spec=SEED_SPEC, sampling=SamplingParams(temperature=1.0)))
    assert len(out.tokens) == 12
    assert tp_target.stats()["decision_mismatches"] == before


@pytest.mark.skipif(not hasattr(TargetRuntime, "verify_batch"), reason="TargetRuntime has no verify_batch")
def test_verify_batch_is_mirrored(tp_target, model):
    reference = TargetRuntime(model)
    gen = torch.Generator().manual_seed(1)
    prompts = {"b0": random_prompt(seed=11, length=5), "b1": random_prompt(seed=12, length=9)}
    trees = {"b0": random_tree(gen, 6, 64), "b1": random_tree(gen, 2, 64)}
    for sid, prompt in prompts.items():
        tp_target.start(sid, prompt)
        reference.start(sid, prompt)
    items = [("b0", trees["b0"]), ("nope", trees["b1"]), ("b1", trees["b1"])]
    got = tp_target.verify_batch(items)
    want = reference.verify_batch(items)
    assert got[0] == want[0] and got[2] == want[2]
    assert isinstance(got[1], UnknownSessionError)
    for sid, result in (("b0", got[0]), ("b1", got[2])):
        tp_target.commit(sid, len(result.tokens))
        assert_shards_match_prefill(tp_target, sid, prompts[sid] + list(result.tokens), model)
        tp_target.release(sid)


def test_errors_pass_through_and_ranks_stay_usable(tp_target, model):
    tree = DraftTree((1, 2), (-1, 0))
    with pytest.raises(UnknownSessionError):
        tp_target.verify("missing", tree)
    tp_target.start("e", [1, 2, 3])
    with pytest.raises(MalformedTreeError):
        tp_target.verify("e", DraftTree((999,), (-1,)))  # token id outside the vocabulary
    with pytest.raises(SessionStateError):
        tp_target.commit("e", 1)  # no pending verify
    result = tp_target.verify("e", tree)
    with pytest.raises(SessionStateError):
        tp_target.verify("e", tree)
    tp_target.commit("e", len(result.tokens))
    assert_shards_match_prefill(tp_target, "e", [1, 2, 3, *result.tokens], model)
    tp_target.release("e")
    assert not tp_target.failed


def test_ranks_and_their_rendezvous_listen_on_loopback_only(tp_target):
    """Issue 57: the rendezvous port was picked free, released and taken again (a race another process could win),
    and rank 0's store listened on every interface. Now the coordinator holds a loopback store socket and the
    ranks bootstrap on ``lo``: nothing of the target's ranks listens beyond 127.0.0.1."""
    import os

    import psutil

    listening = [(pid, c.laddr.ip) for pid in (os.getpid(), *tp_target.pids)
                 for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert any(pid == os.getpid() and ip == "127.0.0.1" for pid, ip in listening)  # the coordinator's store
    assert listening and all(ip == "127.0.0.1" for _, ip in listening), listening


def test_bad_tp_values_are_refused(model, model_dir):
    with pytest.raises(ValueError, match="tp: 3 ranks do not divide"):
        check_tp_compatible(model.config, 3)
    with pytest.raises(ValueError, match="tp: must be"):
        check_tp_compatible(model.config, 0)
    with pytest.raises(ValueError, match="tp:"):
        TensorParallelTarget(model_dir, tp=4)  # 2 kv heads: refused before anything is spawned


# ------------------------------------------------------------------------------------------------
# Rank failures: RankFailureError within a deadline, never a hang
# ------------------------------------------------------------------------------------------------

def _expect_failure(call, deadline_s: float) -> float:
    began = time.monotonic()
    with pytest.raises(RankFailureError):
        call()
    elapsed = time.monotonic() - began
    assert elapsed < deadline_s, f"RankFailureError after {elapsed:.1f} s"
    return elapsed


def test_killed_rank_gives_rank_failure_quickly(model_dir):
    target = TensorParallelTarget(model_dir, tp=TP, threads_per_rank=1, collective_timeout_s=10)
    try:
        target.start("k", [1, 2, 3, 4])
        target.verify("k", DraftTree((5, 6), (-1, 0)))
        os.kill(target.pids[1], signal.SIGKILL)
        _expect_failure(lambda: target.commit("k", 1), FAILURE_DEADLINE_S)
        assert target.failed
        _expect_failure(lambda: target.verify("k", DraftTree((5,), (-1,))), 1.0)  # later calls fail fast
        target.release("k")  # nothing is held any more: a no-op, not an error
    finally:
        target.close()
    assert all(not os.path.exists(f"/proc/{pid}") or _is_zombie(pid) for pid in target.pids)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except OSError:
        return True


# ------------------------------------------------------------------------------------------------
# Pre-packed local shards (what the CPU service uses for speed), on a model with tied embeddings
# ------------------------------------------------------------------------------------------------

def test_prepacked_tied_shards_match_unsharded_then_a_stuck_rank_fails(tmp_path):
    """Pre-packed shards with a tied lm_head give the unsharded logits, decisions and per-shard KV;
    then a rank that is alive but never joins the collective (SIGSTOP) makes rank 0's all-reduce
    time out: RankFailureError after the 3 s collective timeout, not a hang. (One target for both
    checks: each start costs ~10 s here.)"""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.5,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(5)
    tied = Qwen2ForCausalLM(config).eval()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    tied.save_pretrained(tmp_path)
    reference = TargetRuntime(tied)
    gen = torch.Generator().manual_seed(2)
    with TensorParallelTarget(tmp_path, tp=TP, threads_per_rank=1, collective_timeout_s=3, prepack=True) as target:
        assert target.prepacked == [2 * 7 + 1] * TP  # q, k, v, o, gate, up, down per layer + the tied lm_head
        assert target.packed  # the ranks pack verify_batch rows (sdpa models)
        prompt = random_prompt(seed=21, length=7)
        target.start("p", prompt)
        reference.start("p", prompt)
        committed = list(prompt)
        for _ in range(4):
            # The greedy continuation interleaved with random nodes: 3 accepted nodes at slots 1, 3, 5
            # of the tree, so commit compacts non-contiguous slots on every rank.
            greedy = hf_greedy(tied, committed, 3)
            shift = torch.randint(1, 64, (3,), generator=gen).tolist()
            noise = [(g + d) % 64 for g, d in zip(greedy, shift)]  # never the greedy token of its depth
            tree = DraftTree((noise[0], greedy[0], noise[1], greedy[1], noise[2], greedy[2]), (-1, -1, 0, 1, 1, 3))
            torch.testing.assert_close(target.tree_logits("p", tree), reference.tree_logits("p", tree), atol=1e-4, rtol=0)
            result = target.verify("p", tree)
            assert result == reference.verify("p", tree)
            assert result.accepted_nodes == (1, 3, 5)
            target.commit("p", len(result.tokens))
            reference.commit("p", len(result.tokens))
            committed += result.tokens
            assert_shards_match_prefill(target, "p", committed, tied)
        os.kill(target.pids[1], signal.SIGSTOP)
        elapsed = _expect_failure(lambda: target.verify("p", random_tree(gen, 4, 64)), FAILURE_DEADLINE_S)
        assert elapsed >= 2.5  # it was the collective timeout that fired


# ------------------------------------------------------------------------------------------------
# The target service with --tp: python -m target_service and specdec target-server
# ------------------------------------------------------------------------------------------------

_SPECDEC = Path(sys.executable).parent / "specdec"  # the console script (spawn re-runs it as __mp_main__)
ENTRY = {
    "module": [sys.executable, "-m", "target_service"],
    "cli": [str(_SPECDEC), "target-server"] if _SPECDEC.exists() else [sys.executable, "-m", "orchestrator.cli", "target-server"],
    "draft-module": [sys.executable, "-m", "draft_service"],
}
_RANK_PIDS = re.compile(r"tensor-parallel ranks started: .*pids \[(?P<pids>[\d, ]+)\]")


def _rank_pids(service: Service) -> list[int]:
    match = _RANK_PIDS.search(service.stderr)
    assert match, service.stderr[-2000:]
    return [int(pid) for pid in match["pids"].split(",")]


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}") or _is_zombie(pid)


@pytest.fixture(scope="module")
def service_pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("tp-service-models"))


@pytest.fixture(scope="module")
def tp_services(service_pair, tmp_path_factory):
    """Both entry points with --tp 2, started together (their start-ups overlap)."""
    config = write_config(tmp_path_factory.mktemp("tp-service") / "serve.yaml", service_pair)
    launched = {how: launch_command("target", [*ENTRY[how], "--config", str(config), "--port", "0", "--tp", "2"])
                for how in ("module", "cli")}
    try:
        for service in launched.values():
            wait_ready(service, timeout_s=180)
        yield launched
    finally:
        for service in launched.values():
            stop_service(service)


def _health(channel, service: str) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    request = health_pb2.HealthCheckRequest(service=service)
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status


def _generate_over_grpc(stub, draft: DraftRuntime, session_id: str, prompt: list[int], n: int, spec) -> tuple[list[int], int]:
    """Greedy speculative generation: trees from an in-process draft, verified by the service."""
    from specdec.v1 import target_pb2
    from specdec.wire import tree_to_proto

    stub.Prefill(target_pb2.PrefillRequest(session_id=session_id, prompt_ids=prompt), timeout=30)
    draft.start(session_id, prompt)
    out, rounds = [], 0
    while len(out) < n:
        max_depth = n - len(out) - 1
        tree = draft.propose(session_id, spec, max_depth) if max_depth >= 1 else DraftTree((), ())
        result = stub.Verify(target_pb2.VerifyRequest(session_id=session_id, tree=tree_to_proto(tree)), timeout=30)
        committed = list(result.tokens)[: n - len(out)]
        stub.Commit(target_pb2.CommitRequest(session_id=session_id, num_tokens=len(committed)), timeout=30)
        draft.commit(session_id, committed, list(result.accepted_nodes)[: len(committed)])
        out += committed
        rounds += 1
    assert stub.Release(target_pb2.ReleaseRequest(session_id=session_id), timeout=10).released
    draft.release(session_id)
    return out, rounds


def test_tp_service_generates_like_the_target_then_a_killed_rank_is_unavailable(tp_services, service_pair):
    import grpc
    from grpc_health.v1 import health_pb2
    from transformers import AutoModelForCausalLM

    from specdec.v1 import target_pb2, target_pb2_grpc
    from specdec.wire import tree_to_proto

    service = tp_services["module"]
    target_model = AutoModelForCausalLM.from_pretrained(service_pair.target, dtype=torch.float32).eval()
    draft = DraftRuntime(AutoModelForCausalLM.from_pretrained(service_pair.draft, dtype=torch.float32).eval())
    pids = _rank_pids(service)
    assert len(pids) == TP and all(_parent_of(pid) == service.proc.pid for pid in pids)
    with grpc.insecure_channel(service.address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        info = stub.Info(target_pb2.InfoRequest(), timeout=10)
        assert info.tensor_parallel == TP and info.vocab_size == target_model.config.vocab_size
        assert info.context_limit == 256 and list(info.eos_token_ids) == [0]

        prompt = random_prompt(31, length=6, vocab=info.vocab_size)
        out, rounds = _generate_over_grpc(stub, draft, "g", prompt, N_NEW, SEED_SPEC)
        with torch.no_grad():
            ids, want = list(prompt), []
            for _ in range(N_NEW):  # the target alone, argmax of a plain causal forward
                want.append(int(causal_logits(target_model, ids)[-1].argmax()))
                ids.append(want[-1])
        assert out == want
        assert rounds < N_NEW, "the draft never agreed: acceptance through the ranks was not exercised"

        stub.Prefill(target_pb2.PrefillRequest(session_id="k", prompt_ids=prompt), timeout=30)
        os.kill(pids[1], signal.SIGKILL)
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            stub.Verify(target_pb2.VerifyRequest(session_id="k", tree=tree_to_proto(DraftTree((5,), (-1,)))),
                        timeout=FAILURE_DEADLINE_S)
        elapsed = time.monotonic() - began
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
        assert "tensor-parallel rank failed" in failed.value.details() and elapsed < FAILURE_DEADLINE_S
        for name in ("", "specdec.v1.TargetService"):  # liveness asks "", readiness the service
            assert _health(channel, name) == health_pb2.HealthCheckResponse.NOT_SERVING
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as again:  # every later model call fails fast, same status
            stub.Prefill(target_pb2.PrefillRequest(session_id="k2", prompt_ids=prompt), timeout=10)
        assert again.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - began < 2.0
        assert stub.Info(target_pb2.InfoRequest(), timeout=10).tensor_parallel == TP  # still answers
    code = stop_service(service)
    assert code == 0 and "Traceback" not in service.stderr, service.stderr[-4000:]
    assert all(_gone(pid) for pid in pids)


def test_tp_service_from_the_cli_serves_and_sigterm_stops_the_ranks(tp_services):
    import grpc
    from grpc_health.v1 import health_pb2

    from specdec.v1 import target_pb2, target_pb2_grpc
    from specdec.wire import tree_to_proto

    service = tp_services["cli"]
    pids = _rank_pids(service)
    assert len(pids) == TP and all(_parent_of(pid) == service.proc.pid for pid in pids)
    with grpc.insecure_channel(service.address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        assert stub.Info(target_pb2.InfoRequest(), timeout=10).tensor_parallel == TP
        assert _health(channel, "specdec.v1.TargetService") == health_pb2.HealthCheckResponse.SERVING
        stub.Prefill(target_pb2.PrefillRequest(session_id="c", prompt_ids=[1, 2, 3]), timeout=30)
        result = stub.Verify(target_pb2.VerifyRequest(session_id="c", tree=tree_to_proto(DraftTree((4, 5), (-1, 0)))),
                             timeout=30)
        assert 1 <= len(result.tokens) <= 3
    service.proc.send_signal(signal.SIGTERM)
    code, waited = wait_for_exit(service, timeout_s=30)
    assert code == 0 and "Traceback" not in service.stderr, service.stderr[-4000:]
    assert "target-service draining" in service.stderr
    deadline = time.monotonic() + 5
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(pid) for pid in pids), "a rank outlived the service"


@pytest.mark.parametrize("entry, flags, field", [
    ("module", ["--tp", "3"], "target.tp"),           # 4 heads, 2 kv heads: not divisible by 3
    ("cli", ["--tp", "3"], "target.tp"),
    ("draft-module", ["--device", "nosuch"], "draft.device"),
], ids=["module-tp3", "cli-tp3", "draft-device"])
def test_bad_tp_or_device_flag_exits_2_naming_the_field(service_pair, tmp_path, entry, flags, field):
    config = write_config(tmp_path / "serve.yaml", service_pair)
    proc = subprocess.run([*ENTRY[entry], "--config", str(config), "--port", "0", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert re.search(rf"^error: {re.escape(field)}: ", proc.stderr, re.M), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "ready on" not in proc.stdout
