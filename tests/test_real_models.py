"""The default real pair (Qwen2.5-Coder 1.5B target, 0.5B draft), float32, greedy, three Spec-Bench prompts.

Speculative output must equal the target alone (transformers ``generate(do_sample=False)`` on the
same model object), token for token, and the draft must get some tokens accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orchestrator.embedded import build_pipeline, encode_prompt
from orchestrator.engine import GenerationRequest
from specdec.tree_spec import SEED_SPEC, TreeSpec

QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
pytestmark = pytest.mark.real_models


def spec_bench_prompts(n: int = 3) -> list[str]:
    """The first question of n different Spec-Bench categories."""
    seen, prompts = set(), []
    for line in QUESTIONS.read_text().splitlines():
        q = json.loads(line)
        if q["category"] not in seen:
            seen.add(q["category"])
            prompts.append(q["turns"][0])
        if len(prompts) == n:
            break
    return prompts


@pytest.fixture(scope="module")
def pipe():
    if not QUESTIONS.is_file():
        pytest.skip(f"Spec-Bench questions not found at {QUESTIONS} (../shared is absent)")
    torch.set_num_threads(2)
    return build_pipeline(dtype="float32")


@pytest.mark.parametrize("index, spec", [(0, SEED_SPEC), (1, SEED_SPEC), (2, TreeSpec.chain(4))])
def test_default_pair_greedy_equals_target_only(pipe, index, spec):
    prompt_ids = encode_prompt(pipe.tokenizer, spec_bench_prompts()[index], raw=False)
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
