"""Tensor-parallel target: P rank processes, each running a TargetRuntime over its shard of the model
(docs/serving.md "Tensor parallelism").

Sharding: transformers' own plan (``DistributedConfig(tp_size=P)``); for Qwen2 and Llama the Megatron-LM
layout (Shoeybi et al. 2019, §3), so each rank's cache is an ordinary DynamicCache of (1, H_kv / P, S, D)
per layer and ``compact_kv`` / ``truncate_kv`` work per shard. Logits match the unsharded model within ~2e-5
(float32). Ranks are spawned (scripts need an ``if __name__ == "__main__":`` guard) and wait on a pipe, not in
a collective; after every deciding call rank 0's pending results and generator states are broadcast
(mismatches counted: ``stats()``). A rank exiting, a collective error or timeout, diverging answers, or a call
over ``call_timeout_s`` kill all ranks and raise RankFailureError, then and on every later call; errors every
rank raises alike are re-raised as such.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import secrets
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.distributed import DistributedConfig
from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard
from transformers.utils import logging as hf_logging

from specdec.cpu_linear import PackedLinear
from specdec.models import DTYPES, check_supported
from specdec.placement import placement, usable_cpus
from specdec.sampling import GREEDY, SamplingParams
from specdec.tree_spec import MAX_TREE_NODES
from specdec.kv_budget import free_memory_bytes, kv_bytes_per_token, ranks_free_bytes
from target_service.runtime import TargetRuntime

# TargetRuntime methods that never set a pending result or advance a generator: no decision broadcast after them.
_NON_DECIDING = frozenset({"start", "extend", "commit", "release", "tree_logits", "prompt_logprobs"})


class RankFailureError(RuntimeError):
    """A rank died, hung, or fell out of step; the target is unusable (gRPC UNAVAILABLE). ``rank``: or None."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (RankFailureError, (str(self), self.rank))


class RemoteRankError(RuntimeError):
    """An exception raised on a rank that could not be sent back as itself (not picklable)."""


def _rendezvous(timeout_s: float) -> dist.TCPStore:
    """The coordinator's TCPStore on a loopback socket it binds itself (no port picked, then freed).
    The ranks dial ``.port``."""
    sock = socket.create_server(("127.0.0.1", 0), backlog=64)
    try:
        store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now and closes it with itself
    return store


def tp_backend(devices: list[str]) -> str:
    """nccl for CUDA ranks, gloo for CPU ones; ValueError naming ``device`` for another type or a mix."""
    kinds = {d.partition(":")[0] for d in devices}
    if len(kinds) != 1 or not kinds <= {"cpu", "cuda"}:
        raise ValueError(f"device: tensor parallelism runs on cpu (gloo) or cuda (nccl) ranks, got {devices}")
    return "nccl" if kinds == {"cuda"} else "gloo"


def check_tp_compatible(config, tp: int) -> None:
    """Raise ValueError naming ``tp`` unless the config has a ``base_model_tp_plan`` and head counts divisible by it."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp: must be an integer >= 1, got {tp!r}")
    if tp == 1:
        return
    if not getattr(config, "base_model_tp_plan", None):
        raise ValueError(f"tp: model type {config.model_type!r} has no transformers tensor-parallel plan")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp or kv_heads % tp:
        raise ValueError(f"tp: {tp} ranks do not divide num_attention_heads {heads} and num_key_value_heads {kv_heads}")


# -- rank side ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class _RankSpec:
    model_dir: str
    world: int
    port: int
    devices: tuple[str, ...]
    backend: str
    dtype: str
    threads: int
    collective_timeout_s: float
    max_tree_nodes: int
    prepack: bool


def _sendable(exc: BaseException) -> BaseException:
    """The exception itself when it survives pickling, else a RemoteRankError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        return RemoteRankError(f"{type(exc).__name__}: {exc}")


def _send(conn, kind: str, value, tb: str | None = None) -> None:
    """One reply, plain pickle (no shared-memory handles a killed rank could leak); unpicklable -> "err"."""
    try:
        payload = pickle.dumps((kind, value, tb))
    except Exception as exc:  # noqa: BLE001
        payload = pickle.dumps(("err", RemoteRankError(f"reply does not pickle: {type(exc).__name__}: {exc}"), None))
    conn.send_bytes(payload)


def _sanitize(value):
    """Exceptions in a result (e.g. ``verify_batch``'s per-item errors) made sendable."""
    if isinstance(value, BaseException):
        return _sendable(value)
    if isinstance(value, torch.Tensor):
        return value.cpu()  # the coordinator unpickles it: a CUDA tensor would open a context there
    if isinstance(value, list):
        return [_sanitize(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_sanitize(v) for v in value)
    return value


def _is_comm_error(exc: BaseException) -> bool:
    """Errors that mean the process group is broken (a peer died or a collective timed out)."""
    if isinstance(exc, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        key in text for key in ("gloo", "nccl", "connection closed", "connection reset", "timed out", "broken pipe")
    )


def _load_shard(spec: _RankSpec, rank: int):
    """Load this rank's shard in a TargetRuntime; returns (runtime, number of linears pre-packed)."""
    hf_logging.disable_progress_bar()
    kwargs = {"dtype": DTYPES[spec.dtype]}
    if spec.world > 1:
        kwargs["distributed_config"] = DistributedConfig(tp_size=spec.world)
    model = AutoModelForCausalLM.from_pretrained(spec.model_dir, **kwargs)
    model = (model.to(spec.devices[rank]) if spec.world == 1 else model).eval()
    check_supported(model, "--target")
    packed = prepack_tp_linears(model) if spec.prepack else 0
    return TargetRuntime(model, max_tree_nodes=spec.max_tree_nodes), packed


def _rank_main(rank: int, spec: _RankSpec, conn) -> None:
    """Entry point of one rank process: init the process group, load the shard, serve calls."""
    torch.set_num_threads(spec.threads)
    device = torch.device(spec.devices[rank])
    os.environ.update(  # what transformers reads to bind a rank to its accelerator (cuda:LOCAL_RANK)
        RANK=str(rank), LOCAL_RANK=str(rank if device.index is None else device.index), WORLD_SIZE=str(spec.world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec.port),
    )
    if spec.backend == "gloo":  # transformers shards on the machine's accelerator: CPU ranks see none
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    for bootstrap in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # ranks share a host: loopback unless told
        os.environ.setdefault(bootstrap, "lo")
    try:
        if spec.backend == "nccl":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=spec.collective_timeout_s)
        store = dist.TCPStore("127.0.0.1", spec.port, is_master=False, timeout=timeout)  # the coordinator's
        dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.world, timeout=timeout)
        runtime, packed = _load_shard(spec, rank)
    except BaseException as exc:  # noqa: BLE001 - reported to the coordinator, then exit
        _send(conn, "err", _sendable(exc), traceback.format_exc())
        return
    _send(conn, "ok", {"vocab_size": runtime.vocab_size, "pid": os.getpid(), "prepacked": packed,
                       "packed_rows": runtime.packed, "free_bytes": free_memory_bytes(str(device)),
                       "device": placement(str(device)).device})
    mismatches = 0
    while True:
        try:
            name, args, kwargs = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the coordinator is gone
            break
        if name == "_shutdown":
            _send(conn, "ok", None)
            break
        try:
            if name == "_stats":
                value = {"decision_mismatches": mismatches}
            elif name == "_apply":
                fn, fn_args = args
                value = _sanitize(fn(runtime, rank, *fn_args))
            else:
                outcome = _run(runtime, name, args, kwargs)
                if name not in _NON_DECIDING:
                    mismatches += _mirror_decisions(runtime, rank)
                if isinstance(outcome, BaseException):
                    raise outcome
                # Only rank 0's value is returned; the others answer small (no [N + 1, V] logits).
                value = _sanitize(outcome) if rank == 0 else None
            _send(conn, "ok", value)
        except BaseException as exc:  # noqa: BLE001 - every error goes back to the coordinator
            kind = "fatal" if _is_comm_error(exc) else "err"
            _send(conn, kind, _sendable(exc), traceback.format_exc())
            if kind == "fatal":
                break


def _run(runtime: TargetRuntime, name: str, args, kwargs):
    """The method's return value, or the exception it raised (returned, not raised)."""
    if name.startswith("_") or not callable(getattr(TargetRuntime, name, None)):
        return AttributeError(f"TargetRuntime has no public method {name!r}")
    try:
        return getattr(runtime, name)(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001
        if _is_comm_error(exc):
            raise
        return exc


def _mirror_decisions(runtime: TargetRuntime, rank: int) -> int:
    """Collective: every rank adopts rank 0's pending results and generator states; returns how many differed."""
    box = [{sid: (s.pending, None if s.rng is None else s.rng.bit_generator.state)
            for sid, s in runtime.sessions.items()} if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if rank == 0:
        return 0
    differ = 0
    for sid, (pending, rng_state) in box[0].items():
        s = runtime.sessions.get(sid)
        if s is None:
            continue
        if s.pending != pending:
            differ += 1
        s.pending = pending
        if rng_state is not None and s.rng is not None:
            s.rng.bit_generator.state = rng_state
    return differ


def prepack_tp_linears(model) -> int:
    """Run the sharded float32 CPU linears of a transformers-TP model with oneDNN pre-packed local weights
    (``PackedLinear``) per ``model.tp_plan`` style; frees untied original shards. Returns the number changed."""
    if not torch.backends.mkldnn.is_available():
        return 0
    plan = dict(getattr(model, "tp_plan", None) or {})
    owners: dict[int, int] = {}  # storage of each parameter's local shard -> parameters using it (tied weights)
    for _, param in model.named_parameters(remove_duplicate=False):
        ptr = (param.to_local() if isinstance(param, DTensor) else param).untyped_storage().data_ptr()
        owners[ptr] = owners.get(ptr, 0) + 1
    changed = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or not isinstance(module.weight, DTensor):
            continue
        weight_local = module.weight.to_local()
        if weight_local.dtype != torch.float32 or weight_local.device.type != "cpu":
            continue
        forward = _packed_forward(module, weight_local, plan.get(replace_layer_number_by_wildcard(name)))
        if forward is None:
            continue
        module.forward = forward
        if owners.get(weight_local.untyped_storage().data_ptr()) == 1:  # not tied (e.g. to the embedding)
            module.weight = nn.Parameter(weight_local.new_empty(0), requires_grad=False)
        changed += 1
    return changed


def _packed_forward(module, weight_local: torch.Tensor, style: str | None):
    """One sharded linear's forward over its pre-packed local weight, by TP style; None for one it does not handle."""
    bias = module.bias
    bias_local = None if bias is None else (bias.to_local() if isinstance(bias, DTensor) else bias).detach().clone()
    group = module.weight.device_mesh.get_group()
    local = nn.Linear(weight_local.shape[1], weight_local.shape[0], bias=False)  # (out or out / P, in or in / P)
    local.weight = nn.Parameter(weight_local.detach().clone(), requires_grad=False)
    if style == "rowwise":  # the bias is added once, after the all-reduce
        packed = PackedLinear(local)

        def row_forward(x, packed=packed, group=group, bias=bias_local):
            y = packed(x)  # (..., out) partial sums of this rank's input features
            dist.all_reduce(y, group=group)
            return y if bias is None else y + bias

        return row_forward
    if bias_local is not None:
        local.bias = nn.Parameter(bias_local, requires_grad=False)
    if style == "colwise":
        return PackedLinear(local).forward
    if style == "colwise_gather_output" and module.out_features == weight_local.shape[0] * group.size():
        packed = PackedLinear(local)

        def gather_forward(x, packed=packed, group=group):
            y = packed(x).contiguous()  # (..., out / P)
            parts = [torch.empty_like(y) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, y, group=group)
            return torch.cat(parts, dim=-1)  # (..., out)

        return gather_forward
    return None


# -- coordinator side (the target service's process) --------------------------------------------

class TensorParallelTarget:
    """A TargetRuntime over ``tp`` rank processes; every public TargetRuntime method is mirrored, one call at a time.
    dtype: float32 | bfloat16 | float16; threads_per_rank: None = usable_cpus() // tp; call_timeout_s: the most
    one call may take (None = no limit); devices: rank r's device (None = all "cpu"); times in seconds. After the
    start: ``device`` (rank 0's), ``free_kv_bytes``. Raises ValueError naming ``tp`` or ``device``, the rank's
    loading error, RankFailureError when a rank dies or the start times out. ``close()`` (or ``with``) stops them."""

    def __init__(self, model_dir, tp: int = 2, dtype: str = "float32", threads_per_rank: int | None = None,
                 collective_timeout_s: float = 30.0, call_timeout_s: float | None = 600.0,
                 start_timeout_s: float = 600.0, max_tree_nodes: int = MAX_TREE_NODES, prepack: bool = False,
                 devices: list[str] | None = None):
        devices = list(devices or ["cpu"] * tp)
        if len(devices) != tp:
            raise ValueError(f"device: {len(devices)} devices for tp {tp} ranks")
        self.backend = tp_backend(devices)
        self.config = AutoConfig.from_pretrained(model_dir)
        check_tp_compatible(self.config, tp)
        self.tp = tp
        self.max_tree_nodes = max_tree_nodes
        self.collective_timeout_s = collective_timeout_s
        self.call_timeout_s = call_timeout_s
        self._lock = threading.Lock()
        self._failure: RankFailureError | None = None
        self._closed = False
        threads = threads_per_rank or max(1, usable_cpus() // tp)
        self._rendezvous = _rendezvous(start_timeout_s)
        spec = _RankSpec(str(model_dir), tp, self._rendezvous.port, tuple(devices), self.backend, dtype, threads,
                         collective_timeout_s, max_tree_nodes, prepack)
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for rank in range(tp):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_rank_main, args=(rank, spec, child_end), name=f"specdec-tp-rank{rank}", daemon=True)
            proc.start()
            child_end.close()
            self._conns.append(parent_end)
            self._procs.append(proc)
        try:
            replies = self._gather(time.monotonic() + start_timeout_s, "start-up", stop_on_error=True)
        except BaseException:
            self._kill()
            raise
        for reply in replies:
            if reply is not None and reply[0] != "ok":
                self._kill()
                raise reply[1]
        self.vocab_size = replies[0][1]["vocab_size"]
        self.pids = [proc.pid for proc in self._procs]
        self.kv_bytes_per_token = kv_bytes_per_token(self.config, DTYPES[dtype].itemsize)  # all ranks together
        self.device = replies[0][1]["device"]
        self.free_kv_bytes = ranks_free_bytes(devices, [reply[1]["free_bytes"] for reply in replies])
        self.prepacked = [reply[1]["prepacked"] for reply in replies]
        self.packed = all(reply[1]["packed_rows"] for reply in replies)  # verify_batch's layout (TargetRuntime.packed)

    def start(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams = GREEDY) -> tuple:
        """``TargetRuntime.start`` on every rank (rank 0's prompt logprobs); an unseeded sampled request gets one
        random seed shared by all."""
        if not sampling.greedy and sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(63))
        return self._call("start", (session_id, list(prompt_ids), sampling))

    def release(self, session_id: str) -> None:
        """``TargetRuntime.release`` on every rank. After a rank failure it is a no-op (nothing is held)."""
        if self._failure is not None or self._closed:
            return
        self._call("release", (session_id,))

    def __getattr__(self, name: str):
        """Any other public TargetRuntime method (``extend``, ``verify``, ``commit``, ``verify_batch``, ...),
        mirrored on every rank; rank 0's value (its decision, its [N + 1, V] logits) is the result."""
        if name.startswith("_") or not callable(getattr(TargetRuntime, name, None)):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

        def mirrored(*args, **kwargs):
            return self._call(name, args, kwargs)

        mirrored.__name__ = name
        mirrored.__doc__ = getattr(TargetRuntime, name).__doc__
        return mirrored

    def on_ranks(self, fn, *args) -> list:
        """Run module-level ``fn(runtime, rank, *args)`` on every rank (not a collective); values in rank order."""
        return self._call("_apply", (fn, args), gather=True)

    def stats(self) -> dict:
        """{"decision_mismatches": [per rank], "tp", "backend", "failed"}."""
        per_rank = [] if self._failure else [s["decision_mismatches"] for s in self._call("_stats", gather=True)]
        return {"decision_mismatches": per_rank, "tp": self.tp, "backend": self.backend, "failed": self._failure is not None}

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the ranks (a clean shutdown, then kill what is left after ``timeout_s``). Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            if self._failure is None:
                for conn in self._conns:
                    try:
                        conn.send_bytes(pickle.dumps(("_shutdown", (), {})))
                    except OSError:
                        pass
                deadline = time.monotonic() + timeout_s
                for proc in self._procs:
                    proc.join(max(0.0, deadline - time.monotonic()))
            self._kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if not self._closed:
                self._kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _call(self, name: str, args: tuple = (), kwargs: dict | None = None, gather: bool = False):
        """Send one call to every rank; rank 0's value (or every rank's, ``gather``), or raise."""
        with self._lock:
            if self._closed:
                raise RankFailureError("tensor-parallel target is closed")
            if self._failure is not None:
                raise RankFailureError(f"tensor-parallel target failed earlier: {self._failure}", self._failure.rank)
            self._check_alive()
            payload = pickle.dumps((name, tuple(args), dict(kwargs or {})))
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send_bytes(payload)
                except OSError as exc:
                    self._fail(f"rank {rank}: cannot send {name!r} ({exc})", rank)
            deadline = None if self.call_timeout_s is None else time.monotonic() + self.call_timeout_s
            replies = self._gather(deadline, name)
            kinds = [kind for kind, _, _ in replies]
            if len(set(kinds)) > 1 or (
                kinds[0] == "err" and len({type(value).__name__ for _, value, _ in replies}) > 1
            ):
                outcomes = ", ".join(f"rank {r}: {k} {type(v).__name__ if k != 'ok' else ''}".strip()
                                     for r, (k, v, _) in enumerate(replies))
                self._fail(f"ranks disagree on {name!r} ({outcomes}): their states diverged", None)
            if kinds[0] == "err":
                raise replies[0][1]
            return [value for _, value, _ in replies] if gather else replies[0][1]

    def _gather(self, deadline: float | None, what: str, stop_on_error: bool = False) -> list:
        """One reply (kind, value, traceback) per rank, kind "ok" | "err" | "fatal". Raises RankFailureError
        (after killing every rank) on a rank exit, a "fatal", replies still owed ``collective_timeout_s``
        + 5 s after an error, or at ``deadline`` (time.monotonic()). ``stop_on_error``: return at the first "err"."""
        replies: list = [None] * len(self._conns)
        grace_until = None
        while any(r is None for r in replies):
            waiting = {conn: rank for rank, conn in enumerate(self._conns) if replies[rank] is None}
            sentinels = {self._procs[rank].sentinel: rank for rank in waiting.values()}
            limits = [t for t in (deadline, grace_until) if t is not None]
            timeout = None if not limits else max(0.0, min(limits) - time.monotonic())
            ready = wait(list(waiting) + list(sentinels), timeout)
            for obj in ready:
                if obj in waiting:
                    rank = waiting[obj]
                    try:
                        replies[rank] = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        self._fail(f"rank {rank} exited during {what!r}", rank)
                    kind, value, _ = replies[rank]
                    if kind == "fatal":
                        self._fail(f"rank {rank}: collective failed during {what!r}: {value}", rank)
                    if kind == "err" and stop_on_error:
                        return replies
                    if kind == "err" and grace_until is None:
                        grace_until = time.monotonic() + self.collective_timeout_s + 5.0
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    if replies[rank] is None and not self._conns[rank].poll():
                        self._fail(f"rank {rank} exited during {what!r}", rank)
            now = time.monotonic()
            late = [r for r, v in enumerate(replies) if v is None]
            if late and deadline is not None and now >= deadline:
                self._fail(f"ranks {late} did not answer {what!r} in time", late[0])
            if late and grace_until is not None and now >= grace_until:
                self._fail(f"ranks {late} hung in {what!r} after another rank failed", late[0])
        return replies

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self._procs):
            if proc.exitcode is not None:
                self._fail(f"rank {rank} is dead", rank)

    def _fail(self, message: str, rank: int | None):
        """Kill every rank, remember the failure, raise it (the message ends with the exit codes)."""
        self._kill()
        codes = ", ".join(f"rank {r}: {p.exitcode}" for r, p in enumerate(self._procs))
        self._failure = RankFailureError(f"{message} [exit codes {codes}]", rank)
        raise self._failure

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._rendezvous = None


def build_target(model_dir, tp: int, dtype: str = "float32", devices: list[str] | None = None,
                 max_tree_nodes: int = MAX_TREE_NODES, **tp_options) -> TensorParallelTarget:
    """The target service's TensorParallelTarget on ``devices`` (one per rank; None = all "cpu"; ``tp_options``:
    its keyword arguments). Raises ValueError naming ``tp`` or ``device``, and the rank's loading error."""
    devices = list(devices or ["cpu"] * tp)
    tp_options.setdefault("prepack", devices[0] == "cpu" and dtype == "float32")
    return TensorParallelTarget(model_dir, tp=tp, dtype=dtype, max_tree_nodes=max_tree_nodes, devices=devices,
                                **tp_options)
