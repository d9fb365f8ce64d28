"""Free draft branches from the context: n-gram (prompt lookup) continuations.

Prompt lookup decoding (Saxena 2023; REST, He et al. NAACL'24) proposes what followed the most recent earlier
occurrence of the context's last n tokens, merged into the draft's tree as SpecInfer merges speculators
(Miao et al. ASPLOS'24 §3). Example: context [5, 7, 9, 2, 5, 7], max_ngram 3, max_tokens 3: [2, 5, 7] occurs
nowhere earlier, [5, 7] at index 0 -> continuation [9, 2, 5], match length 2.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def match_continuation(context: Sequence[int], max_tokens: int, max_ngram: int = 3, min_ngram: int = 1,
                       max_match: int = 32) -> tuple[list[int], int]:
    """The tokens that followed the most recent earlier occurrence of the context's last n tokens,
    and how far back that occurrence matches the context.

    context: [T] token ids; max_tokens: K. n goes from max_ngram down to min_ngram, the first n with a
    match wins, its most recent occurrence is used. Returns ([K'] ids, L), K' <= K, L the match length
    (n <= L <= max(max_ngram, max_match)), which predicts acceptance far better than n; ([], 0) when
    nothing matches. Raises ValueError for min_ngram < 1 or max_ngram < min_ngram."""
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"min_ngram/max_ngram: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    ids = np.asarray(context, dtype=np.int64)  # (T,)
    t = len(ids)
    if max_tokens < 1 or t < 2:
        return [], 0
    # ends e < t - 1 of earlier occurrences of the last token (a continuation ids[e + 1] exists); L[i] = how
    # many tokens match backwards from ends[i] (ids[e - j] == ids[t - 1 - j] for j < L), grown one step at a time
    ends = np.nonzero(ids[: t - 1] == ids[t - 1])[0]  # (M,)
    match = np.ones(len(ends), dtype=np.int64)  # (M,)
    alive = np.ones(len(ends), dtype=bool)  # (M,) still matching
    for j in range(1, max(max_ngram, max_match)):
        prev = ends - j  # (M,)
        alive &= prev >= 0
        if not alive.any():
            break
        alive[alive] = ids[prev[alive]] == ids[t - 1 - j]
        match += alive
    for n in range(min(max_ngram, t - 1), min_ngram - 1, -1):
        ok = np.nonzero(match >= n)[0]
        if len(ok):
            best = ok[-1]  # the most recent occurrence of the n-gram
            e = int(ends[best])
            return ids[e + 1: e + 1 + max_tokens].tolist(), int(match[best])
    return [], 0

