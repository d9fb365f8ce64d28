"""Spec-Bench benchmark: target-only vs tree speculative vs HF assisted generation, greedy, one run,
plus a sampled speculative pass (default temperature 0.7) reporting acceptance under sampling.

Writes ``results.json`` (per question and per category) and ``results.md`` (a markdown table).
Speedups are ratios measured side by side in the same process, since this machine is noisy.
"""

from __future__ import annotations

import json
import platform
import time
from collections import defaultdict
from dataclasses import asdict, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track

from orchestrator.embedded import build_pipeline, default_control, encode_prompt, set_threads
from orchestrator.controller import GenerationRequest
from specdec.sampling import GREEDY, SamplingParams
from specdec.stats import GenerationStats
from specdec.tree_spec import TreeSpec

console = Console(stderr=True)


def load_questions(path: Path, per_category: int) -> list[dict]:
    """The first ``per_category`` questions of each Spec-Bench category, in file order."""
    taken: dict[str, int] = defaultdict(int)
    out = []
    for line in path.read_text().splitlines():
        q = json.loads(line)
        if taken[q["category"]] < per_category:
            taken[q["category"]] += 1
            out.append(q)
    return out


def _hf_generate(model, prompt_ids, max_new_tokens, eos_ids, assistant=None) -> tuple[list[int], float]:
    ids = torch.tensor([prompt_ids])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                  eos_token_id=sorted(eos_ids), pad_token_id=sorted(eos_ids)[0])
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, **kwargs)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - start


def _spec_row(stats: GenerationStats) -> dict:
    return {"new_tokens": stats.new_tokens, "s": stats.total_s, "rounds": stats.rounds,
            "proposed": stats.proposed_tokens, "accepted": stats.accepted_tokens, "ttft_ms": stats.ttft_ms}


def run_question(pipe, prompt_ids, spec, max_new_tokens, hf_assisted: bool, sampling: SamplingParams = GREEDY) -> dict:
    """One question: target alone, speculative and (optionally) HF assisted, greedy; then, unless
    ``sampling`` is greedy, a speculative pass with those sampling parameters ("sampled")."""
    eos = pipe.engine.eos_token_ids
    base_tokens, base_s = _hf_generate(pipe.target_model, prompt_ids, max_new_tokens, eos)
    result = pipe.engine.generate(GenerationRequest(prompt_ids, max_new_tokens, spec=spec))
    row = {
        "prompt_tokens": len(prompt_ids),
        "target_only": {"new_tokens": len(base_tokens), "s": base_s},
        "speculative": _spec_row(result.stats),
        "spec_matches_target": result.tokens == base_tokens,
    }
    if not sampling.greedy:
        sampled = pipe.engine.generate(GenerationRequest(prompt_ids, max_new_tokens, spec=spec, sampling=sampling))
        row["sampled"] = _spec_row(sampled.stats)
    if hf_assisted:
        hf_tokens, hf_s = _hf_generate(pipe.target_model, prompt_ids, max_new_tokens, eos, pipe.draft_model)
        row["hf_assisted"] = {"new_tokens": len(hf_tokens), "s": hf_s}
        row["hf_matches_target"] = hf_tokens == base_tokens
    return row


def summarize(rows: list[dict]) -> dict:
    """Aggregate question rows: tokens/s of each method, speedups, acceptance figures."""
    def tps(key):
        return sum(r[key]["new_tokens"] for r in rows) / sum(r[key]["s"] for r in rows)

    spec = [r["speculative"] for r in rows]
    out = {
        "questions": len(rows),
        "target_only_tokens_per_s": tps("target_only"),
        "speculative_tokens_per_s": tps("speculative"),
        "mean_accepted_length": sum(s["new_tokens"] for s in spec) / sum(s["rounds"] for s in spec),
        "acceptance_rate": sum(s["accepted"] for s in spec) / max(1, sum(s["proposed"] for s in spec)),
        "spec_match_fraction": sum(r["spec_matches_target"] for r in rows) / len(rows),
    }
    out["speedup"] = out["speculative_tokens_per_s"] / out["target_only_tokens_per_s"]
    out["efficiency"] = out["speedup"] / out["mean_accepted_length"]
    if "sampled" in rows[0]:
        sampled = [r["sampled"] for r in rows]
        out["sampled_tokens_per_s"] = tps("sampled")
        out["sampled_mean_accepted_length"] = sum(s["new_tokens"] for s in sampled) / sum(s["rounds"] for s in sampled)
        out["sampled_acceptance_rate"] = sum(s["accepted"] for s in sampled) / max(1, sum(s["proposed"] for s in sampled))
    if "hf_assisted" in rows[0]:
        out["hf_assisted_tokens_per_s"] = tps("hf_assisted")
        out["hf_speedup"] = out["hf_assisted_tokens_per_s"] / out["target_only_tokens_per_s"]
        out["hf_match_fraction"] = sum(r["hf_matches_target"] for r in rows) / len(rows)
    return out


def markdown_table(summary: dict[str, dict], temperature: float | None = None) -> str:
    """One row per category; greedy columns, HF assisted ones if run, and the sampled pass's
    (labelled with its temperature) if run."""
    first = next(iter(summary.values()))
    hf = "hf_speedup" in first
    sampled = "sampled_acceptance_rate" in first
    head = ["category", "n", "target tok/s", "spec tok/s", "speedup", "mean acc len", "acc rate", "efficiency", "spec = target"]
    if hf:
        head[5:5] = ["HF assisted tok/s", "HF speedup"]
    if sampled:
        label = "sampled" if temperature is None else f"T={temperature:g}"
        head += [f"{label} tok/s", f"{label} mean acc len", f"{label} acc rate"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cat, s in summary.items():
        cells = [cat, str(s["questions"]), f"{s['target_only_tokens_per_s']:.2f}", f"{s['speculative_tokens_per_s']:.2f}",
                 f"{s['speedup']:.2f}x", f"{s['mean_accepted_length']:.2f}", f"{s['acceptance_rate']:.3f}",
                 f"{s['efficiency']:.2f}", f"{s['spec_match_fraction']:.0%}"]
        if hf:
            cells[5:5] = [f"{s['hf_assisted_tokens_per_s']:.2f}", f"{s['hf_speedup']:.2f}x"]
        if sampled:
            cells += [f"{s['sampled_tokens_per_s']:.2f}", f"{s['sampled_mean_accepted_length']:.2f}",
                      f"{s['sampled_acceptance_rate']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run_bench(spec: TreeSpec, questions_path: Path, per_category: int, max_new_tokens: int, dtype: str,
              draft_quant: str, out_dir: Path, hf_assisted: bool, threads: int | None,
              sampling: SamplingParams = GREEDY, dynamic_gamma: bool = True) -> dict:
    """Run the benchmark and write results.json + results.md under out_dir; returns the summary.

    sampling: parameters of the sampled speculative pass (greedy = no such pass); question i uses
    seed + i, so the pass is reproducible when a seed is given. dynamic_gamma: speculative passes
    adapt the depth per request (orchestrator.control), else the TreeSpec's depth every round.
    """
    set_threads(threads)
    pipe = build_pipeline(dtype=dtype, draft_quant=draft_quant, control=default_control(dynamic_gamma))
    questions = load_questions(questions_path, per_category)
    warm = encode_prompt(pipe.tokenizer, "Say hi.", raw=False)
    run_question(pipe, warm, spec, 8, hf_assisted, sampling)  # warm-up, not recorded
    rows = []
    for i, q in enumerate(track(questions, description="spec-bench", console=console)):
        prompt_ids = encode_prompt(pipe.tokenizer, q["turns"][0], raw=False)
        seeded = replace(sampling, seed=None if sampling.seed is None else sampling.seed + i)
        row = run_question(pipe, prompt_ids, spec, max_new_tokens, hf_assisted, seeded)
        rows.append({"question_id": q["question_id"], "category": q["category"], **row})
    by_cat: dict[str, list] = defaultdict(list)
    for r in rows:
        by_cat[r["category"]].append(r)
    summary = {cat: summarize(rs) for cat, rs in by_cat.items()}
    summary["overall"] = summarize(rows)
    meta = {"spec": json.loads(spec.to_json()), "dynamic_gamma": dynamic_gamma, "dtype": str(pipe.target_model.dtype), "draft_quant": draft_quant, "max_new_tokens": max_new_tokens,
            "per_category": per_category, "sampling": asdict(sampling),
            "threads": torch.get_num_threads(), "machine": platform.platform(),
            "cpu_count": __import__("os").cpu_count()}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "summary": summary, "questions": rows}, indent=2))
    table = markdown_table(summary, None if sampling.greedy else sampling.temperature)
    passes = "greedy" if sampling.greedy else f"greedy + sampled: {sampling.describe()} (+ question index)"
    (out_dir / "results.md").write_text(f"# Spec-Bench ({dtype}, {passes}, {max_new_tokens} new tokens)\n\n"
                                        f"TreeSpec: `{spec.to_json()}`\n\n{table}")
    print(table)
    return summary
