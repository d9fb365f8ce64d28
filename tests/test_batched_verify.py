"""Batched verification across sessions (``TargetRuntime.verify_batch``, DESIGN.md "Batching"): one
target forward verifies the trees of several sessions with different cached lengths and tree sizes,
and every item's result and session state equal what its own ``verify`` gives.

Tolerances: batched rows differ from solo rows only by float32 round-off of a differently shaped
computation (measured <= 6e-6 on these std-0.2 models, the same order as a solo tree forward vs a
plain causal forward); a wrong mask, position or slot changes logits and KV by O(0.1-1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specdec.forward as forward_module
import target_service.runtime as runtime_module
from draft_service.runtime import DraftRuntime
from specdec.interfaces import UnknownSessionError
from specdec.kv_cache import append_kv_row, cache_length, new_cache, stack_kv
from specdec.sampling import GREEDY, SamplingParams
from specdec.tree import DraftTree, MalformedTreeError, Proposal, node_depths, tree_attention_mask, tree_position_ids
from specdec.tree_spec import SEED_SPEC, TreeSpec
from target_service.runtime import SessionStateError, TargetRuntime, batched_tree_inputs
from tests.conftest import (
    VOCAB,
    OracleDraft,
    assert_kv_equal,
    cache_kv,
    hf_greedy,
    perturbed_copy,
    prefill_kv,
    random_prompt,
    tiny_model,
)

STD = 0.2  # as in test_cache_rollback: float32 round-off stays well inside atol 1e-5
MODELS = {
    "qwen2": lambda: tiny_model("qwen2", seed=0, init_std=STD),
    "llama": lambda: tiny_model("llama", seed=1, init_std=STD),
}
TOL = dict(atol=1e-5, rtol=1e-5)
MIN = torch.finfo(torch.float32).min


class ForwardSpy:
    """Counts the target runtime's solo forwards (``model_forward`` or its DirectDecoder) and batched
    forwards, and keeps the logits they returned."""

    def __init__(self, monkeypatch):
        self.solo: list[torch.Tensor] = []  # [Q, V] per solo forward
        self.batched: list = []  # per batched forward: [B, Q, V] (padded) or B x [N_b + 1, V] (packed)
        solo_fn, batch_fn = forward_module.model_forward, forward_module.model_forward_batch
        packed_fn = runtime_module.model_forward_packed

        self.model = None  # set: only this model's solo forwards are kept (not a draft's)

        def solo(fn, *args, **kwargs):
            out = fn(*args, **kwargs)
            model = args[0].model if fn is decoder_call else args[0]
            if self.model is None or model is self.model:
                self.solo.append(out)
            return out

        def batched(*args, **kwargs):
            self.batched.append(batch_fn(*args, **kwargs))
            return self.batched[-1]

        def packed(*args, **kwargs):
            self.batched.append(packed_fn(*args, **kwargs))
            return self.batched[-1]

        class SpiedDecoder(forward_module.DirectDecoder):  # a runtime's solo forwards where it goes direct
            def __call__(decoder, *args, **kwargs):
                return solo(decoder_call, decoder, *args, **kwargs)

        decoder_call = forward_module.DirectDecoder.__call__
        monkeypatch.setattr(forward_module, "model_forward", lambda *args, **kwargs: solo(solo_fn, *args, **kwargs))
        monkeypatch.setattr(forward_module, "DirectDecoder", SpiedDecoder)
        monkeypatch.setattr(forward_module, "model_forward_batch", batched)
        monkeypatch.setattr(runtime_module, "model_forward_packed", packed)

    def reset(self):
        self.solo.clear()
        self.batched.clear()


@pytest.fixture
def spy(monkeypatch):
    return ForwardSpy(monkeypatch)


# ------------------------------------------------------------------------------------------------
# Trees whose accepted path is known: nodes on ``path`` carry the target's greedy tokens
# ------------------------------------------------------------------------------------------------

def tree_with_path(parents, reference, path) -> DraftTree:
    """Nodes in ``path`` (a root path) get the greedy reference token of their depth; every other
    node a token that differs from it, so greedy verification accepts exactly ``path``."""
    depths = node_depths(parents)
    tokens = [reference[d - 1] if i in path else (reference[d - 1] + 1 + i) % VOCAB for i, d in enumerate(depths)]
    return DraftTree(tuple(tokens), tuple(parents))


CHAIN4 = (-1, 0, 1, 2)
WIDE8 = (-1,) * 8
SEED_LIKE = (-1,) * 6 + (0, 0, 1, 1, 6, 8)  # the SEED_SPEC shape: 6 + 4 + 2 nodes
# (prompt length, tree parents, accepted path): L = prompt length - 1, so the first has L = 0.
CASES = [
    (1, SEED_LIKE, (1, 8, 11)),  # empty cache, non-first sibling, full depth accepted
    (6, CHAIN4, (0, 1)),  # partial chain
    (13, WIDE8, (5,)),  # wide, sixth sibling
    (3, (), ()),  # empty tree: plain decoding step
    (22, CHAIN4, (0, 1, 2, 3)),  # whole chain + bonus
]


def _case_items(kind, cases, prefix="s"):
    model = MODELS[kind]()
    sessions = []
    for index, (length, parents, path) in enumerate(cases):
        prompt = random_prompt(seed=9000 + 31 * index + length, length=length)
        reference = hf_greedy(model, prompt, 6)
        tree = tree_with_path(parents, reference, path)
        sessions.append((f"{prefix}{index}", prompt, tree, path, reference))
    return model, sessions


# ------------------------------------------------------------------------------------------------
# Layout helpers
# ------------------------------------------------------------------------------------------------

def test_batched_tree_inputs_layout():
    """Each real row is tree_attention_mask with the pad columns hidden; pad rows see themselves only."""
    trees = [DraftTree((5, 6, 7), (-1, -1, 0)), DraftTree((), ()), DraftTree((1, 2, 3, 4, 5), (-1, 0, 0, 1, 3))]
    lengths, roots = [0, 4, 2], [9, 8, 7]
    ids, positions, mask = batched_tree_inputs(roots, trees, lengths)
    width, q = 4, 6
    assert ids.shape == positions.shape == (3, q) and mask.shape == (3, 1, q, width + q)
    for row, (tree, length, root) in enumerate(zip(trees, lengths, roots)):
        n = tree.size + 1
        assert ids[row, :n].tolist() == [root, *tree.tokens] and (ids[row, n:] == 0).all()
        assert positions[row, :n].tolist() == tree_position_ids(tree.parents, length).tolist()
        solo = tree_attention_mask(tree.parents, length)[0, 0]  # (n, length + n)
        assert torch.equal(mask[row, 0, :n, :length], solo[:, :length])
        assert (mask[row, 0, :n, length:width] == MIN).all(), "pad slots of the cached region must be hidden"
        assert torch.equal(mask[row, 0, :n, width : width + n], solo[:, length:])
        assert (mask[row, 0, :n, width + n :] == MIN).all(), "real rows must not see pad rows"
        for pad in range(n, q):
            visible = (mask[row, 0, pad] == 0).nonzero().flatten().tolist()
            assert visible == [width + pad]
    # One row without padding is exactly the solo mask.
    _, _, one = batched_tree_inputs([9], trees[2:], [3])
    assert torch.equal(one, tree_attention_mask(trees[2].parents, 3))


def _slot_cache(slots: int, offset: float, heads: int = 2, dim: int = 3):
    cache = new_cache(MODELS["qwen2"]().config)
    if slots:
        for layer in range(len(cache.layers)):
            keys = torch.arange(slots, dtype=torch.float32).view(1, 1, slots, 1).expand(1, heads, slots, dim)
            keys = keys + offset + 100 * layer
            cache.update(keys.clone(), -keys.clone(), layer)
    return cache


def test_stack_kv_and_append_kv_row():
    config = MODELS["qwen2"]().config
    caches = [_slot_cache(5, 1000), _slot_cache(0, 0), _slot_cache(2, 2000)]  # the middle one uninitialised
    stacked = stack_kv(caches, [3, 0, 2], config)  # take 3 of cache 0's 5 slots
    for layer, got in enumerate(stacked.layers):
        assert got.keys.shape == (3, 2, 3, 3)
        assert got.keys[0, 1, :, 0].tolist() == [1000 + 100 * layer + s for s in range(3)]
        assert (got.keys[1] == 0).all() and (got.values[1] == 0).all()
        assert got.keys[2, 0, :, 2].tolist() == [2000 + 100 * layer, 2001 + 100 * layer, 0]
        assert torch.equal(got.values, -got.keys)
    assert cache_length(caches[0]) == 5 and caches[0].layers[0].keys.shape[0] == 1  # inputs untouched
    append_kv_row(caches[1], stacked, 2, 0, 2)  # initialises the empty cache
    append_kv_row(caches[0], stacked, 0, 1, 2)
    assert caches[1].layers[1].keys[0, 0, :, 0].tolist() == [2100, 2101]
    assert caches[0].layers[0].keys[0, 0, :, 0].tolist() == [1000, 1001, 1002, 1003, 1004, 1001, 1002]
    assert stack_kv([_slot_cache(0, 0)], [0], config).get_seq_length() == 0
    with pytest.raises(ValueError, match="lengths"):
        stack_kv(caches[:1], [99], config)


# ------------------------------------------------------------------------------------------------
# (a) one batched verify equals solo verifies
# ------------------------------------------------------------------------------------------------

def _assert_same_session(batched_rt, solo_rt, sid):
    b, s = batched_rt.sessions[sid], solo_rt.sessions[sid]
    assert (b.cache_len, b.root, b.pending) == (s.cache_len, s.root, s.pending)
    assert cache_length(b.cache) == cache_length(s.cache)
    assert_kv_equal(cache_kv(b.cache), cache_kv(s.cache), **TOL, what=f"{sid} cache vs solo")


PLAIN = [(3, (), ()), (1, (), ()), (17, (), ())]  # Q = 1: one new token per row (plain decoding steps)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("cases", [CASES[:2], CASES[1:4], CASES, CASES[::-1], PLAIN],
                         ids=["B2", "B3", "B5", "B5-reversed", "B3-plain"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_batch_equals_solo(kind, cases, packed, spy):
    model, sessions = _case_items(kind, cases)
    solo, batched = TargetRuntime(model), TargetRuntime(model, packed=packed)
    for sid, prompt, *_ in sessions:
        solo.start(sid, prompt)
        batched.start(sid, prompt)
    spy.reset()

    results = batched.verify_batch([(sid, tree) for sid, _, tree, _, _ in sessions])
    assert len(spy.batched) == 1 and not spy.solo, "one batched forward, no solo forward"
    logits = spy.batched[0]  # (B, Q, V) padded, B x (N_b + 1, V) packed
    q = max(tree.size for _, _, tree, _, _ in sessions) + 1
    rows = [q if not packed else tree.size + 1 for _, _, tree, _, _ in sessions]
    assert [len(r) for r in logits] == rows, "padded: Q rows each; packed: each session's own rows"

    for row, (sid, prompt, tree, path, reference) in enumerate(sessions):
        spy.reset()
        expected = solo.verify(sid, tree)
        assert results[row] == expected
        assert results[row].accepted_nodes == path and results[row].tokens == tuple(reference[: len(path) + 1])
        # the solo first verify reuses R's logits from start (no forward when the tree is empty) and
        # feeds the nodes alone; the batch feeds R again in every row
        torch.testing.assert_close(logits[row][0], solo.sessions[sid].root_logits, **TOL)
        if tree.size:
            torch.testing.assert_close(logits[row][1 : tree.size + 1], spy.solo[0], **TOL)
        _assert_same_session(batched, solo, sid)
        assert cache_length(batched.sessions[sid].cache) == len(prompt) - 1 + tree.size + 1

    # commit works unchanged: cut one result short, take the others whole
    for row, (sid, prompt, tree, path, reference) in enumerate(sessions):
        n = len(results[row].tokens) - (1 if row == 0 and len(results[row].tokens) > 1 else 0)
        batched.commit(sid, n)
        committed = prompt + list(results[row].tokens[:n])
        expected = prefill_kv(model, committed[:-1])
        assert_kv_equal(cache_kv(batched.sessions[sid].cache), expected, **TOL, what=f"{sid} after commit")
        assert batched.sessions[sid].root == committed[-1]


def test_batch_drops_stale_slots_of_a_failed_verify(spy):
    """A session whose cache still holds the slots of a forward without a verify result (a failed
    verify) is rolled back to its committed prefix first, as ``verify`` does."""
    model, sessions = _case_items("qwen2", CASES[1:3])
    solo, batched = TargetRuntime(model), TargetRuntime(model)
    for sid, prompt, *_ in sessions:
        solo.start(sid, prompt)
        batched.start(sid, prompt)
    sid0, _, tree0, _, _ = sessions[0]
    batched.tree_logits(sid0, tree0)  # 5 slots past the committed prefix, no pending result
    results = batched.verify_batch([(sid, tree) for sid, _, tree, _, _ in sessions])
    for row, (sid, _, tree, _, _) in enumerate(sessions):
        assert results[row] == solo.verify(sid, tree)
        _assert_same_session(batched, solo, sid)


def test_batch_of_one_is_the_solo_path(spy):
    model, sessions = _case_items("qwen2", CASES[:1])
    sid, prompt, tree, path, _ = sessions[0]
    runtime = TargetRuntime(model)
    runtime.start(sid, prompt)
    runtime.start("other", [1, 2])
    spy.reset()
    results = runtime.verify_batch([(sid, tree), ("missing", tree)])  # one valid item left
    assert len(spy.solo) == 1 and not spy.batched
    assert results[0].accepted_nodes == path and isinstance(results[1], UnknownSessionError)
    assert runtime.verify_batch([]) == []
    assert not spy.batched


# ------------------------------------------------------------------------------------------------
# (b) multi-round greedy generation, every round's verifies batched
# ------------------------------------------------------------------------------------------------

class Request:
    def __init__(self, sid, prompt, n, draft, spec):
        self.sid, self.prompt, self.n, self.draft, self.spec = sid, prompt, n, draft, spec
        self.committed = list(prompt)
        self.accepted_lengths: list[int] = []

    @property
    def done(self):
        return len(self.committed) - len(self.prompt) >= self.n


def _requests(kind):
    model = MODELS[kind]()
    plain = [(0, 1, 5, None, None)]  # (seed, prompt length, max new tokens, agree, spec); agree None = no draft
    oracle = [(1, 4, 7, 0, TreeSpec.chain(3)), (2, 9, 15, 2, SEED_SPEC), (3, 2, 12, 9, TreeSpec.chain(4))]
    requests = []
    for seed, length, n, agree, spec in plain + oracle:
        prompt = random_prompt(seed=9100 + seed, length=length)
        draft = None
        if agree is not None:
            draft = OracleDraft(prompt, hf_greedy(model, prompt, n + 8), agree=agree, seed=seed)
        requests.append(Request(f"r{seed}", prompt, n, draft, spec))
    # A real draft model (perturbed target) gives varying accepted lengths.
    prompt = random_prompt(seed=9105, length=17)
    draft = DraftRuntime(perturbed_copy(model, seed=5, scale=0.04))
    requests.append(Request("r5", prompt, 20, draft, SEED_SPEC))
    return model, requests


@pytest.mark.parametrize("kind", list(MODELS))
def test_batched_rounds_generate_target_greedy_tokens(kind, spy):
    model, requests = _requests(kind)
    target, spy.model = TargetRuntime(model), model
    for r in requests:
        target.start(r.sid, r.prompt)
        if r.draft is not None:
            r.draft.start(r.sid, r.prompt, GREEDY)
    spy.reset()
    batch_sizes, solo_rounds = [], 0
    while active := [r for r in requests if not r.done]:
        trees = [r.draft.propose(r.sid, r.spec, r.spec.gamma) if r.draft else DraftTree((), ()) for r in active]
        before = len(spy.batched)
        results = target.verify_batch([(r.sid, tree) for r, tree in zip(active, trees)])
        batch_sizes.append(len(active))
        if len(active) > 1:
            assert len(spy.batched) == before + 1 and len(spy.batched[-1]) == len(active)
        else:
            solo_rounds += 1  # a batch of one takes the solo path
        for r, tree, result in zip(active, trees, results):
            assert not isinstance(result, Exception), result
            # max_new_tokens may cut the accepted path: commit fewer tokens than verified
            num = min(len(result.tokens), r.n - (len(r.committed) - len(r.prompt)))
            target.commit(r.sid, num)
            if r.draft is not None:
                r.draft.commit(r.sid, list(result.tokens[:num]), list(result.accepted_nodes[:num]))
            r.committed += result.tokens[:num]
            r.accepted_lengths.append(len(result.accepted_nodes))
            s = target.sessions[r.sid]
            assert s.cache_len == len(r.committed) - 1 and s.root == r.committed[-1]
            assert_kv_equal(cache_kv(s.cache), prefill_kv(model, r.committed[:-1]), **TOL, what=f"{r.sid} cache")
    assert len(spy.solo) == solo_rounds, "every round of several requests should use the batched forward"
    for r in requests:
        assert r.committed[len(r.prompt):] == hf_greedy(model, r.prompt, r.n), r.sid
    # the batch shrank as requests finished, and acceptance differed between requests
    assert batch_sizes[0] == len(requests) and len(set(batch_sizes)) >= 3, batch_sizes
    lengths = {r.sid: set(r.accepted_lengths) for r in requests}
    assert lengths["r0"] == {0} and lengths["r1"] == {0} and lengths["r2"] == {2} and 4 in lengths["r3"]
    assert len(lengths["r5"]) >= 2, lengths["r5"]


@pytest.mark.parametrize("kind", list(MODELS))
def test_batched_rounds_many_prompts_default_models(kind):
    """Token equality on the suite's default std-0.5 models (larger logits, larger round-off than
    the std-0.2 ones): 10 requests with prompt lengths 1..28, all verified together every round."""
    model = tiny_model(kind, seed={"qwen2": 0, "llama": 1}[kind])
    draft = DraftRuntime(perturbed_copy(model, seed=7, scale=0.1))
    target = TargetRuntime(model)
    prompts = {f"p{i}": random_prompt(seed=9300 + i, length=1 + 3 * i) for i in range(10)}
    out = {sid: [] for sid in prompts}
    for sid, prompt in prompts.items():
        target.start(sid, prompt)
        draft.start(sid, prompt)
    n, accepted = 16, 0
    while active := [sid for sid in prompts if len(out[sid]) < n]:
        trees = [draft.propose(sid, SEED_SPEC, SEED_SPEC.gamma) for sid in active]
        for sid, result in zip(active, target.verify_batch(list(zip(active, trees)))):
            num = min(len(result.tokens), n - len(out[sid]))
            target.commit(sid, num)
            draft.commit(sid, list(result.tokens[:num]), list(result.accepted_nodes[:num]))
            out[sid] += result.tokens[:num]
            accepted += len(result.accepted_nodes)
    for sid, prompt in prompts.items():
        assert out[sid] == hf_greedy(model, prompt, n), sid
    assert accepted > 0


# ------------------------------------------------------------------------------------------------
# (c) seeded sampled sessions batched with greedy ones
# ------------------------------------------------------------------------------------------------

SAMPLED_TREE = TreeSpec(gamma=2, topKSpec=[[3], [2]], topHead=[1, 1], treeType=1)


@pytest.mark.parametrize("kind", list(MODELS))
def test_sampled_sessions_batched_reproduce_solo_tokens(kind):
    model = MODELS[kind]()
    draft_model = perturbed_copy(model, seed=6, scale=0.04)
    configs = [  # (sampling, spec, prompt length)
        (SamplingParams(temperature=0.8, seed=11), SEED_SPEC, 5),
        (GREEDY, SEED_SPEC, 12),
        (SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=12), SAMPLED_TREE, 2),
        (SamplingParams(temperature=1.2, seed=13), TreeSpec.chain(3), 8),
        (GREEDY, TreeSpec.chain(2), 1),
    ]
    solo, batched, draft = TargetRuntime(model), TargetRuntime(model), DraftRuntime(draft_model)
    sids = [f"x{i}" for i in range(len(configs))]
    committed = {}
    for sid, (sampling, _, length) in zip(sids, configs):
        prompt = random_prompt(seed=9200 + length, length=length)
        committed[sid] = list(prompt)
        for worker in (solo, batched, draft):
            worker.start(sid, prompt, sampling)
    n_new = 16
    proposals_seen = 0
    for _ in range(n_new):  # every round commits >= 1 token
        trees = [draft.propose(sid, spec, spec.gamma) for sid, (_, spec, _) in zip(sids, configs)]
        proposals_seen += sum(len(tree.proposals) for tree in trees)
        results = batched.verify_batch(list(zip(sids, trees)))
        for sid, tree, result in zip(sids, trees, results):
            assert result == solo.verify(sid, tree), sid
            for worker in (solo, batched):
                worker.commit(sid, len(result.tokens))
            draft.commit(sid, list(result.tokens), list(result.accepted_nodes))
            committed[sid] += result.tokens
    for sid, (sampling, _, _) in zip(sids, configs):
        b, s = batched.sessions[sid], solo.sessions[sid]
        if not sampling.greedy:  # same number of draws from the same stream
            assert b.rng.bit_generator.state == s.rng.bit_generator.state, sid
        assert_kv_equal(cache_kv(b.cache), cache_kv(s.cache), **TOL, what=sid)
    assert proposals_seen > 0, "no sampled (treeType 1) tree was verified"
    # sanity: the sampled requests really sampled (they left the greedy continuation)
    for sid, (sampling, _, length) in zip(sids, configs):
        prompt = committed[sid][:length]
        greedy = hf_greedy(model, prompt, n_new)
        assert (committed[sid][length : length + n_new] == greedy) == sampling.greedy, sid


# ------------------------------------------------------------------------------------------------
# (d) per-item errors
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(MODELS))
def test_per_item_errors_leave_other_items_alone(kind, spy):
    model, sessions = _case_items(kind, CASES[:3])
    solo, batched = TargetRuntime(model), TargetRuntime(model)
    for sid, prompt, *_ in sessions:
        solo.start(sid, prompt)
        batched.start(sid, prompt)
    batched.start("pending", [4, 5, 6])
    pending = batched.verify("pending", DraftTree((7,), (-1,)))
    pending_slots = cache_length(batched.sessions["pending"].cache)
    batched.start("bad", [1, 2, 3])
    (a, _, tree_a, _, _), (b, _, tree_b, _, _), (c, _, tree_c, _, _) = sessions
    items = [
        ("missing", tree_a),
        (a, tree_a),
        ("bad", DraftTree((3, VOCAB), (-1, 0))),  # token id outside the vocabulary
        ("pending", DraftTree((1,), (-1,))),
        (b, tree_b),
        (a, tree_c),  # duplicate session id
        ("bad", DraftTree(tuple(range(40)), (-1,) * 40)),  # duplicate too (and over a 32-node limit)
        "not a pair",
        (c, None),
    ]
    batched.max_tree_nodes = 32
    spy.reset()
    results = batched.verify_batch(items)
    assert len(spy.batched) == 1 and len(spy.batched[0]) == 2, "only the two valid items go to the forward"
    assert isinstance(results[0], UnknownSessionError) and "missing" in str(results[0])
    assert isinstance(results[2], MalformedTreeError) and "tokens[1]" in str(results[2])
    assert isinstance(results[3], SessionStateError) and "uncommitted" in str(results[3])
    assert isinstance(results[5], SessionStateError) and "item 1" in str(results[5])
    assert isinstance(results[6], SessionStateError) and "item 2" in str(results[6])
    assert isinstance(results[7], TypeError) and isinstance(results[8], TypeError)
    for index, sid, tree in [(1, a, tree_a), (4, b, tree_b)]:
        assert results[index] == solo.verify(sid, tree)
        _assert_same_session(batched, solo, sid)
    # failed items changed nothing
    assert batched.sessions["pending"].pending == pending
    assert cache_length(batched.sessions["pending"].cache) == pending_slots
    # (until its first commit a session's cache holds its whole prompt, R's KV included: runtime docstring)
    assert batched.sessions["bad"].pending is None and cache_length(batched.sessions["bad"].cache) == 3
    assert batched.sessions[c].pending is None and cache_length(batched.sessions[c].cache) == 13
    # only invalid items: no forward at all
    spy.reset()
    again = batched.verify_batch([("missing", tree_a), (a, tree_a)])  # a is now pending
    assert not spy.batched and not spy.solo
    assert isinstance(again[0], UnknownSessionError) and isinstance(again[1], SessionStateError)


def test_acceptance_error_stays_in_its_slot(spy):
    """A sampled tree whose proposal gives a sibling q = 0 fails in the acceptance walk, after the
    forward: its slot gets the error ``verify`` raises, the other item is unaffected."""
    model = MODELS["qwen2"]()
    sampling = SamplingParams(temperature=0.9, seed=3)
    q = np.zeros(VOCAB)
    q[[10, 11]] = 0.5
    broken = DraftTree((12, 10), (-1, -1), proposals=(Proposal(-1, q),))  # 12 has q = 0
    _, sessions = _case_items("qwen2", CASES[1:2])
    sid, prompt, tree, path, _ = sessions[0]
    solo, batched = TargetRuntime(model), TargetRuntime(model)
    for runtime in (solo, batched):
        runtime.start("sampled", [5, 6, 7, 8], sampling)
        runtime.start(sid, prompt)
    results = batched.verify_batch([("sampled", broken), (sid, tree)])
    assert len(spy.batched) == 1
    with pytest.raises(MalformedTreeError, match="q = 0") as raised:
        solo.verify("sampled", broken)
    assert type(results[0]) is type(raised.value) and str(results[0]) == str(raised.value)
    assert results[1].accepted_nodes == path and results[1] == solo.verify(sid, tree)
    for name in ("sampled", sid):
        _assert_same_session(batched, solo, name)  # the failed one as verify leaves it: no pending
    assert batched.sessions["sampled"].pending is None


def test_packed_layout_needs_sdpa_and_auto_falls_back_to_padded():
    """packed=None picks the packed layout on an sdpa model and the padded one on an eager model
    (or one whose class does not take a registered attention); packed=True there is refused naming
    attn_implementation; a packed forward on a model that was never switched, with mismatched
    lengths, an empty row or a mask of the wrong shape is refused too."""
    import copy

    from specdec.forward import model_forward_packed

    sdpa = copy.deepcopy(tiny_model("qwen2", seed=0, init_std=STD))
    sdpa.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="use_packed_attention"):
        model_forward_packed(sdpa, [new_cache(sdpa.config)], [[1]], [torch.tensor([0])], [torch.zeros(1, 1, 1, 1)])
    assert TargetRuntime(sdpa).packed and sdpa.config._attn_implementation == "specdec_packed"
    eager = copy.deepcopy(sdpa)
    eager.set_attn_implementation("eager")
    assert not TargetRuntime(eager).packed
    with pytest.raises(ValueError, match="attn_implementation"):
        TargetRuntime(eager, packed=True)
    with pytest.raises(ValueError, match="lengths 2 / 1"):
        model_forward_packed(sdpa, [new_cache(sdpa.config)] * 2, [[1]], [torch.tensor([0])], [torch.zeros(1, 1, 1, 1)])
    with pytest.raises(ValueError, match=r"masks\[0\]: shape \(1, 1, 1, 3\), expected \(1, 1, 2, 2\)"):
        model_forward_packed(sdpa, [new_cache(sdpa.config)], [[1, 2]], [torch.tensor([0, 1])], [torch.zeros(1, 1, 1, 3)])
    with pytest.raises(ValueError, match=r"masks\[0\]: .*for 0 >= 1 rows"):
        model_forward_packed(sdpa, [new_cache(sdpa.config)], [[]], [torch.tensor([], dtype=torch.long)], [torch.zeros(1, 1, 0, 0)])
    # a class that cannot switch its attention (transformers only warns): refused, auto falls back to padded
    stuck = copy.deepcopy(sdpa)
    stuck.set_attn_implementation("sdpa")
    stuck.set_attn_implementation = lambda name: None  # what transformers does for such a class: keep sdpa
    assert not TargetRuntime(stuck).packed and stuck.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="does not take a registered attention"):
        TargetRuntime(stuck, packed=True)
