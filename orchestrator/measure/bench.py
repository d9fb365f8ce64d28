"""``specdec bench``: target-only vs tree speculative (ours) vs HF assisted vs HF prompt-lookup decoding, side by
side in one process; writes ``results.json`` and ``results.md``. The method: docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections import defaultdict
from dataclasses import asdict, replace
from importlib import resources
from itertools import zip_longest
from pathlib import Path
from typing import Sequence

import torch
import transformers
from rich.console import Console
from rich.progress import track
from transformers.generation.streamers import BaseStreamer

from orchestrator.loop.embedded import build_pipeline, encode_prompt, set_threads
from orchestrator.loop.controller import GenerationRequest
from orchestrator.measure import md_table
from specdec.config import DraftWindowConfig, FrontConfig
from specdec.placement import cpu_model
from specdec.sampling import GREEDY, SamplingParams
from specdec.stats import GenerationStats, position_rates
from specdec.tree_spec import TreeSpec

console = Console(stderr=True)

BUILTIN_QUESTIONS = resources.files("orchestrator.measure") / "data" / "prompts.jsonl"
PROMPT_LOOKUP_NUM_TOKENS = 10  # HF prompt-lookup decoding: tokens copied from the context per step
# Greedy methods, in their base order; "target_only" is the baseline of every speedup.
METHODS = ("target_only", "plain", "speculative", "hf_assisted", "prompt_lookup")
LABELS = {"target_only": "target", "plain": "plain (ours)", "speculative": "spec", "hf_assisted": "HF assisted",
          "prompt_lookup": "HF prompt lookup"}


class QuestionsError(ValueError):
    """Unreadable or malformed question file, or a bad selection; the message names the option."""


def parse_questions(text: str, source: str) -> list[dict]:
    """Questions of a JSONL text (one object per non-blank line: question_id, category, turns)."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except json.JSONDecodeError as exc:
            raise QuestionsError(f"--questions {source}: line {n} is not JSON ({exc.msg})") from None
        turns = q.get("turns") if isinstance(q, dict) else None
        if not (isinstance(q, dict) and "question_id" in q and isinstance(q.get("category"), str)
                and isinstance(turns, list) and turns and isinstance(turns[0], str)):
            raise QuestionsError(f"--questions {source}: line {n}: expected an object with question_id, category "
                                 "and turns (a list of strings)")
        out.append(q)
    if not out:
        raise QuestionsError(f"--questions {source}: no questions")
    return out


def select_questions(questions: list[dict], per_category: int, offset: int = 0) -> list[dict]:
    """Questions offset .. offset + per_category - 1 of each category (counted in file order)."""
    if offset < 0:
        raise QuestionsError(f"--offset: must be >= 0, got {offset}")
    seen: dict[str, int] = defaultdict(int)
    out = []
    for q in questions:
        index = seen[q["category"]]
        seen[q["category"]] += 1
        if offset <= index < offset + per_category:
            out.append(q)
    if not out:
        raise QuestionsError(f"--offset {offset}: no category has more than {offset} questions")
    return out


def load_questions(path: Path | None, per_category: int, offset: int = 0, categories: Sequence[str] = ()) -> list[dict]:
    """The selected questions of ``path`` (None: built-in set); QuestionsError on a bad file or empty selection."""
    if path is None:
        text, source = BUILTIN_QUESTIONS.read_text(encoding="utf-8"), "built-in"
    else:
        if not path.is_file():
            raise QuestionsError(f"--questions: no such file {path}")
        try:
            text, source = path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise QuestionsError(f"--questions: cannot read {path}: {exc}") from None
    questions = parse_questions(text, source)
    known = sorted({q["category"] for q in questions})
    unknown = [c for c in categories if c not in known]
    if unknown:
        raise QuestionsError(f"--category: {', '.join(unknown)} not in {source} (its categories: {', '.join(known)})")
    if categories:
        questions = [q for q in questions if q["category"] in categories]
    return select_questions(questions, per_category, offset)


class FirstTokenTimer(BaseStreamer):  # when generate() emits its first new tokens (after the prompt's put())
    def __init__(self):
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def _hf_generate(model, prompt_ids, max_new_tokens, eos_ids, **extra) -> tuple[list[int], dict]:
    """Greedy HF generate (extra: assistant_model / prompt_lookup_num_tokens): tokens, {new_tokens, s, ttft_ms}."""
    ids = torch.tensor([prompt_ids], device=model.device)  # (1, T)
    timer = FirstTokenTimer()
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                  eos_token_id=sorted(eos_ids), pad_token_id=sorted(eos_ids)[0], streamer=timer, **extra)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, **kwargs)
    total_s = time.perf_counter() - start
    tokens = out[0, len(prompt_ids):].tolist()
    first = timer.first_token_at if timer.first_token_at is not None else start + total_s
    return tokens, {"new_tokens": len(tokens), "s": total_s, "ttft_ms": (first - start) * 1000}


def _spec_row(stats: GenerationStats) -> dict:
    return {"new_tokens": stats.new_tokens, "s": stats.total_s, "ttft_ms": stats.ttft_ms, "rounds": stats.rounds,
            "proposed": stats.proposed_tokens, "accepted": stats.accepted_tokens, "drafted": stats.drafted_tokens,
            "context_proposed": stats.context_proposed_tokens, "context_accepted": stats.context_accepted_tokens,
            "expected_accepted": round(stats.expected_accepted_tokens, 2), "cost_plain_rounds": stats.cost_plain_rounds,
            "position_proposed": list(stats.position_proposed), "position_accepted": list(stats.position_accepted),
            "draft_s": round(stats.draft_s, 6), "verify_s": round(stats.verify_s, 6), "draft_rounds": stats.draft_rounds}


def greedy_methods(hf_assisted: bool = True, prompt_lookup: bool = True, plain: bool = False) -> list[str]:
    """The greedy methods to run, in base order (plain, our engine without a draft, only when asked)."""
    skip = {"hf_assisted": not hf_assisted, "prompt_lookup": not prompt_lookup, "plain": not plain}
    return [m for m in METHODS if not skip.get(m, False)]


def method_order(methods: Sequence[str], k: int) -> list[str]:
    """Order k (any integer) of a balanced Latin square over ``methods`` (Williams 1949, Australian J. Sci.
    Res. 2(3)): order 0 is m[0], m[1], m[n-1], m[2], m[n-2], ...; order k adds k (mod n) to each index; for odd
    n, orders n .. 2n-1 are orders 0 .. n-1 reversed."""
    n = len(methods)
    if n == 0:
        return []
    first, lo, hi = [0], 1, n - 1
    while lo <= hi:
        first.append(lo)
        lo += 1
        if lo <= hi:
            first.append(hi)
            hi -= 1
    k %= n if n % 2 == 0 else 2 * n
    order = [methods[(i + k) % n] for i in first]
    return order[::-1] if k >= n else order


def run_method(pipe, method: str, prompt_ids, spec, max_new_tokens) -> tuple[list[int], dict]:
    """One greedy pass of one method: its tokens and its row (new_tokens, s, ttft_ms, ...)."""
    if method in ("speculative", "plain"):  # our engine, with or without the draft
        plain = method == "plain"
        result = pipe.engine.generate(GenerationRequest(prompt_ids, max_new_tokens, spec=None if plain else spec))
        row = _spec_row(result.stats)
        return result.tokens, {k: row[k] for k in ("new_tokens", "s", "ttft_ms", "rounds", "drafted")} if plain else row
    extra = {"hf_assisted": {"assistant_model": pipe.draft_model},
             "prompt_lookup": {"prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS}}.get(method, {})
    return _hf_generate(pipe.target_model, prompt_ids, max_new_tokens, pipe.engine.eos_token_ids, **extra)


def median_pass(method: str, runs: list[tuple[list[int], dict]], base_tokens: list[int]) -> dict:
    """A method's row: its median pass by time, ``repeat_s`` (each pass's s), whether all equal ``base_tokens``."""
    _, figures = sorted(runs, key=lambda pass_: pass_[1]["s"])[(len(runs) - 1) // 2]
    figures = dict(figures)
    if len(runs) > 1:
        figures["repeat_s"] = [pass_figures["s"] for _, pass_figures in runs]
    same = all(tokens == base_tokens for tokens, _ in runs)
    if method != "target_only":
        figures["matches_target"] = same
    elif len(runs) > 1:
        figures["repeats_agree"] = same  # False: the target itself is not deterministic here
    return figures


def run_question(pipe, prompt_ids, spec, max_new_tokens, hf_assisted: bool = True, sampling: SamplingParams = GREEDY,
                 prompt_lookup: bool = True, rotate: int = 0, repeats: int = 1, plain: bool = False) -> dict:
    """One question: each greedy method back to back (pass j in ``method_order(methods, rotate + j)``), each row
    the median of ``repeats`` passes, then a "sampled" pass unless greedy. ValueError for repeats < 1."""
    if repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {repeats}")
    methods = greedy_methods(hf_assisted, prompt_lookup, plain)
    passes: dict[str, list[tuple[list[int], dict]]] = {m: [] for m in methods}
    orders = [method_order(methods, rotate + j) for j in range(repeats)]
    for order in orders:
        for m in order:
            passes[m].append(run_method(pipe, m, prompt_ids, spec, max_new_tokens))
    row = {"prompt_tokens": len(prompt_ids), "order": orders[0]}
    if repeats > 1:
        row["orders"] = orders
    for m in methods:
        row[m] = median_pass(m, passes[m], passes["target_only"][0][0])
    if not sampling.greedy:
        sampled = pipe.engine.generate(GenerationRequest(prompt_ids, max_new_tokens, spec=spec, sampling=sampling))
        row["sampled"] = _spec_row(sampled.stats)
    return row


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def method_figures(runs: list[dict]) -> dict:
    """One method's tokens/s (end to end, decode only) as ratios of sums, TTFT as the mean over questions."""
    return {"tokens_per_s": _ratio(sum(r["new_tokens"] for r in runs), sum(r["s"] for r in runs)),
            "decode_tokens_per_s": _ratio(sum(max(0, r["new_tokens"] - 1) for r in runs),
                                          sum(r["s"] - r["ttft_ms"] / 1000 for r in runs)),
            "ttft_ms": sum(r["ttft_ms"] for r in runs) / len(runs)}


def summarize(rows: list[dict]) -> dict:
    """Aggregate question rows: per method tokens/s, TTFT, speedups and match fraction; ours' acceptance."""
    out: dict = {"questions": len(rows)}
    for m in (m for m in METHODS if m in rows[0]):
        for key, value in method_figures([r[m] for r in rows]).items():
            out[f"{m}_{key}"] = value
        if m != "target_only":
            out[f"{m}_speedup"] = _ratio(out[f"{m}_tokens_per_s"], out["target_only_tokens_per_s"])
            out[f"{m}_decode_speedup"] = _ratio(out[f"{m}_decode_tokens_per_s"], out["target_only_decode_tokens_per_s"])
            out[f"{m}_ttft_ratio"] = _ratio(out[f"{m}_ttft_ms"], out["target_only_ttft_ms"])
            out[f"{m}_match_fraction"] = sum(r[m]["matches_target"] for r in rows) / len(rows)
    if "plain" in rows[0]:
        out["speculative_over_plain"] = _ratio(out["speculative_tokens_per_s"], out["plain_tokens_per_s"])
    spec = [r["speculative"] for r in rows]
    out["mean_accepted_length"], out["acceptance_rate"] = _acceptance(spec)
    out["efficiency"] = _ratio(out["speculative_speedup"], out["mean_accepted_length"])
    if all("draft_rounds" in s for s in spec):  # rows written before the phases were recorded have none
        total = sum(s["s"] for s in spec)
        for phase, share in (("ttft", sum(s["ttft_ms"] for s in spec) / 1000), ("draft", sum(s["draft_s"] for s in spec)),
                             ("verify", sum(s["verify_s"] for s in spec))):
            out[f"speculative_{phase}_share"] = _ratio(share, total)
        out["speculative_draft_rounds"] = sum(s["draft_rounds"] for s in spec)
        out["speculative_draft_ms_per_draft_round"] = _ratio(1000 * sum(s["draft_s"] for s in spec),
                                                             out["speculative_draft_rounds"])
    proposed, accepted = ([sum(column) for column in zip_longest(*(r.get(key, []) for r in spec), fillvalue=0)]
                          for key in ("position_proposed", "position_accepted"))
    out["position_proposed"] = proposed
    out["acceptance_by_position"] = position_rates(proposed, accepted)
    if "sampled" in rows[0]:
        sampled = [r["sampled"] for r in rows]
        out["sampled_tokens_per_s"] = method_figures(sampled)["tokens_per_s"]
        out["sampled_mean_accepted_length"], out["sampled_acceptance_rate"] = _acceptance(sampled)
    return out


def _acceptance(runs: list[dict]) -> tuple[float, float]:
    """(mean accepted length: tokens per round, acceptance rate: accepted / proposed draft tokens) of the runs."""
    return (_ratio(sum(s["new_tokens"] for s in runs), sum(s["rounds"] for s in runs)),
            _ratio(sum(s["accepted"] for s in runs), sum(s["proposed"] for s in runs)))


def speedup_table(summary: dict[str, dict], temperature: float | None = None) -> str:
    """One row per category: target-only tokens/s, each method's speedups, ours' acceptance, output matches."""
    first = next(iter(summary.values()))
    others = [m for m in METHODS[1:] if f"{m}_speedup" in first]
    sampled = "sampled_acceptance_rate" in first
    head = ["category", "n", "target tok/s"]
    head += [f"{LABELS[m]} {kind}" for m in others for kind in ("speedup", "decode speedup")]
    over_plain = "speculative_over_plain" in first
    if over_plain:
        head += ["spec / plain (ours)"]
    head += ["mean acc len", "acc rate", "efficiency"] + [f"{LABELS[m]} = target" for m in others]
    if sampled:
        label = "sampled" if temperature is None else f"T={temperature:g}"
        head += [f"{label} tok/s", f"{label} mean acc len", f"{label} acc rate"]
    rows = []
    for cat, s in summary.items():
        cells = [cat, str(s["questions"]), f"{s['target_only_tokens_per_s']:.2f}"]
        cells += [f"{s[f'{m}_{kind}']:.2f}x" for m in others for kind in ("speedup", "decode_speedup")]
        if over_plain:
            cells += [f"{s['speculative_over_plain']:.2f}x"]
        cells += [f"{s['mean_accepted_length']:.2f}", f"{s['acceptance_rate']:.3f}", f"{s['efficiency']:.2f}"]
        cells += [f"{s[f'{m}_match_fraction']:.0%}" for m in others]
        if sampled:
            cells += [f"{s['sampled_tokens_per_s']:.2f}", f"{s['sampled_mean_accepted_length']:.2f}",
                      f"{s['sampled_acceptance_rate']:.3f}"]
        rows.append(cells)
    return md_table(head, rows)


def latency_table(summary: dict[str, dict]) -> str:
    """One row per category: each method's TTFT (ms), decode-only and end-to-end tokens/s."""
    first = next(iter(summary.values()))
    methods = [m for m in METHODS if f"{m}_tokens_per_s" in first]
    head = ["category"] + [f"{LABELS[m]} {kind}" for m in methods for kind in ("TTFT ms", "decode tok/s", "tok/s")]
    rows = [[cat] + [f"{s[f'{m}_{key}']:.{digits}f}" for m in methods
                     for key, digits in (("ttft_ms", 0), ("decode_tokens_per_s", 2), ("tokens_per_s", 2))]
            for cat, s in summary.items()]
    return md_table(head, rows)


def position_table(summary: dict[str, dict]) -> str:
    """One row per category: ours' acceptance at each tree position (rounds reaching it in parentheses)."""
    depth = max((len(s.get("position_proposed", [])) for s in summary.values()), default=0)
    if depth == 0:
        return ""
    rows = []
    for cat, s in summary.items():
        proposed, rates = s.get("position_proposed", []), s.get("acceptance_by_position", [])
        rows.append([cat] + [f"{rates[d]:.2f} ({proposed[d]})" if d < len(proposed) else "-" for d in range(depth)])
    return md_table(["acceptance at position"] + [str(d + 1) for d in range(depth)], rows)


def phase_table(summary: dict[str, dict]) -> str:
    """One row per category: shares of ours' time (first token, later draft phases, verifies, the rest)
    and the draft phase's mean ms; empty for rows without phases."""
    if not all("speculative_draft_share" in s for s in summary.values()):
        return ""
    rows = []
    for cat, s in summary.items():
        shares = [s[f"speculative_{phase}_share"] for phase in ("ttft", "draft", "verify")]
        per_round = f"{s['speculative_draft_ms_per_draft_round']:.0f}" if s["speculative_draft_rounds"] else "-"
        rows.append([cat] + [f"{x:.0%}" for x in shares] + [f"{1 - sum(shares):.0%}", per_round])
    return md_table(["spec time share", "TTFT", "draft", "verify", "other", "draft ms / draft round"], rows)


def markdown_table(summary: dict[str, dict], temperature: float | None = None) -> str:
    """The speedup, TTFT / tokens/s, acceptance-per-position and phase tables, blank lines between."""
    extra = [t for t in (position_table(summary), phase_table(summary)) if t]
    return speedup_table(summary, temperature) + "\n" + latency_table(summary) + "".join("\n" + t for t in extra)


def run_questions(pipe, questions: list[dict], spec, max_new_tokens: int, sampling: SamplingParams,
                  **options) -> tuple[list[dict], list]:
    """``run_question`` on each question; returns rows and the ids too long for the context (ValueError if all)."""
    rows, skipped = [], []
    for i, q in enumerate(track(questions, description="bench", console=console)):
        prompt_ids = encode_prompt(pipe.tokenizer, q["turns"][0], raw=False)
        if len(prompt_ids) + max_new_tokens > pipe.engine.context_limit:
            console.print(f"skipped question {q['question_id']}: {len(prompt_ids)} prompt tokens + {max_new_tokens} "
                          f"new exceed the context ({pipe.engine.context_limit})", markup=False)
            skipped.append(q["question_id"])
            continue
        seeded = replace(sampling, seed=None if sampling.seed is None else sampling.seed + i)
        row = run_question(pipe, prompt_ids, spec, max_new_tokens, sampling=seeded, rotate=i, **options)
        rows.append({"question_id": q["question_id"], "category": q["category"], **row})
    if not rows:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: no selected question fits in the context "
                         f"({pipe.engine.context_limit} tokens)")
    return rows, skipped


def run_bench(spec: TreeSpec, questions_path: Path | None, per_category: int, max_new_tokens: int, dtype: str,
              draft_quant: str, out_dir: Path, hf_assisted: bool = True, threads: int | None = None,
              sampling: SamplingParams = GREEDY, control: str = "cost-aware", *, offset: int = 0,
              prompt_lookup: bool = True, target: str | None = None, draft: str | None = None,
              draft_window: DraftWindowConfig | None = FrontConfig().draft_window, categories: Sequence[str] = (),
              argmax_screen: bool = True, repeats: int = 1, plain: bool = True, device: str = "cpu",
              draft_device: str | None = None) -> dict:
    """Run the benchmark (parameters: ``specdec bench``'s options) and write results.json + results.md under out_dir;
    returns the summary. ValueError for repeats < 1 before the models load."""
    if repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {repeats}")
    questions = load_questions(questions_path, per_category, offset, categories)  # bad files fail before the models load
    set_threads(threads)
    pipe = build_pipeline(target, draft, dtype=dtype, device=device, draft_quant=draft_quant, control=control,
                          draft_window=draft_window, argmax_screen=argmax_screen, draft_device=draft_device)
    cost_start = pipe.shared.cost.snapshot() if pipe.shared else None  # the start-up measurement's shape
    warm = encode_prompt(pipe.tokenizer, "Say hi.", raw=False)
    run_question(pipe, warm, spec, 8, hf_assisted, sampling, prompt_lookup, plain=plain)  # warm-up, not recorded
    rows, skipped = run_questions(pipe, questions, spec, max_new_tokens, sampling, hf_assisted=hf_assisted,
                                  prompt_lookup=prompt_lookup, repeats=repeats, plain=plain)
    meta = {"questions": "built-in" if questions_path is None else str(questions_path), "offset": offset,
            "per_category": per_category, "repeats": repeats,
            "target_repeats_agreed": sum(r["target_only"].get("repeats_agree", True) for r in rows),
            "questions_run": len(rows), "skipped": skipped, "methods": greedy_methods(hf_assisted, prompt_lookup, plain),
            "prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS, "target": target, "draft": draft,
            "spec": json.loads(spec.to_json()), "control": control, "categories": list(categories),
            "draft_window": draft_window.model_dump() if draft_window is not None else None,
            "argmax_screen": pipe.engine.target.argmax_head is not None, "argmax_screen_requested": argmax_screen,
            "cost_model_start": cost_start, "cost_model": pipe.shared.cost.snapshot() if pipe.shared else None,
            "dtype": str(pipe.target_model.dtype), "draft_quant": draft_quant, "max_new_tokens": max_new_tokens,
            "sampling": asdict(sampling), "threads": torch.get_num_threads(), "machine": platform.platform(),
            "cpu": cpu_model(), "cpu_count": os.cpu_count(), "transformers": transformers.__version__}
    return write_results(out_dir, rows, meta, spec, dtype, sampling, max_new_tokens)


def write_results(out_dir: Path, rows: list[dict], meta: dict, spec: TreeSpec, dtype: str, sampling: SamplingParams,
                  max_new_tokens: int) -> dict:
    """Write results.json and results.md under out_dir; prints the tables and returns the summaries."""
    by_cat: dict[str, list] = defaultdict(list)
    for r in rows:
        by_cat[r["category"]].append(r)
    summary = {cat: summarize(rs) for cat, rs in by_cat.items()}
    summary["overall"] = summarize(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({"meta": meta, "summary": summary, "questions": rows}, indent=2))
    table = markdown_table(summary, None if sampling.greedy else sampling.temperature)
    (out_dir / "results.md").write_text(_report(meta, spec, dtype, sampling, max_new_tokens, table))
    print(table)
    return summary


def _cost_line(meta: dict) -> str:
    """The cost model's V(n) and D(p) at start-up and at the end; empty without the cost-aware control."""
    start, end = meta.get("cost_model_start"), meta.get("cost_model")
    if not start or not end:
        return ""

    def figures(snap: dict) -> str:
        v, d = snap["verify_ms"], snap["draft_step_ms"]
        return (f"V({', '.join(map(str, v))}) = {', '.join(f'{ms:.0f}' for ms in v.values())} ms, "
                f"D({', '.join(map(str, d))}) = {', '.join(f'{ms:.0f}' for ms in d.values())} ms")

    return f"Cost model at start-up: {figures(start)}; at the end of the run: {figures(end)}.\n\n"


def _report(meta: dict, spec: TreeSpec, dtype: str, sampling: SamplingParams, max_new_tokens: int, table: str) -> str:
    passes = "greedy" if sampling.greedy else f"greedy + sampled: {sampling.describe()} (+ question index)"
    source = "built-in prompt set" if meta["questions"] == "built-in" else meta["questions"]
    screen = "on" if meta["argmax_screen"] else (
        "off (requested; it needs a float32 CPU target and fbgemm kernels)" if meta["argmax_screen_requested"] else "off")
    repeats = meta.get("repeats", 1)
    plain_note = ("Target-only is transformers' `generate` on the target; plain (ours) is our engine without a draft "
                  "(our forwards and, where on, the argmax screen), so spec / plain (ours) is what speculation alone "
                  "gains. ") if "plain" in meta.get("methods", ()) else ""
    median = ""
    if repeats > 1:
        median = (f"; every greedy method {repeats} times per question, its median pass by total time recorded"
                  f"{' (the faster of 2)' if repeats == 2 else ''}; `X = target` requires every pass of X to equal "
                  f"target-only's first; target-only's own passes agreed on {meta['target_repeats_agreed']} of "
                  f"{meta['questions_run']} questions")
    return (f"# specdec bench ({source}, offset {meta['offset']}, {dtype}, {passes}, {max_new_tokens} new tokens)\n\n"
            f"Machine: {meta.get('cpu') or 'CPU model unknown'}, {meta['cpu_count']} CPUs, {meta['threads']} torch "
            f"threads, torch {torch.__version__}. TreeSpec: `{spec.to_json()}`; greedy argmax screen: {screen}{median}\n\n"
            f"{_cost_line(meta)}"
            "Speedups are against target-only in the same run: end to end (new tokens / total time) and "
            "decode only ((new tokens - 1) / (total time - TTFT)). Efficiency = speedup / mean accepted "
            f"length. HF prompt lookup: `prompt_lookup_num_tokens={PROMPT_LOOKUP_NUM_TOKENS}`. "
            f"{plain_note}"
            "`X = target`: share of questions whose greedy output equals target-only's. Acceptance at "
            "position d: of the rounds whose verified tree (draft and context branches) reached depth d, the "
            "share whose committed path reached it too (rounds in parentheses; vLLM's per-position "
            "acceptance). Spec time share: of the speculative runs' seconds, the first token's (TTFT), the "
            "later rounds' draft phases and verifies, and the rest; draft ms / draft round: the draft phase's "
            "mean over the later rounds that asked the draft.\n\n"
            f"{table}")
