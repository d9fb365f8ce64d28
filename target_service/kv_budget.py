"""How many KV slots the target service may hand out: ``target.max_kv_tokens: auto`` sized from memory.

A fixed slot count either wastes memory or lets concurrent long requests take the process past what
the machine (or its container) has, and out-of-memory under concurrency is the failure operators
name first. ``auto`` (the default) fixes the budget once, at start-up after the weights are loaded,
the way vLLM sizes its KV blocks from ``gpu_memory_utilization``:

    max_kv_tokens = floor(target.kv_memory_fraction * free memory / KV bytes per token)

- KV bytes per token: 2 (K and V) x layers x KV heads x head dim x element size, over all
  tensor-parallel ranks (Qwen2.5-1.5B in float32: 2 x 28 x 2 x 128 x 4 = 57,344 bytes).
- Free memory, CPU: the smaller of the machine's MemAvailable (/proc/meminfo) and what the process's
  cgroup (a container's memory limit, v2 or v1) has left. CUDA: ``torch.cuda.mem_get_info`` of the
  first device, times the number of ranks (each holds its share of the heads).
- The default fraction, 0.7, leaves headroom for what the budget does not count: verification's
  activations and attention masks, the draft and front when they share the machine.

Where memory cannot be read (no /proc), the budget is ``FALLBACK_KV_TOKENS``.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

FALLBACK_KV_TOKENS = 1 << 20  # the former fixed default
_CGROUP_V2 = Path("/sys/fs/cgroup")
_CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def kv_bytes_per_token(config, element_size: int) -> int:
    """Bytes of K and V one cached token holds over all layers. config: a transformers model config
    (num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size, optional head_dim);
    element_size: bytes per KV element (4 for float32, 2 for bfloat16)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element_size


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (no limit) -> None


def cgroup_free_bytes() -> int | None:
    """Memory the process's cgroup may still use (limit - usage), or None without a limit."""
    for limit_file, usage_file in ((_CGROUP_V2 / "memory.max", _CGROUP_V2 / "memory.current"),
                                   (_CGROUP_V1 / "memory.limit_in_bytes", _CGROUP_V1 / "memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < (1 << 60):  # v1 writes a huge number for "none"
            return max(0, limit - usage)
    return None


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where there is no /proc."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def free_memory_bytes(device: str, ranks: int = 1) -> int | None:
    """Memory the KV cache may grow into on ``device`` ("cpu" or "cuda[:N]"), or None if unknown."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device if ":" in device else "cuda:0"))
        return free * ranks
    known = [b for b in (host_available_bytes(), cgroup_free_bytes()) if b is not None]
    return min(known) if known else None


def resolve_max_kv_tokens(setting: int | str, fraction: float, bytes_per_token: int | None,
                          free_bytes: int | None) -> int:
    """``setting`` itself when it is a number; for "auto", ``fraction`` of ``free_bytes`` over
    ``bytes_per_token`` (at least 1 slot), or FALLBACK_KV_TOKENS when either is unknown."""
    if setting != "auto":
        return int(setting)
    if not bytes_per_token or free_bytes is None:
        return FALLBACK_KV_TOKENS
    return max(1, int(fraction * free_bytes) // bytes_per_token)
