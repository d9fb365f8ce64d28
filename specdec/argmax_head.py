"""Exact greedy argmax of the LM head from an int8 screen plus a float32 re-check of the survivors.

Greedy verification needs only each row's argmax, and on a float32 CPU target the LM head is a large share of
every forward. ``ArgmaxHead`` gets approximate logits A from an int8 copy with a rigorous per-token error bound
B (derivation: docs/design.md "The argmax screen's bound"), keeps the tokens with A + B >= max(A - B) and
recomputes those in float64: the float32 argmax except at near-ties within float32 GEMM rounding.

Screen-then-verify top-logit search as in quantized maximum inner product search (Guo et al. 2020,
"Accelerating Large-Scale Inference with Anisotropic Vector Quantization", §3); rounding bound from
Higham, "Accuracy and Stability of Numerical Algorithms", 2002, §3.1.
"""

from __future__ import annotations

import logging
import warnings

import torch

log = logging.getLogger(__name__)

LEVEL = 63  # 7-bit symmetric integer inputs: k in [-63, 63]
PIN = (-64.0, 63.0)  # extra input columns: fbgemm's dynamic qparams become scale 1, zero point 64
ROUNDING = 1e-4  # least relative slack for float32 rounding (of A and of the reference GEMM); grows with H
FLOOR = 1e-3  # absolute slack (logits)
MAX_CANDIDATES = 4096  # more survivors than this in a row: that row takes the full float32 head
CHUNK_ROWS = 8192  # weight rows per step while building
SCREEN_ROWS = 32  # hidden rows per screen call: bounds the [rows, V] temporaries (~16 bytes per row and token)
# Rows past which the full float32 head is faster (the screen's int8 GEMM runs 2 rows per hidden row;
# the callers in specdec.forward switch to the full head above it).
MAX_ROWS = 20
SLOPE_SLACK = 1.001  # rounds the bound's float32 norms up


def rounding_slack(hidden_size: int) -> float:
    """Relative slack for the float32 rounding of an H-term dot product, of ||x|| ||W_i||: the
    worst case is about H * 2^-24 (Higham 2002, section 3.1), plus room for the rounding of A."""
    return max(ROUNDING, 1.1 * (hidden_size + 8) * 2.0**-24)


def fbgemm_available() -> bool:
    """Whether torch has the fbgemm (x86) quantized kernels the screen uses."""
    engines = torch.backends.quantized.supported_engines
    return "fbgemm" in engines or "x86" in engines


class ArgmaxHead:
    """Exact row-wise argmax of ``hidden @ weight.T``. weight: [V, H] float32 (copied; 5 bytes per weight
    in all). Use ``build``, which checks the kernel first."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"weight: need a [V, H] float32 CPU tensor, got {tuple(weight.shape)} {weight.dtype} on {weight.device}")
        with torch.no_grad():
            self.weight = weight.detach().clone().contiguous()  # (V, H)
            v, h = self.weight.shape
            self.vocab_size, self.hidden_size = v, h
            self.max_rows = MAX_ROWS  # forwards with more greedy rows use the full head (specdec.forward)
            rounding = rounding_slack(h)
            scale = (self.weight.abs().amax(dim=1) / 127).clamp_min(1e-12)  # (V,) float32
            q = torch.empty(v, h + len(PIN), dtype=torch.int8)  # pin columns weigh 0
            q[:, h:] = 0
            x_slope, r_slope = torch.empty(v), torch.empty(v)
            for lo in range(0, v, CHUNK_ROWS):  # float64 temporaries a chunk at a time
                w = self.weight[lo : lo + CHUNK_ROWS]
                s = scale[lo : lo + CHUNK_ROWS, None]
                qi = torch.round(w / s).clamp_(-127, 127)  # integers
                q[lo : lo + CHUNK_ROWS, :h] = qi.to(torch.int8)
                approx = qi.mul_(s)  # s_i Q_i (float32: each element within 2^-24 of its own size)
                # the bound's slopes in ||x|| and ||r||: ||E_i|| + rounding ||W_i|| and ||s_i Q_i||; the
                # float32 rounding here is below 1e-4 of each norm, SLOPE_SLACK covers it
                x_slope[lo : lo + CHUNK_ROWS] = ((w - approx).norm(dim=1) + rounding * w.norm(dim=1)) * SLOPE_SLACK
                r_slope[lo : lo + CHUNK_ROWS] = approx.norm(dim=1) * SLOPE_SLACK
            self._x_slope, self._r_slope = x_slope, r_slope
            gen = torch.Generator().manual_seed(0)
            tokens = torch.unique(torch.cat([torch.randint(0, v, (2048,), generator=gen), torch.tensor([0, v - 1])]))
            self._probe = (tokens, q[tokens, :h].double(), scale[tokens].double())  # a vocabulary sample, for the check
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch.ao quantized tensor deprecation notices
                qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros(v, dtype=torch.long), 0)
                self._packed = torch.ops.quantized.linear_prepack(qweight, None)
            del q, qweight

    @classmethod
    def build(cls, weight: torch.Tensor) -> ArgmaxHead | None:
        """An ArgmaxHead for ``weight`` [V, H], or None where the int8 kernel is missing or does not
        compute the pinned integer products exactly (checked on random inputs)."""
        if not fbgemm_available():
            return None
        head = cls(weight)
        exact = head._kernel_is_exact()
        del head._probe
        if not exact:
            log.warning("int8 argmax screen: fbgemm's dynamic linear does not match its float64 reference here; "
                        "greedy rows use the full float32 head")
            return None
        return head

    def _screen(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [P, H] integer-valued float32 in [-63, 63] -> [P, V] float32, sum_j rows_j s_i Q_ij."""
        pins = torch.tensor(PIN).expand(rows.shape[0], len(PIN))
        return torch.ops.quantized.linear_dynamic(torch.cat([rows, pins], dim=1), self._packed, True)

    def _kernel_is_exact(self) -> bool:
        gen = torch.Generator().manual_seed(0)
        tokens, q, scale = self._probe  # (T,), (T, H) float64, (T,) float64
        for m in (1, 2, 5, 33, 2 * SCREEN_ROWS):  # the kernel may take other paths for other row counts
            rows = torch.randint(-LEVEL, LEVEL + 1, (m, self.hidden_size), generator=gen).float()
            rows[0] = LEVEL if m % 2 else -LEVEL  # the extremes, where 16-bit pair sums would saturate first
            got = self._screen(rows)[:, tokens].double()
            want = (rows.double() @ q.t()) * scale[None]  # exact: integer sums times the scale
            if not bool(((got - want).abs() <= 2.0**-22 * want.abs() + 1e-30).all()):  # one float32 rounding
                return False
        return True

    @torch.inference_mode()
    def scores(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [M, H] float32 -> (A, B), both [M, V] float32: the int8 estimate of each logit and
        a bound on |float32 logit - A| (module docstring). Needs finite rows."""
        x = hidden.detach().reshape(-1, self.hidden_size).float()  # (M, H)
        m = x.shape[0]
        x64 = x.double()
        sx = (x.abs().amax(dim=1, keepdim=True) / LEVEL).clamp_min(1e-30)  # (M, 1) float32
        k = torch.round(x64 / sx.double()).clamp(-LEVEL, LEVEL)
        rest = x64 - k * sx.double()
        sd = (rest.abs().amax(dim=1, keepdim=True).float() / LEVEL).clamp_min(1e-30)  # (M, 1) float32
        k2 = torch.round(rest / sd.double()).clamp(-LEVEL, LEVEL)
        r_norm = (rest - k2 * sd.double()).norm(dim=1, keepdim=True).float()  # (M, 1) ||r||
        x_norm = x64.norm(dim=1, keepdim=True).float()
        y = self._screen(torch.cat([k, k2]).float())  # (2M, V)
        approx = y[:m].mul_(sx).add_(y[m:].mul_(sd))  # (M, V) A
        bound = torch.addcmul(torch.addcmul(torch.full_like(approx, FLOOR), x_norm * SLOPE_SLACK, self._x_slope[None]),
                              r_norm * SLOPE_SLACK, self._r_slope[None])  # (M, V) B
        return approx, bound

    @torch.inference_mode()
    def survivors(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] float32 (finite) -> [M, V] bool: tokens with A + B >= max(A - B), the argmax among them."""
        approx, bound = self.scores(hidden)
        floor = (approx - bound).amax(dim=1, keepdim=True)  # (M, 1): some token's logit is at least this
        return approx.add_(bound).ge_(floor).bool()  # (M, V)

    @torch.inference_mode()
    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] float32 -> [M] int64 argmax (first on exact ties); rows with over MAX_CANDIDATES
        survivors or non-finite values take the full float32 product."""
        x = hidden.detach().reshape(-1, self.hidden_size).float()  # (M, H)
        out = torch.empty(x.shape[0], dtype=torch.long)
        finite = torch.isfinite(x).all(dim=1).tolist()
        for lo in range(0, x.shape[0], SCREEN_ROWS):
            keep = self.survivors(x[lo : lo + SCREEN_ROWS].nan_to_num(0.0, 0.0, 0.0))  # (<= SCREEN_ROWS, V)
            for i in range(keep.shape[0]):
                out[lo + i] = self._decide(x[lo + i], keep[i] if finite[lo + i] else None)
        return out

    def _decide(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """One row's argmax from its survivors keep [V] bool (None: the full product)."""
        if keep is not None:
            cands = keep.nonzero().flatten()  # ascending: ties resolve to the first, as argmax
            if 0 < len(cands) <= MAX_CANDIDATES:
                # float64 per-token sums: the same summation for every candidate (identical weight rows
                # give identical logits, so a tie goes to the first token, as torch.argmax does)
                return cands[(self.weight[cands].double() * x.double()).sum(dim=1).argmax()]
        return (x[None] @ self.weight.t()).argmax()  # too many survivors, or a non-finite row


_ATTR = "specdec_argmax_head"


def argmax_head_of(model) -> ArgmaxHead | None:
    """The ArgmaxHead ``attach_argmax_head`` gave ``model`` (None: greedy rows use the full head)."""
    return getattr(model, _ATTR, None)


@torch.inference_mode()
def attach_argmax_head(model) -> bool:
    """Give a float32 CPU causal LM an ArgmaxHead of its LM head; returns whether it got one (only where the logits are
    the bias-free head over ``get_decoder()``'s output, checked bit for bit). Call before ``prepack_linears``."""
    head_module = model.get_output_embeddings()
    if (type(head_module) is not torch.nn.Linear or head_module.bias is not None
            or head_module.weight.dtype != torch.float32 or head_module.weight.device.type != "cpu"):
        return False
    if not fbgemm_available():
        return False
    ids = torch.tensor([[1, 2, 3]])
    cache_free = {"use_cache": False}
    whole = model(ids, **cache_free).logits[0]  # (3, V)
    hidden = model.get_decoder()(ids, **cache_free).last_hidden_state[0]  # (3, H)
    if not torch.equal(whole, head_module(hidden)):
        return False
    head = ArgmaxHead.build(head_module.weight)
    if head is None or not torch.equal(head.argmax(hidden), whole.argmax(dim=-1)):
        return False
    object.__setattr__(model, _ATTR, head)  # a plain attribute: not a submodule, not in the state dict
    return True
