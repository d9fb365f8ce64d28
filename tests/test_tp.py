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
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from draft_service.runtime import DraftRuntime
from orchestrator.engine import GenerationRequest, SpeculativeEngine
from specdec.interfaces import UnknownSessionError
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, MalformedTreeError
from specdec.tree_spec import SEED_SPEC, TreeSpec
from target_service.runtime import SessionStateError, TargetRuntime
from target_service.tp import RankFailureError, TensorParallelTarget, check_tp_compatible
from tests.conftest import assert_kv_equal, hf_greedy, perturbed_copy, prefill_kv, random_prompt, tiny_model

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
    target = TensorParallelTarget(model_dir, tp=TP, threads_per_rank=1, collective_timeout_s=10, call_timeout_s=60)
    yield target
    target.close()


def random_tree(gen: torch.Generator, nodes: int, vocab: int) -> DraftTree:
    """A random tree of ``nodes`` nodes (random parents, breadth-first order is not required)."""
    tokens = torch.randint(0, vocab, (nodes,), generator=gen).tolist()
    parents = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(nodes)]
    return DraftTree(tuple(tokens), tuple(parents))


def assert_shards_match_prefill(target: TensorParallelTarget, session_id: str, committed: list[int], model) -> None:
    """Each rank's KV = its kv heads of a fresh causal prefill of all committed tokens but the root."""
    expected = prefill_kv(model, committed[:-1])  # per layer (1, H, L, D)
    shards = target.session_kv(session_id)
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
    assert tp_target.sessions == {}


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
    assert tp_target.sessions == {}


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
