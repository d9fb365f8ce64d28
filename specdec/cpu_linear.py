"""Fast float32 linear layers on the CPU for the few-row matmuls of speculative decoding.

Verification multiplies every weight by N + 1 rows (a tree), drafting by topHead[d] rows. On CPUs
without native bf16 GEMM (AVX2-only, e.g. many AMD EPYC), torch's default float32 path (MKL sgemm)
costs ~4x more for 13 rows than for 1, and bf16 ~12x. oneDNN with weights pre-packed once
(the op torch inductor uses for frozen CPU linears) costs ~2.5x: measured on a 2-core AMD EPYC,
8960x1536 weight, 1 thread: 1 row 3.1 ms, 13 rows 7.8 ms (MKL 2.7 / 12.1 ms, bf16 2.8 / 33.9 ms).
Whole Qwen2.5-1.5B forward after 300 tokens, 2 threads, float32: 1 / 4 / 13 / 32 new tokens
285 / 365 / 552 / 894 ms packed vs 351 / 925 / - / - ms with MKL.

``prepack_linears`` swaps each ``nn.Linear`` of a float32 model on the CPU for ``PackedLinear``
(same weights, same maths); the model class is otherwise untouched.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.checkpoint_memory import checkpoint_ranges, drop_checkpoint_pages


def default_cpu_dtype() -> str:
    """float32 on every CPU (``--dtype auto``): measured faster than bfloat16 for speculative decoding
    on both CPUs this project runs on, and the dtype in which greedy output equals the target's.

    2-core AMD EPYC (AVX2, no bf16 GEMM): bf16 costs ~12x more for a 13-row tree than for 1 row (module
    docstring). 2-core Intel Xeon with AVX512-BF16 (no AMX), Qwen2.5-1.5B after 300 cached tokens,
    2 threads: V(1 / 4 / 8 / 16 / 32 rows) = 240 / 274 / 333 / 466 / 783 ms in bf16 against
    253 / 323 / 351 / 427 / 590 ms in packed float32 with the argmax screen, and a 256-token prefill
    3.7 s against 2.35 s (2026-12-04). bfloat16 stays an explicit choice (``--dtype bfloat16``), e.g.
    on CPUs with AMX tiles, which were not measured.
    """
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
        """``forward`` as a plain function bound to this layer's buffers (no module call; for
        ``specdec.forward.DirectDecoder``): x [..., in_features] float32 -> [..., out_features]
        float32, the same oneDNN op and result as ``forward``. It reads the buffers as they are now
        (re-pack, then call this again)."""
        weight, bias, n_in, n_out = self.packed_weight, self.bias, self.in_features, self.out_features
        op = torch.ops.mkldnn._linear_pointwise.default

        def linear(x: torch.Tensor) -> torch.Tensor:
            return op(x.reshape(-1, n_in), weight, bias, "none", [], "").reshape(*x.shape[:-1], n_out)

        return linear


def prepack_linears(model: nn.Module) -> int:
    """Replace every float32 CPU ``nn.Linear`` in ``model`` with a PackedLinear; returns how many.

    A no-op (returns 0) for other dtypes or devices, or where oneDNN is unavailable. Each replaced
    weight's pages in a memory-mapped checkpoint are released as soon as it is packed
    (specdec.checkpoint_memory), so loading holds one copy of the weights at a time, not two.
    """
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
