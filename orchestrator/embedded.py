"""Embedded mode: draft and target as in-process workers on one machine, same round loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draft_service.runtime import DraftRuntime
from orchestrator.engine import SpeculativeEngine
from specdec.cpu_linear import default_cpu_dtype, prepack_linears
from specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET, ModelError, check_pair, load_model, resolve_model_dir
from target_service.runtime import TargetRuntime


@dataclass
class EmbeddedPipeline:
    engine: SpeculativeEngine
    tokenizer: object
    target_model: object
    draft_model: object | None


def eos_token_ids(model, tokenizer) -> set[int]:
    """EOS ids from the generation config (int or list) and the tokenizer."""
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto``: bfloat16 where the CPU has native bf16 GEMM (or on a GPU), else float32."""
    if dtype != "auto":
        return dtype
    return default_cpu_dtype() if device == "cpu" else "bfloat16"


def quantize_draft(model):
    """int8 dynamic quantization of the draft's linear layers (fbgemm kernels).

    Only the draft: it changes which tokens are proposed (acceptance), never the output, which the
    unquantized target verifies.
    """
    return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


def build_pipeline(
    target: str | None = None,
    draft: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    speculate: bool = True,
    max_context: int | None = None,
    draft_quant: str = "none",
) -> EmbeddedPipeline:
    """Load the pair (defaults: the real Qwen2.5-Coder pair), check it, wire the engine.

    dtype: auto | bfloat16 | float32 | float16; draft_quant: none | int8 (CPU only).
    Raises ModelError for unknown paths or an incompatible pair.
    """
    dtype = resolve_dtype(dtype, device)
    target_model, tokenizer = load_model(resolve_model_dir(target, DEFAULT_TARGET, "--target"), dtype, device)
    prepack_linears(target_model)
    draft_model = draft_runtime = None
    if speculate:
        draft_model, draft_tok = load_model(resolve_model_dir(draft, DEFAULT_DRAFT, "--draft"), dtype, device)
        check_pair(draft_model, draft_tok, target_model, tokenizer)
        if draft_quant == "int8":
            draft_model = quantize_draft(draft_model.float())
        else:
            prepack_linears(draft_model)
        shared_vocab = min(draft_model.config.vocab_size, target_model.config.vocab_size)
        draft_runtime = DraftRuntime(draft_model, vocab_size=shared_vocab)
    limit = target_model.config.max_position_embeddings
    if max_context is not None:
        if max_context < 2:
            raise ModelError(f"--max-context: must be >= 2, got {max_context}")
        limit = min(limit, max_context)
    engine = SpeculativeEngine(
        TargetRuntime(target_model), draft_runtime, eos_token_ids(target_model, tokenizer), limit,
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
    )
    return EmbeddedPipeline(engine, tokenizer, target_model, draft_model)


def encode_prompt(tokenizer, prompt: str, raw: bool) -> list[int]:
    """Token ids of a prompt; instruct models get their chat template unless ``raw``."""
    if not raw and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
