"""The default real pair (Qwen2.5-Coder 1.5B target, 0.5B draft), float32, on the built-in prompt set.

Greedy: speculative output must equal the target alone (transformers ``generate(do_sample=False)``
on the same model object), token for token, and the draft must get some tokens accepted.
Temperature 0.7: fluent text, accepted draft tokens, and the benchmark table reports them.
Both models' ``DirectDecoder`` (the runtimes' one-session forward) gives the model forward's logits
and KV bit for bit at the real shapes, attention as the runtimes set it (tests/test_forward_paths.py
also compares with transformers' own attention, on tiny models).
The prompts are the first of each category in the package's own set (``orchestrator/measure/data/prompts.jsonl``),
so these tests run on any clone (before 2026-12-06 they read ../shared's Spec-Bench file and were
skipped without it).
"""

from __future__ import annotations

import re

import pytest
import torch

from orchestrator.measure.bench import load_questions, markdown_table, run_question, summarize
from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.embedded import build_pipeline, encode_prompt
from specdec.argmax_head import argmax_head_of
from specdec.forward import DirectDecoder, model_forward
from specdec.kv_cache import new_cache
from specdec.sampling import SamplingParams
from specdec.tree import node_depths
from specdec.tree_spec import SEED_SPEC, TreeSpec
from tests.conftest import cache_kv, tree_mask

pytestmark = pytest.mark.real_models


def builtin_prompts(n: int = 3) -> list[str]:
    """The first prompt of the first n categories of the built-in set (writing, roleplay, reasoning)."""
    return [q["turns"][0] for q in load_questions(None, per_category=1)[:n]]


@pytest.fixture(scope="module")
def pipe():
    torch.set_num_threads(2)
    return build_pipeline(dtype="float32")


@pytest.mark.parametrize("index, spec", [(0, SEED_SPEC), (1, SEED_SPEC), (2, TreeSpec.chain(4))])
def test_default_pair_greedy_equals_target_only(pipe, index, spec):
    prompt_ids = encode_prompt(pipe.tokenizer, builtin_prompts()[index], raw=False)
    eos = sorted(pipe.engine.eos_token_ids)
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        ref = pipe.target_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                         do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    ref_tokens = ref[0, len(prompt_ids):].tolist()
    result = pipe.engine.generate(GenerationRequest(prompt_ids, 32, spec=spec))
    assert result.tokens == ref_tokens
    assert len(result.tokens) == 32 or result.tokens[-1] in eos
    assert result.stats.acceptance_rate > 0
    assert result.stats.rounds < len(result.tokens)  # speculation committed more than one token per round


def _mean_target_nll(pipe, prompt_ids, tokens) -> float:
    """Mean negative log-likelihood (nats/token) of ``tokens`` after the prompt under the target."""
    ids = torch.tensor([prompt_ids + tokens])
    with torch.inference_mode():
        logprobs = torch.log_softmax(pipe.target_model(ids).logits[0, len(prompt_ids) - 1 : -1].float(), -1)
    return float(-logprobs.gather(1, torch.tensor(tokens)[:, None]).mean())


@pytest.mark.parametrize("tree_type", [0, 1])
def test_default_pair_sampled_text_is_fluent(pipe, tree_type):
    """Temperature 0.7: readable text (the target finds it likely: a few nats/token at most, where
    random tokens cost ~12) and accepted draft tokens, for both tree types."""
    prompt_ids = encode_prompt(pipe.tokenizer, builtin_prompts()[0], raw=False)
    spec = SEED_SPEC.model_copy(update={"tree_type": tree_type})
    result = pipe.engine.generate(GenerationRequest(prompt_ids, 32, spec=spec, sampling=SamplingParams(temperature=0.7, seed=0)))
    text = pipe.tokenizer.decode(result.tokens, skip_special_tokens=True)
    stats = result.stats
    print(f"treeType {tree_type}, T=0.7: acceptance rate {stats.acceptance_rate:.3f}, mean accepted length "
          f"{stats.mean_accepted_length:.2f}, {stats.tokens_per_s:.2f} tokens/s: {text!r}")
    assert len(re.findall(r"[A-Za-z]{2,}", text)) >= 5, text
    assert sum(ch.isprintable() or ch.isspace() for ch in text) >= 0.95 * len(text), text
    assert _mean_target_nll(pipe, prompt_ids, result.tokens) < 2.5, text
    assert stats.acceptance_rate > 0 and stats.mean_accepted_length > 1


def test_benchmark_table_reports_sampled_acceptance(pipe):
    prompt_ids = encode_prompt(pipe.tokenizer, builtin_prompts()[1], raw=False)
    row = run_question(pipe, prompt_ids, SEED_SPEC, 24, hf_assisted=False, sampling=SamplingParams(temperature=0.7, seed=0))
    summary = summarize([row])
    print(markdown_table({"overall": summary}, temperature=0.7))
    assert summary["sampled_acceptance_rate"] > 0 and summary["sampled_mean_accepted_length"] > 1
    table = markdown_table({"overall": summary}, temperature=0.7)
    assert "T=0.7 acc rate" in table.splitlines()[0]


def depth_positions(parents: list[int], cached: int) -> torch.Tensor:
    """[P] position ids of P tree rows after ``cached`` slots: a row at depth d (parents -1 at depth 0) at cached + d."""
    return torch.tensor([cached + d - 1 for d in node_depths(parents)])  # node_depths: parent -1 is depth 1


@pytest.mark.parametrize("which", ["draft", "target"])
def test_direct_decoder_equals_the_model_forward_on_the_real_pair(pipe, which):
    """The int8 draft and the packed float32 target as the pipeline loaded them (attention as the
    runtimes set it): the call shapes the runtimes make, logits and KV equal bit for bit with the
    model forward: a prefill (last row's logits), the draft's catch-up of 2 pending tokens (no mask:
    DirectDecoder builds the causal one), a 4-node tree step (tree mask, tree position ids: a node at
    depth d sits at cached + d), a one-row step, and for the target a greedy verify through its
    ArgmaxHead (argmax ids)."""
    model = pipe.draft_model if which == "draft" else pipe.target_model
    direct = DirectDecoder.of(model)
    assert direct is not None  # the real pair has no forward hooks and a layout DirectDecoder knows
    ids = encode_prompt(pipe.tokenizer, builtin_prompts()[2], raw=False)
    at = len(ids) - 7
    parents = [-1, 0, 0, 1]
    calls = [(ids[:at], torch.arange(at), None, 1, None),
             (ids[at:at + 2], torch.arange(at, at + 2), None, None, None),
             (ids[at + 2:at + 6], depth_positions(parents, at + 2), tree_mask(at + 2, parents), None, None),
             (ids[-1:], torch.tensor([at + 6]), None, None, None)]
    if which == "target":
        head = argmax_head_of(model)
        assert head is not None
        calls.append(([ids[0], ids[1], ids[2]], depth_positions([-1, 0, 1], at + 7), tree_mask(at + 7, [-1, 0, 1]),
                      None, head))
    ref_cache, cache = new_cache(model.config), new_cache(model.config)
    with torch.inference_mode():
        for i, (step_ids, positions, mask, keep, argmax_head) in enumerate(calls):
            expected = model_forward(model, ref_cache, step_ids, positions, mask, logits_rows=keep, argmax_head=argmax_head)
            got = direct(cache, step_ids, positions, mask, logits_rows=keep, argmax_head=argmax_head)
            if argmax_head is None:
                assert got.shape == expected.shape == (keep or len(step_ids), model.config.vocab_size), i
            else:
                assert got.shape == expected.shape == (len(step_ids),) and got.dtype == torch.int64, i
            assert torch.equal(got, expected), (i, (got.double() - expected.double()).abs().max().item())
            for (k, v), (ref_k, ref_v) in zip(cache_kv(cache), cache_kv(ref_cache)):
                assert torch.equal(k, ref_k) and torch.equal(v, ref_v), i
