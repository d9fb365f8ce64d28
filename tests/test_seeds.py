"""Per-request sampling parameters and seeds through SpeculativeEngine with tiny models.

- a seeded request gives the same tokens run alone, again on fresh workers, and in a batch with other
  requests (seeded, unseeded, greedy), whatever the global random state;
- unseeded requests differ from run to run, different seeds differ;
- temperature-0 requests are exactly greedy (transformers ``generate``), also next to sampled ones;
- top_k = 1 makes sampling deterministic: the output is the greedy one, so the target really
  processes p with the request's parameters (not defaults).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from draft_service.runtime import DraftRuntime
from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.engine import SpeculativeEngine
from specdec.sampling import SamplingParams
from specdec.tree_spec import SEED_SPEC, TreeSpec
from target_service.runtime import TargetRuntime
from tests.conftest import hf_greedy, perturbed_copy, tiny_model

N_NEW = 24
PROMPT = [5, 17, 42, 9]


def make_engine(draft_scale: float = 0.05) -> SpeculativeEngine:
    """Fresh workers (no state shared with other engines) over the same tiny pair."""
    target = tiny_model("qwen2", seed=0)
    draft = perturbed_copy(target, seed=3, scale=draft_scale)
    return SpeculativeEngine(TargetRuntime(target), DraftRuntime(draft), eos_token_ids=[], context_limit=256)


def spec_of(tree_type: int) -> TreeSpec:
    return SEED_SPEC.model_copy(update={"tree_type": tree_type})


def scramble_global_rng(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@pytest.mark.parametrize("tree_type", [0, 1])
def test_seeded_request_alone_repeated_and_batched(tree_type):
    spec = spec_of(tree_type)
    request = GenerationRequest(PROMPT, N_NEW, spec=spec, sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=7))
    engine = make_engine()
    scramble_global_rng(1)
    alone = engine.generate(request).tokens
    scramble_global_rng(2)
    again = engine.generate(request).tokens
    fresh = make_engine().generate(request).tokens
    neighbours = [
        GenerationRequest([1, 2, 3], N_NEW, spec=spec, sampling=SamplingParams(temperature=1.0)),  # unseeded
        GenerationRequest(PROMPT, N_NEW // 2, spec=spec),  # greedy
        GenerationRequest([9, 9], N_NEW, spec=spec, sampling=SamplingParams(temperature=1.2, top_k=5, seed=7)),
        GenerationRequest(PROMPT, N_NEW, spec=None, sampling=SamplingParams(temperature=0.8, seed=8)),  # no draft
    ]
    scramble_global_rng(3)
    batched = engine.generate_batch([neighbours[0], neighbours[1], request, neighbours[2], neighbours[3]])
    assert len(alone) == N_NEW
    assert alone == again == fresh == batched[2].tokens
    assert [len(r.tokens) for r in batched] == [N_NEW, N_NEW // 2, N_NEW, N_NEW, N_NEW]


@pytest.mark.parametrize("tree_type", [0, 1])
def test_unseeded_and_different_seeds_differ(tree_type):
    engine = make_engine()
    spec = spec_of(tree_type)
    runs = [engine.generate(GenerationRequest(PROMPT, 40, spec=spec, sampling=SamplingParams(temperature=1.0))).tokens
            for _ in range(2)]
    assert runs[0] != runs[1]
    seeded = [engine.generate(GenerationRequest(PROMPT, 40, spec=spec, sampling=SamplingParams(temperature=1.0, seed=s))).tokens
              for s in (1, 2)]
    assert seeded[0] != seeded[1]


@pytest.mark.parametrize("tree_type", [0, 1])
def test_greedy_is_exact_next_to_sampled_requests(tree_type):
    engine = make_engine()
    spec = spec_of(tree_type)
    reference = hf_greedy(tiny_model("qwen2", seed=0), PROMPT, N_NEW)
    batch = engine.generate_batch([
        GenerationRequest(PROMPT, N_NEW, spec=spec, sampling=SamplingParams(temperature=1.0, seed=1)),
        GenerationRequest(PROMPT, N_NEW, spec=spec),  # temperature 0
        GenerationRequest(PROMPT, N_NEW, spec=spec, sampling=SamplingParams(temperature=0.5)),
        GenerationRequest(PROMPT, N_NEW, spec=None),  # temperature 0, no draft
    ])
    assert batch[1].tokens == reference
    assert batch[3].tokens == reference
    assert batch[0].tokens != reference  # the sampled neighbour really sampled


@pytest.mark.parametrize("tree_type, spec_on", [(0, True), (1, True), (0, False)])
def test_top_k_one_sampling_equals_greedy(tree_type, spec_on):
    engine = make_engine()
    spec = spec_of(tree_type) if spec_on else None
    reference = hf_greedy(tiny_model("qwen2", seed=0), PROMPT, N_NEW)
    result = engine.generate(GenerationRequest(PROMPT, N_NEW, spec=spec, sampling=SamplingParams(temperature=1.3, top_k=1)))
    assert result.tokens == reference
    if spec_on:
        assert result.stats.accepted_tokens > 0
