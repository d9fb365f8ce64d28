"""PackedLinear (oneDNN pre-packed float32 weights) computes what nn.Linear computes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from draft_service.runtime import DraftRuntime
from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.engine import SpeculativeEngine
from specdec.cpu_linear import PackedLinear, prepack_linears
from specdec.tree_spec import SEED_SPEC
from target_service.runtime import TargetRuntime
from tests.conftest import hf_greedy, perturbed_copy, random_prompt, tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not available")


@pytest.mark.parametrize("rows", [1, 2, 13, 40])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(3, rows, 48)
    expected = linear(x)
    got = PackedLinear(linear)(x)
    assert got.shape == (3, rows, 80)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_prepack_replaces_all_float32_linears_and_skips_others():
    model = copy.deepcopy(tiny_model("qwen2", seed=3))
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert prepack_linears(model) == n_linear > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    bf16 = copy.deepcopy(tiny_model("qwen2", seed=3)).to(torch.bfloat16)
    assert prepack_linears(bf16) == 0


def test_prepacked_pair_keeps_greedy_equality():
    target = copy.deepcopy(tiny_model("qwen2", seed=0))
    draft = copy.deepcopy(perturbed_copy(tiny_model("qwen2", seed=0), seed=1, scale=0.05))
    prepack_linears(target)
    prepack_linears(draft)
    engine = SpeculativeEngine(TargetRuntime(target), DraftRuntime(draft), [], 512)
    for seed in range(4):
        prompt = random_prompt(seed)
        result = engine.generate(GenerationRequest(prompt, 16, spec=SEED_SPEC))
        assert result.tokens == hf_greedy(target, prompt, 16)
        assert result.stats.accepted_tokens > 0
