"""Load the draft and target models (models only: the services wrap them in their runtimes).

    target = load_target(models)            # model + tokenizer + context limit + EOS ids
    draft = load_draft(models, target)      # model + shared vocabulary size (checked against the target)

``target_info``: the target's config and tokenizer without its weights. Every function raises ModelError naming
the model argument for unknown paths, unsupported models or an incompatible pair.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from specdec.argmax_head import attach_argmax_head
from specdec.checkpoint_memory import own_weights
from specdec.config import ModelsConfig
from specdec.cpu_linear import default_cpu_dtype, prepack_linears
from specdec.models import (
    DEFAULT_DRAFT, DEFAULT_TARGET, DTYPES, ModelError, check_pair, check_supported, load_model, resolve_model_dir,
)

log = logging.getLogger(__name__)


@dataclass
class LoadedTarget:
    """The target model ready to serve. context_limit: max total tokens (prompt + generated)."""

    model: object
    tokenizer: object
    context_limit: int
    eos_token_ids: frozenset[int]
    name: str  # the model directory

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype


@dataclass
class TargetInfo:
    """What the draft (and a tensor-parallel target service, whose ranks hold the weights) needs to
    know of the target, without its weights (config + tokenizer + generation config)."""

    tokenizer: object
    vocab_size: int
    dtype: torch.dtype  # the dtype the target is loaded in (same models.dtype)
    context_limit: int = 0  # max total tokens, as LoadedTarget.context_limit
    eos_token_ids: frozenset[int] = frozenset()  # as LoadedTarget.eos_token_ids
    name: str = ""  # the model directory


@dataclass
class LoadedDraft:
    """The draft model ready to serve. context_limit: the draft's max positions; vocab_size: the ids
    both models share (the smaller of the two vocabularies), the draft runtime's ``vocab_size``."""

    model: object
    tokenizer: object
    context_limit: int
    name: str
    vocab_size: int


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
    """``auto``: float32 on the CPU (``specdec.cpu_linear.default_cpu_dtype``), bfloat16 on a GPU."""
    if dtype != "auto":
        return dtype
    return default_cpu_dtype() if device == "cpu" else "bfloat16"


def resolve_draft_quant(draft_quant: str, device: str) -> str:
    """``auto``: int8 on a CPU with fbgemm kernels (several times faster, slightly lower agreement), else none.
    Raises ModelError naming ``draft_quant`` for int8 on another device (the kernels are CPU-only)."""
    on_cpu = device.startswith("cpu")
    if draft_quant == "int8" and not on_cpu:
        raise ModelError(f"draft_quant: int8 runs on a CPU only (fbgemm kernels), the draft is on {device} (use none)")
    if draft_quant != "auto":
        return draft_quant
    return "int8" if on_cpu and "fbgemm" in torch.backends.quantized.supported_engines else "none"


def quantize_draft(model):
    """int8 dynamic quantization of the draft's linears (torch.ao, fbgemm): moves acceptance, never the output."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization deprecation notices
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        # In place: a copy would read every float weight into process memory first (2 GB for the default).
        return quantize_dynamic(model.float(), {torch.nn.Linear: per_channel_dynamic_qconfig}, inplace=True)


def context_limit(model, max_context: int | None) -> int:
    """The model's max positions, capped by ``max_context`` (tokens) when given."""
    limit = model.config.max_position_embeddings
    return limit if max_context is None else min(limit, max_context)


def load_target(models: ModelsConfig, label: str = "--target") -> LoadedTarget:
    """Load, check and pre-pack the target model (None = the default). Raises ModelError naming ``label``."""
    dtype = resolve_dtype(models.dtype, models.device)
    model_dir = resolve_model_dir(models.target, DEFAULT_TARGET, label)
    model, tokenizer = load_model(model_dir, dtype, models.device)
    check_supported(model, label)
    if models.argmax_screen and dtype == "float32" and models.device == "cpu":
        if not attach_argmax_head(model):  # before prepacking: it copies the head's plain weight
            log.info("%s: no greedy argmax screen (the LM head is not a plain float32 linear, or no fbgemm kernels); "
                     "greedy rows use the full head", label)
    prepack_linears(model)
    own_weights(model)  # what is left (embedding, norms) stops holding the mapped checkpoint
    return LoadedTarget(model, tokenizer, context_limit(model, models.max_context),
                        frozenset(eos_token_ids(model, tokenizer)), str(model_dir))


def target_info(models: ModelsConfig, label: str = "--target") -> TargetInfo:
    """The target's tokenizer, vocabulary size, context limit and EOS ids without its weights, the same
    values as ``load_target``. Raises ModelError naming ``label``."""
    model_dir = resolve_model_dir(models.target, DEFAULT_TARGET, label)
    try:
        config = AutoConfig.from_pretrained(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"{label}: cannot load the config or tokenizer from {model_dir}: {exc}") from exc
    try:
        generation = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json
        generation = GenerationConfig.from_model_config(config)
    shell = SimpleNamespace(config=config, generation_config=generation)  # what the two helpers read
    return TargetInfo(tokenizer, config.vocab_size, DTYPES[resolve_dtype(models.dtype, models.device)],
                      context_limit(shell, models.max_context), frozenset(eos_token_ids(shell, tokenizer)),
                      str(model_dir))


def load_draft(models: ModelsConfig, target: LoadedTarget | TargetInfo, label: str = "--draft") -> LoadedDraft:
    """Load the draft (None = the default real draft), check it against ``target``, quantize it per
    models.draft_quant, on models.device, in the target's dtype (``auto`` follows the target's device). Raises
    ModelError naming ``label`` (or the incompatibility, or a CPU-only draft_quant elsewhere)."""
    quant = resolve_draft_quant(models.draft_quant, models.device)
    model_dir = resolve_model_dir(models.draft, DEFAULT_DRAFT, label)
    model, tokenizer = load_model(model_dir, str(target.dtype).removeprefix("torch."), models.device)
    check_supported(model, label)
    check_pair(model, tokenizer, target, target.tokenizer)  # reads target.dtype only
    if quant == "int8":
        model = quantize_draft(model)
    else:
        prepack_linears(model)
    own_weights(model)
    shared_vocab = min(model.config.vocab_size, target.vocab_size)
    return LoadedDraft(model, tokenizer, context_limit(model, models.max_context), str(model_dir), shared_vocab)
