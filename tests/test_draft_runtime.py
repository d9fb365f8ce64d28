"""DraftRuntime.prefill: the draft service prefills at Start so the draft's prefill overlaps the
target's; the trees and the cache afterwards are those of the lazy path (prefill in the first propose)."""

from __future__ import annotations

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
