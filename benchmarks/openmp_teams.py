"""Plain batched decoding steps of the target when one thread, or two, have run torch work.

libgomp keeps one OpenMP team per thread that starts a parallel region; with more managed OpenMP
threads than CPUs it stops spinning between regions (``specdec.model_worker``). This measures what
that costs a target forward, side by side in one run: each mode runs in a fresh process (the state
cannot be undone in a process), one process at a time (never two targets at once), alternating
``--repeats`` times (one then two in odd repeats, two then one in even ones):

- ``one``: the target is loaded, and every step runs, on one ModelWorker thread (the services since
  this benchmark's commit);
- ``two``: the target is loaded on the main thread (the services before), then every step runs on
  a ModelWorker thread.

Each step is ``verify_batch`` of ``--sessions`` sessions with empty trees (one plain decoding step
each, built-in prompts of at most 200 tokens), then a commit; the first 3 steps are not timed.
Writes JSON + markdown (``--out``). Figures: median step ms and the process's CPU time / wall time
during the steps (2.0 = both CPUs busy on a 2-CPU machine).

    python benchmarks/openmp_teams.py --out bench_out/openmp_teams
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = ("one", "two")


def measure(mode: str, sessions: int, steps: int, target: str | None) -> dict:
    """One mode in this process (see the module docstring); returns median_step_ms, mean_step_ms and
    cpu_per_wall (process CPU time / wall time over the timed steps)."""
    from serving import load_prompts, spread
    from specdec.config import ModelsConfig
    from specdec.model_setup import load_target
    from specdec.model_worker import ModelWorker
    from specdec.tree import DraftTree
    from target_service.runtime import TargetRuntime

    worker = ModelWorker("target-runtime")
    load = lambda: load_target(ModelsConfig(dtype="float32", target=target))  # noqa: E731
    loaded = worker.call(load) if mode == "one" else load()
    runtime = worker.call(TargetRuntime, loaded.model)
    prompts = [q["ids"] for q in spread(load_prompts(None, loaded.tokenizer, 200), sessions)]
    sids = [f"s{i}" for i in range(len(prompts))]
    empty = DraftTree((), ())

    def step() -> tuple[float, float]:
        c0, t0 = time.process_time(), time.perf_counter()
        runtime.verify_batch([(sid, empty) for sid in sids])
        t1, c1 = time.perf_counter(), time.process_time()
        for sid in sids:
            runtime.commit(sid, 1)
        return t1 - t0, c1 - c0

    for sid, ids in zip(sids, prompts):
        worker.call(runtime.start, sid, ids)
    timed = [worker.call(step) for _ in range(steps + 3)][3:]
    worker.close()
    wall = [w for w, _ in timed]
    return {"median_step_ms": 1000 * statistics.median(wall), "mean_step_ms": 1000 * statistics.mean(wall),
            "cpu_per_wall": sum(c for _, c in timed) / sum(wall), "sessions": len(sids)}


def markdown(rows: list[dict], meta: dict) -> str:
    """The record's markdown: a heading, the set-up, and a row per process (rows from ``main``)."""
    from orchestrator.bench import _table

    head = ["run", "mode", "median step ms", "mean step ms", "CPU time / wall", "vs one (same repeat)"]
    cells = [[str(r["repeat"]), r["mode"], f"{r['median_step_ms']:.0f}", f"{r['mean_step_ms']:.0f}",
              f"{r['cpu_per_wall']:.2f}", f"{r['vs_one']:.2f}x"] for r in rows]
    return "\n".join([f"# Target plain steps with one or two torch threads ({meta['machine']})", "",
                      f"{meta['sessions']} sessions, one plain step each per forward (verify_batch of empty trees), "
                      f"float32 target, {meta['steps']} timed steps per process, modes alternating in fresh processes.",
                      "", _table(head, cells)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--target", default=None, help="target model directory or .gguf (default: the real pair's)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="the most one mode's process may take")
    p.add_argument("--out", type=Path, default=Path("bench_out/openmp_teams"))
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # internal: one measurement, JSON on stdout
    args = p.parse_args(argv)
    if args.sessions < 1 or args.steps < 1 or args.repeats < 1 or args.timeout_s <= 0:
        p.error("--sessions / --steps / --repeats / --timeout-s: need >= 1 / >= 1 / >= 1 / > 0")
    if args.mode:
        from specdec.models import ModelError

        try:
            print(json.dumps(measure(args.mode, args.sessions, args.steps, args.target)))
        except ModelError as exc:  # names the target: a usage error, no traceback
            p.error(str(exc))
        return 0
    from orchestrator.bench import write_record

    rows = []
    for repeat in range(1, args.repeats + 1):
        by_mode = {}
        for mode in MODES if repeat % 2 else MODES[::-1]:
            argv_ = [sys.executable, __file__, "--mode", mode, "--sessions", str(args.sessions), "--steps", str(args.steps)]
            if args.target:
                argv_ += ["--target", args.target]
            try:
                done = subprocess.run(argv_, capture_output=True, text=True, timeout=args.timeout_s)
            except subprocess.TimeoutExpired:
                print(f"--timeout-s: mode {mode} took over {args.timeout_s} s", file=sys.stderr)
                return 1
            lines = done.stdout.strip().splitlines()
            if done.returncode != 0 or not lines:
                print(done.stderr[-3000:], file=sys.stderr)
                return done.returncode or 1
            by_mode[mode] = {**json.loads(lines[-1]), "mode": mode, "repeat": repeat}
            print(f"repeat {repeat}, {mode}: {by_mode[mode]['median_step_ms']:.0f} ms, "
                  f"CPU {by_mode[mode]['cpu_per_wall']:.2f}", flush=True)
        for row in by_mode.values():
            row["vs_one"] = row["median_step_ms"] / by_mode["one"]["median_step_ms"]
        rows += [by_mode[mode] for mode in MODES]
    import torch

    meta = {"machine": f"{platform.processor() or platform.machine()}, {platform.platform()}",
            "sessions": args.sessions, "steps": args.steps, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "openmp": torch.__config__.parallel_info().splitlines()[3].strip(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    write_record(args.out, {"meta": meta, "rows": rows}, markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
