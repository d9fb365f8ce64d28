"""Sampling parameters and the sampling maths the draft and the target apply identically (q and p both from
``processed_probs`` with the same SamplingParams, or verification is not lossless; docs/design.md "Verification").
Float64 NumPy on the CPU, on the few rows a round needs. Dims: V vocabulary, S support, K siblings."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


class SamplingParamsError(ValueError):
    """Invalid sampling parameters; ``field`` names the offending parameter."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


MIN_TEMPERATURE = 1e-3  # below it logits / temperature overflow float64 for real logit ranges
MAX_LOGPROBS = 20  # most alternatives per position (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters. temperature: 0 = greedy (argmax; top_p and top_k are then irrelevant), > 0 =
    sample; top_p: nucleus mass in (0, 1] (1 = off); top_k: keep the k most likely tokens (0 = off); seed: seeds the
    request's random draws (None = a fresh random seed per session); logprobs: report each generated token's logprob
    with this many top alternatives (0..MAX_LOGPROBS; None = off), as vLLM's SamplingParams; the target alone reads it
    (``token_logprobs``); prompt_logprobs: the same for the prompt's tokens but the first, from the target's prefill."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SamplingParamsError(name, f"expected a number, got {value!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError("temperature", f"must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise SamplingParamsError(
                "temperature", f"must be 0 (greedy) or >= {MIN_TEMPERATURE} (smaller overflows the softmax), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingParamsError("top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise SamplingParamsError("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise SamplingParamsError(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def seeded(self) -> bool:
        """Sampled with a seed: the same request must give the same tokens every run, so nothing that
        shapes its trees may depend on timings or load."""
        return not self.greedy and self.seed is not None

    def describe(self) -> str:
        """One line for logs and tables, e.g. ``temperature 0.7, top-p 0.9, top-k 0, seed 3``."""
        if self.greedy:
            return "greedy"
        seed = "random" if self.seed is None else self.seed
        return f"temperature {self.temperature:g}, top-p {self.top_p:g}, top-k {self.top_k}, seed {seed}"


GREEDY = SamplingParams()


def processed_probs(logits, params: SamplingParams) -> np.ndarray:
    """Sampling distribution after temperature, top-k and top-p, in that order (transformers' warpers'
    rules, in float64). logits: [..., V] tensor or array (log-probs work too). Returns [..., V] float64
    NumPy summing to 1. Not for greedy params."""
    assert not params.greedy, "processed_probs: temperature 0 is greedy (argmax), not a distribution"
    if isinstance(logits, torch.Tensor):
        # at least float32 across (half float64's bytes); float64 below, an exact widening
        logits = logits.detach().to("cpu", torch.promote_types(logits.dtype, torch.float32)).numpy()
    scores = np.asarray(logits, dtype=np.float64) / params.temperature  # (..., V)
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = np.partition(scores, vocab - params.top_k, axis=-1)[..., vocab - params.top_k, None]  # (..., 1)
        scores = np.where(scores < kth, -np.inf, scores)
    if params.top_p < 1:
        scores = np.stack([_nucleus(row, params.top_p) for row in scores.reshape(-1, vocab)]).reshape(scores.shape)
    return _softmax(scores)


def _nucleus(scores: np.ndarray, top_p: float, candidates: int = 1024) -> np.ndarray:
    """Top-p on one row of scores [V] (-inf outside the nucleus), transformers' rule read from the top so
    only the ``candidates`` most likely tokens need sorting when they hold >= top_p."""
    probs = _softmax(scores)  # (V,)
    vocab = len(scores)
    for m in (min(candidates, vocab), vocab):
        top = np.argpartition(-probs, m - 1)[:m] if m < vocab else np.arange(vocab)
        order = top[np.argsort(-probs[top], kind="stable")]  # (m,) most likely first
        mass_before = np.cumsum(probs[order]) - probs[order]  # mass of the strictly more likely
        if mass_before[-1] + probs[order[-1]] >= top_p:  # the nucleus lies inside the candidates
            break
    out = np.full(vocab, -np.inf)
    keep = order[mass_before < top_p]
    out[keep] = scores[keep]
    return out


def _softmax(scores: np.ndarray) -> np.ndarray:
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))  # (..., V); -inf -> 0
    return e / e.sum(axis=-1, keepdims=True)


def derive_seed(seed: int, stream: str) -> int:
    """A 63-bit seed for one random stream ("draft", "target") of a request seed (SHA-256)."""
    digest = hashlib.sha256(f"{seed}/{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class TokenLogprob(NamedTuple):
    """One position's log-probabilities: ``token``'s, and the ``top`` (id, logprob) pairs, likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> tuple[TokenLogprob, ...]:
    """The log-softmax (float32) of raw logits [P, V], before temperature, top-k and top-p (OpenAI's and vLLM's
    default): row i scores tokens[i] ([P] ids) and lists its k most likely tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (P, V)
    chosen = logp.gather(1, torch.tensor(list(tokens), device=logp.device)[:, None])[:, 0].tolist()
    values, ids = logp.topk(k, dim=-1)  # (P, k)
    return tuple(TokenLogprob(t, lp, tuple(zip(i, v)))
                 for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist()))


def session_rng(params: SamplingParams, stream: str) -> np.random.Generator:
    """The random generator of one session's stream (draft and target differ): ``params.seed``, else OS entropy."""
    seed = None if params.seed is None else derive_seed(params.seed, stream)
    return np.random.default_rng(seed)  # PCG64


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from probs: [V] (inverse CDF, one uniform draw). Never a zero-probability token."""
    cdf = np.cumsum(probs)  # (V,)
    token = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return token if token < len(probs) else int(probs.nonzero()[0][-1])  # u * total rounded up to total


def sample_without_replacement(probs: np.ndarray, k: int, rng: np.random.Generator) -> list[int]:
    """min(k, support) distinct tokens from probs [V] in draw order, the law of successive draws without
    replacement (exponential race: Efraimidis & Spirakis 2006; Gumbel-top-k, Kool et al. ICML'19)."""
    support = probs.nonzero()[0]  # (S,)
    k = min(k, support.size)
    clocks = rng.standard_exponential(support.size) / probs[support]  # (S,)
    if k == 1:
        return [int(support[clocks.argmin()])]
    first = np.argpartition(clocks, k - 1)[:k] if k < support.size else np.arange(support.size)
    return support[first[np.argsort(clocks[first])]].tolist()


def acceptance_probability(p: np.ndarray, q: np.ndarray, token: int) -> float:
    """min(1, p(x) / q(x)) for a draft token x ~ q, q(x) > 0; p, q: [V]. (Leviathan et al. 2023, Algorithm 1.)"""
    qx = float(q[token])
    assert qx > 0, f"token {token} has q = 0: it cannot have been drawn from q"
    return min(1.0, float(p[token]) / qx)


def accept(p: np.ndarray, q: np.ndarray, token: int, rng: np.random.Generator) -> bool:
    """Accept the draft token with probability min(1, p(x) / q(x)) (one uniform draw)."""
    return rng.random() < acceptance_probability(p, q, token)


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The residual distribution norm(max(0, p - q)): [V]. When it is all zero (p == q, where
    rejection has probability 0 and only rounding got us here) it is p itself."""
    r = np.maximum(p - q, 0.0)  # (V,)
    total = r.sum()
    return r / total if total > 0 else p


def without_token(q: np.ndarray, token: int) -> np.ndarray:
    """q with one drawn token removed and renormalised: the law of the next draw without
    replacement. [V] -> [V]; all zero when the token was q's whole support."""
    out = q.copy()
    out[token] = 0.0
    total = out.sum()
    return out / total if total > 0 else out
