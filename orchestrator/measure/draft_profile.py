"""``specdec profile-draft``: the DraftProfile (design note 004) of each candidate draft (``PATH[@QUANT]``) against
one target loaded once, with ``specdec eval``'s runner; writes ``profile.json`` and ``profile.md`` (docs/usage.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel
from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

from orchestrator.loop.embedded import encode_prompt, wire_pipeline
from orchestrator.measure import md_table
from orchestrator.measure.bench import _hf_generate, console, load_questions, method_figures
from orchestrator.measure.eval_report import EmbeddedRunner, run_questions, summarize_slice
from specdec.config import FrontConfig, ModelsConfig
from specdec.cpu_linear import PackedLinear
from specdec.model_setup import load_draft, load_target
from specdec.models import DEFAULT_DRAFT, ModelError, check_pair, load_model, resolve_model_dir
from specdec.tree_spec import DEFAULT_SPEC

QUANTS = ("none", "int8")


class DraftProfile(BaseModel):
    """One candidate's figures; JSON names in camelCase (the seed's DraftProfile, then details)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, frozen=True)

    name: str
    parameters: int
    tokens_per_second: float | None = None  # None: not measured (incompatible tokenizer)
    acceptance_rate: float | None = None
    compatible_tokenizer: bool
    tokenizer_reason: str | None = None  # why the tokenizers are incompatible; None when compatible
    draft_quant: str
    end_to_end_speedup: float | None = None  # speculative / target-only end-to-end tokens/s
    decode_speedup: float | None = None
    mean_accepted_length: float | None = None
    output_equivalent: bool | None = None  # greedy outputs token-identical to target-only on every question

    def to_json(self) -> dict:
        return self.model_dump(by_alias=True)


@dataclass(frozen=True)
class Candidate:
    path: str | None  # None = the default draft
    quant: str

    @property
    def name(self) -> str:
        return f"{self.path or 'default'}@{self.quant}"


def parse_candidate(text: str, default_quant: str) -> Candidate:
    """``PATH[@QUANT]`` -> Candidate; raises ValueError naming --candidate for a bad quantization."""
    path, _, quant = text.rpartition("@") if "@" in text else (text, "", default_quant)
    quant = quant or default_quant
    if quant not in QUANTS:
        raise ValueError(f"--candidate {text}: quantization must be one of {', '.join(QUANTS)}, got {quant!r}")
    return Candidate(None if path in ("", "default") else path, quant)


def count_parameters(model) -> int:
    """Weights and biases of the model; CPU-packed linears (int8, oneDNN) hold theirs outside parameters()."""
    n = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, DynamicInt8Linear):
            bias = module.bias()
            n += module.weight().numel() + (bias.numel() if bias is not None else 0)
        elif isinstance(module, PackedLinear):
            n += module.in_features * module.out_features + (module.bias.numel() if module.bias is not None else 0)
    return n


def _incompatible(candidate: Candidate, models, loaded_target) -> DraftProfile:
    """The profile of a draft whose tokenizer does not match: its size and the reason only."""
    model, tokenizer = load_model(resolve_model_dir(candidate.path, DEFAULT_DRAFT, "--candidate"),
                                  str(loaded_target.dtype).removeprefix("torch."), models.device)
    try:
        check_pair(model, tokenizer, loaded_target.model, loaded_target.tokenizer)
        reason = None
    except ModelError as exc:
        reason = str(exc)
    return DraftProfile(name=candidate.name, parameters=count_parameters(model), compatible_tokenizer=False,
                        tokenizer_reason=reason, draft_quant=candidate.quant)


def profile_candidate(candidate: Candidate, base_models, loaded_target, questions, spec, max_new_tokens: int,
                      control: str) -> DraftProfile:
    """Load one candidate against the loaded target and measure its DraftProfile."""
    models = base_models.model_copy(update={"draft": candidate.path, "draft_quant": candidate.quant})
    try:
        loaded_draft = load_draft(models, loaded_target, label="--candidate")
    except ModelError as exc:
        if "incompatible tokenizers" not in str(exc):
            raise
        return _incompatible(candidate, models, loaded_target)
    pipe = wire_pipeline(loaded_target, loaded_draft, control)
    prompts = [encode_prompt(pipe.tokenizer, q["turns"][0], raw=False) for q in questions]
    eos_ids = loaded_target.eos_token_ids  # the draft alone, decode only (greedy HF generate), after a warm-up
    _hf_generate(loaded_draft.model, prompts[0], 4, eos_ids)
    rows = [_hf_generate(loaded_draft.model, ids, max_new_tokens, eos_ids)[1] for ids in prompts]
    tokens_per_s = method_figures(rows)["decode_tokens_per_s"]
    runs, _ = run_questions(EmbeddedRunner(pipe, spec, max_new_tokens), questions, pipe.engine.context_limit,
                            max_new_tokens)
    if not runs:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: no selected question fits in the context")
    report = summarize_slice(runs, "overall", "all", "profile", candidate.name)
    return DraftProfile(name=candidate.name, parameters=count_parameters(loaded_draft.model),
                        tokens_per_second=tokens_per_s, acceptance_rate=report.acceptance_rate,
                        compatible_tokenizer=True, draft_quant=candidate.quant,
                        end_to_end_speedup=report.speedup, decode_speedup=report.decode_speedup,
                        mean_accepted_length=report.mean_accepted_length, output_equivalent=report.output_equivalent)


def markdown(profiles: list[DraftProfile], meta: dict) -> str:
    """profile.md: one row per candidate."""
    def num(value, fmt):
        return "n/a" if value is None else format(value, fmt)

    rows = [[p.name, f"{p.parameters / 1e6:.2f} M", num(p.tokens_per_second, ".2f"), num(p.acceptance_rate, ".3f"),
             num(p.mean_accepted_length, ".2f"), num(p.end_to_end_speedup, ".2f"),
             "yes" if p.compatible_tokenizer else "no: " + (p.tokenizer_reason or "")] for p in profiles]
    return (f"# specdec profile-draft (target {meta['target'] or 'default'}, {meta['task_set']}, "
            f"{meta['per_category']} per category, {meta['max_new_tokens']} new tokens, {meta['dtype']})\n\n"
            "Draft tok/s: the draft alone, decode only. Speedup: end-to-end tokens/s of speculation with the draft "
            "over the target alone (greedy, same questions).\n\n"
            + md_table(["draft", "parameters", "draft tok/s", "acceptance rate", "mean acc len", "speedup",
                        "tokenizer compatible"], rows))


def run_profile(candidates: list[Candidate], out_dir: Path, *, target: str | None = None, questions_path: Path | None = None,
                per_category: int = 1, max_new_tokens: int = 64, dtype: str = "auto", control: str = "cost-aware",
                spec=None, device: str = "cpu", draft_device: str | None = None) -> list[DraftProfile]:
    """Profile every candidate (the target on ``device``, the drafts on ``draft_device``, None = device) and write
    profile.{json,md} under out_dir; QuestionsError/ModelError/ValueError."""
    questions = load_questions(questions_path, per_category)
    loaded_target = load_target(ModelsConfig(target=target, dtype=dtype, device=device))
    base = ModelsConfig(target=target, dtype=dtype, device=draft_device or device)
    profiles = []
    for candidate in candidates:
        console.print(f"profile-draft: {candidate.name}", highlight=False, markup=False)
        profiles.append(profile_candidate(candidate, base, loaded_target, questions, spec or DEFAULT_SPEC,
                                          max_new_tokens, control))
    meta = {"target": target, "task_set": "built-in" if questions_path is None else str(questions_path),
            "per_category": per_category, "max_new_tokens": max_new_tokens, "dtype": str(loaded_target.dtype),
            "control": control, "draft_window": FrontConfig().draft_window.model_dump()}  # wire_pipeline's default
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "profile.json").write_text(json.dumps({"meta": meta, "drafts": [p.to_json() for p in profiles]}, indent=2))
    (out_dir / "profile.md").write_text(markdown(profiles, meta))
    return profiles
