"""Tiny saved model pairs and service config files, for the tests that start real servers or the CLI.

    pair = save_tiny_pair(tmp_path)                        # target + draft dirs (seeded, tokenizer included)
    config = write_config(tmp_path / "serve.yaml", pair, target={"max_batch": 4})
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

CORPUS = ["the quick brown fox jumps over the lazy dog", "def add(a, b):\n    return a + b", "hello world"]


def save_tiny(path, seed: int, corpus=CORPUS, max_pos: int = 64, noise_of: int | None = None, noise: float = 0.0):
    """Save a tiny random Qwen2 model with a small byte-level BPE tokenizer trained on ``corpus``. The weights come from
    ``seed``; with ``noise_of`` set they are instead those of seed ``noise_of`` plus N(0, noise^2) drawn from ``seed``
    (a draft close to that target: partial acceptance). Returns ``path``."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=1, special_tokens=["<eos>"], show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>")
    tok.save_pretrained(path)
    torch.manual_seed(seed if noise_of is None else noise_of)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                      initializer_range=0.5, eos_token_id=0, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    if noise_of is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * noise)
    model.save_pretrained(path)
    return path


@dataclass(frozen=True)
class ModelPair:
    target: Path
    draft: Path


def save_tiny_pair(root, max_pos: int = 256, noise: float = 0.03) -> ModelPair:
    """A tiny target (seed 0) and a draft close to it (target + noise, seed 1) under ``root``."""
    root = Path(root)
    return ModelPair(save_tiny(root / "target", 0, max_pos=max_pos),
                     save_tiny(root / "draft", 1, max_pos=max_pos, noise_of=0, noise=noise))


def write_config(path, pair: ModelPair | None = None, **sections) -> Path:
    """Write a service config YAML for tests: float32, no draft quantization, one torch thread, ephemeral ports;
    ``sections`` (e.g. target={"max_kv_tokens": 64}, grpc={...}) are merged in. Returns ``path``."""
    data: dict = {
        "models": {"dtype": "float32", "draft_quant": "none", "threads": 1},
        "grpc": {"shutdown_grace_s": 5.0},
        "draft": {"port": 0},
        "target": {"port": 0},
    }
    if pair is not None:
        data["models"].update(target=str(pair.target), draft=str(pair.draft))
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
    return Path(path)
