"""Loaded models stop holding their memory-mapped checkpoint (specdec.checkpoint_memory).

The fault: transformers memory-maps safetensors, so every page read while loading (each linear read
once to pre-pack or quantize it) stayed resident behind the tensors that still viewed the file: the
default target service held 12.3 GB for 6.8 GB of weights. These tests use a tiny saved model and
check the mechanism: which tensors view the file before and after, that dropping pages never changes
a value that was not written (mapped or anonymous) nor a neighbour's that was, and that loading still
gives the same logits.
"""

from __future__ import annotations

import sys

import pytest
import torch

from specdec.checkpoint_memory import checkpoint_ranges, drop_checkpoint_pages, own_weights
from specdec.config import ModelsConfig
from specdec.model_setup import load_draft, load_target
from specdec.models import load_model
from specdec.harness.tiny_pair import save_tiny_pair

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


def _mapped(model) -> list[str]:
    """Names of the parameters and buffers whose bytes lie in a mapped checkpoint file."""
    ranges = checkpoint_ranges()
    return [name for name, t in list(model.named_parameters()) + list(model.named_buffers())
            if t.numel() and not t.is_mkldnn and any(lo <= t.data_ptr() < hi for lo, hi in ranges)]


def test_a_loaded_model_views_its_checkpoint_and_own_weights_copies_it_out(pair):
    model, _ = load_model(pair.target, "float32")
    before = _mapped(model)
    assert "model.embed_tokens.weight" in before and len(before) > 5  # transformers maps the file
    reference = {name: t.detach().clone() for name, t in model.named_parameters()}
    copied = own_weights(model)
    assert _mapped(model) == []
    assert copied == sum(t.numel() * t.element_size() for name, t in model.named_parameters() if name in before)
    for name, t in model.named_parameters():
        assert torch.equal(t, reference[name]), name


def test_dropping_a_tensors_pages_leaves_its_neighbours_writes(pair):
    """The mapping is copy-on-write: a page written in place and then dropped would go back to the
    file's bytes. Only whole pages inside the dropped tensor go, so a small neighbour written in
    place (sharing a page with it) keeps its value (found by review: pages used to be rounded outward)."""
    model, _ = load_model(pair.target, "float32")
    written = model.model.norm.weight
    with torch.no_grad():
        written.fill_(3.0)
    others = [t for name, t in model.named_parameters() if name != "model.norm.weight"]
    drop_checkpoint_pages(others)
    assert torch.all(written == 3.0)


def test_dropping_pages_never_changes_a_value_never_written(pair):
    model, _ = load_model(pair.target, "float32")
    mapped = model.model.embed_tokens.weight
    anonymous = torch.randn(4096, 64)  # not in any file mapping: must be left alone
    copies = mapped.detach().clone(), anonymous.clone()
    ranges = checkpoint_ranges()
    assert drop_checkpoint_pages([mapped], ranges) > 0
    assert drop_checkpoint_pages([anonymous], ranges) == 0
    assert torch.equal(mapped, copies[0])  # re-read from the file
    assert torch.equal(anonymous, copies[1])


@pytest.mark.parametrize("draft_quant", ["none", "int8"])
def test_loaded_target_and_draft_hold_no_checkpoint_views_and_keep_their_logits(pair, draft_quant):
    models = ModelsConfig(target=str(pair.target), draft=str(pair.draft), dtype="float32", draft_quant=draft_quant)
    plain, _ = load_model(pair.target, "float32")
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        expected = plain(ids).logits
    target = load_target(models)
    draft = load_draft(models, target)
    assert _mapped(target.model) == [] and _mapped(draft.model) == []
    with torch.no_grad():
        torch.testing.assert_close(target.model(ids).logits, expected, rtol=1e-5, atol=1e-5)
