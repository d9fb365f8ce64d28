"""The int8-screened exact argmax head (``specdec.argmax_head``) and the target runtime's greedy
rows through it.

Criterion everywhere: the screened argmax equals ``torch.argmax`` of the float32 logits exactly,
row for row (no tolerance), on hidden states with the outlier dimensions real LLM hidden states
have and on constructed near-ties; and a target runtime whose greedy rows go through the screen
gives the very same VerifyResults (and sampled sessions the same draws) as one without it, with
partial acceptance at every depth (scripted drafts) and in packed batches mixing greedy and sampled
sessions. The screen must also prune (most tokens never reach the float32 re-check) and its error
bound must matter (without it the same data gives wrong argmaxes), so neither a screen that keeps
every token nor one that trusts the int8 scores passes.
"""

from __future__ import annotations

import copy

import pytest
import torch

import specdec.argmax_head as argmax_head_module
from draft_service.runtime import DraftRuntime
from orchestrator.controller import GenerationRequest
from orchestrator.engine import SpeculativeEngine
from specdec.argmax_head import ArgmaxHead, argmax_head_of, attach_argmax_head, fbgemm_available
from specdec.sampling import GREEDY, SamplingParams
from specdec.tree_spec import SEED_SPEC, TreeSpec
from target_service.runtime import TargetRuntime
from tests.conftest import OracleDraft, hf_greedy, perturbed_copy, random_prompt, tiny_model

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="torch has no fbgemm/x86 quantized kernels here")

V, H = 3000, 96


def _weight(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=gen) * 0.05
    w *= torch.rand(V, 1, generator=gen) * 1.5 + 0.25  # rows of different norms (per-channel scales differ)
    return w


def _hidden(rows: int, seed: int) -> torch.Tensor:
    """Hidden states with a few large outlier dimensions, as LLM final hidden states have."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, H, generator=gen) * 2
    x[:, [3, 17, 50]] *= 40  # outliers: they set the 7-bit scale, the rest rounds coarsely
    return x


@pytest.fixture(scope="module")
def head_and_weight():
    w = _weight()
    head = ArgmaxHead.build(w)
    assert head is not None, "the kernel check refused fbgemm on this machine"
    return head, w


@pytest.mark.parametrize("rows", [1, 3, 17, 40])
def test_screened_argmax_equals_float32_argmax(head_and_weight, rows):
    head, w = head_and_weight
    x = _hidden(rows, seed=rows)
    assert torch.equal(head.argmax(x), (x @ w.t()).argmax(dim=-1))


def test_near_ties_resolve_as_float32(head_and_weight):
    """Tokens whose logits differ by 1e-5 of their size (far inside the int8 error, ~100 float32
    ulps): the exact re-check decides. Each winner gets its own rival (no exact ties)."""
    _, w = head_and_weight
    w = w.clone()
    x = _hidden(24, seed=7)
    top = (x @ w.t()).argmax(dim=-1).tolist()
    gen = torch.Generator().manual_seed(3)
    used, rivals = set(top), {}
    for row in range(24):
        if top[row] in rivals.values() or len(rivals) == 8:
            continue
        rival = next(int(t) for t in torch.randperm(V, generator=gen) if int(t) not in used)
        used.add(rival)
        rivals[rival] = top[row]
        sign = 1 if len(rivals) % 2 else -1  # beats or trails the winner by a hair
        w[rival] = w[top[row]] * (1 + sign * 1e-5)
    head = ArgmaxHead.build(w)
    want = (x @ w.t()).argmax(dim=-1)
    assert torch.equal(head.argmax(x), want)
    moved = sum(int(want[r]) != top[r] for r in range(24))
    assert moved > 0 and len(rivals) >= 4, "no rival won: the near-ties were not exercised"


def _rivals(w: torch.Tensor, x: torch.Tensor, gap: float, seed: int) -> torch.Tensor:
    """A copy of w where each row's winner gets a rival token whose weight row differs from the
    winner's by a random perturbation (other int8 rounding) but whose logit on that row is the
    winner's +- gap (alternating), so the int8 scores alone cannot tell them apart."""
    w = w.clone()
    top = (x @ w.t()).argmax(dim=-1).tolist()
    gen = torch.Generator().manual_seed(seed)
    used, done = set(top), set()
    for row, winner in enumerate(top):
        if winner in done:
            continue
        done.add(winner)
        rival = next(int(t) for t in torch.randperm(V, generator=gen) if int(t) not in used)
        used.add(rival)
        p = torch.randn(H, generator=gen) * 0.01
        want_gap = gap if len(done) % 2 else -gap
        row_x = x[row].double()
        new = w[winner].double() + p.double()
        new -= ((new - w[winner].double()) @ row_x - want_gap) / (row_x @ row_x) * row_x
        w[rival] = new.float()
    return w


def test_screen_prunes_and_its_bound_matters(monkeypatch):
    x = _hidden(48, seed=11)
    w = _rivals(_weight(), x, gap=0.02, seed=5)
    head = ArgmaxHead.build(w)
    want = (x @ w.t()).argmax(dim=-1)
    assert torch.equal(head.argmax(x), want)
    kept = head.survivors(x).sum(dim=1)  # (48,) tokens re-checked exactly per row
    assert kept.float().median() <= V / 50, f"the screen keeps {kept.tolist()} of {V} tokens"
    # The int8 scores alone (bound 0: keep only the best approximate score) get rows wrong.
    monkeypatch.setattr(head, "_x_slope", torch.zeros(V))
    monkeypatch.setattr(head, "_r_slope", torch.zeros(V))
    monkeypatch.setattr(argmax_head_module, "FLOOR", 0.0)
    wrong = int((head.argmax(x) != want).sum())
    assert wrong > 0, "this data cannot tell a bounded screen from a bare one"


def test_kernel_check_refuses_an_inexact_kernel(monkeypatch):
    real = ArgmaxHead._screen
    monkeypatch.setattr(ArgmaxHead, "_screen", lambda self, rows: real(self, rows) * (1 + 1e-3))
    assert ArgmaxHead.build(_weight(1)) is None


def test_attach_only_where_logits_are_the_plain_head():
    model = copy.deepcopy(tiny_model("qwen2", seed=0))
    assert attach_argmax_head(model)
    assert argmax_head_of(model) is not None
    assert "specdec_argmax_head" not in dict(model.named_modules())  # not a submodule
    biased = copy.deepcopy(tiny_model("qwen2", seed=0))
    head = biased.lm_head
    biased.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    assert not attach_argmax_head(biased)
    assert argmax_head_of(biased) is None
    bf16 = copy.deepcopy(tiny_model("qwen2", seed=0)).to(torch.bfloat16)
    assert not attach_argmax_head(bf16)


# ------------------------------------------------------------------------------------------------
# the target runtime's greedy rows through the screen
# ------------------------------------------------------------------------------------------------


def _screened(model):
    out = copy.deepcopy(model)
    assert attach_argmax_head(out)
    return out


class CountingHead:
    """Wraps an ArgmaxHead, counting the rows it decided."""

    def __init__(self, head):
        self.head, self.rows = head, 0

    def argmax(self, hidden):
        self.rows += hidden.reshape(-1, self.head.hidden_size).shape[0]
        return self.head.argmax(hidden)


SPECS = {"chain4": TreeSpec.chain(4), "seed": SEED_SPEC}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("agree", range(5))
def test_greedy_generation_through_the_screen_equals_target(name, agree):
    """A scripted draft right for exactly ``agree`` tokens a round (capped by the tree's depth)."""
    spec = SPECS[name]
    agree = min(agree, spec.gamma)
    model = tiny_model("qwen2", seed=0)
    screened = _screened(model)
    prompt = random_prompt(seed=4100 + agree + len(name))
    n_new = 16
    reference = hf_greedy(model, prompt, n_new + spec.gamma + 1)
    runtime = TargetRuntime(screened)
    counter = runtime.argmax_head = CountingHead(runtime.argmax_head)
    engine = SpeculativeEngine(runtime, OracleDraft(prompt, reference, agree=agree, seed=agree),
                               eos_token_ids=[], context_limit=512)
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=n_new, spec=spec))
    assert out.tokens == reference[:n_new]
    assert counter.rows >= out.stats.rounds - 1  # every verify forward's rows went through the screen


def test_packed_batch_mixing_greedy_and_sampled_sessions_equals_full_head():
    model = tiny_model("qwen2", seed=0, init_std=0.2)
    draft_model = perturbed_copy(model, seed=6, scale=0.04)
    configs = [  # (sampling, spec, prompt length)
        (GREEDY, SEED_SPEC, 12),
        (SamplingParams(temperature=0.8, seed=11), SEED_SPEC, 5),
        (GREEDY, TreeSpec.chain(3), 1),
        (SamplingParams(temperature=1.0, top_k=20, seed=12), TreeSpec(gamma=2, topKSpec=[[3], [2]], topHead=[1, 1], treeType=1), 3),
    ]
    full, screened, draft = TargetRuntime(model), TargetRuntime(_screened(model)), DraftRuntime(draft_model)
    assert screened.packed
    counter = screened.argmax_head = CountingHead(screened.argmax_head)
    sids = [f"m{i}" for i in range(len(configs))]
    for sid, (sampling, _, length) in zip(sids, configs):
        prompt = random_prompt(seed=5200 + length, length=length)
        for worker in (full, screened, draft):
            worker.start(sid, prompt, sampling)
    accepted_depths = set()
    for _ in range(10):
        trees = [draft.propose(sid, spec, spec.gamma) for sid, (_, spec, _) in zip(sids, configs)]
        got = screened.verify_batch(list(zip(sids, trees)))
        want = full.verify_batch(list(zip(sids, trees)))
        assert got == want
        for sid, result in zip(sids, got):
            accepted_depths.add(len(result.accepted_nodes))
            for worker in (full, screened):
                worker.commit(sid, len(result.tokens))
            draft.commit(sid, list(result.tokens), list(result.accepted_nodes))
    for sid, (sampling, _, _) in zip(sids, configs):
        if not sampling.greedy:  # the same draws from the same stream
            assert screened.sessions[sid].rng.bit_generator.state == full.sessions[sid].rng.bit_generator.state
    assert counter.rows > 0
    assert len(accepted_depths) >= 2, f"acceptance never varied: {accepted_depths}"
