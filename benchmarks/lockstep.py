"""The ceiling of lock-step speculation under load, in one process: N requests whose rounds run together.

    python benchmarks/lockstep.py --levels 1,4,8,16 --modes plain,chain1,chain2,chain3,plain \
        --max-new-tokens 48 --out bench_out/lockstep

No services, no gRPC, no Ray, no control policy: the default real pair (float32 target, int8 draft;
``--target`` / ``--draft`` for others) in this process, greedy. Per level, N requests (the serving benchmark's prompts: built-in first turns,
round-robin over the categories, <= 200 tokens, chat template) are prefilled, then decoded round by
round, all of them in every round: ``plain`` verifies every request's empty tree in one target
forward (``TargetRuntime.verify_batch``: plain batched decoding); ``chainK`` first grows every
request's chain of K draft tokens in one draft forward per depth (``DraftRuntime.propose_batch``),
then verifies all chains in one target forward. Rounds run until every request has
``--max-new-tokens`` tokens (a request that has them leaves the batch). Timed: the decode rounds
only (prefill excluded). Outputs must equal plain's for every mode (float32 greedy).

What it answers: how much speculation can gain at N concurrent requests on this machine when every
draft step and every verify is shared by all of them (the goodput case of Liu et al. 2024, SmartSpec,
section 4), to compare with what the services reach (benchmarks/serving.py). Writes results.json
and results.md (tokens/s, ratio to the level's plain rows, ms per round in the draft and the
verify, tokens per request per round).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from draft_service.runtime import DraftRuntime  # noqa: E402
from orchestrator.bench import _table, write_record  # noqa: E402
from serving import load_prompts, spread  # noqa: E402
from specdec.config import ModelsConfig  # noqa: E402
from specdec.model_setup import load_draft, load_target  # noqa: E402
from specdec.models import ModelError  # noqa: E402
from specdec.tree import DraftTree  # noqa: E402
from specdec.tree_spec import TreeSpec  # noqa: E402
from target_service.runtime import TargetRuntime  # noqa: E402

EMPTY = DraftTree((), ())


def parse_mode(mode: str) -> int:
    """Draft steps per round of a mode: plain = 0, chainK = K (>= 1). Raises ValueError naming --modes."""
    if mode == "plain":
        return 0
    if mode.startswith("chain") and mode[5:].isdigit() and int(mode[5:]) >= 1:
        return int(mode[5:])
    raise ValueError(f"--modes: {mode!r} is neither plain nor chainK (K >= 1)")


def run_level(target: TargetRuntime, draft: DraftRuntime, prompts: list[list[int]], steps: int,
              new_tokens: int, tag: str) -> dict:
    """One level and mode: every request prefilled (prompts: [N] lists of token ids), then lock-step
    rounds of ``steps`` draft tokens each (0 = plain) until each request has ``new_tokens``. Returns
    tokens, wall_s and tokens_per_s (decode rounds only), rounds, draft_ms_per_round,
    verify_ms_per_round (ms) and outputs ([N] token lists). Raises a verify's exception."""
    sids = [f"{tag}-{i}" for i in range(len(prompts))]
    out: dict[str, list[int]] = {s: [] for s in sids}
    for sid, ids in zip(sids, prompts):
        target.start(sid, ids)
        if steps:
            draft.start(sid, ids)
            draft.prefill(sid)
    rounds, draft_s, verify_s = 0, 0.0, 0.0
    live = list(sids)
    started = time.perf_counter()
    while live:
        t0 = time.perf_counter()
        if steps:
            trees = draft.propose_batch([(sid, TreeSpec.chain(steps), steps) for sid in live])
        else:
            trees = [EMPTY] * len(live)
        t1 = time.perf_counter()
        results = target.verify_batch(list(zip(live, trees)))
        t2 = time.perf_counter()
        rounds, draft_s, verify_s = rounds + 1, draft_s + t1 - t0, verify_s + t2 - t1
        for sid, result in zip(live, results):
            if isinstance(result, Exception):
                raise result
            n = min(len(result.tokens), new_tokens - len(out[sid]))
            target.commit(sid, n)
            if steps:
                draft.commit(sid, list(result.tokens[:n]), list(result.accepted_nodes[: n - 1]))
            out[sid].extend(result.tokens[:n])
        live = [sid for sid in live if len(out[sid]) < new_tokens]
    wall = time.perf_counter() - started
    for sid in sids:
        target.release(sid)
        draft.release(sid)
    tokens = sum(len(v) for v in out.values())
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "rounds": rounds,
            "draft_ms_per_round": 1000 * draft_s / rounds, "verify_ms_per_round": 1000 * verify_s / rounds,
            "outputs": [out[s] for s in sids]}


def markdown(rows: list[dict], meta: dict) -> str:
    """The record's markdown: a heading with the set-up and a row per level and mode (rows from ``main``)."""
    head = ["requests", "mode", "tok/s", "vs plain (same level, mean of its plain rows)", "rounds",
            "draft ms / round", "verify ms / round", "output = plain"]
    cells = [[str(r["requests"]), r["mode"], f"{r['tokens_per_s']:.2f}", f"{r['vs_plain']:.2f}x", str(r["rounds"]),
              f"{r['draft_ms_per_round']:.0f}", f"{r['verify_ms_per_round']:.0f}", str(r["same_as_plain"])] for r in rows]
    return "\n".join([f"# Lock-step speculation in one process ({meta['machine']}, {meta['dtype']} target, int8 draft, "
                      f"{meta['max_new_tokens']} new tokens, greedy)", "", _table(head, cells)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--levels", default="1,4,8", help="requests per level, comma separated")
    p.add_argument("--modes", default="plain,chain1,chain2,chain3,plain",
                   help="per level, in this order: plain and/or chainK (repeat plain to bracket the others)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-prompt-tokens", type=int, default=200)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--target", default=None, help="target model directory or .gguf (default: the real pair's)")
    p.add_argument("--draft", default=None, help="draft model directory or .gguf (default: the real pair's)")
    p.add_argument("--out", type=Path, default=Path("bench_out/lockstep"))
    args = p.parse_args(argv)
    try:
        levels = [int(x) for x in args.levels.split(",")]
        if any(n < 1 for n in levels):
            raise ValueError
    except ValueError:
        p.error(f"--levels: comma-separated positive integers, got {args.levels!r}")
    try:
        modes = [(m, parse_mode(m)) for m in args.modes.split(",")]
    except ValueError as exc:
        p.error(str(exc))
    if args.threads:
        torch.set_num_threads(args.threads)
    models = ModelsConfig(dtype="float32", target=args.target, draft=args.draft)
    try:
        loaded_target = load_target(models)
        loaded_draft = load_draft(models, loaded_target)
    except ModelError as exc:  # names --target or --draft
        p.error(str(exc))
    target = TargetRuntime(loaded_target.model)
    draft = DraftRuntime(loaded_draft.model, vocab_size=loaded_draft.vocab_size)
    prompts = [q["ids"] for q in spread(load_prompts(None, loaded_target.tokenizer, args.max_prompt_tokens), max(levels))]
    if len(prompts) < max(levels):
        p.error(f"--levels: only {len(prompts)} built-in prompts fit --max-prompt-tokens {args.max_prompt_tokens}")
    rows = []
    for n in levels:
        level = []
        for k, (mode, steps) in enumerate(modes):
            row = run_level(target, draft, prompts[:n], steps, args.max_new_tokens, f"{n}-{k}-{mode}")
            row.update(requests=n, mode=mode)
            level.append(row)
            print(f"{n} requests, {mode}: {row['tokens_per_s']:.2f} tok/s, {row['rounds']} rounds", flush=True)
        plain = [r for r in level if r["mode"] == "plain"]
        base = sum(r["tokens_per_s"] for r in plain) / len(plain) if plain else float("nan")
        for r in level:
            r["vs_plain"] = r["tokens_per_s"] / base
            r["same_as_plain"] = not plain or r["outputs"] == plain[0]["outputs"]
        rows += level
    meta = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
            "dtype": str(loaded_target.model.dtype).replace("torch.", ""), "max_new_tokens": args.max_new_tokens,
            "levels": levels, "modes": [m for m, _ in modes], "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for r in rows:
        r.pop("outputs")
    write_record(args.out, {"meta": meta, "rows": rows}, markdown(rows, meta))
    return 0 if all(r["same_as_plain"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
