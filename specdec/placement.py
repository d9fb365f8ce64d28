"""Where a service's model computes, so the orchestrator can tell whether draft and target share it.

    p = placement("cpu")                 # this process: host name, device, CPUs it may run on
    shares_compute(draft_p, target_p)    # True: same host and device (CPU: overlapping CPU sets)

Both services report it in Info (``host``, ``device``, ``cpus``); shared compute makes the planning price
draft steps for the whole batch. Pods on one node differ by host name; a CUDA device is named by its UUID
(``CUDA_VISIBLE_DEVICES`` renumbers); a tensor-parallel target reports "cuda", separate from any draft.
"""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Placement:
    """host: the machine's host name; device: "cpu", "cuda:0", ...; cpus: the CPUs the process may
    run on (its affinity; () where unknown)."""

    host: str
    device: str
    cpus: tuple[int, ...] = field(default=())


def placement(device: str) -> Placement:
    """This process's placement for a model on ``device`` ("cpu", "cuda:1", ...; a CUDA device with
    an index is reported by its UUID)."""
    try:
        cpus = tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        cpus = ()
    return Placement(socket.gethostname(), _device_name(str(device)), cpus)


def _device_name(device: str) -> str:
    if not device.startswith("cuda:"):
        return device
    try:
        import torch  # here: the orchestrator imports this module without torch

        return f"cuda:{torch.cuda.get_device_properties(int(device.split(':')[1])).uuid}"
    except Exception:  # noqa: BLE001 - no CUDA here, or an old torch: the index is the best name left
        return device


def shares_compute(a: Placement, b: Placement) -> bool:
    """Whether two services compute on the same hardware: same host and device, and on CPU at least
    one CPU both may run on (unknown CPU sets count as overlapping)."""
    if not a.host or a.host != b.host or a.device != b.device:
        return False
    if a.device.startswith("cpu") and a.cpus and b.cpus:
        return bool(set(a.cpus) & set(b.cpus))
    return True


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it ("AMD EPYC", "Intel(R) Xeon(R) ..."), else
    ``platform.processor()`` (other systems; may be ""). Benchmark records carry it: speed figures
    belong to the CPU they were measured on."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
