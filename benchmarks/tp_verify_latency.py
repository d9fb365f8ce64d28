"""Verify latency of the target: tensor parallel over P ranks (target_service.tp) vs one process.

    python benchmarks/tp_verify_latency.py --model ~/.cache/specdec/models/qwen2.5-coder-1.5b-instruct \
        --tp 2 --nodes 1,8,32 --context 300 --repeats 10 --json bench_out/tp_verify.json

What is timed: one ``verify`` of a random token tree of N nodes (N + 1 query rows: the root R and the
nodes, tree mask and position ids) after ``--context`` cached tokens, greedy; then ``commit(1)``
(untimed) so the next verify starts from a committed state (the context grows by one token per
repeat). Per N: ``--warmup`` untimed verifies, then ``--repeats`` timed ones; the table gives the
median and the 90th percentile in ms.

Configurations, run one after the other so only one copy of the model is in memory:
- ``tp1``: TargetRuntime in this process, ``--threads`` torch threads (embedded mode's target);
- ``tpP``: TensorParallelTarget with P rank processes, ``--threads // P`` threads each (at least 1),
  gloo on CPU (NCCL on CUDA); its verify includes the coordinator's pipe round trip.
Both pre-pack their float32 CPU linears for oneDNN unless ``--no-prepack`` (embedded mode does).
Correctness on the way: the tree logits of each N's tree (one extra forward, untimed) are compared
between the two configurations (max abs difference, argmax equality; in the table and the JSON).
Memory: tp1 holds the whole model; each rank holds 1/P of the decoder weights plus the replicated
embeddings (and 1/P of lm_head). Run it on a quiet machine: the figures are wall-clock.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from specdec.tree import DraftTree  # noqa: E402


def random_tree(nodes: int, vocab: int, seed: int) -> DraftTree:
    """A seeded random tree of ``nodes`` nodes: node i's parent uniform in [-1, i)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (nodes,), generator=gen).tolist()
    parents = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(nodes)]
    return DraftTree(tuple(tokens), tuple(parents))


def time_verifies(target, vocab: int, node_counts, context: int, repeats: int, warmup: int,
                  seed: int = 0) -> tuple[dict, dict]:
    """({N: [verify seconds] * repeats}, {N: tree logits [N + 1, V] of the first verify's tree}) for
    one target (TargetRuntime or TensorParallelTarget); the logits let configurations be compared."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (context + 1,), generator=gen).tolist()  # context cached + the root
    out, logits = {}, {}
    for n in node_counts:
        sid = f"bench-{n}"
        target.start(sid, prompt)
        tree = random_tree(n, vocab, seed + n)
        logits[n] = target.tree_logits(sid, tree)  # (N + 1, V); the next verify rolls these slots back
        times = []
        for i in range(warmup + repeats):
            began = time.perf_counter()
            target.verify(sid, tree)
            elapsed = time.perf_counter() - began
            target.commit(sid, 1)
            if i >= warmup:
                times.append(elapsed)
        target.release(sid)
        out[n] = times
    return out, logits


def summarize(times: list[float]) -> dict:
    ordered = sorted(times)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return {"median_ms": statistics.median(ordered) * 1000, "p90_ms": p90 * 1000, "runs": len(ordered)}


def run_tp1(model_dir: str, dtype: str, threads: int, prepack: bool, args) -> tuple[dict, dict]:
    from specdec.cpu_linear import prepack_linears
    from specdec.models import load_model
    from target_service.runtime import TargetRuntime

    torch.set_num_threads(threads)
    model, _ = load_model(Path(model_dir), dtype)
    if prepack:
        prepack_linears(model)
    runtime = TargetRuntime(model)
    result = time_verifies(runtime, model.config.vocab_size, args.nodes, args.context, args.repeats, args.warmup)
    del runtime, model
    return result


def run_tp(model_dir: str, tp: int, dtype: str, threads: int, prepack: bool, args) -> tuple[dict, dict]:
    from target_service.tp import TensorParallelTarget

    with TensorParallelTarget(model_dir, tp=tp, dtype=dtype, threads_per_rank=max(1, threads // tp), prepack=prepack,
                              collective_timeout_s=300) as target:
        return time_verifies(target, target.vocab_size, args.nodes, args.context, args.repeats, args.warmup)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="transformers model directory (config.json + weights)")
    parser.add_argument("--tp", type=int, default=2, help="ranks of the tensor-parallel configuration (default 2)")
    parser.add_argument("--nodes", default="1,8,32", help="tree sizes N, comma-separated (default 1,8,32)")
    parser.add_argument("--context", type=int, default=300, help="cached tokens before the tree (default 300)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads in all (default: cores)")
    parser.add_argument("--no-prepack", action="store_true", help="keep torch's own linears (no oneDNN pre-packing)")
    parser.add_argument("--skip-tp1", action="store_true", help="measure only the tensor-parallel configuration")
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args(argv)
    args.nodes = [int(x) for x in args.nodes.split(",") if x.strip()]
    if args.tp < 1 or args.context < 0 or args.repeats < 1 or not args.nodes or min(args.nodes) < 0:
        parser.error("--tp, --repeats and --nodes must be positive, --context >= 0")
    prepack = not args.no_prepack

    configs, logits = {}, {}
    if not args.skip_tp1:
        configs["tp1"], logits["tp1"] = run_tp1(args.model, args.dtype, args.threads, prepack, args)
    configs[f"tp{args.tp}"], logits[f"tp{args.tp}"] = run_tp(args.model, args.tp, args.dtype, args.threads, prepack, args)
    agreement = {}
    if len(logits) == 2:  # the sharded target must give the unsharded logits (float round-off aside)
        a, b = logits.values()
        agreement = {
            str(n): {"max_abs_diff": float((a[n] - b[n]).abs().max()),
                     "argmax_equal": bool(torch.equal(a[n].argmax(-1), b[n].argmax(-1)))}
            for n in args.nodes
        }

    import transformers

    record = {
        "model": str(args.model), "context": args.context, "dtype": args.dtype, "threads": args.threads,
        "prepack": prepack, "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "results": {name: {str(n): summarize(t) for n, t in by_n.items()} for name, by_n in configs.items()},
        "logits_tp1_vs_tp": agreement,
    }
    names = list(configs)
    print(f"verify latency, {args.model}, context {args.context}, {args.dtype}, {args.threads} threads in all, "
          f"prepack {prepack}; median (p90) ms over {args.repeats} runs")
    print("| tree nodes | " + " | ".join(names) + (" | speed-up |" if len(names) == 2 else " |"))
    print("|---|" + "---|" * (len(names) + (len(names) == 2)))
    for n in args.nodes:
        cells = [record["results"][name][str(n)] for name in names]
        row = [f"{c['median_ms']:.1f} ({c['p90_ms']:.1f})" for c in cells]
        if len(names) == 2:
            row.append(f"{cells[0]['median_ms'] / cells[1]['median_ms']:.2f}x")
        print(f"| {n} | " + " | ".join(row) + " |")
    for n, check in agreement.items():
        print(f"tree logits, {n} nodes: max |tp1 - tp{args.tp}| = {check['max_abs_diff']:.2e}, "
              f"argmax equal: {check['argmax_equal']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
