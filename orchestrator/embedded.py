"""Embedded mode: draft and target as in-process workers on one machine, same round loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import ValidationError

from draft_service.runtime import DraftRuntime
from orchestrator.control import RequestControl
from orchestrator.engine import SpeculativeEngine
from specdec.config import FrontConfig, ModelsConfig
from specdec.model_setup import load_draft, load_target
from specdec.models import ModelError
from target_service.runtime import TargetRuntime


@dataclass
class EmbeddedPipeline:
    engine: SpeculativeEngine
    tokenizer: object
    target_model: object
    draft_model: object | None


def build_pipeline(
    target: str | None = None,
    draft: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    speculate: bool = True,
    max_context: int | None = None,
    draft_quant: str = "auto",
    control=None,
) -> EmbeddedPipeline:
    """Load the pair (defaults: the real Qwen2.5-Coder pair), check it, wire the engine.

    dtype: auto | bfloat16 | float32 | float16; draft_quant: auto | none | int8 (CPU only);
    control: per-request control policy factory (TreeSpec -> policy, e.g. ``orchestrator.control.
    RequestControl`` for dynamic gamma and fallback; None = the fixed TreeSpec every round).
    Raises ModelError for unknown paths, bad values or an incompatible pair.
    """
    if max_context is not None and max_context < 2:
        raise ModelError(f"--max-context: must be >= 2, got {max_context}")
    try:
        models = ModelsConfig(target=target, draft=draft, dtype=dtype, device=device, max_context=max_context,
                              draft_quant=draft_quant)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ModelError(f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']}") from None
    loaded = load_target(models)
    draft_model = draft_runtime = draft_limit = None
    if speculate:
        loaded_draft = load_draft(models, loaded)
        draft_model, draft_limit = loaded_draft.model, loaded_draft.context_limit
        draft_runtime = DraftRuntime(draft_model, vocab_size=loaded_draft.vocab_size)
    tokenizer = loaded.tokenizer
    engine = SpeculativeEngine(
        TargetRuntime(loaded.model), draft_runtime, loaded.eos_token_ids, loaded.context_limit,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False), control_factory=control,
        draft_context_limit=draft_limit,
    )
    return EmbeddedPipeline(engine, tokenizer, loaded.model, draft_model)


def default_control(dynamic_gamma: bool = True):
    """The control policy factory of ``specdec generate`` / ``bench``: dynamic gamma and fallback with
    the service defaults (specdec.config.FrontConfig), or None = the fixed TreeSpec every round."""
    if not dynamic_gamma:
        return None
    front = FrontConfig()
    return lambda spec: RequestControl(spec, front.dynamic_gamma, front.fallback)


def encode_prompt(tokenizer, prompt: str, raw: bool) -> list[int]:
    """Token ids of a prompt; instruct models get their chat template unless ``raw``."""
    if not raw and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
