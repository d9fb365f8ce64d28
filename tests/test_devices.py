"""A device per service, on CPU: draft.device / target.device (models.device the default for both), the rank
devices and the backend they pick, the --device / --draft-device flags of every command reaching the config or
the in-process pipeline, CPU-only options refused on an accelerator (CUDA pretended, ``forbid_cuda``), and a
tensor-parallel coordinator path (KV budget, placement, rank 0's tensors) that never calls torch.cuda."""

from __future__ import annotations

import os
import pickle
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from orchestrator.cli import main as cli
from specdec.config import ConfigError, ModelsConfig, TargetServerConfig, load_config, rank_devices
from specdec.kv_budget import ranks_free_bytes, service_budget
from specdec.model_setup import load_draft, resolve_draft_quant
from specdec.models import ModelError
from specdec.placement import placement
from specdec.process_entry import check_device
from target_service import tp
from tests.conftest import forbid_cuda


def test_models_device_is_the_default_of_both_services_and_each_can_differ():
    default = load_config()
    assert (default.draft_device, default.target_devices) == ("cpu", ["cpu"])
    old = load_config(None, {"models.device": "cuda", "target.tp": 2})
    assert (old.draft_device, old.target_devices) == ("cuda", ["cuda:0", "cuda:1"])
    split = load_config(None, {"models.device": "cuda", "draft.device": "cpu", "target.device": "cuda:1", "target.tp": 3})
    assert (split.draft_device, split.target_devices) == ("cpu", ["cuda:1", "cuda:2", "cuda:3"])
    assert split.models_on(split.draft_device).device == "cpu" and split.models.device == "cuda"
    listed = load_config(None, {"target.device": ["cuda:0", "cuda:2"], "target.tp": 2})
    assert listed.target_devices == ["cuda:0", "cuda:2"] and listed.draft_device == "cpu"
    assert rank_devices("cpu", 2) == ["cpu", "cpu"] and rank_devices("mps", 1) == ["mps"]


@pytest.mark.parametrize("overrides, message", [
    ({"target.device": ["cuda:0"], "target.tp": 2}, "target.device: 1 devices for target.tp 2"),
    ({"target.device": ["cuda:0", "cpu"], "target.tp": 2}, "target.device: tensor-parallel ranks run all on cpu"),
    ({"target.device": ["cuda:1", "cuda:1"], "target.tp": 2}, "target.device: two ranks share one GPU"),
    ({"target.device": "mps", "target.tp": 2}, "target.device: tensor-parallel ranks run all on cpu"),
    ({"models.device": "cuda:first", "target.tp": 2}, "models.device: 'cuda:first' is not a device"),
    ({"draft.device": "cuda:0", "models.draft_quant": "int8"}, "models.draft_quant: int8 runs on a CPU only"),
    ({"models.device": "cuda", "models.draft_quant": "int8"}, "models.draft_quant: int8 runs on a CPU only"),
])
def test_bad_devices_fail_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_int8_draft_is_cpu_only(monkeypatch):
    forbid_cuda(monkeypatch)
    assert load_config(None, {"draft.device": "cpu", "target.device": "cuda", "models.draft_quant": "int8"})
    assert resolve_draft_quant("auto", "cuda:1") == "none"
    with pytest.raises(ModelError, match=r"^draft_quant: int8 runs on a CPU only .* cuda:1"):
        resolve_draft_quant("int8", "cuda:1")
    target = SimpleNamespace(dtype=torch.float32)  # refused before anything loads
    with pytest.raises(ModelError, match="^draft_quant: "):
        load_draft(ModelsConfig(draft_quant="int8", device="cuda:0", draft="/nonexistent"), target)


def test_check_device_names_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="^draft.device: 'cuda' but CUDA is not available"):
        check_device("cuda", "draft.device")
    with pytest.raises(ValueError, match="^--device: 'gpu' is not a torch device"):
        check_device("gpu", "--device")
    forbid_cuda(monkeypatch)  # 4 devices
    check_device("cuda:3", "target.device")
    with pytest.raises(ValueError, match="^target.device: 'cuda:4' but this machine has 4 CUDA devices"):
        check_device("cuda:4", "target.device")


def test_backend_follows_the_devices_not_the_machine(monkeypatch, tmp_path):
    forbid_cuda(monkeypatch)  # CUDA "available": CPU ranks still take gloo
    assert tp.tp_backend(["cpu", "cpu"]) == "gloo"
    assert tp.tp_backend(["cuda:0", "cuda:1"]) == "nccl"
    with pytest.raises(ValueError, match="^device: "):
        tp.tp_backend(["cuda:0", "cpu"])
    with pytest.raises(ValueError, match="^device: 1 devices for tp 2"):  # refused before any rank is spawned
        tp.TensorParallelTarget(tmp_path, tp=2, devices=["cpu"])


class _Conn:
    def __init__(self):
        self.sent = []

    def send_bytes(self, payload):
        self.sent.append(pickle.loads(payload))


@pytest.mark.parametrize("devices, rank, local_rank, bound, visible", [
    (("cuda:2", "cuda:3"), 1, "3", "cuda:3", None),    # rank 1 on its own GPU, transformers binds LOCAL_RANK
    (("cpu", "cpu"), 1, "1", None, ""),                # CPU ranks see no GPU: transformers shards on the CPU
])
def test_each_rank_binds_its_own_device(monkeypatch, devices, rank, local_rank, bound, visible):
    forbid_cuda(monkeypatch)
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(str(device)))

    def no_store(*args, **kwargs):
        raise RuntimeError("stop here")
    monkeypatch.setattr(tp.dist, "TCPStore", no_store)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    spec = tp._RankSpec("/nowhere", 2, 1, devices, tp.tp_backend(list(devices)), "float32", torch.get_num_threads(),
                        5.0, 16, False)
    conn = _Conn()
    tp._rank_main(rank, spec, conn)
    assert conn.sent[0][0] == "err" and "stop here" in str(conn.sent[0][1])
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"]) == (str(rank), local_rank)
    assert calls == ([bound] if bound else [])
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible


def test_ranks_free_memory_is_shared_on_the_host_and_scarcest_on_gpus():
    assert ranks_free_bytes(["cpu", "cpu"], [8 << 30, 8 << 30]) == 8 << 30          # one host's memory
    assert ranks_free_bytes(["cuda:0", "cuda:1"], [8 << 30, 6 << 30]) == 12 << 30   # 2 x the scarcer GPU
    assert ranks_free_bytes(["cuda:0", "cuda:1"], [8 << 30, None]) is None


def test_the_coordinator_path_calls_no_cuda(monkeypatch):
    """KV budget from the ranks' own measurement, placement by rank 0's name, rank 0's tensors sent as CPU ones."""
    forbid_cuda(monkeypatch)
    coordinator = SimpleNamespace(free_kv_bytes=10 * 1000, kv_bytes_per_token=1000, device="cuda:GPU-0a1b")
    assert service_budget("target-service", TargetServerConfig(tp=2, kv_memory_fraction=0.5), coordinator) == 5
    assert placement(coordinator.device).device == "cuda:GPU-0a1b"

    class Moved(torch.Tensor):  # stands for a CUDA tensor: .cpu() is what the coordinator must receive
        def cpu(self):
            return torch.zeros(2)
    logits = torch.ones(2).as_subclass(Moved)
    sent = tp._sanitize([logits, (logits, 1)])
    assert type(sent[0]) is torch.Tensor and sent[0].tolist() == [0.0, 0.0] and type(sent[1][0]) is torch.Tensor


def _capture(monkeypatch, module: str, name: str) -> dict:
    """Replace module.name by a stub that records its keyword arguments and stops the command."""
    seen = {}

    def stub(*args, **kwargs):
        seen.update(kwargs, args=args)
        raise ValueError("captured")
    monkeypatch.setattr(f"{module}.{name}", stub)
    return seen


@pytest.mark.parametrize("command, module, name", [
    ("generate", "orchestrator.loop.embedded", "build_pipeline"),
    ("bench", "orchestrator.measure.bench", "run_bench"),
    ("eval", "orchestrator.measure.eval_report", "run_eval"),
    ("profile-draft", "orchestrator.measure.draft_profile", "run_profile"),
])
def test_in_process_commands_pass_both_devices(monkeypatch, tmp_path, command, module, name):
    forbid_cuda(monkeypatch)
    seen = _capture(monkeypatch, module, name)
    extra = {"eval": ["--out", str(tmp_path)], "profile-draft": ["--out", str(tmp_path), "--candidate", "default"],
             "generate": ["hi"]}.get(command, [])
    result = CliRunner().invoke(cli.app, [command, *extra, "--device", "cuda:1", "--draft-device", "cpu"])
    assert "captured" in result.output, result.output
    assert (seen["device"], seen["draft_device"]) == ("cuda:1", "cpu")
    result = CliRunner().invoke(cli.app, [command, *extra, "--device", "cuda:9"])
    assert result.exit_code == 2 and "--device: 'cuda:9'" in result.output


def test_serve_and_server_flags_reach_the_config(monkeypatch):
    forbid_cuda(monkeypatch)
    launched = {}
    monkeypatch.setattr(cli, "launch", lambda *args, **kwargs: launched.update(kwargs) or 0)
    result = CliRunner().invoke(cli.app, ["serve", "--tp", "2", "--device", "cuda:1,cuda:3"])
    assert result.exit_code == 0, result.output
    assert (launched["device"], launched["draft_device"]) == ("cuda:1,cuda:3", "cuda:1")  # the draft: --device's first
    result = CliRunner().invoke(cli.app, ["serve", "--tp", "2", "--device", "cuda:1", "--draft-device", "cuda:0"])
    assert (launched["device"], launched["draft_device"]) == ("cuda:1", "cuda:0")
    result = CliRunner().invoke(cli.app, ["serve", "--tp", "2", "--device", "cuda:1,cuda:1"])
    assert result.exit_code == 2 and "target.device: two ranks share one GPU" in result.output
    for server, module in (("draft-server", "draft_service.server"), ("target-server", "target_service.server")):
        seen = {}
        monkeypatch.setattr(f"{module}.run", lambda path, overrides: seen.update(overrides) or 0)
        CliRunner().invoke(cli.app, [server, "--device", "cuda:0,cuda:2" if server == "target-server" else "cuda:1",
                                     *(["--tp", "2"] if server == "target-server" else [])])
        config = load_config(None, seen)
        assert (config.draft_device if server == "draft-server" else config.target_devices) == (
            "cuda:1" if server == "draft-server" else ["cuda:0", "cuda:2"])
