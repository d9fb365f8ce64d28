"""DraftRuntime.prefill: the draft service prefills at Start so the draft's prefill overlaps the
target's; the trees and the cache afterwards are those of the lazy path (prefill in the first propose).
DraftRuntime.propose_batch: several sessions' trees in shared forwards equal their solo trees."""

from __future__ import annotations

import pytest
import torch

from draft_service.runtime import DraftRuntime
from specdec.tree_spec import TreeSpec
from tests.conftest import assert_kv_equal, cache_kv, prefill_kv, random_prompt, tiny_model

SPEC = TreeSpec(gamma=3, topKSpec=[[3], [1, 1], [1, 1]], topHead=[1, 2, 2])


def _rounds(runtime: DraftRuntime, sid: str, prompt: list[int], eager: bool):
    runtime.start(sid, prompt)
    if eager:
        runtime.prefill(sid)
        assert runtime.sessions[sid].cached_len == len(prompt) - 1
    trees = []
    for _ in range(3):
        tree = runtime.propose(sid, SPEC, 3)
        trees.append(tree)
        runtime.commit(sid, [tree.tokens[0], tree.tokens[3]], [0])  # accept node 0, then a bonus token
    return trees


def test_eager_prefill_gives_the_same_trees_and_cache():
    model = tiny_model("qwen2", seed=4)
    prompt = random_prompt(seed=9, length=17)
    lazy, eager = DraftRuntime(model), DraftRuntime(model)
    lazy_trees = _rounds(lazy, "a", prompt, eager=False)
    eager_trees = _rounds(eager, "a", prompt, eager=True)
    assert [t.tokens for t in eager_trees] == [t.tokens for t in lazy_trees]
    s = eager.sessions["a"]
    assert_kv_equal(cache_kv(s.cache), prefill_kv(model, s.tokens[: s.cached_len]), what="draft cache")


def test_prefill_of_a_released_session_is_a_no_op():
    runtime = DraftRuntime(tiny_model("qwen2", seed=4))
    runtime.prefill("gone")  # queued by the service, the stream ended first: nothing to do, no error
    runtime.start("b", [5])
    runtime.prefill("b")  # one token: nothing to prefill (it is the root of the first tree)
    assert runtime.sessions["b"].cached_len == 0


BATCH_SPECS = [
    SPEC,
    TreeSpec.chain(4),
    TreeSpec(gamma=2, topKSpec=[[4], [2, 1, 1]], topHead=[1, 3], treeType=1),
    TreeSpec(gamma=3, topKSpec=[[2], [2, 1], [1, 1]], topHead=[1, 2, 2], treeType=1),
    TreeSpec(gamma=4, topKSpec=[[3], [1, 1], [1], [1]], topHead=[1, 2, 1, 1]),
    TreeSpec(gamma=2, topKSpec=[[1], [3]], topHead=[1, 1], treeType=1),
]


def _batch_sessions(runtime: DraftRuntime) -> list[tuple[str, list[int], object]]:
    """Six sessions: prompt lengths 3..40, greedy and seeded sampled (treeType 0 and 1)."""
    from specdec.sampling import GREEDY, SamplingParams

    samplings = [GREEDY, GREEDY, SamplingParams(0.8, seed=3), SamplingParams(1.0, top_k=20, seed=4),
                 SamplingParams(0.7, top_p=0.9, seed=5), GREEDY]
    out = []
    for i, (length, sampling) in enumerate(zip((3, 17, 40, 9, 25, 5), samplings)):
        sid, prompt = f"s{i}", random_prompt(seed=100 + i, length=length)
        runtime.start(sid, prompt, sampling)
        out.append((sid, prompt, sampling))
    return out


def _commit_first_path(runtime: DraftRuntime, sid: str, tree, accept: int) -> None:
    """Accept the first ``accept`` nodes along the first-child path (fewer if the tree is shallower),
    then a bonus token."""
    path, node = [], -1
    while len(path) < accept:
        children = [i for i, p in enumerate(tree.parents) if p == node]
        if not children:
            break
        node = children[0]
        path.append(node)
    runtime.commit(sid, [tree.tokens[n] for n in path] + [7 + len(path)], path)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_batched_proposals_equal_each_sessions_solo_trees_and_cache(monkeypatch, packed):
    """propose_batch over six sessions (different prompt lengths, TreeSpecs, greedy and seeded
    sampled, one prefilled eagerly, partial acceptance of 0..3 nodes between rounds) gives every
    session the tree ``propose`` gives it alone, round after round, in shared forwards (the first
    holds all six), and leaves each cache equal to a fresh prefill of its committed tokens."""
    import draft_service.runtime as module

    model = tiny_model("qwen2", seed=4)
    batched, solo = DraftRuntime(model, packed=packed), DraftRuntime(model)
    sessions = _batch_sessions(batched)
    _batch_sessions(solo)
    batched.prefill("s2")  # cached lengths differ at the first step too
    solo.prefill("s2")
    shared_rows = []  # (layout, sessions B, rows per session) of every shared forward
    import specdec.forward as forward_module

    real, real_packed = forward_module.model_forward_batch, module.model_forward_packed
    monkeypatch.setattr(forward_module, "model_forward_batch", lambda model_, cache, ids, *rest: shared_rows.append(
        ("padded", ids.shape[0], [ids.shape[1]] * ids.shape[0])) or real(model_, cache, ids, *rest))
    monkeypatch.setattr(module, "model_forward_packed", lambda model_, caches, ids, *rest: shared_rows.append(
        ("packed", len(ids), list(map(len, ids)))) or real_packed(model_, caches, ids, *rest))
    for round_ in range(4):
        items = [(sid, BATCH_SPECS[i], 4) for i, (sid, _, _) in enumerate(sessions)]
        trees = batched.propose_batch(items)
        for i, (sid, spec, depth) in enumerate(items):
            alone = solo.propose(sid, spec, depth)
            assert (trees[i].tokens, trees[i].parents) == (alone.tokens, alone.parents), (round_, sid)
            assert trees[i].draft_logprobs == pytest.approx(alone.draft_logprobs, abs=1e-4)
            accept = (round_ + i) % 4
            _commit_first_path(batched, sid, trees[i], accept)
            _commit_first_path(solo, sid, alone, accept)
    assert shared_rows and shared_rows[0][1] == 6 and len(shared_rows) >= 4 * 2, shared_rows
    assert {layout for layout, _, _ in shared_rows} == {"packed" if packed else "padded"}
    if packed:  # each session's own rows: sessions expanding different numbers of parents differ
        assert any(len(set(rows)) > 1 for _, _, rows in shared_rows), shared_rows
    for sid, _, _ in sessions:
        s = batched.sessions[sid]
        assert_kv_equal(cache_kv(s.cache), prefill_kv(model, s.tokens[: s.cached_len]), what=f"{sid} draft cache")


def test_batched_proposals_report_per_item_errors():
    """An unknown session and a repeated session fail in their own slots; the others get trees."""
    from specdec.interfaces import SessionStateError, UnknownSessionError

    runtime = DraftRuntime(tiny_model("qwen2", seed=4))
    runtime.start("a", random_prompt(seed=1, length=5))
    runtime.start("b", random_prompt(seed=2, length=8))
    out = runtime.propose_batch([("a", SPEC, 3), ("nope", SPEC, 3), ("b", SPEC, 3), ("a", SPEC, 3)])
    assert out[0].size == out[2].size == 7
    assert isinstance(out[1], UnknownSessionError) and "nope" in str(out[1])
    assert isinstance(out[3], SessionStateError) and "item 0" in str(out[3])


def _seeded_and_greedy_rounds(runtime: DraftRuntime, merged: bool) -> list:
    """Three rounds of three sessions (two greedy, one seeded sampled, treeType 1): proposed
    together (``propose_batch``) when ``merged``, else one ``propose`` each; partial acceptance."""
    from specdec.sampling import GREEDY, SamplingParams

    seeded = SamplingParams(0.9, seed=11)
    for i, (length, sampling) in enumerate(zip((12, 30, 7), (GREEDY, seeded, GREEDY))):
        runtime.start(f"q{i}", random_prompt(seed=300 + i, length=length), sampling)
    specs = [SPEC, TreeSpec(gamma=3, topKSpec=[[2], [2, 1], [1, 1]], topHead=[1, 2, 2], treeType=1), TreeSpec.chain(3)]
    trees = []
    for round_ in range(3):
        items = [(f"q{i}", specs[i], 3) for i in range(3)]
        out = runtime.propose_batch(items) if merged else [runtime.propose(*item) for item in items]
        for i, tree in enumerate(out):
            _commit_first_path(runtime, f"q{i}", tree, (round_ + i) % 3)
        trees.append(out)
    return trees


needs_int8_kernels = pytest.mark.skipif(not {"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines),
                                        reason="the int8 draft (quantize_draft) needs fbgemm / x86 kernels")


@needs_int8_kernels
def test_a_seeded_session_of_an_int8_draft_never_shares_a_forward(monkeypatch):
    """A dynamically quantized draft (the int8 CPU default) quantizes each linear's input with one
    scale for all the rows of a call, so a merged step moves a session's log-probs with the other
    sessions' rows. A seeded sampled session's steps then run alone: its trees equal its solo trees
    exactly, while the greedy sessions still share forwards. Without the rule (``scale_per_call``
    off) its log-probs differ, so the comparison has teeth."""
    import copy

    import draft_service.runtime as module
    from specdec.model_setup import quantize_draft

    model = quantize_draft(copy.deepcopy(tiny_model("qwen2", seed=4)))  # in place: not the memoised model
    assert DraftRuntime(model).scale_per_call and not DraftRuntime(tiny_model("qwen2", seed=4)).scale_per_call
    shared = []
    real = module.model_forward_packed
    monkeypatch.setattr(module, "model_forward_packed",
                        lambda model_, caches, ids, *rest: shared.append(len(ids)) or real(model_, caches, ids, *rest))
    solo = _seeded_and_greedy_rounds(DraftRuntime(model), merged=False)
    merged = _seeded_and_greedy_rounds(DraftRuntime(model), merged=True)
    assert shared and set(shared) == {2}, shared  # the two greedy sessions, never the seeded one
    for round_ in range(3):
        a, b = merged[round_][1], solo[round_][1]
        assert (a.tokens, a.parents, a.draft_logprobs) == (b.tokens, b.parents, b.draft_logprobs), round_
    unruled = DraftRuntime(model)
    unruled.scale_per_call = False
    together = _seeded_and_greedy_rounds(unruled, merged=True)
    assert any(together[r][1].draft_logprobs != solo[r][1].draft_logprobs for r in range(3))


@needs_int8_kernels
def test_a_started_prefill_ends_in_its_own_chunks_whenever_the_first_propose_comes():
    """The draft service queues a session's prefill chunk by chunk, and its first propose may come
    before the last chunk ran. That propose feeds what is left in chunks of the same size, then the
    root alone, so the calls are those of a finished prefill: an int8 draft's trees (whose
    activation scales follow the rows of each call) and its cache are the same either way. Feeding
    the rest in one call (the old path, ``prefill_chunk`` cleared) gives other log-probs."""
    import copy

    from specdec.model_setup import quantize_draft
    from specdec.sampling import SamplingParams

    model = quantize_draft(copy.deepcopy(tiny_model("qwen2", seed=4)))
    prompt = random_prompt(seed=21, length=40)
    spec = TreeSpec(gamma=3, topKSpec=[[2], [2, 1], [1, 1]], topHead=[1, 2, 2], treeType=1)
    sampling = SamplingParams(0.9, seed=2)

    def first_tree(prefill_calls: int | None, old_path: bool = False):
        runtime = DraftRuntime(model)
        runtime.start("a", prompt, sampling)
        calls = 0
        while runtime.prefill("a", 8) and (prefill_calls is None or calls + 1 < prefill_calls):
            calls += 1
        if old_path:
            runtime.sessions["a"].prefill_chunk = None
        tree = runtime.propose("a", spec, 3)
        return tree, cache_kv(runtime.sessions["a"].cache)

    finished, finished_kv = first_tree(None)
    for early in (1, 3):
        tree, kv = first_tree(early)
        assert (tree.tokens, tree.parents, tree.draft_logprobs) == (finished.tokens, finished.parents, finished.draft_logprobs)
        assert_kv_equal(kv, finished_kv, what=f"cache after {early} prefill chunks")
    old, _ = first_tree(1, old_path=True)
    assert old.draft_logprobs != finished.draft_logprobs


def test_a_failed_prefill_forward_leaves_the_cache_at_its_prefilled_prefix():
    """A chunk whose forward fails (here after the cache grew, as a forward failing in its last
    layer leaves it) is dropped from the cache: the next propose, which ends the prefill itself,
    gives the tree of a clean run."""
    model = tiny_model("qwen2", seed=4)
    prompt = random_prompt(seed=22, length=30)
    runtime = DraftRuntime(model)
    runtime.start("a", prompt)
    assert runtime.prefill("a", 8)
    real = runtime._forward  # the session's forward (DirectDecoder for this model)

    def fails_after_writing(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("injected forward failure")

    runtime._forward = fails_after_writing
    with pytest.raises(RuntimeError, match="injected"):
        runtime.prefill("a", 8)
    runtime._forward = real
    s = runtime.sessions["a"]
    assert s.cached_len == 8
    assert_kv_equal(cache_kv(s.cache), prefill_kv(model, prompt[:8]), what="cache after the failed chunk")
    clean = DraftRuntime(model)
    clean.start("a", prompt)
    clean.prefill("a", 8)
    assert runtime.propose("a", SPEC, 3).tokens == clean.propose("a", SPEC, 3).tokens
    assert_kv_equal(cache_kv(s.cache), cache_kv(clean.sessions["a"].cache), what="cache after the first propose")
