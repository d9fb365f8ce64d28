"""How many KV slots a service may hand out: ``max_kv_tokens: auto`` sized from memory once after loading, as vLLM
sizes KV blocks from ``gpu_memory_utilization``: floor(kv_memory_fraction * free memory / KV bytes per token).

Free memory, CPU: min(MemAvailable, the cgroup's limit left, inactive file cache not counted); CUDA:
``torch.cuda.mem_get_info``, read by the process that computes there (a tensor-parallel rank, never its
coordinator). Unreadable: ``FALLBACK_KV_TOKENS``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FALLBACK_KV_TOKENS = 1 << 20  # slots when free memory or the KV bytes per token are unknown
_CGROUP_V2 = Path("/sys/fs/cgroup")
_CGROUP_V1 = Path("/sys/fs/cgroup/memory")
_PROC_CGROUP = Path("/proc/self/cgroup")


def kv_bytes_per_token(config, element_size: int) -> int:
    """Bytes of K and V one cached token holds over all layers. config: a transformers model config;
    element_size: bytes per KV element (4 for float32)."""
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


def _cgroup_dirs() -> list[tuple[Path, str, str, str]]:
    """(folder, limit file, usage file, inactive-file key of memory.stat) to try, the process's own
    cgroup first (from /proc/self/cgroup: v2 "0::/path", v1 "N:memory:/path"), then the mount roots
    (a container with its own cgroup namespace sees its cgroup there)."""
    v2, v1 = ("memory.max", "memory.current", "inactive_file"), ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                                  "total_inactive_file")
    own = []
    try:
        for line in _PROC_CGROUP.read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            if hierarchy == "0" and path.strip("/"):
                own.append((_CGROUP_V2 / path.strip("/"), *v2))
            elif "memory" in controllers.split(",") and path.strip("/"):
                own.append((_CGROUP_V1 / path.strip("/"), *v1))
    except (OSError, ValueError):
        pass
    return own + [(_CGROUP_V2, *v2), (_CGROUP_V1, *v1)]


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def cgroup_free_bytes() -> int | None:
    """Memory the process's cgroup may still use (None without a limit): limit - (usage - inactive file cache),
    since the kernel reclaims that cache first."""
    for folder, limit_name, usage_name, inactive_key in _cgroup_dirs():
        limit, usage = _read_int(folder / limit_name), _read_int(folder / usage_name)
        if limit is not None and usage is not None and limit < (1 << 60):  # v1 writes a huge number for "none"
            return max(0, limit - max(0, usage - _stat(folder / "memory.stat", inactive_key)))
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


def free_memory_bytes(device: str) -> int | None:
    """Memory the KV cache may grow into on ``device`` ("cpu" or "cuda[:N]"), or None if unknown. On CUDA it
    opens a context on the device: call it only in the process that computes there."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    known = [b for b in (host_available_bytes(), cgroup_free_bytes()) if b is not None]
    return min(known) if known else None


def ranks_free_bytes(devices: list[str], free: list[int | None]) -> int | None:
    """KV memory of tensor-parallel ranks (each holds 1/P of every token) on ``devices``, each rank's ``free``
    memory measured on its own device: the scarcest device's free bytes x P / the ranks on it (CPU ranks
    share the host's memory, GPU ranks have one each). None if any is unknown."""
    if not free or any(f is None for f in free):
        return None
    return min(f * len(devices) // devices.count(d) for d, f in zip(devices, free))


def resolve_max_kv_tokens(fraction: float, bytes_per_token: int | None, free_bytes: int | None) -> int:
    """``max_kv_tokens: auto``: ``fraction`` of ``free_bytes`` over ``bytes_per_token`` (at least 1 slot),
    or FALLBACK_KV_TOKENS when either is unknown."""
    if not bytes_per_token or free_bytes is None:
        log.warning("max_kv_tokens auto: free memory or KV bytes per token unknown; %d slots (set "
                    "max_kv_tokens to size it)", FALLBACK_KV_TOKENS)
        return FALLBACK_KV_TOKENS
    return max(1, int(fraction * free_bytes) // bytes_per_token)


def service_budget(service: str, config, runtime) -> int:
    """The KV slots of a service ("target-service", "draft-service"; config: its section): ``max_kv_tokens``, or
    for "auto" ``resolve_max_kv_tokens`` of the runtime's ``free_kv_bytes`` where its ranks measured them (the
    coordinator opens no CUDA context), else ``free_memory_bytes`` of its ``device``; logged once."""
    if config.max_kv_tokens != "auto":
        return config.max_kv_tokens
    free = (runtime.free_kv_bytes if hasattr(runtime, "free_kv_bytes")
            else free_memory_bytes(getattr(runtime, "device", "cpu")))
    fraction, bytes_per_token = config.kv_memory_fraction, getattr(runtime, "kv_bytes_per_token", None)
    budget = resolve_max_kv_tokens(fraction, bytes_per_token, free)
    log.info("%s: max_kv_tokens auto = %d (%.2f of %s free, %s bytes per token)", service, budget, fraction,
             f"{free / 2**30:.1f} GiB" if free is not None else "unknown", bytes_per_token)
    return budget
