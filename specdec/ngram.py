"""Free draft branches from the context: n-gram (prompt lookup) continuations.

Dims: T context tokens (prompt + generated so far), K continuation tokens.

The context often repeats itself (summaries quote their source, code reuses names, answers copy
from retrieved documents). Prompt lookup decoding proposes, at zero model cost, the tokens that
followed the most recent earlier occurrence of the context's last n tokens (Saxena 2023, "Prompt
Lookup Decoding"; REST, He et al. NAACL'24, retrieves from a datastore the same way). SpecInfer
(Miao et al. ASPLOS'24 §3) merges several speculators' candidates into one token tree; the
orchestrator merges these continuations into the draft's tree as extra branches
(``specdec.tree.merge_chain``), verified in the same forward.

Worked example: context [5, 7, 9, 2, 5, 7], max_ngram 3, max_tokens 3. The last 3 tokens
[2, 5, 7] occur nowhere earlier; the last 2, [5, 7], occur at index 0, followed by [9, 2, 5, 7]:
the continuation is [9, 2, 5].
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def lookup_continuation(context: Sequence[int], max_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the context's last n tokens.

    context: [T] token ids; max_tokens: K, the longest continuation returned; n is tried from
    max_ngram down to min_ngram and the first n with a match wins (a longer match predicts better).
    Among matches of that n the most recent one with at least one following token is used.
    Returns [K'] ids, K' <= max_tokens (empty when nothing matches). Raises ValueError for
    min_ngram < 1 or max_ngram < min_ngram.
    """
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"min_ngram/max_ngram: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    ids = np.asarray(context, dtype=np.int64)  # (T,)
    t = len(ids)
    if max_tokens < 1 or t < 2:
        return []
    for n in range(min(max_ngram, t - 1), min_ngram - 1, -1):
        tail = ids[t - n:]  # (n,)
        # Candidate starts i with ids[i:i+n] == tail and i + n < t (a continuation exists).
        starts = np.nonzero(ids[: t - n] == tail[0])[0]  # occurrence i must end before the tail starts
        for i in starts[::-1]:  # most recent first
            if np.array_equal(ids[i:i + n], tail):
                return ids[i + n: i + n + max_tokens].tolist()
    return []
