"""KV cache rollback (DESIGN.md "Commit and rollback"): after every round the target cache equals a
fresh prefill of all committed tokens but the root, and the draft cache equals a fresh prefill of
its first ``cached_len`` committed tokens — with partial acceptance, full acceptance and stops that
cut an accepted path."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from draft_service.runtime import DraftRuntime
from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.engine import SpeculativeEngine
from specdec.kv_cache import cache_length, compact_kv, truncate_kv
from specdec.tree import ancestors, node_depths
from specdec.tree_spec import SEED_SPEC, TreeSpec
from target_service.runtime import SessionStateError, TargetRuntime
from tests.conftest import (
    RecordingDraft,
    RecordingTarget,
    assert_kv_equal,
    cache_kv,
    hf_greedy,
    perturbed_copy,
    prefill_kv,
    random_prompt,
    tiny_model,
)

SPECS = {
    "seed": SEED_SPEC,
    "chain4": TreeSpec.chain(4),
    "wide": TreeSpec(gamma=2, topKSpec=[[8], [4]], topHead=[1, 1]),
    "deep": TreeSpec(gamma=5, topKSpec=[[3], [2, 1], [1, 1], [1, 1], [1, 1]], topHead=[1, 2, 2, 2, 2]),
}
# A smaller init std than elsewhere keeps activations (and float32 round-off between a tree forward
# and a fresh prefill, ~3e-6 here) well inside atol 1e-5; with std 0.5 it reaches ~2e-5.
STD = 0.2
MODELS = {
    "qwen2": lambda: tiny_model("qwen2", seed=0, init_std=STD),
    "llama": lambda: tiny_model("llama", seed=1, init_std=STD),
}


# ------------------------------------------------------------------------------------------------
# compact_kv on its docstring example
# ------------------------------------------------------------------------------------------------

def _slot_cache(slots: int, layers: int = 2) -> DynamicCache:
    """A cache whose slot s holds the value s (+ 100 * layer; values negated) everywhere."""
    cache = DynamicCache()
    for layer in range(layers):
        keys = torch.arange(slots, dtype=torch.float32).view(1, 1, slots, 1).expand(1, 2, slots, 3).clone()
        cache.update(keys + 100 * layer, -(keys + 100 * layer), layer)  # (1, 2, S, 3)
    return cache


def _slots(cache, layer=0):
    return cache.layers[layer].keys[0, 0, :, 0].tolist()


def test_compact_kv_docstring_example():
    """7 prefix slots, R at slot 7, nodes 0..11 at 8..19; accepting nodes [0, 6] keeps 0..7, 8, 14."""
    cache = _slot_cache(20)
    compact_kv(cache, 8, [8 + 0, 8 + 6])
    assert cache_length(cache) == 10
    assert _slots(cache) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 14]
    assert _slots(cache, 1) == [100 + s for s in [0, 1, 2, 3, 4, 5, 6, 7, 8, 14]]
    assert (-cache.layers[1].values[0, 1, :, 2]).tolist() == _slots(cache, 1)


def test_compact_kv_overlapping_moves():
    cache = _slot_cache(12)
    compact_kv(cache, 3, [4, 5, 9, 11])  # destinations 3..6 overlap sources 4, 5
    assert _slots(cache) == [0, 1, 2, 4, 5, 9, 11]
    truncate_kv(cache, 2)
    assert _slots(cache) == [0, 1]
    compact_kv(cache, 2, [])
    assert cache_length(cache) == 2


# ------------------------------------------------------------------------------------------------
# Engine rounds, caches checked after every commit
# ------------------------------------------------------------------------------------------------

class CacheChecker:
    """After-commit checks for both workers against fresh prefills."""

    def __init__(self, target_model, draft_model):
        self.target_model = target_model
        self.draft_model = draft_model
        self.target = None  # RecordingTarget, for the committed tokens
        self.target_checks = 0
        self.draft_checks = 0

    def check_target(self, runtime, session_id, committed):
        s = runtime.sessions[session_id]
        assert s.pending is None
        assert s.cache_len == len(committed) - 1
        assert s.root == committed[-1]
        assert cache_length(s.cache) == len(committed) - 1
        assert_kv_equal(cache_kv(s.cache), prefill_kv(self.target_model, committed[:-1]), what="target cache")
        self.target_checks += 1

    def check_draft(self, runtime, session_id):
        s = runtime.sessions[session_id]
        assert s.tokens == self.target.committed  # the engine commits the target first
        assert s.slot_of_node == {}
        assert 0 <= s.cached_len <= len(s.tokens)
        assert cache_length(s.cache) == s.cached_len
        assert_kv_equal(cache_kv(s.cache), prefill_kv(self.draft_model, s.tokens[: s.cached_len]), what="draft cache")
        self.draft_checks += 1


class DeepDraft:
    """A DraftRuntime that ignores the engine's max_depth (so stops land inside accepted paths)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.sessions = runtime.sessions

    def start(self, session_id, prompt_ids, sampling):
        self.runtime.start(session_id, prompt_ids, sampling)

    def propose(self, session_id, spec, max_depth):
        return self.runtime.propose(session_id, spec, spec.gamma)

    def commit(self, session_id, tokens, accepted_nodes):
        self.runtime.commit(session_id, tokens, accepted_nodes)

    def release(self, session_id):
        self.runtime.release(session_id)


def _run_checked(model, draft_model, prompt, spec, n, eos=(), deep=False):
    checker = CacheChecker(model, draft_model)
    target = RecordingTarget(TargetRuntime(model), check_after_commit=checker.check_target)
    checker.target = target
    inner = DraftRuntime(draft_model)
    draft = RecordingDraft(DeepDraft(inner) if deep else inner, check_after_commit=lambda w, sid: checker.check_draft(inner, sid))
    engine = SpeculativeEngine(target, draft, eos_token_ids=eos, context_limit=512)
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=n, spec=spec))
    assert checker.target_checks == checker.draft_checks == out.stats.rounds
    assert target.committed == prompt + out.tokens
    assert target.final_cache_len == len(prompt) + len(out.tokens) - 1
    return out, draft.log.rounds


def _depth(tree):
    return 0 if tree is None else max(node_depths(tree.parents), default=0)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("name", list(SPECS))
def test_caches_after_every_round_partial_acceptance(name, kind):
    model = MODELS[kind]()
    draft_model = perturbed_copy(model, seed=5, scale=0.04)
    prompt = random_prompt(seed=500 + len(name), length=6)
    out, rounds = _run_checked(model, draft_model, prompt, SPECS[name], n=24)
    assert out.tokens == hf_greedy(model, prompt, 24)
    partial = [r for r in rounds if 0 < len(r.accepted) < _depth(r.tree)]
    assert partial, "no round with partial acceptance: the test would not exercise rollback"


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("name", ["seed", "chain4", "deep"])
def test_caches_after_every_round_draft_equals_target(name, kind):
    """Long accepted paths: the draft keeps the KV of the accepted nodes it fed."""
    model = MODELS[kind]()
    prompt = random_prompt(seed=600 + len(name), length=5)
    out, rounds = _run_checked(model, model, prompt, SPECS[name], n=20)
    assert out.tokens == hf_greedy(model, prompt, 20)
    assert max(len(r.accepted) for r in rounds) >= 2


@pytest.mark.parametrize("kind", list(MODELS))
def test_caches_when_eos_cuts_the_path(kind):
    model = MODELS[kind]()
    prompt = random_prompt(seed=700, length=4)
    reference = hf_greedy(model, prompt, 30)
    # An EOS that is not the first token, at its first occurrence.
    k = next(i for i in range(6, 30) if reference[i] not in reference[:i])
    out, rounds = _run_checked(model, model, prompt, TreeSpec.chain(4), n=30, eos=[reference[k]])
    assert out.tokens == reference[: k + 1]
    assert out.stats.stop_reason == "eos"


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("n", [2, 3, 5, 8, 9])
def test_caches_when_max_new_tokens_cuts_a_deep_path(n, kind):
    """The draft builds depth-5 trees whatever the budget; the stop cuts the accepted path."""
    model = MODELS[kind]()
    prompt = random_prompt(seed=800 + n, length=5)
    out, rounds = _run_checked(model, model, prompt, TreeSpec.chain(5), n=n, deep=True)
    assert out.tokens == hf_greedy(model, prompt, n)
    # Round 1 commits 6 tokens (5 accepted + bonus) when n > 6; the last round's cut falls inside
    # its depth-5 accepted path, so it commits accepted draft tokens only.
    last = rounds[-1]
    assert _depth(last.tree) == 5
    assert len(rounds) == (1 if n <= 6 else 2)
    assert last.accepted == list(range(n if n <= 6 else n - 6))


# ------------------------------------------------------------------------------------------------
# Driving the target runtime by hand
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4])
def test_target_commit_fewer_tokens(num_tokens):
    """Verify a chain the target fully accepts, commit only num_tokens of its 4 tokens."""
    model = MODELS["llama"]()
    prompt = [3, 14, 15, 9, 26]
    greedy = hf_greedy(model, prompt, 4)
    from specdec.tree import DraftTree

    # Branch off the path at every depth so that the dropped slots sit between the kept ones.
    tree = DraftTree(
        tokens=(greedy[0], (greedy[0] + 1) % 64, greedy[1], (greedy[1] + 1) % 64, greedy[2]),
        parents=(-1, -1, 0, 0, 2),
    )
    target = TargetRuntime(model)
    target.start("s", prompt)
    result = target.verify("s", tree)
    assert result.accepted_nodes == (0, 2, 4)
    assert list(result.tokens) == greedy
    with pytest.raises(SessionStateError):
        target.verify("s", tree)  # the pending result must be committed first
    with pytest.raises(ValueError, match="num_tokens"):
        target.commit("s", 5)
    target.commit("s", num_tokens)
    committed = prompt + greedy[:num_tokens]
    s = target.sessions["s"]
    assert s.cache_len == len(committed) - 1 and s.root == committed[-1]
    assert_kv_equal(cache_kv(s.cache), prefill_kv(model, committed[:-1]), what="target cache")
    with pytest.raises(SessionStateError):
        target.commit("s", 1)
    # The next round continues from there.
    result = target.verify("s", DraftTree((), ()))
    assert result.tokens == (hf_greedy(model, committed, 1)[0],)


def test_draft_commit_keeps_fed_prefix_of_accepted_path():
    """Accept a depth-3 path whose first two nodes were fed: both stay cached, the leaf does not."""
    model = MODELS["qwen2"]()
    draft = DraftRuntime(model)
    prompt = [1, 2, 3, 4]
    draft.start("s", prompt)
    tree = draft.propose("s", SEED_SPEC, max_depth=3)
    leaf = tree.size - 1
    path = ancestors(tree.parents, leaf)
    assert [tree.expanded[i] for i in path] == [True, True, False]
    tokens = [tree.tokens[i] for i in path] + [7]
    draft.commit("s", tokens, path)
    s = draft.sessions["s"]
    assert s.cached_len == len(prompt) + 2
    assert_kv_equal(cache_kv(s.cache), prefill_kv(model, (prompt + tokens)[: s.cached_len]), what="draft cache")
    # Next round: only the pending tokens (leaf + bonus) are fed; the tree is the causal top-k.
    tree2 = draft.propose("s", SEED_SPEC, max_depth=3)
    assert s.cached_len == len(prompt) + len(tokens)
    from tests.conftest import causal_logits

    ref = causal_logits(model, prompt + tokens)[-1].topk(6).indices.tolist()
    assert list(tree2.tokens[:6]) == ref


def test_release_and_unknown_sessions():
    from specdec.interfaces import UnknownSessionError as DraftUnknown, UnknownSessionError as TargetUnknown
    from specdec.tree import DraftTree

    model = MODELS["qwen2"]()
    target, draft = TargetRuntime(model), DraftRuntime(model)
    target.start("a", [1, 2, 3])
    draft.start("a", [1, 2, 3])
    target.release("a")
    draft.release("a")
    assert target.sessions == {} and draft.sessions == {}
    with pytest.raises(TargetUnknown, match="session_id"):
        target.verify("a", DraftTree((), ()))
    with pytest.raises(DraftUnknown, match="session_id"):
        draft.propose("a", SEED_SPEC, 3)
    with pytest.raises(ValueError, match="prompt_ids"):
        target.start("b", [])
    target.release("never-started")  # idempotent
