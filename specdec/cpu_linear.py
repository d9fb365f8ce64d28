"""Fast float32 linear layers on the CPU for the few-row matmuls of speculative decoding: oneDNN with weights pre-packed
once, as torch inductor does for frozen CPU linears (docs/design.md "Speed paths")."""

from __future__ import annotations

import torch
from torch import nn

from specdec.checkpoint_memory import checkpoint_ranges, drop_checkpoint_pages


def default_cpu_dtype() -> str:
    """float32 on every CPU (``--dtype auto``): packed float32 verifies tree rows faster than bfloat16
    on CPUs without AMX tiles, and it is the dtype in which greedy output equals the target's.
    bfloat16 stays an explicit choice (``--dtype bfloat16``), e.g. on CPUs with AMX tiles."""
    return "float32"


class PackedLinear(nn.Module):
    """y = x W^T + b with W pre-packed for oneDNN. x: [..., in] float32 -> [..., out] float32."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None))
            bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, in)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")  # (M, out)
        return y.reshape(*x.shape[:-1], self.out_features)

    def direct(self):
        """``forward`` as a plain function bound to the current buffers (for ``DirectDecoder``); same result."""
        weight, bias, n_in, n_out = self.packed_weight, self.bias, self.in_features, self.out_features
        op = torch.ops.mkldnn._linear_pointwise.default

        def linear(x: torch.Tensor) -> torch.Tensor:
            return op(x.reshape(-1, n_in), weight, bias, "none", [], "").reshape(*x.shape[:-1], n_out)

        return linear


def prepack_linears(model: nn.Module) -> int:
    """Replace every float32 CPU ``nn.Linear`` in ``model`` with a PackedLinear; returns how many (0 without
    oneDNN). Each weight's checkpoint pages are released once packed, so loading holds one copy."""
    if not torch.backends.mkldnn.is_available():
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu"
    ]
    ranges = checkpoint_ranges()
    replaced = {id(child.weight) for _, _, child in targets}
    kept = {p.data_ptr() for p in model.parameters() if id(p) not in replaced}  # e.g. an embedding a head is tied to
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
        if child.weight.data_ptr() not in kept:
            drop_checkpoint_pages([child.weight], ranges)
    return len(targets)
