"""Embedded mode: draft and target as in-process workers on one machine, same round loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import ValidationError

from draft_service.runtime import DraftRuntime
from orchestrator.planning.control import ControlFactory, FixedControl
from orchestrator.planning.cost_aware import CostAwareFactory, SharedState
from orchestrator.planning.cost_model import CostModel, measure_worker_costs
from orchestrator.loop.engine import SpeculativeEngine
from specdec.config import CONTROLS, DraftWindowConfig, FrontConfig, ModelsConfig
from specdec.model_setup import LoadedDraft, LoadedTarget, load_draft, load_target
from specdec.models import ModelError
from specdec.placement import usable_cpus
from target_service.runtime import TargetRuntime


@dataclass
class EmbeddedPipeline:
    engine: SpeculativeEngine
    tokenizer: object
    target_model: object
    draft_model: object | None
    shared: SharedState | None = None  # cost model and calibrations of the cost-aware control


def build_pipeline(target: str | None = None, draft: str | None = None, dtype: str = "auto", device: str = "cpu",
                   speculate: bool = True, max_context: int | None = None, draft_quant: str = "auto",
                   control: str | ControlFactory | None = "cost-aware", measure_costs: bool = True,
                   pipeline: bool = False, draft_window: DraftWindowConfig | None = FrontConfig().draft_window,
                   argmax_screen: bool = True, draft_device: str | None = None) -> EmbeddedPipeline:
    """Load the pair (defaults: the real Qwen2.5-Coder pair), check it, wire the engine. dtype, devices, draft_quant,
    argmax_screen: as ``specdec generate``'s flags (draft_device None = device); control: one of CONTROLS or a
    factory (None = fixed TreeSpec); measure_costs: time V(n) and D(p) on these models, else prior figures;
    draft_window: None = all tokens. Raises ModelError for unknown paths, bad values or an incompatible pair."""
    try:
        models = ModelsConfig(target=target, draft=draft, dtype=dtype, device=device, max_context=max_context,
                              draft_quant=draft_quant, argmax_screen=argmax_screen)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ModelError(f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']}") from None
    loaded = load_target(models)
    draft_models = models.model_copy(update={"device": draft_device or device})
    return wire_pipeline(loaded, load_draft(draft_models, loaded) if speculate else None, control, measure_costs,
                         pipeline, draft_window)


def wire_pipeline(loaded: LoadedTarget, loaded_draft: LoadedDraft | None, control: str | ControlFactory | None = "cost-aware",
                  measure_costs: bool = True, pipeline: bool = False,
                  draft_window: DraftWindowConfig | None = FrontConfig().draft_window) -> EmbeddedPipeline:
    """``build_pipeline`` without the loading (several drafts can share one loaded target); loaded_draft None =
    target only. Raises ModelError for an unknown control mode."""
    draft_model = draft_runtime = draft_limit = None
    if loaded_draft is not None:
        draft_model, draft_limit = loaded_draft.model, loaded_draft.context_limit
        draft_runtime = DraftRuntime(draft_model, vocab_size=loaded_draft.vocab_size)
    tokenizer = loaded.tokenizer
    target_runtime = TargetRuntime(loaded.model)
    factory, shared = make_control(control, target_runtime, draft_runtime, measure_costs)
    engine = SpeculativeEngine(target_runtime, draft_runtime, loaded.eos_token_ids, loaded.context_limit,
                               decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                               control_factory=factory, draft_context_limit=draft_limit, pipeline=pipeline,
                               draft_window=draft_window, ahead_candidates=FrontConfig().ahead_candidates)
    return EmbeddedPipeline(engine, tokenizer, loaded.model, draft_model, shared)


def make_control(control: str | ControlFactory | None, target, draft, measure_costs: bool = True,
                 front: FrontConfig = FrontConfig()) -> tuple[ControlFactory | None, SharedState | None]:
    """(factory, SharedState) for a mode of CONTROLS with the service defaults (``cost-aware``: costs measured on
    the workers unless measure_costs is False); a factory or None as it is. Raises ModelError for an unknown mode."""
    if control is None or callable(control):
        return control, None
    if control == "fixed":
        return (lambda spec: FixedControl(spec, front.fallback)), None
    if control != "cost-aware":
        raise ModelError(f"--control: one of {', '.join(CONTROLS)}, got {control!r}")
    shared = SharedState(cost=measure_worker_costs(target, draft, target.vocab_size) if measure_costs else CostModel())
    return CostAwareFactory(front.cost_aware, front.fallback, shared), shared


def encode_prompt(tokenizer, prompt: str, raw: bool) -> list[int]:
    """Token ids of a prompt; instruct models get their chat template unless ``raw``."""
    if not raw and tokenizer.chat_template:
        return encode_chat(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer(prompt)["input_ids"]


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of messages through the chat template, ending with the assistant's turn. Raises ValueError
    without a chat template."""
    if not tokenizer.chat_template:
        raise ValueError("messages: the model's tokenizer has no chat template (send a raw prompt instead)")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def set_threads(threads: int | None) -> None:
    """torch's CPU threads: ``threads``, None = the CPUs this process can keep busy (``usable_cpus``)."""
    torch.set_num_threads(threads or usable_cpus())
