"""The greedy argmax screen (specdec.argmax_head) side by side in one process: target-only, HF assisted
generation, and speculative decoding with the screen on and off, on the same model objects, greedy.

    python benchmarks/argmax_screen.py --questions question.jsonl --offset 5 --per-category 1 \
        --max-new-tokens 64 --out bench_out/argmax_screen

Per question the methods run back to back, their order rotated left by the question's index (drift of
the machine spreads over every method). ``spec_screen`` / ``spec_full``: the same pipeline with the
target runtime's ``argmax_head`` set / cleared between runs (the cost-aware control learns across the
runs of one process, as in ``specdec bench``). Also times the LM head alone (the model's packed
float32 head + argmax vs the screen) for 1 / 4 / 8 / 16 rows of real hidden states.

What is timed: total seconds per request (prefill included), TTFT, decode seconds (total - TTFT) and,
for the speculative runs, the mean verify wall time per round. Writes results.json and results.md.
Outputs are compared with target-only (``same``): they must be equal (float32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from orchestrator.bench import _hf_generate, _spec_row, add_question_args, fitting_prompts, load_questions, question_meta, write_record  # noqa: E402
from orchestrator.controller import GenerationRequest  # noqa: E402
from orchestrator.embedded import build_pipeline, encode_prompt  # noqa: E402
from specdec.tree_spec import DEFAULT_SPEC  # noqa: E402

METHODS = ["target", "hf_assisted", "spec_screen", "spec_full"]


def totals(rows: list[dict]) -> dict:
    """Per method: tokens, seconds, decode seconds, tokens/s and speedups over target-only and HF assisted."""
    out = {}
    for m in METHODS:
        n = sum(r[m]["new_tokens"] for r in rows)
        s = sum(r[m]["s"] for r in rows)
        decode = sum(r[m]["s"] - r[m]["ttft_ms"] / 1000 for r in rows)
        out[m] = {"new_tokens": n, "s": s, "decode_s": decode, "tokens_per_s": n / s if s else 0.0}
        verify = [v for r in rows for v in r[m].get("verify_ms", [])]
        if verify:
            out[m]["mean_verify_ms"] = statistics.mean(verify)
    for m in METHODS:
        for base in ("target", "hf_assisted"):
            b = out[base]["tokens_per_s"]
            out[m][f"speedup_vs_{base}"] = out[m]["tokens_per_s"] / b if b else 0.0
        out[m]["decode_speedup"] = out["target"]["decode_s"] / out[m]["decode_s"] if out[m]["decode_s"] else 0.0
    return out


def head_timings(model, head, hidden: torch.Tensor, reps: int = 7) -> list[dict]:
    """Median ms of the model's own head + argmax and of the screen, for 1 / 4 / 8 / 16 rows (as many as hidden has)."""
    out = []
    for m in (1, 4, 8, 16):
        if m > hidden.shape[0]:  # a short last prompt
            break
        x = hidden[:m]
        row = {"rows": m}
        for name, fn in (("full_head_ms", lambda: model.get_output_embeddings()(x).argmax(-1)),
                         ("screen_ms", lambda: head.argmax(x))):
            fn()
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            row[name] = 1000 * sorted(ts)[reps // 2]
        row["equal"] = bool(torch.equal(model.get_output_embeddings()(x).argmax(-1), head.argmax(x)))
        out.append(row)
    return out


def markdown(rows: list[dict], summary: dict, heads: list[dict], meta: dict) -> str:
    lines = [f"# Greedy argmax screen ({meta['questions']}, offset {meta['offset']}, {meta['max_new_tokens']} new tokens, greedy)",
             "", "Per question: seconds end to end (decode = total - TTFT); speculative runs: mean verify ms a round; "
             "`DIFFERS` = output not equal to target-only.", "",
             "| question | category | prompt | new | " + " | ".join(METHODS) + " |",
             "|---|---|---|---|" + "---|" * len(METHODS)]
    for r in rows:
        cells = []
        for m in METHODS:
            f = r[m]
            extra = f", verify {statistics.mean(f['verify_ms']):.0f} ms" if f.get("verify_ms") else ""
            extra += "" if f.get("same", True) else ", DIFFERS"
            cells.append(f"{f['s']:.1f} ({f['s'] - f['ttft_ms'] / 1000:.1f}){extra}")
        lines.append(f"| {r['question_id']} | {r['category']} | {r['prompt_tokens']} | {r['target']['new_tokens']} | "
                     + " | ".join(cells) + " |")
    lines += ["", "| method | tokens | s | decode s | tok/s | vs target-only | vs HF assisted | decode speedup | mean verify ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    for m in METHODS:
        t = summary[m]
        verify = f"{t['mean_verify_ms']:.0f}" if "mean_verify_ms" in t else "-"
        lines.append(f"| {m} | {t['new_tokens']} | {t['s']:.1f} | {t['decode_s']:.1f} | {t['tokens_per_s']:.3f} | "
                     f"{t['speedup_vs_target']:.3f} | {t['speedup_vs_hf_assisted']:.3f} | {t['decode_speedup']:.3f} | {verify} |")
    lines += ["", "LM head alone (median ms; real hidden states of the last prompt):", "",
              "| rows | model's packed float32 head + argmax | screen | same argmax |", "|---|---|---|---|"]
    for h in heads:
        lines.append(f"| {h['rows']} | {h['full_head_ms']:.1f} | {h['screen_ms']:.1f} | {h['equal']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_question_args(ap, per_category=1, max_new_tokens=64, out="bench_out/argmax_screen")
    args = ap.parse_args(argv)
    questions = load_questions(args.questions, args.per_category, args.offset, args.category)
    pipe = build_pipeline(args.target, args.draft, dtype="float32")
    runtime = pipe.engine.target  # the in-process TargetRuntime
    head = runtime.argmax_head
    if head is None:
        raise SystemExit("the target has no argmax screen here (not float32 CPU, or no fbgemm kernels)")
    verify_ms: list[float] = []
    pipe.engine.controller.on_round = lambda r: verify_ms.append(1000 * r.verify_s)
    warm = encode_prompt(pipe.tokenizer, "Say hi.", raw=False)
    pipe.engine.generate(GenerationRequest(warm, 8, spec=DEFAULT_SPEC))
    rows, last_ids = [], None
    for i, q, ids in fitting_prompts(questions, pipe.tokenizer, args.max_new_tokens, pipe.engine.context_limit):
        last_ids = ids
        k = i % len(METHODS)
        order = METHODS[k:] + METHODS[:k]
        outputs = {}
        for m in order:
            if m in ("target", "hf_assisted"):
                extra = {"assistant_model": pipe.draft_model} if m == "hf_assisted" else {}
                outputs[m] = _hf_generate(pipe.target_model, ids, args.max_new_tokens, pipe.engine.eos_token_ids, **extra)
            else:
                runtime.argmax_head = head if m == "spec_screen" else None
                verify_ms.clear()
                result = pipe.engine.generate(GenerationRequest(ids, args.max_new_tokens, spec=DEFAULT_SPEC))
                outputs[m] = (result.tokens, {**_spec_row(result.stats), "verify_ms": list(verify_ms)})
        runtime.argmax_head = head
        base = outputs["target"][0]
        row = {"question_id": q["question_id"], "category": q["category"], "prompt_tokens": len(ids), "order": order}
        for m in METHODS:
            tokens, figures = outputs[m]
            row[m] = {**figures, "same": list(tokens) == list(base)}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items()}, default=str)[:400], flush=True)
    if last_ids is None:
        raise SystemExit(f"--max-new-tokens {args.max_new_tokens}: no selected question fits in the context "
                         f"({pipe.engine.context_limit} tokens)")
    with torch.inference_mode():
        ids = torch.tensor([last_ids[:64]])
        hidden = pipe.target_model.get_decoder()(ids, use_cache=False).last_hidden_state[0, -16:]
    heads = head_timings(pipe.target_model, head, hidden)
    summary = totals(rows)
    meta = question_meta(args)
    write_record(args.out, {"meta": meta, "summary": summary, "head": heads, "questions": rows},
                 markdown(rows, summary, heads, meta))
    return summary


if __name__ == "__main__":
    main()
