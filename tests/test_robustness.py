"""Retries, vocabulary mismatch, multi-byte stop strings and bad values found by review.

Each case once broke a session, crashed, or was silently accepted.
"""

from __future__ import annotations

import pytest

from draft_service.runtime import DraftRuntime
from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.engine import SpeculativeEngine
from orchestrator.loop.stops import StopChecker
from specdec.models import ModelError, check_supported
from specdec.sampling import SamplingParams, SamplingParamsError
from specdec.tree import DraftTree
from specdec.tree_spec import DEFAULT_SPEC, SEED_SPEC, TreeSpecError, parse_tree_spec
from target_service.runtime import TargetRuntime
from tests.conftest import assert_kv_equal, cache_kv, hf_greedy, prefill_kv, random_prompt, tiny_model


def test_target_verify_recovers_after_a_failed_verify():
    target = tiny_model("qwen2", seed=0)
    runtime = TargetRuntime(target)
    prompt = random_prompt(3, length=6)
    runtime.start("s", prompt)
    # A verify that fails after its forward (e.g. a bad proposal found while sampling) leaves the
    # tree's slots in the cache; run that forward alone to leave them there, as such a failure would.
    runtime.tree_logits("s", DraftTree((5, 6, 7), (-1, 0, 1)))
    result = runtime.verify("s", DraftTree((), ()))
    runtime.commit("s", 1)
    expected = hf_greedy(target, prompt, 1)
    assert list(result.tokens) == expected
    assert_kv_equal(cache_kv(runtime.sessions["s"].cache), prefill_kv(target, prompt))


def test_draft_propose_twice_without_commit_gives_the_same_tree_and_cache():
    draft = tiny_model("qwen2", seed=1)
    runtime = DraftRuntime(draft)
    prompt = random_prompt(4, length=5)
    runtime.start("d", prompt)
    first = runtime.propose("d", SEED_SPEC, 3)
    second = runtime.propose("d", SEED_SPEC, 3)  # a retry
    assert (first.tokens, first.parents) == (second.tokens, second.parents)
    runtime.commit("d", [second.tokens[0], 7], [0])
    s = runtime.sessions["d"]
    assert s.cached_len == len(prompt) + (1 if second.expanded[0] else 0)
    assert_kv_equal(cache_kv(s.cache), prefill_kv(draft, s.tokens[: s.cached_len]))


def test_draft_with_a_smaller_vocabulary_falls_back_to_plain_decoding():
    target = tiny_model("qwen2", seed=0, vocab=64)
    draft = tiny_model("qwen2", seed=0, vocab=48)  # ids 48..63 have no draft embedding
    engine = SpeculativeEngine(TargetRuntime(target), DraftRuntime(draft, vocab_size=48), [], 512)
    hits = 0
    for seed in range(12):
        prompt = random_prompt(seed, length=6, vocab=48)
        expected = hf_greedy(target, prompt, 24)
        hits += any(t >= 48 for t in expected)
        assert engine.generate(GenerationRequest(prompt, 24, spec=DEFAULT_SPEC)).tokens == expected
    assert hits > 0  # the fallback path was exercised


@pytest.mark.parametrize("stop, data, stop_after", [
    ("é", [0x41, 0xC3, 0xA9, 0x42], 3),  # 'é' split over two byte tokens
    ("x→", [0x78, 0xE2, 0x86, 0x92, 0x41], 4),  # '→' split over three
    ("AB", [0x41, 0x42, 0x43], 2),
])
def test_stop_string_ending_in_a_split_multibyte_character(stop, data, stop_after):
    checker = StopChecker(1, 100, 1000, frozenset(), (stop,), lambda ids: bytes(ids).decode("utf-8", "replace"))
    pushed = 0
    for token in data:
        pushed += 1
        if checker.push(token):
            break
    assert (pushed, checker.reason) == (stop_after, "stop_string")


def test_bad_request_values_are_rejected_with_the_field():
    engine = SpeculativeEngine(TargetRuntime(tiny_model()), None, [], 512, decode=lambda ids: "")
    with pytest.raises(ValueError, match="stop_strings"):
        engine.generate(GenerationRequest([1, 2], 4, stop_strings=("",)))
    assert GenerationRequest([1], 4, stop_strings="ab").stop_strings == ("ab",)
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams(temperature=1e-300)


@pytest.mark.parametrize("spec, field", [
    ('{"gamma": "3", "topKSpec": [[1], [1], [1]], "topHead": [1, 1, 1]}', "gamma"),
    ('{"gamma": 1, "topKSpec": [[2.0]], "topHead": [1]}', "topKSpec"),
    ('{"gamma": 2, "topKSpec": [[40], [20]], "topHead": [1, 40]}', "topKSpec"),  # 40 + 800 > 512 nodes
])
def test_tree_spec_strict_types_and_node_limit(spec, field):
    with pytest.raises(TreeSpecError, match=field):
        parse_tree_spec(spec)


def test_top_k_larger_than_the_vocabulary_is_capped():
    draft = tiny_model("qwen2", seed=1, vocab=64)
    runtime = DraftRuntime(draft)
    runtime.start("d", [1, 2, 3])
    tree = runtime.propose("d", parse_tree_spec('{"gamma": 1, "topKSpec": [[500]], "topHead": [1]}'), 1)
    assert sorted(tree.tokens) == list(range(64))


def test_sliding_window_models_are_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                         sliding_window=8, max_window_layers=0)
    with pytest.raises(ModelError, match="--target"):
        check_supported(Qwen2ForCausalLM(config), "--target")
    check_supported(tiny_model(), "--target")  # full attention: accepted
