"""Greedy speculative decoding outputs exactly the target model's own greedy tokens (DESIGN.md
"The job in one paragraph"), for chain, wide, deep and SEED_SPEC trees, with
(a) a scripted draft that agrees with the target for exactly i tokens per round, every i,
(b) draft = target, (c) random and perturbed draft models.
Reference: transformers ``generate(do_sample=False)`` of the target alone."""

from __future__ import annotations

import pytest

from draft_service.runtime import DraftRuntime
from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.engine import SpeculativeEngine
from specdec.tree import node_depths
from specdec.tree_spec import SEED_SPEC, TreeSpec
from target_service.runtime import TargetRuntime
from tests.conftest import OracleDraft, RecordingDraft, RecordingTarget, hf_greedy, perturbed_copy, random_prompt, tiny_model

N_NEW = 20
CONTEXT = 512

SPECS = {
    "chain4": TreeSpec.chain(4),
    "wide": TreeSpec(gamma=2, topKSpec=[[8], [4]], topHead=[1, 1]),
    "deep": TreeSpec(gamma=6, topKSpec=[[2], [1, 1], [1, 1], [1, 1], [1, 1], [1, 1]], topHead=[1, 2, 2, 2, 2, 2]),
    "seed": SEED_SPEC,
}
MODELS = {"qwen2": lambda: tiny_model("qwen2", seed=0), "llama": lambda: tiny_model("llama", seed=1)}


def _tree_depth(tree) -> int:
    return 0 if tree is None else max(node_depths(tree.parents), default=0)


def _run(model, draft, prompt, spec, n=N_NEW):
    target = RecordingTarget(TargetRuntime(model))
    engine = SpeculativeEngine(target, draft, eos_token_ids=[], context_limit=CONTEXT)
    rounds = []
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=n, spec=spec), on_tokens=rounds.append)
    assert sum(rounds, []) == out.tokens
    assert out.stats.new_tokens == n and out.stats.stop_reason == "max_new_tokens"
    assert out.stats.rounds == len(rounds)
    # Nothing beyond the output sits in the target cache at the end.
    assert target.final_cache_len == len(prompt) + n - 1
    return out, rounds


# ------------------------------------------------------------------------------------------------
# (a) exactly i accepted tokens per round, for every i from 0 to the spec depth
# ------------------------------------------------------------------------------------------------

ORACLE_CASES = [
    (name, agree, kind)
    for name, spec in SPECS.items()
    for agree in range(spec.gamma + 1)
    for kind in MODELS
]


@pytest.mark.parametrize("name, agree, kind", ORACLE_CASES)
def test_exact_acceptance_lengths(name, agree, kind):
    spec = SPECS[name]
    model = MODELS[kind]()
    prompt = random_prompt(seed=1000 + 10 * agree + len(name) + (kind == "llama"))
    reference = hf_greedy(model, prompt, N_NEW + spec.gamma + 1)
    draft = OracleDraft(prompt, reference, agree=agree, seed=agree)

    out, rounds = _run(model, draft, prompt, spec)

    assert out.tokens == reference[:N_NEW]
    log = draft.log.rounds
    assert len(log) == out.stats.rounds
    done = 0
    for r, committed in zip(log, rounds):
        budget = N_NEW - done
        if budget == 1:
            assert r.tree is None  # no room for a draft token: plain decoding step
        else:
            assert r.max_depth == budget - 1
            assert _tree_depth(r.tree) == min(spec.gamma, r.max_depth)
        assert len(r.accepted) == min(agree, _tree_depth(r.tree))  # exactly i, capped by the tree depth
        assert r.tokens == committed and len(r.tokens) == len(r.accepted) + 1
        if r.accepted:
            assert [r.tree.tokens[n] for n in r.accepted] == r.tokens[:-1]
        done += len(committed)
    assert out.stats.accepted_tokens == sum(len(r.accepted) for r in log)
    assert out.stats.proposed_tokens == sum(r.tree.size for r in log if r.tree is not None)
    assert draft.released


# ------------------------------------------------------------------------------------------------
# (b) draft = target: every path the draft's argmax follows is accepted
# ------------------------------------------------------------------------------------------------

SELF_SPECS = dict(SPECS, chain6=TreeSpec.chain(6))


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("name", list(SELF_SPECS))
def test_draft_equals_target(name, kind):
    spec = SELF_SPECS[name]
    model = MODELS[kind]()
    for seed in (1, 2):
        prompt = random_prompt(seed=2000 + seed + 7 * len(name))
        draft = RecordingDraft(DraftRuntime(model))
        out, rounds = _run(model, draft, prompt, spec)
        assert out.tokens == hf_greedy(model, prompt, N_NEW)
        for r in draft.log.rounds:
            if all(h == 1 for h in spec.top_head):
                # One expanded node per depth, always the draft (= target) argmax: all accepted.
                assert len(r.accepted) == _tree_depth(r.tree)
            else:
                # The draft top-1 at the root is always a child, so at least one token is accepted.
                assert len(r.accepted) >= min(1, _tree_depth(r.tree))


# ------------------------------------------------------------------------------------------------
# (c) unrelated random drafts and perturbed copies of the target (partial acceptance)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("draft_kind", ["random", "perturbed"])
def test_other_drafts(draft_kind, name, kind):
    spec = SPECS[name]
    model = MODELS[kind]()
    if draft_kind == "random":
        draft_model = tiny_model(kind, seed=77, layers=1)
    else:
        draft_model = perturbed_copy(model, seed=5, scale=0.1)
    prompt = random_prompt(seed=3000 + 3 * len(name) + (kind == "llama") + 50 * (draft_kind == "random"))
    draft = RecordingDraft(DraftRuntime(draft_model))
    out, _ = _run(model, draft, prompt, spec)
    assert out.tokens == hf_greedy(model, prompt, N_NEW)
    assert 0 <= out.stats.accepted_tokens <= out.stats.proposed_tokens


@pytest.mark.parametrize("name", ["seed", "wide"])
def test_draft_with_larger_vocabulary(name):
    """A draft whose vocabulary extends the target's: DraftRuntime(vocab_size=...) proposes shared ids only."""
    model = MODELS["llama"]()
    draft = RecordingDraft(DraftRuntime(tiny_model("llama", seed=78, vocab=80), vocab_size=64))
    prompt = random_prompt(seed=3200 + len(name))
    out, _ = _run(model, draft, prompt, SPECS[name])
    assert out.tokens == hf_greedy(model, prompt, N_NEW)
    assert all(max(r.tree.tokens) < 64 for r in draft.log.rounds if r.tree is not None)


def test_perturbed_draft_has_partial_acceptance():
    """Guard for (c): the perturbed draft is neither always right nor always wrong."""
    model = MODELS["qwen2"]()
    draft = RecordingDraft(DraftRuntime(perturbed_copy(model, seed=5, scale=0.1)))
    prompt = random_prompt(seed=3100)
    spec = SPECS["chain4"]
    out, _ = _run(model, draft, prompt, spec, n=40)
    assert out.tokens == hf_greedy(model, prompt, 40)
    lengths = [(len(r.accepted), _tree_depth(r.tree)) for r in draft.log.rounds]
    assert any(0 < n < depth for n, depth in lengths), lengths


# ------------------------------------------------------------------------------------------------
# No speculation, single-token prompts
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(MODELS))
def test_plain_decoding(kind):
    model = MODELS[kind]()
    prompt = random_prompt(seed=4000)
    target = RecordingTarget(TargetRuntime(model))
    engine = SpeculativeEngine(target, None, eos_token_ids=[], context_limit=CONTEXT)
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=N_NEW, spec=SEED_SPEC))
    assert out.tokens == hf_greedy(model, prompt, N_NEW)
    assert out.stats.rounds == N_NEW and out.stats.proposed_tokens == 0
    engine = SpeculativeEngine(target, DraftRuntime(model), eos_token_ids=[], context_limit=CONTEXT)
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=N_NEW, spec=None))
    assert out.tokens == hf_greedy(model, prompt, N_NEW)
    assert out.stats.rounds == N_NEW


@pytest.mark.parametrize("name", ["chain4", "seed"])
def test_single_token_prompt(name):
    model = MODELS["qwen2"]()
    prompt = [17]
    out, _ = _run(model, DraftRuntime(perturbed_copy(model, seed=5, scale=0.1)), prompt, SPECS[name])
    assert out.tokens == hf_greedy(model, prompt, N_NEW)
