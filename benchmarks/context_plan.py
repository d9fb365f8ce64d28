"""The plan's context branch, side by side: this round's own branch against the average of past rounds'.

    python benchmarks/context_plan.py --questions question.jsonl --offset 3 --per-category 2 \
        --category summarization --category rag --category extraction --out bench_out/context_plan

Before drafting, the cost-aware control decides how many draft steps pay (``plan_depth``). With
``round`` (today's control) it values the context branch this round will verify (its match length,
its calibrated chances, ``orchestrator.shaping.context_path``) and counts a draft node only where
that branch fails; with ``average`` (the control before that change: its ``round_context`` hook switched off) it
adds the moving average of past rounds' branches to every plan and counts the draft in full. Both
run the default real pair in one process on the same model objects, greedy, each with its own
SharedState whose cost model is a copy of one start-up measurement; the variants' order alternates
per question. Per question: seconds, TTFT, decode seconds (total - TTFT), rounds, accepted draft and
context tokens, rounds without the draft, and whether the two outputs are equal (float32 greedy: they
must be). Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.bench import add_question_args, fitting_prompts, load_questions, question_meta, write_record  # noqa: E402
from orchestrator.controller import GenerationRequest  # noqa: E402
from orchestrator.cost_aware import SharedState, cost_aware_factory  # noqa: E402
from orchestrator.cost_model import CostModel  # noqa: E402
from orchestrator.embedded import build_pipeline, encode_prompt  # noqa: E402
from specdec.config import FrontConfig  # noqa: E402
from specdec.tree_spec import DEFAULT_SPEC, MAX_TREE_NODES  # noqa: E402

VARIANTS = ("round", "average")


def variant_factory(cost, config=None, adjust=None):
    """A control factory with the front's settings (``cost_aware_factory``; ``config`` replaces its
    CostAwareConfig) over its own SharedState holding a copy of ``cost`` (the same start-up figures,
    learnt on from there by this variant alone); ``adjust(control)`` changes each control it makes.
    The factory's ``shared`` is that SharedState."""
    front = FrontConfig()
    snap = cost.snapshot()
    copied = CostModel(snap["verify_ms"], snap["draft_step_ms"], source=cost.source)
    base = cost_aware_factory(config or front.cost_aware, front.fallback, SharedState(cost=copied))

    def make(spec, max_nodes=MAX_TREE_NODES):
        control = base(spec, max_nodes)
        if adjust is not None:
            adjust(control)
        return control

    make.shared = base.shared
    return make


def _ignore_round_context(control) -> None:
    control.round_context = lambda context: None


def factories(cost) -> dict:
    """{variant: ``variant_factory``}; ``average`` controls ignore each round's context (the
    ``round_context`` hook does nothing), so their plans use the average of past rounds' branches."""
    return {"round": variant_factory(cost), "average": variant_factory(cost, adjust=_ignore_round_context)}


def row_of(result) -> dict:
    s = result.stats
    return {"new_tokens": s.new_tokens, "s": s.total_s, "ttft_ms": s.ttft_ms, "decode_s": s.total_s - s.ttft_ms / 1000,
            "rounds": s.rounds, "accepted": s.accepted_tokens, "context_accepted": s.context_accepted_tokens,
            "context_proposed": s.context_proposed_tokens, "cost_plain_rounds": s.cost_plain_rounds,
            "drafted": s.drafted_tokens}


def run_side_by_side(pipe, args, variants: dict, passes: int = 1) -> list[dict]:
    """Each selected question (``args``: ``add_question_args``'s options) under every variant
    ({name: control factory}, ``variant_factory``), one after another on ``pipe``'s model objects,
    greedy, ``passes`` times; the order of the variants alternates per question and pass. Each
    variant is warmed up once first (not recorded). Returns one row per question and pass:
    question_id, category, prompt_tokens, pass, order, {variant: ``row_of``} and equal (every
    variant's output the same; float32 greedy: it must be). SystemExit where no question fits."""
    questions = load_questions(args.questions, args.per_category, args.offset, args.category)
    controller = pipe.engine.controller
    names = list(variants)
    warm = encode_prompt(pipe.tokenizer, "Say hi.", raw=False)
    for make in variants.values():
        controller.control_factory = make
        pipe.engine.generate(GenerationRequest(warm, 8, spec=DEFAULT_SPEC))
    rows = []
    for p in range(passes):
        for i, q, ids in fitting_prompts(questions, pipe.tokenizer, args.max_new_tokens, pipe.engine.context_limit):
            order = names if (i + p) % 2 == 0 else names[::-1]
            tokens, row = {}, {"question_id": q["question_id"], "category": q["category"], "prompt_tokens": len(ids),
                               "pass": p + 1, "order": list(order)}
            for v in order:
                controller.control_factory = variants[v]
                result = pipe.engine.generate(GenerationRequest(ids, args.max_new_tokens, spec=DEFAULT_SPEC))
                tokens[v], row[v] = result.tokens, row_of(result)
                print(q["question_id"], q["category"], p + 1, v, {k: round(x, 2) for k, x in row[v].items()}, flush=True)
            row["equal"] = all(tokens[v] == tokens[names[0]] for v in names)
            rows.append(row)
    if not rows:
        raise SystemExit("no selected question fits in the context")
    return rows


def totals(rows: list[dict]) -> dict:
    out = {}
    for v in VARIANTS:
        out[v] = {k: sum(r[v][k] for r in rows) for k in ("new_tokens", "s", "decode_s", "rounds", "cost_plain_rounds")}
    out["average_over_round"] = {k: out["average"][k] / out["round"][k] for k in ("s", "decode_s") if out["round"][k]}
    return out


def markdown(meta: dict, rows: list[dict], tot: dict) -> str:
    lines = ["# Context branch in the plan: this round's vs the average (side by side)", "",
             f"Questions: {meta['questions']}, offset {meta['offset']}, {meta['per_category']} per category "
             f"{', '.join(meta['categories']) or '(all)'}, {meta['max_new_tokens']} new tokens, greedy. "
             f"Machine: {meta['machine']}, {meta['cpu_count']} CPUs, torch {meta['torch']}.", "",
             "| question | category | prompt | variant | s | TTFT s | decode s | rounds | accepted | context acc/prop "
             "| rounds without draft | equal |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for v in VARIANTS:
            x = r[v]
            lines.append(f"| {r['question_id']} | {r['category']} | {r['prompt_tokens']} | {v} | {x['s']:.1f} | "
                         f"{x['ttft_ms'] / 1000:.1f} | {x['decode_s']:.1f} | {x['rounds']} | {x['accepted']} | "
                         f"{x['context_accepted']}/{x['context_proposed']} | {x['cost_plain_rounds']} | "
                         f"{'yes' if r['equal'] else 'NO'} |")
    ratio = tot["average_over_round"]
    lines += ["", f"Totals: round {tot['round']['s']:.1f} s ({tot['round']['decode_s']:.1f} s decode), average "
              f"{tot['average']['s']:.1f} s ({tot['average']['decode_s']:.1f} s decode); average / round = "
              f"{ratio.get('s', float('nan')):.3f} end to end, {ratio.get('decode_s', float('nan')):.3f} decode "
              f"(> 1: this round's branch is faster). Outputs equal on {sum(r['equal'] for r in rows)}/{len(rows)}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison and write the record; returns its totals (``totals``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_question_args(parser, per_category=2, max_new_tokens=128, out="bench_out/context_plan")
    args = parser.parse_args(argv)
    pipe = build_pipeline(args.target, args.draft)
    variants = factories(pipe.shared.cost)
    rows = run_side_by_side(pipe, args, variants)
    meta = {**question_meta(args), "spec": DEFAULT_SPEC.to_json(),
            "cost_model": {v: make.shared.cost.snapshot() for v, make in variants.items()}}
    tot = totals(rows)
    write_record(args.out, {"meta": meta, "totals": tot, "questions": rows}, markdown(meta, rows, tot))
    return tot


if __name__ == "__main__":
    main()
