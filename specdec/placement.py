"""Where a service's model computes (``placement``: host, device, CPUs; reported in Info), so the orchestrator can tell
whether draft and target share it (``shares_compute``). A CUDA device is named by its UUID (``CUDA_VISIBLE_DEVICES``
renumbers). ``usable_cpus()`` sizes torch's threads where ``models.threads`` is unset."""

from __future__ import annotations

import math
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
    if not device.startswith("cuda:") or not device[5:].isdigit():  # cpu, or already a UUID name
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


def usable_cpus(cgroup_root: str | Path = "/sys/fs/cgroup") -> int:
    """CPUs this process can keep busy, >= 1: its affinity (``sched_getaffinity``; ``os.cpu_count()`` where
    unknown), capped by the CPU quota of its cgroup rounded up: cgroup v2 ``cpu.max`` ("quota period") of its
    cgroup and every ancestor, else v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``. A container given 1.5
    CPUs on a 64-core host gets 2. cgroup_root: where the cgroup file system is mounted."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    root = Path(cgroup_root)
    quotas = [q for q in map(_v2_quota, _cgroup_dirs(root)) if q is not None]
    v1 = [(_read_int(d / "cpu.cfs_quota_us"), _read_int(d / "cpu.cfs_period_us"))
          for d in (root / "cpu", root / "cpu,cpuacct")]
    quotas += [quota / period for quota, period in v1 if quota and period and quota > 0 and period > 0]  # -1: none
    if quotas:
        cpus = min(cpus, math.ceil(min(quotas)))
    return max(1, cpus)


def _cgroup_dirs(root: Path) -> list[Path]:
    """The process's cgroup v2 directory under ``root`` and its ancestors up to ``root`` (from /proc/self/cgroup)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        own = next((line[3:] for line in lines if line.startswith("0::")), "/")
    except OSError:
        own = "/"
    parts = [part for part in own.strip().split("/") if part]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(directory: Path) -> float | None:
    """CPUs of ``directory``/cpu.max ("150000 100000" -> 1.5); None without a limit ("max ...") or the file."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return int(quota) / int(period) if quota != "max" and int(period) > 0 else None
    except (OSError, ValueError):
        return None


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


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
