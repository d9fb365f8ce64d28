"""How much of a context (n-gram) branch the target accepts, by the branch's match length.

    python benchmarks/context_branches.py --questions question.jsonl --offset 6 --per-category 1 \
        --max-new-tokens 128 --out bench_out/context_branches

First the target's greedy answers (the speculative engine: the same tokens as the target alone,
float32; ``draft_agreement.target_answers``). Then at every answer position (not only where a
round would start) the context branch the cost-aware control would look up there
(``specdec.ngram.match_continuation`` on the prompt and the answer so far) is compared with the
answer's next tokens. Branches are ``--branch-tokens`` long (16 by default, against the control's
8-token branches, ``CostAwareConfig.ngram_tokens``, so the mean run shows how far copies go on):
per match length L (how many tokens before the continuation equal the context's end), the share
of branches whose first token is right and the mean run of right tokens. The shaping keys its
context calibration by L's bucket (``orchestrator.shaping.match_bucket``). Writes results.json and
results.md. Needs no draft model past the answers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draft_agreement import target_answers  # noqa: E402

from orchestrator.bench import add_question_args, question_meta, write_record  # noqa: E402
from orchestrator.shaping import MATCH_BUCKET_LABELS, match_bucket  # noqa: E402
from specdec.ngram import match_continuation  # noqa: E402


def _empty() -> dict:
    return {"branches": 0, "first_right": 0, "accepted": 0}


def _cells(row: dict) -> str:
    return f"{row['branches']} | {row['first_right'] / row['branches']:.2f} | {row['accepted'] / row['branches']:.2f}"


def tally(answers: list[dict], branch_tokens: int = 16, max_ngram: int = 3, max_match: int = 32) -> dict[int, dict]:
    """{L: {branches, first_right, accepted}} over every answer position that has a context branch:
    branches = positions whose context (prompt + answer so far) has a match of length L; first_right
    = those whose branch's first token is the answer's next; accepted = the summed runs of right
    tokens from the branch's start (at most branch_tokens each)."""
    out: dict[int, dict] = {}
    for a in answers:
        prompt, answer = list(a["prompt"]), list(a["answer"])
        for p in range(len(answer)):
            chain, match = match_continuation(prompt + answer[:p], branch_tokens, max_ngram, max_match=max_match)
            if not chain:
                continue
            run = 0
            for proposed, actual in zip(chain, answer[p:]):
                if proposed != actual:
                    break
                run += 1
            row = out.setdefault(match, _empty())
            row["branches"] += 1
            row["first_right"] += run > 0
            row["accepted"] += run
    return dict(sorted(out.items()))


def by_bucket(rows: dict[int, dict]) -> dict[int, dict]:
    """``tally``'s rows summed per ``match_bucket``."""
    out: dict[int, dict] = {}
    for match, row in rows.items():
        b = out.setdefault(match_bucket(match), _empty())
        for k in b:
            b[k] += row[k]
    return dict(sorted(out.items()))


def markdown(rows: dict[int, dict], buckets: dict[int, dict], meta: dict) -> str:
    lines = [f"# Context branches by match length ({meta['questions']}, offset {meta['offset']}, "
             f"{meta['max_new_tokens']} new tokens, {meta['branch_tokens']}-token branches)", "",
             f"{meta['answers']} target answers, {meta['answer_tokens']} answer positions. first right = the branch's "
             "first token is the target's next token; mean run = right tokens from the branch's start.", "",
             "| match-length bucket | match lengths | branches | first right | mean run |", "|---|---|---|---|---|"]
    for b, r in buckets.items():
        lines.append(f"| {b} | {MATCH_BUCKET_LABELS[b]} | {_cells(r)} |")
    lines += ["", "| match length | branches | first right | mean run |", "|---|---|---|---|"]
    for m, r in rows.items():
        lines.append(f"| {m} | {_cells(r)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_question_args(ap, per_category=1, max_new_tokens=128, out="bench_out/context_branches")
    ap.add_argument("--branch-tokens", type=int, default=16, help="longest branch compared")
    args = ap.parse_args(argv)
    answers = target_answers(args)
    rows = tally(answers, args.branch_tokens)
    buckets = by_bucket(rows)
    meta = {**question_meta(args), "branch_tokens": args.branch_tokens, "answers": len(answers),
            "answer_tokens": sum(len(a["answer"]) for a in answers)}
    answers_meta = [{k: a[k] for k in ("question_id", "category")} | {"prompt_tokens": len(a["prompt"])} for a in answers]
    write_record(args.out, {"meta": meta, "buckets": buckets, "match_lengths": rows, "answers": answers_meta},
                 markdown(rows, buckets, meta))
    return buckets


if __name__ == "__main__":
    main()
