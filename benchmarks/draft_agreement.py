"""How often the draft's top-1 token equals the target's greedy token, per draft quantization.

    python benchmarks/draft_agreement.py --questions question.jsonl --offset 6 --per-category 1 \
        --max-new-tokens 48 --out bench_out/draft_agreement

First the target's greedy answers (the speculative engine: the same tokens as the target alone,
float32). Then, per draft variant (``int8``: the product's ``quantize_draft``; ``float32``), two
agreement figures over those answer tokens:

- ``stepwise``: the draft fed one token per call after its prompt prefill, close to how it drafts
  in generation (the figure that matters for acceptance; the product's draft opens with its context
  window and runs tree levels of a few rows a call);
- ``one_call``: the whole prompt + answer in one forward (teacher forcing). A dynamically quantized
  draft computes each call with one activation scale over all its rows, so this reads int8 low.

Also the median ms of a one-token step. Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from orchestrator.bench import add_question_args, fitting_prompts, load_questions, question_meta, write_record  # noqa: E402
from orchestrator.controller import GenerationRequest  # noqa: E402
from orchestrator.embedded import build_pipeline  # noqa: E402
from specdec.forward import model_forward  # noqa: E402
from specdec.kv_cache import new_cache  # noqa: E402
from specdec.model_setup import quantize_draft  # noqa: E402
from specdec.models import DEFAULT_DRAFT, load_model, resolve_model_dir  # noqa: E402
from specdec.tree_spec import DEFAULT_SPEC  # noqa: E402

VARIANTS = ("int8", "float32")


def target_answers(args) -> list[dict]:
    """The target's greedy answer to each question that fits: [{question_id, category, prompt, answer}].
    The pipeline is released on return (the target's memory, before a caller loads other models).
    Raises SystemExit with a message when no selected question fits in the context."""
    questions = load_questions(args.questions, args.per_category, args.offset, args.category)
    pipe = build_pipeline(args.target, args.draft, dtype="float32")
    out = []
    for _, q, ids in fitting_prompts(questions, pipe.tokenizer, args.max_new_tokens, pipe.engine.context_limit):
        result = pipe.engine.generate(GenerationRequest(ids, args.max_new_tokens, spec=DEFAULT_SPEC))
        out.append({"question_id": q["question_id"], "category": q["category"], "prompt": ids, "answer": list(result.tokens)})
    if not out:
        raise SystemExit(f"--max-new-tokens {args.max_new_tokens}: no selected question fits in the context")
    return out


@torch.inference_mode()
def agreement(model, answers: list[dict]) -> dict:
    """Top-1 agreement of ``model`` with the answers, stepwise and in one call, and the step's median ms."""
    step_hits = call_hits = total = 0
    step_s = []
    for a in answers:
        prompt, answer = a["prompt"], a["answer"]
        cache = new_cache(model.config)
        if len(prompt) > 1:
            model_forward(model, cache, prompt[:-1], torch.arange(len(prompt) - 1), None, logits_rows=1)
        fed = [prompt[-1], *answer[:-1]]  # each step predicts the next answer token
        for pos, (token, want) in enumerate(zip(fed, answer), start=len(prompt) - 1):
            t = time.perf_counter()
            logits = model_forward(model, cache, [token], torch.tensor([pos]), None, logits_rows=1)  # (1, V)
            step_s.append(time.perf_counter() - t)
            step_hits += int(logits[-1].argmax()) == want
        seq = prompt + answer
        logits = model_forward(model, new_cache(model.config), seq, torch.arange(len(seq)), None,
                               logits_rows=len(answer) + 1)[:-1]  # rows predicting the answer tokens
        call_hits += int((logits.argmax(-1) == torch.tensor(answer)).sum())
        total += len(answer)
    return {"tokens": total, "stepwise": step_hits / total if total else 0.0,
            "one_call": call_hits / total if total else 0.0,
            "step_ms": 1000 * statistics.median(step_s) if step_s else 0.0}


def markdown(summary: dict, meta: dict) -> str:
    lines = [f"# Draft top-1 agreement with the target's greedy answers ({meta['questions']}, offset {meta['offset']}, "
             f"{meta['max_new_tokens']} new tokens)", "",
             f"{meta['answers']} answers, {summary[VARIANTS[0]]['tokens']} answer tokens. stepwise = one token a call "
             "(as in drafting); one call = the whole text in one forward (teacher forcing).", "",
             "| draft | stepwise agreement | one-call agreement | one-token step ms (median) |", "|---|---|---|---|"]
    for v, s in summary.items():
        lines.append(f"| {v} | {s['stepwise']:.3f} | {s['one_call']:.3f} | {s['step_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_question_args(ap, per_category=1, max_new_tokens=48, out="bench_out/draft_agreement")
    args = ap.parse_args(argv)
    answers = target_answers(args)
    draft_dir = resolve_model_dir(args.draft, DEFAULT_DRAFT, "--draft")
    summary = {}
    for variant in VARIANTS:
        model, _ = load_model(draft_dir, "float32", "cpu")
        if variant == "int8":
            model = quantize_draft(model)
        summary[variant] = agreement(model, answers)
        print(variant, summary[variant], flush=True)
        del model
    meta = {**question_meta(args), "answers": len(answers), "threads": torch.get_num_threads()}
    rows = [{k: a[k] for k in ("question_id", "category")} | {"prompt_tokens": len(a["prompt"]), "answer": a["answer"]}
            for a in answers]
    write_record(args.out, {"meta": meta, "summary": summary, "answers": rows}, markdown(summary, meta))
    return summary


if __name__ == "__main__":
    main()
