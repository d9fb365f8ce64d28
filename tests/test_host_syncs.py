"""The hot path's host synchronisations and masks (docs/design.md "Speed paths").

- Host syncs per round, counted on the CPU by wrapping the torch.Tensor methods that read a tensor on the host
  (``item``, ``tolist``, ``cpu``, ``to("cpu")``, ``int()`` / ``float()`` / ``bool()`` / ``__index__``,
  ``np.asarray``); on an accelerator each is a device-to-host copy that waits for the device. ``numpy()`` is not
  counted: it only reads a tensor already on the host. Bound: one per forward (greedy: the draft's picks per step,
  the target's argmax ids) and, sampled, one per draft step and per visited target row.
- Plain rows (one row seeing every slot) run without a mask: bit for bit transformers' cached decode step.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch

from draft_service.runtime import DraftRuntime
from specdec.forward import DirectDecoder, model_forward, model_forward_packed, use_packed_attention
from specdec.kv_cache import new_cache
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, tree_attention_mask, tree_position_ids
from specdec.tree_spec import TreeSpec
from target_service.runtime import TargetRuntime
from tests.conftest import _cache_kwarg, cache_kv, perturbed_copy, random_prompt, tiny_model

HOST_READS = ("item", "tolist", "cpu", "__int__", "__float__", "__bool__", "__index__", "__array__")
SPEC = TreeSpec(gamma=3, topKSpec=[[3], [2, 1], [1, 1]], topHead=[1, 2, 2], treeType=0, gammaThreshold=0)


@pytest.fixture
def syncs(monkeypatch):
    """A Counter of host reads by method name, counting while ``syncs["on"]`` is 1."""
    counts = collections.Counter()

    def wrap(name):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, **kwargs):
            to_host = name != "to" or "cpu" in (*(a for a in args if isinstance(a, str)), kwargs.get("device"))
            if counts["on"] and to_host:
                counts[name] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)

    for name in (*HOST_READS, "to"):
        wrap(name)
    return counts


def _round(syncs, draft, target, sid, spec=SPEC):
    """One drafted round (propose, verify, both commits); returns (host reads, VerifyResult)."""
    syncs.clear()
    syncs["on"] = 1
    tree = draft.propose(sid, spec, spec.gamma)
    result = target.verify(sid, tree)
    target.commit(sid, len(result.tokens))
    draft.commit(sid, list(result.tokens), list(result.accepted_nodes))
    syncs["on"] = 0
    return sum(syncs.values()), result


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("qwen2", seed=0)
    return target, perturbed_copy(target, seed=1, scale=0.05)


@pytest.mark.parametrize("direct", [True, False])
def test_a_greedy_round_syncs_once_per_forward(syncs, pair, direct):
    target_model, draft_model = pair
    draft, target = DraftRuntime(draft_model, direct=direct), TargetRuntime(target_model, direct=direct)
    prompt = random_prompt(3, 9)
    draft.start("a", prompt)
    target.start("a", prompt)
    for _ in range(3):  # 3 draft steps + 1 target verify: one read each (before: 2 per expanded node + 1 = 11)
        assert _round(syncs, draft, target, "a")[0] == SPEC.gamma + 1, syncs
    for _ in range(2):  # plain round: the target's argmax id only
        syncs.clear()
        syncs["on"] = 1
        target.verify("a", DraftTree((), ()))
        target.commit("a", 1)
        syncs["on"] = 0
        assert sum(syncs.values()) == 1, syncs


def test_a_batched_greedy_round_syncs_once_per_session_and_forward(syncs, pair):
    target_model, draft_model = pair
    draft, target = DraftRuntime(draft_model), TargetRuntime(target_model)
    for sid, seed in (("a", 6), ("b", 7)):
        draft.start(sid, random_prompt(seed, 8))
        target.start(sid, random_prompt(seed, 8))
    for _ in range(2):  # 3 shared draft forwards and 1 packed verify, each read once per session
        syncs.clear()
        syncs["on"] = 1
        trees = draft.propose_batch([("a", SPEC, SPEC.gamma), ("b", SPEC, SPEC.gamma)])
        results = target.verify_batch(list(zip("ab", trees)))
        for sid, result in zip("ab", results):
            target.commit(sid, len(result.tokens))
            draft.commit(sid, list(result.tokens), list(result.accepted_nodes))
        syncs["on"] = 0
        assert sum(syncs.values()) == 2 * (SPEC.gamma + 1), syncs


@pytest.mark.parametrize("tree_type", [0, 1])
def test_a_sampled_round_syncs_once_per_draft_step_and_visited_row(syncs, pair, tree_type):
    target_model, draft_model = pair
    draft, target = DraftRuntime(draft_model), TargetRuntime(target_model)
    prompt, sampling = random_prompt(4, 9), SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    draft.start("s", prompt, sampling)
    target.start("s", prompt, sampling)
    spec = SPEC.model_copy(update={"tree_type": tree_type})
    for _ in range(3):
        count, result = _round(syncs, draft, target, "s", spec)
        assert count == spec.gamma + len(result.tokens), syncs  # visited rows: the accepted path + the last


@pytest.mark.parametrize("direct", [True, False])
def test_a_plain_row_without_a_mask_is_transformers_decode_step_bit_for_bit(direct):
    """No mask: SDPA's grouped-query kernel, as transformers' own cached decode (HF generate, the greedy
    reference); the all-visible mask took the head-packing path, within 1e-6 relative of it."""
    model = copy.deepcopy(tiny_model("qwen2", seed=7))
    reference_model = copy.deepcopy(model)
    use_packed_attention(model)
    forward = DirectDecoder.of(model) if direct else (lambda *a, **k: model_forward(model, *a, **k))
    prompt = random_prompt(5, 11)
    cache = new_cache(model.config)
    forward(cache, prompt, torch.arange(len(prompt)), None)
    caches = [copy.deepcopy(cache) for _ in range(3)]
    position = torch.tensor([len(prompt)])
    plain = forward(caches[0], [17], position, None)  # (1, V)
    (packed,) = model_forward_packed(model, [caches[1]], [[17]], [position], [None])
    masked = forward(caches[2], [17], position, torch.zeros(1, 1, 1, len(prompt) + 1))
    with torch.no_grad():
        kv, ones = {_cache_kwarg(model): new_cache(model.config)}, torch.ones(1, len(prompt) + 1, dtype=torch.long)
        reference_model(torch.tensor([prompt]), attention_mask=ones[:, :-1], **kv)
        step = reference_model(torch.tensor([[17]]), attention_mask=ones, **kv).logits[0]
    assert torch.equal(plain, step) and torch.equal(packed, step)
    assert (plain - masked).abs().max() <= 1e-6 * masked.abs().max()
    for (k0, v0), (k1, v1) in zip(cache_kv(caches[0]), cache_kv(caches[1])):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_tree_masks_and_positions_come_from_a_per_shape_copy_left_unchanged():
    parents = (-1, -1, 0, 2)
    first = tree_attention_mask(parents, 3)
    expected = first.clone()
    first.fill_(7.0)  # a caller writing its mask must not change the next one
    tree_position_ids(parents, 3).fill_(0)
    assert torch.equal(tree_attention_mask(list(parents), 3), expected)
    assert tree_position_ids(parents, 3).tolist() == [3, 4, 4, 5, 6]
    visible = expected[0, 0] == 0
    assert visible[:, :4].all() and visible[4].tolist() == [True] * 5 + [False, True, True]
