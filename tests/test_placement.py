"""specdec.placement.usable_cpus: torch threads sized from the CPU affinity and the cgroup quota (fake cgroup trees)."""

from __future__ import annotations

import os

import pytest
import torch

from specdec import placement
from specdec.placement import usable_cpus


@pytest.fixture
def four_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("cpu_max, expected", [
    ("150000 100000\n", 2),   # 1.5 CPUs rounds up
    ("100000 100000\n", 1),
    ("50000 100000\n", 1),    # half a CPU: still one thread
    ("800000 100000\n", 4),   # a quota above the affinity: the affinity
    ("max 100000\n", 4),      # no limit
    ("garbage\n", 4),         # unreadable: no limit
])
def test_cgroup_v2_quota_caps_the_affinity(tmp_path, four_cpus, cpu_max, expected):
    _write(tmp_path / "cpu.max", cpu_max)
    assert usable_cpus(tmp_path) == expected


def test_the_tightest_cgroup_v2_ancestor_wins(tmp_path, four_cpus, monkeypatch):
    monkeypatch.setattr(placement, "_cgroup_dirs", lambda root: [root / "pod" / "box", root / "pod", root])
    _write(tmp_path / "cpu.max", "max 100000")
    _write(tmp_path / "pod" / "cpu.max", "200000 100000")  # the pod's 2 CPUs bound its container's 3
    _write(tmp_path / "pod" / "box" / "cpu.max", "300000 100000")
    assert usable_cpus(tmp_path) == 2


@pytest.mark.parametrize("controller, quota, expected", [
    ("cpu", "250000", 3), ("cpu,cpuacct", "100000", 1), ("cpu", "-1", 4)])  # -1: no limit
def test_cgroup_v1_quota(tmp_path, four_cpus, controller, quota, expected):
    _write(tmp_path / controller / "cpu.cfs_quota_us", quota)
    _write(tmp_path / controller / "cpu.cfs_period_us", "100000")
    assert usable_cpus(tmp_path) == expected


def test_without_a_cgroup_the_affinity_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5}, raising=False)
    _write(tmp_path / "cpu.max", "400000 100000")
    assert usable_cpus(tmp_path) == 1  # pinned to one CPU under a 4-CPU quota
    assert usable_cpus(tmp_path / "absent") == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert usable_cpus(tmp_path / "absent") == 3


def test_unset_threads_take_the_usable_cpus(monkeypatch):
    from orchestrator.loop import embedded

    before = torch.get_num_threads()
    monkeypatch.setattr(embedded, "usable_cpus", lambda: 1)
    try:
        embedded.set_threads(None)
        assert torch.get_num_threads() == 1
        embedded.set_threads(2)  # set: as given
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
