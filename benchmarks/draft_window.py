"""Draft context window (specdec.config.DraftWindowConfig) side by side in one process: target-only and
speculative decoding with several draft windows, on the same model objects and questions, greedy.

    python benchmarks/draft_window.py --questions question.jsonl --category summarization --category rag \
        --category extraction --offset 5 --per-category 2 --windows none,256,256f32 --out bench_out/window

Windows: ``none`` = the draft sees every committed token; ``N`` = the first 32 and the last N - 32
tokens for the whole request; ``NfK`` = the same, re-opened with every committed token once K tokens
are generated (full_after_tokens). Per question the methods run back to back, their order rotated
left by the question's index (drift of the machine spreads over every method). The default control
(cost-aware) learns across the runs of one process, as in ``specdec bench``.

What is timed: total seconds per request (prefill included), TTFT, and decode seconds (total - TTFT:
the draft's prefill, which the window shortens, falls here: the first round never drafts). Writes
results.json (per question rows, totals) and results.md. Outputs are compared with target-only
(``same``): they must be equal (float32).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.bench import _hf_generate, _spec_row, add_question_args, fitting_prompts, load_questions, question_meta, write_record  # noqa: E402
from orchestrator.controller import GenerationRequest  # noqa: E402
from orchestrator.embedded import build_pipeline, encode_prompt  # noqa: E402
from specdec.config import DraftWindowConfig  # noqa: E402
from specdec.tree_spec import DEFAULT_SPEC  # noqa: E402


def window_of(name: str) -> DraftWindowConfig | None:
    """``none`` | ``N`` | ``NfK`` -> the window (module docstring). Raises ValueError for other names."""
    if name == "none":
        return None
    tokens, _, full_after = name.partition("f")
    return DraftWindowConfig(max_tokens=int(tokens), full_after_tokens=int(full_after) if full_after else None)


def question_row(q: dict, ids: list[int], order: list[str], outputs: dict) -> dict:
    """One question's record row, printed as a JSON line: each method's figures, with ``same`` (its
    tokens equal target-only's) for every method but ``target``. outputs: method -> (tokens, figures)."""
    base = outputs["target"][0]
    row = {"question_id": q["question_id"], "category": q["category"], "prompt_tokens": len(ids), "order": order}
    for m, (tokens, figures) in outputs.items():
        row[m] = figures if m == "target" else {**figures, "same": tokens == base}
    print(json.dumps(row), flush=True)
    return row


def totals(rows: list[dict], methods: list[str]) -> dict:
    """Per method: tokens, seconds, decode seconds, tokens/s and the speedup over target-only."""
    out = {}
    for m in methods:
        n = sum(r[m]["new_tokens"] for r in rows)
        s = sum(r[m]["s"] for r in rows)
        decode = sum(r[m]["s"] - r[m]["ttft_ms"] / 1000 for r in rows)
        out[m] = {"new_tokens": n, "s": s, "decode_s": decode, "tokens_per_s": n / s if s else 0.0}
    base = out["target"]["tokens_per_s"]
    for m in methods:
        out[m]["speedup"] = out[m]["tokens_per_s"] / base if base else 0.0
        out[m]["decode_speedup"] = out["target"]["decode_s"] / out[m]["decode_s"] if out[m]["decode_s"] else 0.0
    return out


def markdown(rows: list[dict], methods: list[str], summary: dict, meta: dict) -> str:
    lines = [f"# Draft context window ({meta['questions']}, offset {meta['offset']}, {meta['max_new_tokens']} new tokens, greedy)",
             "", "Per question: seconds end to end (decode seconds = total - TTFT); accepted / proposed draft tokens; "
             "`same` = output equals target-only.", "",
             "| question | category | prompt | new | " + " | ".join(methods) + " |",
             "|---|---|---|---|" + "---|" * len(methods)]
    for r in rows:
        cells = []
        for m in methods:
            f = r[m]
            extra = "" if m == "target" else f", {f['accepted']}/{f['proposed']}{'' if f['same'] else ', DIFFERS'}"
            cells.append(f"{f['s']:.1f} ({f['s'] - f['ttft_ms'] / 1000:.1f}){extra}")
        lines.append(f"| {r['question_id']} | {r['category']} | {r['prompt_tokens']} | {r['target']['new_tokens']} | "
                     + " | ".join(cells) + " |")
    lines += ["", "| method | tokens | s | decode s | tok/s | speedup | decode speedup |", "|---|---|---|---|---|---|---|"]
    for m in methods:
        t = summary[m]
        lines.append(f"| {m} | {t['new_tokens']} | {t['s']:.1f} | {t['decode_s']:.1f} | {t['tokens_per_s']:.3f} | "
                     f"{t['speedup']:.3f} | {t['decode_speedup']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_question_args(ap, per_category=2, max_new_tokens=128, out="bench_out/draft_window")
    ap.add_argument("--windows", default="none,256", help="comma-separated: none, N or NfK")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    names = args.windows.split(",")
    windows = {f"w{name}": window_of(name) for name in names}
    questions = load_questions(args.questions, args.per_category, args.offset, args.category)
    pipe = build_pipeline(args.target, args.draft, dtype=args.dtype)
    warm = encode_prompt(pipe.tokenizer, "Say hi.", raw=False)
    pipe.engine.generate(GenerationRequest(warm, 8, spec=DEFAULT_SPEC))
    methods = ["target", *windows]
    rows = []
    for i, q, ids in fitting_prompts(questions, pipe.tokenizer, args.max_new_tokens, pipe.engine.context_limit):
        k = i % len(methods)
        order = methods[k:] + methods[:k]
        outputs = {}
        for m in order:
            if m == "target":
                outputs[m] = _hf_generate(pipe.target_model, ids, args.max_new_tokens, pipe.engine.eos_token_ids)
            else:
                pipe.engine.controller.draft_window = windows[m]
                result = pipe.engine.generate(GenerationRequest(ids, args.max_new_tokens, spec=DEFAULT_SPEC))
                outputs[m] = (result.tokens, _spec_row(result.stats))
        rows.append(question_row(q, ids, order, outputs))
    summary = totals(rows, methods)
    meta = {**question_meta(args), "windows": {m: (w.model_dump() if w is not None else None) for m, w in windows.items()},
            "dtype": args.dtype}
    write_record(args.out, {"meta": meta, "summary": summary, "questions": rows}, markdown(rows, methods, summary, meta))
    return summary


if __name__ == "__main__":
    main()
