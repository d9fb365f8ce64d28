"""n-gram (prompt lookup) continuations and merging them into token trees (specdec.ngram, specdec.tree)."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.ngram import match_continuation
from specdec.tree import SOURCE_CONTEXT, SOURCE_DRAFT, DraftTree, MalformedTreeError, Proposal, merge_chain, select_nodes


def lookup_continuation(*args, **kwargs):
    """The continuation alone (what the first tests below were written against)."""
    return match_continuation(*args, **kwargs)[0]


def test_worked_example():
    assert lookup_continuation([5, 7, 9, 2, 5, 7], max_tokens=3) == [9, 2, 5]


def test_longest_ngram_wins_over_a_more_recent_shorter_match():
    # last 2 tokens [1, 2]: the 2-gram matched at index 0 (-> 3); the 1-gram [2] also at index 5 (-> 9)
    ctx = [1, 2, 3, 4, 0, 2, 9, 1, 2]
    assert lookup_continuation(ctx, 2, max_ngram=2) == [3, 4]
    assert lookup_continuation(ctx, 2, max_ngram=1) == [9, 1]  # 1-gram [2]: its most recent match, index 5

def test_most_recent_match_and_caps():
    ctx = [8, 1, 5, 8, 1, 6, 8, 1]
    assert lookup_continuation(ctx, 4, max_ngram=2) == [6, 8, 1]  # the match at index 3, not index 0
    assert lookup_continuation(ctx, 1, max_ngram=2) == [6]
    assert lookup_continuation(ctx, 0) == []
    assert lookup_continuation([1, 2, 3], 5) == []  # nothing repeats
    assert lookup_continuation([4], 5) == []


def test_match_length_counts_how_far_back_the_occurrence_matches():
    # [5, 7] occurs at index 5 (preceded by 4, where the context has 1: match 2) and at index 1 (preceded
    # by 1, as the context's end is: match 3). With 2-grams the most recent wins, its match is 2; with
    # 3-grams only the older one matches
    ctx = [1, 5, 7, 0, 4, 5, 7, 3, 1, 5, 7]
    assert match_continuation(ctx, 3, max_ngram=2) == ([3, 1, 5], 2)
    assert match_continuation(ctx, 3, max_ngram=3) == ([0, 4, 5], 3)
    # a copied run: the context's last 6 tokens repeat an earlier stretch exactly, then it continues
    source = [9, 1, 2, 3, 4, 5, 6, 7, 8]
    copy = [0, 0, 1, 2, 3, 4, 5, 6]
    assert match_continuation(source + copy, 2) == ([7, 8], 6)  # 6 tokens match, though max_ngram is 3
    assert match_continuation(source + copy, 2, max_match=4) == ([7, 8], 4)  # counted up to max_match
    assert match_continuation(source + copy, 2, max_ngram=1, max_match=1) == ([7, 8], 1)
    assert match_continuation([1, 2, 3], 4) == ([], 0)
    assert match_continuation([3, 3, 3, 3], 4) == ([3], 3)  # overlapping occurrence: ends at index 2, matches 3


def _old_lookup(context, max_tokens, max_ngram=3, min_ngram=1):
    """specdec.ngram.lookup_continuation as it was before match lengths (commit 1e71d72), verbatim
    but for this docstring and the returned start of the continuation: the selection
    match_continuation must keep. Returns (chain, index of the chain's first token; -1 for none)."""
    ids = np.asarray(context, dtype=np.int64)  # (T,)
    t = len(ids)
    if max_tokens < 1 or t < 2:
        return [], -1
    for n in range(min(max_ngram, t - 1), min_ngram - 1, -1):
        tail = ids[t - n:]  # (n,)
        starts = np.nonzero(ids[: t - n] == tail[0])[0]  # occurrence i must end before the tail starts
        for i in starts[::-1]:  # most recent first
            if np.array_equal(ids[i:i + n], tail):
                return ids[i + n: i + n + max_tokens].tolist(), int(i + n)
    return [], -1


def _match_length(context, chain_start, cap):
    """Tokens before ``chain_start`` that equal the context's last tokens, counted one by one up to cap."""
    length = 0
    while length < cap and chain_start - 1 - length >= 0 and context[chain_start - 1 - length] == context[-1 - length]:
        length += 1
    return length


def test_match_continuation_keeps_the_old_selection_and_counts_the_match():
    # small vocabularies make many overlapping and repeated occurrences; every bound and edge is drawn
    rng = np.random.default_rng(7)
    for _ in range(3000):
        vocab = int(rng.integers(1, 5))
        context = rng.integers(0, vocab, size=int(rng.integers(0, 25))).tolist()
        max_ngram = int(rng.integers(1, 6))
        min_ngram = int(rng.integers(1, max_ngram + 1))
        max_tokens, max_match = int(rng.integers(0, 6)), int(rng.integers(0, 12))
        case = (context, max_tokens, max_ngram, min_ngram, max_match)
        chain, length = match_continuation(context, max_tokens, max_ngram, min_ngram, max_match)
        old_chain, start = _old_lookup(context, max_tokens, max_ngram, min_ngram)
        assert chain == old_chain, case
        cap = max(max_ngram, max_match)
        assert length == (_match_length(context, start, cap) if chain else 0), case
        assert not chain or min_ngram <= length <= cap, case


def test_bad_ngram_bounds():
    with pytest.raises(ValueError, match="min_ngram"):
        lookup_continuation([1, 2, 1], 2, max_ngram=1, min_ngram=2)


def test_merge_chain_shares_matching_nodes_and_appends_the_rest():
    tree = DraftTree((7, 8), (-1, 0), (-0.1, -0.2), (True, False))
    merged, path = merge_chain(tree, -1, [7, 9, 4])
    assert merged.tokens == (7, 8, 9, 4)
    assert merged.parents == (-1, 0, 0, 2)
    assert merged.sources == (SOURCE_DRAFT, SOURCE_DRAFT, SOURCE_CONTEXT, SOURCE_CONTEXT)
    assert merged.expanded == (True, False, False, False)
    assert merged.draft_logprobs[:2] == (-0.1, -0.2)
    assert path == [0, 2, 3]
    same, path = merge_chain(tree, -1, [7, 8])  # entirely shared: nothing appended
    assert same.tokens == tree.tokens and path == [0, 1]
    below, path = merge_chain(tree, 1, [3])  # under a draft node
    assert below.parents == (-1, 0, 1) and path == [2]


def test_merge_chain_on_an_empty_tree():
    merged, path = merge_chain(DraftTree((), ()), -1, [3, 3])
    assert merged.parents == (-1, 0) and merged.sources == (SOURCE_CONTEXT, SOURCE_CONTEXT) and path == [0, 1]


def test_select_nodes_keeps_order_and_remaps_proposals():
    q = np.full(4, 0.25)
    tree = DraftTree((1, 2, 3, 0), (-1, -1, 0, 1), (-1.0,) * 4, (True, True, False, False),
                     (Proposal(-1, q), Proposal(0, q), Proposal(1, q)), (0, 0, 0, 1))
    sub, old = select_nodes(tree, [2, 0])
    assert old == [0, 2] and sub.tokens == (1, 3) and sub.parents == (-1, 0)
    assert [p.parent for p in sub.proposals] == [-1, 0]
    assert sub.sources == (0, 0)
    with pytest.raises(MalformedTreeError, match="keep: node 3"):
        select_nodes(tree, [3])


def test_sources_are_validated():
    with pytest.raises(MalformedTreeError, match="sources"):
        DraftTree((1,), (-1,), sources=(0, 1))
    with pytest.raises(MalformedTreeError, match="sources"):
        DraftTree((1,), (-1,), sources=(2,))
