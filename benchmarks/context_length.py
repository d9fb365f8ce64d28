"""Context branches, side by side: today's (8 tokens, match buckets up to 6+) against long ones (16, up to 12+).

    python benchmarks/context_length.py --questions question.jsonl --offset 5 --per-category 2 \
        --category summarization --category rag --category extraction --category writing \
        --passes 2 --out bench_out/context_length

The cost-aware control merges each round's context (n-gram) branch into the verified tree
(``orchestrator.shaping``). ``default`` is today's control: branches of up to 8 tokens
(``CostAwareConfig.ngram_tokens``), every match of 6 or more tokens in one calibration bucket
(``orchestrator.shaping.match_bucket``). ``long`` lets a branch run to 16 tokens and gives matches of
12 or more (a copy going on for a dozen tokens: a quote, a summary's sentence) their own bucket
(``long_lookup``), so the shaping may keep long branches there without keeping them after every
6-token match. Both run the default real pair in one process on the same model objects, greedy,
each with its own SharedState whose cost model is a copy of one start-up measurement; the variants'
order alternates per question and pass. Per question and pass: seconds, TTFT, decode seconds (total
- TTFT), rounds, accepted draft and context tokens, and whether the outputs are equal (float32
greedy: they must be). Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.bench import add_question_args, question_meta, write_record  # noqa: E402
from orchestrator.embedded import build_pipeline  # noqa: E402
from orchestrator.shaping import match_bucket  # noqa: E402
from specdec.config import FrontConfig  # noqa: E402
from specdec.ngram import match_continuation  # noqa: E402
from specdec.tree_spec import DEFAULT_SPEC  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from context_plan import run_side_by_side, variant_factory  # noqa: E402  (the same side-by-side set-up)

VARIANTS = ("default", "long")
LONG_TOKENS = 16  # the long variant's branch length (today's: CostAwareConfig.ngram_tokens)
LONG_MATCH = 12  # the long variant's last bucket holds matches of this many tokens or more


def long_lookup(context, max_tokens: int, max_ngram: int = 3) -> tuple[list[int], int]:
    """The long variant's context branch: as ``orchestrator.shaping.ngram_continuation``, with matches
    counted up to LONG_MATCH tokens and keyed 1, 2, 3, 4 (4-5), 5 (6 to LONG_MATCH - 1) or 6 (LONG_MATCH+)."""
    chain, match = match_continuation(context, max_tokens, max_ngram=max_ngram, max_match=LONG_MATCH)
    return chain, 6 if match >= LONG_MATCH else match_bucket(match)


def _long_branches(control) -> None:
    control.lookup = partial(long_lookup, max_ngram=control.max_ngram)


def factories(cost) -> dict:
    """{variant: ``context_plan.variant_factory``}; ``long`` controls get LONG_TOKENS-token branches
    and ``long_lookup``."""
    long_config = FrontConfig().cost_aware.model_copy(update={"ngram_tokens": LONG_TOKENS})
    return {"default": variant_factory(cost), "long": variant_factory(cost, long_config, _long_branches)}


def totals(rows: list[dict]) -> dict:
    out = {v: {k: sum(r[v][k] for r in rows) for k in ("new_tokens", "s", "decode_s", "rounds", "context_accepted")}
           for v in VARIANTS}
    out["default_over_long"] = {k: out["default"][k] / out["long"][k] for k in ("s", "decode_s") if out["long"][k]}
    return out


def markdown(meta: dict, rows: list[dict], tot: dict) -> str:
    lines = ["# Context branches: today's (8 tokens, 6+ match bucket) vs long ones (16 tokens, 12+), side by side", "",
             f"Questions: {meta['questions']}, offset {meta['offset']}, {meta['per_category']} per category "
             f"{', '.join(meta['categories']) or '(all)'}, {meta['max_new_tokens']} new tokens, greedy, "
             f"{meta['passes']} pass(es). Machine: {meta['cpu']}, {meta['cpu_count']} CPUs, torch {meta['torch']}.", "",
             "| question | category | pass | variant | s | TTFT s | decode s | rounds | accepted | context acc/prop "
             "| equal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for v in VARIANTS:
            x = r[v]
            lines.append(f"| {r['question_id']} | {r['category']} | {r['pass']} | {v} | {x['s']:.1f} | "
                         f"{x['ttft_ms'] / 1000:.1f} | {x['decode_s']:.1f} | {x['rounds']} | {x['accepted']} | "
                         f"{x['context_accepted']}/{x['context_proposed']} | {'yes' if r['equal'] else 'NO'} |")
    ratio = tot["default_over_long"]
    lines += ["", f"Totals: default {tot['default']['s']:.1f} s ({tot['default']['decode_s']:.1f} s decode, "
              f"{tot['default']['rounds']} rounds), long {tot['long']['s']:.1f} s ({tot['long']['decode_s']:.1f} s "
              f"decode, {tot['long']['rounds']} rounds); default / long = {ratio.get('s', float('nan')):.3f} end to "
              f"end, {ratio.get('decode_s', float('nan')):.3f} decode (> 1: long branches are faster). "
              f"Outputs equal on {sum(r['equal'] for r in rows)}/{len(rows)}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison and write the record; returns its totals (``totals``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_question_args(parser, per_category=2, max_new_tokens=128, out="bench_out/context_length")
    parser.add_argument("--passes", type=int, default=1, help="passes over the questions (order alternates)")
    args = parser.parse_args(argv)
    if args.passes < 1:
        parser.error("--passes: must be >= 1")
    pipe = build_pipeline(args.target, args.draft)
    variants = factories(pipe.shared.cost)
    rows = run_side_by_side(pipe, args, variants, args.passes)
    meta = {**question_meta(args), "passes": args.passes, "spec": DEFAULT_SPEC.to_json(),
            "cost_model": {v: make.shared.cost.snapshot() for v, make in variants.items()}}
    tot = totals(rows)
    write_record(args.out, {"meta": meta, "totals": tot, "questions": rows}, markdown(meta, rows, tot))
    return tot


if __name__ == "__main__":
    main()
