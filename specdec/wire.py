"""Conversions between the in-process types and the wire messages (protos/specdec/v1).

The receiving side never trusts a message: every check raises MalformedTreeError / SamplingParamsError /
TreeSpecError naming the field (INVALID_ARGUMENT).
"""

from __future__ import annotations

import math

import numpy as np

from specdec.sampling import SamplingParams, TokenLogprob
from specdec.stats import GenerationStats
from specdec.tree import SOURCE_CONTEXT, SOURCE_DRAFT, DraftTree, MalformedTreeError, Proposal, node_depths, validate_tree
from specdec.tree_spec import MAX_GAMMA, TreeSpec, parse_tree_spec
from specdec.v1 import generation_pb2, tree_pb2


def tree_to_proto(tree: DraftTree) -> tree_pb2.TokenTree:
    msg = tree_pb2.TokenTree(
        tokens=list(tree.tokens), parents=list(tree.parents),
        draft_logprobs=list(tree.draft_logprobs), expanded=list(tree.expanded), sources=list(tree.sources),
    )
    for prop in tree.proposals:
        token_ids, probs = prop.sparse()
        msg.proposals.add(parent=prop.parent, token_ids=token_ids.tolist(), probs=probs.tolist())
    return msg


def tree_from_proto(msg: tree_pb2.TokenTree, vocab_size: int, max_nodes: int, max_depth: int = MAX_GAMMA) -> DraftTree:
    """An untrusted TokenTree -> DraftTree (ids < vocab_size, at most max_nodes). Raises MalformedTreeError."""
    tokens, parents = tuple(msg.tokens), tuple(msg.parents)
    n = len(tokens)
    validate_tree(tokens, parents, vocab_size, max_nodes)
    for name in ("draft_logprobs", "expanded", "sources"):
        if len(getattr(msg, name)) not in (0, n):
            raise MalformedTreeError(f"{name}: length {len(getattr(msg, name))} != tokens length {n}")
    for i, lp in enumerate(msg.draft_logprobs):
        if math.isnan(lp) or lp > 1e-4:
            raise MalformedTreeError(f"draft_logprobs[{i}] = {lp}: must be a log-probability (<= 0, not NaN)")
    if n and max(node_depths(parents)) > max_depth:
        raise MalformedTreeError(f"parents: tree depth {max(node_depths(parents))} exceeds the limit of {max_depth}")
    proposals = []
    seen = set()
    for j, prop in enumerate(msg.proposals):
        field = f"proposals[{j}]"
        if not -1 <= prop.parent < n:
            raise MalformedTreeError(f"{field}.parent = {prop.parent}: must be -1 (root) or a node index < {n}")
        if prop.parent in seen:
            raise MalformedTreeError(f"{field}.parent = {prop.parent}: a second proposal for the same node")
        seen.add(prop.parent)
        if len(prop.token_ids) != len(prop.probs) or not prop.token_ids:
            raise MalformedTreeError(f"{field}.probs: length {len(prop.probs)} != token_ids length {len(prop.token_ids)} (or empty)")
        ids = np.asarray(prop.token_ids, dtype=np.int64)
        probs = np.asarray(prop.probs, dtype=np.float64)
        if ids.min() < 0 or ids.max() >= vocab_size:
            raise MalformedTreeError(f"{field}.token_ids: ids outside the vocabulary [0, {vocab_size})")
        if len(np.unique(ids)) != len(ids):
            raise MalformedTreeError(f"{field}.token_ids: repeated ids")
        if not np.all(np.isfinite(probs)) or probs.min() < 0 or abs(probs.sum() - 1.0) > 1e-6:
            raise MalformedTreeError(f"{field}.probs: must be finite, >= 0 and sum to 1 (sum {probs.sum()})")
        proposals.append(Proposal.from_sparse(prop.parent, ids, probs, vocab_size))
    for i, src in enumerate(msg.sources):
        if src not in (SOURCE_DRAFT, SOURCE_CONTEXT):
            raise MalformedTreeError(f"sources[{i}] = {src}: must be {SOURCE_DRAFT} (draft) or {SOURCE_CONTEXT} (context)")
    return DraftTree(tokens, parents, tuple(msg.draft_logprobs), tuple(msg.expanded), tuple(proposals),
                     tuple(msg.sources))


def sampling_to_proto(params: SamplingParams) -> tree_pb2.SamplingParams:
    msg = tree_pb2.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    if params.seed is not None:
        msg.seed = params.seed
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            setattr(msg, name, getattr(params, name))
    return msg


def sampling_from_proto(msg: tree_pb2.SamplingParams) -> SamplingParams:
    """Raises SamplingParamsError naming the field. An unset top_p (0) means 1 (off)."""
    return SamplingParams(
        temperature=msg.temperature, top_p=msg.top_p if msg.top_p != 0 else 1.0, top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None, logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


def logprobs_to_proto(logprobs) -> list[tree_pb2.TokenLogprobs]:
    """``TokenLogprob``s as TokenLogprobs messages (the token ids travel beside them)."""
    return [tree_pb2.TokenLogprobs(logprob=lp.logprob, top_ids=[i for i, _ in lp.top],
                                   top_logprobs=[v for _, v in lp.top]) for lp in logprobs]


def logprobs_from_proto(msgs, tokens) -> tuple[TokenLogprob, ...]:
    """TokenLogprobs messages of ``tokens`` (one each, or none) as ``TokenLogprob``s."""
    return tuple(TokenLogprob(t, m.logprob, tuple(zip(m.top_ids, m.top_logprobs))) for t, m in zip(tokens, msgs))


def spec_to_proto(spec: TreeSpec) -> tree_pb2.TreeSpec:
    return tree_pb2.TreeSpec(
        gamma=spec.gamma, top_k_spec=[tree_pb2.TopKRow(k=list(row)) for row in spec.top_k_spec],
        top_head=list(spec.top_head), tree_type=spec.tree_type, gamma_threshold=spec.gamma_threshold,
    )


def spec_from_proto(msg: tree_pb2.TreeSpec) -> TreeSpec:
    """Raises TreeSpecError naming the field."""
    return parse_tree_spec({
        "gamma": msg.gamma, "topKSpec": [list(row.k) for row in msg.top_k_spec], "topHead": list(msg.top_head),
        "treeType": msg.tree_type, "gammaThreshold": msg.gamma_threshold,
    })


def stats_to_proto(stats: GenerationStats, prompt_tokens: int) -> generation_pb2.FinalStats:
    """A request's statistics as the front's FinalStats; prompt_tokens: the prompt's length in tokens."""
    return generation_pb2.FinalStats(
        new_tokens=stats.new_tokens, prompt_tokens=prompt_tokens, rounds=stats.rounds,
        acceptance_rate=stats.acceptance_rate, mean_accepted_length=stats.mean_accepted_length,
        ttft_ms=stats.ttft_ms, total_s=stats.total_s, stop_reason=stats.stop_reason or "",
        fallback_rounds=stats.fallback_rounds, final_gamma=stats.final_gamma,
        proposed_tokens=stats.proposed_tokens, accepted_tokens=stats.accepted_tokens,
        cost_plain_rounds=stats.cost_plain_rounds, drafted_tokens=stats.drafted_tokens,
        context_proposed_tokens=stats.context_proposed_tokens, context_accepted_tokens=stats.context_accepted_tokens,
        expected_accepted_tokens=stats.expected_accepted_tokens, failovers=stats.failovers,
        pipeline_ahead_hits=stats.pipeline_ahead_hits, pipeline_ahead_misses=stats.pipeline_ahead_misses,
        position_proposed=stats.position_proposed, position_accepted=stats.position_accepted,
        draft_s=stats.draft_s, verify_s=stats.verify_s, draft_rounds=stats.draft_rounds,
        draft_link_rtt_ms=stats.draft_link_rtt_ms, target_link_rtt_ms=stats.target_link_rtt_ms,  # None: unset
        predraft_hits=stats.predraft_hits, pipelined_rounds=stats.pipelined_rounds,
        predrafted_rounds=stats.predrafted_rounds, ahead_hit_rate=stats.ahead_hit_rate,
        in_line_share=stats.round_shares["in_line"], pipelined_share=stats.round_shares["pipelined"],
        predrafted_share=stats.round_shares["predrafted"],
    )
