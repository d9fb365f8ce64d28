"""target.max_kv_tokens: auto (specdec.kv_budget): the KV slot budget sized from free memory.

The fault: the fixed default (1,048,576 slots) admitted ~57 GB of float32 KV for the default target
on a 24 GiB machine, so concurrent long requests could take the target service out of memory instead
of getting RESOURCE_EXHAUSTED. These tests check the arithmetic on the real model's shape, where free
memory is read (host, container limit), and that a servicer with ``auto`` refuses past the budget it
computed and reports it in Info.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from transformers import Qwen2Config

from specdec.config import ConfigError, TargetServerConfig, load_config
from specdec import kv_budget
from specdec.kv_budget import (
    FALLBACK_KV_TOKENS, cgroup_free_bytes, free_memory_bytes, kv_bytes_per_token, resolve_max_kv_tokens,
)
from tests.conftest import tiny_model


def test_bytes_per_token_of_the_default_target_shape():
    # Qwen2.5-Coder-1.5B: 28 layers, 12 heads of 128, 2 KV heads
    config = Qwen2Config(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2)
    assert kv_bytes_per_token(config, 4) == 2 * 28 * 2 * 128 * 4 == 57_344
    assert kv_bytes_per_token(config, 2) == 28_672


def test_resolve_uses_the_fraction_of_free_memory():
    assert resolve_max_kv_tokens(0.7, 57_344, 10 << 30) == int(0.7 * (10 << 30)) // 57_344 == 131_072
    assert resolve_max_kv_tokens(0.5, 1000, 10_000) == 5
    assert resolve_max_kv_tokens(0.7, 1000, 0) == 1
    assert resolve_max_kv_tokens(0.7, None, 10 << 30) == FALLBACK_KV_TOKENS
    assert resolve_max_kv_tokens(0.7, 57_344, None) == FALLBACK_KV_TOKENS


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_container_limit_bounds_free_memory(tmp_path, monkeypatch, version):
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir(), v1.mkdir()
    if version == "v2":
        (v2 / "memory.max").write_text("8589934592\n")  # 8 GiB limit
        (v2 / "memory.current").write_text("6442450944\n")  # 6 GiB used
    else:
        (v1 / "memory.limit_in_bytes").write_text("8589934592\n")
        (v1 / "memory.usage_in_bytes").write_text("6442450944\n")
    monkeypatch.setattr(kv_budget, "_CGROUP_V2", v2)
    monkeypatch.setattr(kv_budget, "_CGROUP_V1", v1)
    monkeypatch.setattr(kv_budget, "_PROC_CGROUP", tmp_path / "no-such-file")
    assert cgroup_free_bytes() == 2 << 30
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: 20 << 30)
    assert free_memory_bytes("cpu") == 2 << 30  # the container's 2 GiB, not the host's 20
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: 1 << 30)
    assert free_memory_bytes("cpu") == 1 << 30


def test_no_limit_means_the_host_figure(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("123\n")
    monkeypatch.setattr(kv_budget, "_CGROUP_V2", tmp_path)
    monkeypatch.setattr(kv_budget, "_CGROUP_V1", tmp_path / "none")
    monkeypatch.setattr(kv_budget, "_PROC_CGROUP", tmp_path / "no-such-file")
    assert cgroup_free_bytes() is None
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: 3 << 30)
    assert free_memory_bytes("cpu") == 3 << 30


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_the_processs_own_cgroup_is_read_and_reclaimable_file_cache_counts_as_free(tmp_path, monkeypatch, version):
    """Without a cgroup namespace the limit is on the process's own cgroup, not the mount root; the
    inactive file cache (e.g. the checkpoint just read) is reclaimed before the limit bites."""
    root = tmp_path / version
    own = root / "kubepods" / "pod1"
    own.mkdir(parents=True)
    names = {"v2": ("memory.max", "memory.current", "inactive_file", "0::/kubepods/pod1\n"),
             "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file",
                    "4:memory:/kubepods/pod1\n0::/\n")}[version]
    (own / names[0]).write_text(str(8 << 30))
    (own / names[1]).write_text(str(7 << 30))
    (own / "memory.stat").write_text(f"anon 123\n{names[2]} {3 << 30}\nother 5\n")
    (tmp_path / "cgroup").write_text(names[3])
    monkeypatch.setattr(kv_budget, "_PROC_CGROUP", tmp_path / "cgroup")
    monkeypatch.setattr(kv_budget, "_CGROUP_V2", root)
    monkeypatch.setattr(kv_budget, "_CGROUP_V1", root)
    assert cgroup_free_bytes() == (8 << 30) - ((7 << 30) - (3 << 30))  # 4 GiB, not 1


def test_an_unknown_budget_is_logged(caplog):
    with caplog.at_level("WARNING", logger="specdec.kv_budget"):
        assert resolve_max_kv_tokens(0.7, 57_344, None) == FALLBACK_KV_TOKENS
    assert "max_kv_tokens" in caplog.text


def test_the_config_takes_auto_or_a_positive_count(tmp_path):
    assert TargetServerConfig().max_kv_tokens == "auto"
    path = tmp_path / "c.yaml"
    for bad in ("0", "lots", "-5"):
        path.write_text(f"target:\n  max_kv_tokens: {bad}\n")
        with pytest.raises(ConfigError, match="max_kv_tokens"):
            load_config(str(path))
    path.write_text("target:\n  kv_memory_fraction: 1.5\n")
    with pytest.raises(ConfigError, match="kv_memory_fraction"):
        load_config(str(path))


def test_an_auto_servicer_refuses_past_its_computed_budget_and_reports_it(monkeypatch):
    from specdec.config import GrpcConfig
    from specdec.grpc_host import ServiceHost
    from specdec.v1 import target_pb2, target_pb2_grpc
    from target_service.runtime import TargetRuntime
    from target_service.server import SERVICE_NAME, TargetServicer

    runtime = TargetRuntime(tiny_model("qwen2", seed=0))
    per_token = runtime.kv_bytes_per_token
    assert per_token == kv_bytes_per_token(runtime.model.config, 4) > 0
    # 10 slots' worth of free memory at fraction 0.5 -> a budget of 5 slots
    monkeypatch.setattr("specdec.kv_budget.free_memory_bytes", lambda device: 10 * per_token)

    async def main():
        host = ServiceHost("test-target", GrpcConfig(shutdown_grace_s=1.0))
        servicer = TargetServicer(runtime, context_limit=64,
                                  config=TargetServerConfig(max_kv_tokens="auto", kv_memory_fraction=0.5))
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, host.server)
        port = await host.start("127.0.0.1", 0, [SERVICE_NAME])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = target_pb2_grpc.TargetServiceStub(channel)
                info = await stub.Info(target_pb2.InfoRequest(), timeout=10)
                small = await stub.Prefill(target_pb2.PrefillRequest(session_id="a", prompt_ids=[1, 2, 3]), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Prefill(target_pb2.PrefillRequest(session_id="b", prompt_ids=[1, 2, 3, 4, 5]), timeout=10)
        finally:
            await host.server.stop(None)
            servicer.close()
        return info, small, refused.value

    info, small, refused = asyncio.run(main())
    assert info.max_kv_tokens == 5
    assert small.cached_tokens == 2
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_kv_tokens" in refused.details()
