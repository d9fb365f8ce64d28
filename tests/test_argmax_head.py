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
from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.engine import SpeculativeEngine
from specdec.argmax_head import ArgmaxHead, argmax_head_of, attach_argmax_head, fbgemm_available
from specdec.sampling import GREEDY, SamplingParams
from specdec.tree_spec import SEED_SPEC, TreeSpec
from specdec.tree import DraftTree
from target_service.runtime import CHUNK_FED, PrefillChunk, TargetRuntime
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


def test_near_ties_resolve_as_float32(head_and_weight):
    """Each winner gets a rival with another int8 rounding whose logit is 1e-3 above or below its own
    (far inside the int8 error, ~500 float32 ulps): the re-check decides, as the float32 GEMM does."""
    _, w = head_and_weight
    x = _hidden(24, seed=7)
    top = (x @ w.t()).argmax(dim=-1)
    w = _rivals(w, x, gap=1e-3, seed=3)
    head = ArgmaxHead.build(w)
    want = (x @ w.t()).argmax(dim=-1)
    assert torch.equal(head.argmax(x), want)
    assert (want != top).any() and (want == top).any(), "the rivals never (or always) won: near-ties not exercised"


def test_bound_holds_and_the_weight_term_is_needed(monkeypatch):
    """|logit - A| <= B for every token of rows with outliers and rivals, against the float64 logits
    and the float32 GEMM's, including tokens whose int8 rounding errors all point along a row's x
    (the worst case of the ||x|| ||E_i|| term); without that term the bound fails for them."""
    x = _hidden(32, seed=13)
    w = _rivals(_weight(2), x, gap=0.02, seed=9)
    gen = torch.Generator().manual_seed(4)
    for token, row in ((11, 0), (12, 5), (13, 9)):  # weights 0.49 of a step off the int8 grid, toward x
        s = 0.001
        grid = torch.randint(-100, 101, (H,), generator=gen).double()
        w_row = (grid + 0.49 * torch.sign(x[row].double())) * s
        w_row[0] = 127 * s  # the row's max: its int8 scale is s
        w[token] = w_row.float()
    head = ArgmaxHead.build(w)
    exact = x.double() @ w.double().t()  # (32, V)
    approx, bound = head.scores(x)
    assert ((exact - approx.double()).abs() <= bound.double()).all()
    assert ((x @ w.t() - approx).abs() <= bound).all()
    monkeypatch.setattr(head, "_x_slope", torch.zeros(V))
    approx, bound = head.scores(x)
    missed = (exact - approx.double()).abs() > bound.double()
    assert missed[0, 11] and missed[5, 12] and missed[9, 13]


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


def test_rows_with_too_many_survivors_take_the_full_product(head_and_weight, monkeypatch):
    head, w = head_and_weight
    x = _hidden(9, seed=17)
    x[4] *= 1e-4  # a flat row: many tokens survive
    decided = []
    full = ArgmaxHead._decide
    monkeypatch.setattr(argmax_head_module, "MAX_CANDIDATES", 2)
    monkeypatch.setattr(ArgmaxHead, "_decide", lambda self, row, keep: decided.append(
        keep is not None and 0 < int(keep.sum()) <= 2) or full(self, row, keep))
    assert torch.equal(head.argmax(x), (x @ w.t()).argmax(dim=-1))
    assert not all(decided), "no row took the full product"


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
    scaled = copy.deepcopy(tiny_model("qwen2", seed=0))  # a model class that scales its logits
    plain_forward = scaled.forward

    def scaled_forward(*args, **kwargs):
        out = plain_forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    scaled.forward = scaled_forward
    assert not attach_argmax_head(scaled)


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
        self.max_rows, self.hidden_size = head.max_rows, head.hidden_size

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
    # a greedy session still prefilling: its chunk rides in the first batch; its first verify is empty
    long = random_prompt(seed=5300, length=30)
    for worker in (full, screened):
        worker.start("p", long[:10])
    draft.start("p", long)
    chunk = PrefillChunk(tuple(long[10:]))
    first = [(sid, DraftTree((), ())) for sid in sids] + [("p", chunk)]
    got, want = screened.verify_batch(first), full.verify_batch(first)
    assert got[:-1] == want[:-1] and got[-1] is CHUNK_FED and want[-1] is CHUNK_FED
    for sid, result in zip(sids, got):
        for worker in (full, screened):
            worker.commit(sid, len(result.tokens))
        draft.commit(sid, list(result.tokens), [])
    got, want = screened.verify_batch([("p", DraftTree((), ())), (sids[1], DraftTree((), ()))]), \
        full.verify_batch([("p", DraftTree((), ())), (sids[1], DraftTree((), ()))])
    assert got == want
    assert got[0].tokens == tuple(hf_greedy(model, long, 1))
    for sid, result in zip(["p", sids[1]], got):
        for worker in (full, screened):
            worker.commit(sid, len(result.tokens))
        draft.commit(sid, list(result.tokens), [])
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


def test_degenerate_rows_take_the_full_product(head_and_weight):
    """A zero row (every logit 0: the first token, as torch.argmax) and a non-finite row (the
    screen keeps nothing) fall back to the full product instead of failing."""
    head, w = head_and_weight
    x = _hidden(3, seed=2)
    x[1] = 0.0
    x[2, 5] = float("nan")
    got = head.argmax(x)
    assert int(got[0]) == int((x[0] @ w.t()).argmax())
    assert int(got[1]) == 0
    assert int(got[2]) == int((x[2:3] @ w.t()).argmax())


def test_forwards_past_max_rows_use_the_full_head():
    """A verify with more rows than ``max_rows`` skips the screen (the full head is faster there) and
    gives the same result; one within it goes through the screen."""
    model = tiny_model("qwen2", seed=0)
    full, screened = TargetRuntime(model), TargetRuntime(_screened(model))
    counter = screened.argmax_head = CountingHead(screened.argmax_head)
    counter.max_rows = 2
    prompt = random_prompt(seed=5400, length=9)
    for worker in (full, screened):
        worker.start("s", prompt)
        worker.verify("s", DraftTree((), ()))
    tokens = tuple(hf_greedy(model, prompt, 4))
    for worker in (full, screened):
        worker.commit("s", 1)
    wide = DraftTree(tokens[1:4], (-1, 0, 1))  # 4 rows with the root: past max_rows
    assert screened.verify("s", wide) == full.verify("s", wide)
    assert counter.rows == 0
    for worker in (full, screened):
        worker.commit("s", 1)
    narrow = DraftTree((tokens[2],), (-1,))  # 2 rows
    assert screened.verify("s", narrow) == full.verify("s", narrow)
    assert counter.rows == 2
