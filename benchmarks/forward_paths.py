"""specdec.forward's two speed paths on and off, side by side in one process on the same model objects:
target-only (HF generate), our plain decoding (no draft, our paths), speculative decoding with
transformers' forward paths, and speculative decoding with ours (the default), greedy.

    python benchmarks/forward_paths.py --questions question.jsonl --offset 5 --per-category 1 \
        --max-new-tokens 128 --out bench_out/forward_paths

``transformers``: the draft's and the target's one-session forwards through the transformers model
forward and every masked multi-row attention through transformers' sdpa path (``repeat_kv``);
``ours``: both through ``DirectDecoder`` and masked multi-row attention through SDPA's grouped-query
path (``_sdpa_attention``); ``plain``: our engine without a draft (``spec=None``: one target forward
per token through ``DirectDecoder``), which shows how much of ours' ratio over target-only is the
leaner target forward rather than speculation. All are bit for bit the same maths, so every output
must equal target-only's (``same``). Each speculative method has its own engine and cost-aware control,
whose cost model is measured at start-up with its own paths (recorded: V(n) and D(p)); the methods
run back to back per question, their order rotated left by the question's index. Writes
results.json (per question rows, totals, start-up cost models) and results.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import specdec.forward as forward  # noqa: E402
from draft_window import markdown, question_row, totals  # noqa: E402
from orchestrator.bench import _hf_generate, _spec_row, add_question_args, fitting_prompts, load_questions, question_meta, write_record  # noqa: E402
from orchestrator.controller import GenerationRequest  # noqa: E402
from orchestrator.embedded import encode_prompt, set_threads, wire_pipeline  # noqa: E402
from specdec.config import ModelsConfig  # noqa: E402
from specdec.model_setup import load_draft, load_target  # noqa: E402
from specdec.tree_spec import DEFAULT_SPEC  # noqa: E402

METHODS = ("target", "plain", "transformers", "ours")
SPECULATIVE = ("transformers", "ours")


def use_paths(method: str, pipe=None) -> None:
    """Switch specdec.forward's grouped-query attention for ``method`` (and, given its pipeline, check
    that its runtimes forward as the method says)."""
    forward.NATIVE_GQA = method != "transformers"
    if pipe is not None:
        for worker in (pipe.engine.draft, pipe.engine.target):
            direct = isinstance(worker._forward, forward.DirectDecoder)
            if direct != (method == "ours"):
                raise RuntimeError(f"{method}: {type(worker).__name__} forwards through {type(worker._forward).__name__}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_question_args(ap, per_category=1, max_new_tokens=128, out="bench_out/forward_paths")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: every CPU this process may use)")
    args = ap.parse_args(argv)
    questions = load_questions(args.questions, args.per_category, args.offset, args.category)
    set_threads(args.threads)
    models = ModelsConfig(target=args.target, draft=args.draft, dtype=args.dtype)
    loaded = load_target(models)
    loaded_draft = load_draft(models, loaded)
    pipes, cost_start = {}, {}
    known = vars(forward.DirectDecoder)["of"]  # the classmethod itself (a bound one would pin the class)
    try:
        for method in SPECULATIVE:
            use_paths(method)
            if method == "transformers":  # its runtimes are built (and its costs measured) without DirectDecoder
                forward.DirectDecoder.of = classmethod(lambda cls, model: None)
            try:
                pipes[method] = wire_pipeline(loaded, loaded_draft)  # measures its cost model with the method's paths
            finally:
                forward.DirectDecoder.of = known
            cost_start[method] = pipes[method].shared.cost.snapshot() if pipes[method].shared else None
        ours = pipes["ours"]
        warm = encode_prompt(ours.tokenizer, "Say hi.", raw=False)
        for method, pipe in pipes.items():
            use_paths(method, pipe)
            pipe.engine.generate(GenerationRequest(warm, 8, spec=DEFAULT_SPEC))
        rows = []
        for i, q, ids in fitting_prompts(questions, ours.tokenizer, args.max_new_tokens, ours.engine.context_limit):
            k = i % len(METHODS)
            order = list(METHODS[k:] + METHODS[:k])
            outputs = {}
            for m in order:
                if m == "target":
                    use_paths("transformers")
                    outputs[m] = _hf_generate(loaded.model, ids, args.max_new_tokens, ours.engine.eos_token_ids)
                else:
                    pipe = pipes.get(m, ours)
                    use_paths(m if m in pipes else "ours", pipe)
                    result = pipe.engine.generate(GenerationRequest(ids, args.max_new_tokens,
                                                                    spec=None if m == "plain" else DEFAULT_SPEC))
                    outputs[m] = (result.tokens, _spec_row(result.stats))
            rows.append(question_row(q, ids, order, outputs))
    finally:
        forward.NATIVE_GQA = True
        forward.DirectDecoder.of = known
    methods = list(METHODS)
    summary = totals(rows, methods)
    summary["ours_over_transformers"] = (summary["ours"]["tokens_per_s"] / summary["transformers"]["tokens_per_s"]
                                         if summary["transformers"]["tokens_per_s"] else 0.0)
    meta = {**question_meta(args), "dtype": args.dtype, "cost_model_start": cost_start}
    md = markdown(rows, methods, summary, meta).replace("# Draft context window", "# Forward paths", 1)
    md += (f"\nOurs over transformers' paths, end to end: {summary['ours_over_transformers']:.3f}x.\n\nCost model at start-up "
           "(V(n) ms for n tree rows, D(p) ms for p expanded parents):\n\n| method | V(n) | D(p) |\n|---|---|---|\n")
    for m, c in cost_start.items():
        if c:
            md += f"| {m} | {c['verify_ms']} | {c['draft_step_ms']} |\n"
    write_record(args.out, {"meta": meta, "summary": summary, "questions": rows}, md)
    return summary


if __name__ == "__main__":
    main()
