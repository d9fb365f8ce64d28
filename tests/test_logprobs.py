"""Issue 60: logprobs of the committed tokens are the target's own log-softmax at each position, whatever the
speculation did: the embedded engine (draft + target runtimes, partial acceptance at several depths, greedy and
seeded sampled) reports what one plain causal forward of the target over the final sequence gives; a logprobs
session beside an ordinary one in one batched verify leaves the other's result unchanged; the fields cross
the wire and bad values name their field."""

from __future__ import annotations

import pytest
import torch

from draft_service.runtime import DraftRuntime
from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.engine import SpeculativeEngine
from orchestrator.serving.front import response_of
from orchestrator.serving.requests import StreamEvent
from specdec.sampling import SamplingParams, SamplingParamsError, TokenLogprob
from specdec.tree import DraftTree
from specdec.tree_spec import TreeSpec
from specdec.wire import (
    logprobs_from_proto,
    logprobs_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from target_service.runtime import PrefillChunk, TargetRuntime
from tests.conftest import causal_logits, perturbed_copy, random_prompt, tiny_model

K = 4
SPEC = TreeSpec(gamma=4, topKSpec=[[2], [1, 1], [1, 1], [1, 1]], topHead=[1, 2, 2, 2])


def assert_target_logprobs(model, prompt: list[int], tokens: list[int], logprobs, k: int = K) -> None:
    """logprobs: one TokenLogprob per token, equal (1e-5) to a plain forward's log-softmax at its position, the top
    k sorted and equal to the reference's top k."""
    ref = torch.log_softmax(causal_logits(model, prompt + tokens), dim=-1)[len(prompt) - 1:-1]  # (n, V)
    assert [lp.token for lp in logprobs] == tokens
    for row, lp in zip(ref, logprobs):
        assert lp.logprob == pytest.approx(row[lp.token].item(), abs=1e-5)
        ids, values = zip(*lp.top)
        assert list(values) == sorted(values, reverse=True) and len(ids) == k
        assert torch.allclose(torch.tensor(values), row.topk(k).values, atol=1e-5)
        if (row > row[lp.token]).sum() < k - 1:  # it ranks clearly inside the top k
            assert lp.token in ids


@pytest.fixture(scope="module")
def engine():
    target = tiny_model("qwen2", seed=0)
    draft = DraftRuntime(perturbed_copy(target, seed=1, scale=0.05))
    return target, SpeculativeEngine(TargetRuntime(target), draft, eos_token_ids=[], context_limit=512)


@pytest.mark.parametrize("sampling", [SamplingParams(logprobs=K), SamplingParams(0.8, seed=3, logprobs=K)],
                         ids=["greedy", "sampled"])
def test_speculative_logprobs_equal_a_plain_forward(engine, sampling):
    model, eng = engine
    prompt = random_prompt(5, 8)
    rounds: list[list[int]] = []
    out = eng.generate(GenerationRequest(prompt, 24, spec=SPEC, sampling=sampling), on_tokens=rounds.append)
    assert len({len(r) for r in rounds}) >= 3, "partial acceptance at several depths"
    assert_target_logprobs(model, prompt, out.tokens, out.logprobs)
    plain = eng.generate(GenerationRequest(prompt, 24, spec=SPEC, sampling=SamplingParams(
        sampling.temperature, seed=sampling.seed)))
    assert plain.tokens == out.tokens and plain.logprobs == []  # asking for logprobs changes no token


def test_a_logprobs_session_beside_an_ordinary_one_in_one_batch():
    model = tiny_model("qwen2", seed=0)
    runtime = TargetRuntime(model)
    tree = DraftTree((5, 9, 7), (-1, 0, -1))
    for sid, prompt, sampling in (("a", [3, 1, 4], SamplingParams(logprobs=2)), ("b", [2, 7, 1, 8], SamplingParams()),
                                  ("b-solo", [2, 7, 1, 8], SamplingParams())):
        runtime.start(sid, prompt, sampling)
    a, b = runtime.verify_batch([("a", tree), ("b", tree)])
    solo = runtime.verify("b-solo", tree)
    assert b == solo and b.logprobs == () and len(a.logprobs) == len(a.tokens)
    assert_target_logprobs(model, [3, 1, 4], list(a.tokens), a.logprobs, k=2)


def test_logprobs_cross_the_wire_and_bad_values_name_the_field():
    assert sampling_from_proto(sampling_to_proto(SamplingParams(logprobs=0))).logprobs == 0
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).logprobs is None
    lps = (TokenLogprob(3, -0.5, ((3, -0.5), (4, -1.25))), TokenLogprob(4, -2.0, ()))
    assert logprobs_from_proto(logprobs_to_proto(lps), [3, 4]) == lps
    first = TokenLogprob(7, None)  # the prompt's first token: no logprob
    msg = response_of("r", StreamEvent([3, 4], "ab", logprobs=lps, prompt_logprobs=(first, lps[0])))
    assert logprobs_from_proto(msg.logprobs, msg.token_ids) == lps and msg.prompt_logprobs[1].logprob == -0.5
    for field, bad in [(f, b) for f in ("logprobs", "prompt_logprobs") for b in (21, -1, True)]:
        with pytest.raises(SamplingParamsError) as info:
            SamplingParams(**{field: bad})
        assert info.value.field == field


def test_prompt_logprobs_equal_a_plain_forward_over_the_prompt(engine):
    """In one prefill, in chunks (extend, and a chunk riding in a batched verify) and through the engine with no
    new tokens (scoring only)."""
    model, eng = engine
    prompt = random_prompt(9, 10)
    runtime = TargetRuntime(model)
    whole = runtime.start("whole", prompt, SamplingParams(prompt_logprobs=3))
    runtime.start("chunked", prompt[:3], SamplingParams(prompt_logprobs=3))
    runtime.extend("chunked", prompt[3:6])
    runtime.start("other", [1, 2], SamplingParams())
    runtime.verify_batch([("chunked", PrefillChunk(tuple(prompt[6:]))), ("other", DraftTree((4,), (-1,)))])
    out = eng.generate(GenerationRequest(prompt, 0, spec=SPEC, sampling=SamplingParams(prompt_logprobs=3)))
    assert out.tokens == [] and out.stats.stop_reason == "max_new_tokens"
    for scored in (whole, runtime.prompt_logprobs("chunked"), out.prompt_logprobs):
        assert_target_logprobs(model, prompt[:1], prompt[1:], scored, k=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate(GenerationRequest(prompt, 0, spec=SPEC))
