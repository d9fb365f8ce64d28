"""One-command device check (issue 59 item 4): exactness and costs on one accelerator, from the repository alone.

    python scripts/device_check.py --device cuda --out device_check      # one GPU, about 8 minutes at most
    python scripts/device_check.py --device cpu --tiny --out /tmp/dc      # CI: tiny models, seconds

Models are random-weight Qwen2 models built from configs (seeded; no weights, no network). Writes
``device_check.json`` and ``device_check.md`` under --out; exit status 1 when an equality verdict is false.
What each figure means: docs/deploy.md "Device check".
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draft_service.runtime import DraftRuntime  # noqa: E402
from orchestrator.loop.controller import GenerationRequest  # noqa: E402
from orchestrator.loop.engine import SpeculativeEngine  # noqa: E402
from orchestrator.planning.cost_model import CostModel, measure_worker_costs  # noqa: E402
from specdec.harness.report import machine, md_table, write_record  # noqa: E402
from specdec.process_entry import check_device  # noqa: E402
from specdec.tree_spec import SEED_SPEC, TreeSpec  # noqa: E402
from target_service.runtime import TargetRuntime  # noqa: E402

# the exactness pair: large initializer_range, so greedy continuations vary and argmax margins dwarf round-off
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.5)
SMALL = dict(TINY, vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8)
# the cost pair: Qwen2.5-7B and Qwen2.5-0.5B shapes (their config.json), default initializer
QWEN_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1e6)
QWEN_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                tie_word_embeddings=True)
ROWS, PARENTS = (1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8)
# acceptance per depth recorded by `specdec bench` on the real pair (Qwen2.5-Coder 1.5B / 0.5B, CPU, default tree)
RECORD = "spec_bench_heldout_cpu_2core_2026-12-06_intel"
DEFAULT_ACCEPTANCE = ROOT / "benchmarks/records" / RECORD / f"{RECORD}.json"


def build(shape: dict, seed: int, dtype, device: str, noise: float = 0.0):
    """A random Qwen2ForCausalLM of ``shape`` (Qwen2Config fields) from ``seed``, plus N(0, noise^2) drawn from
    seed + 1 on every weight when noise > 0 (a draft close to the seed's model: partial acceptance)."""
    torch.manual_seed(seed)
    config = Qwen2Config(**{"tie_word_embeddings": False, **shape}, eos_token_id=None, bos_token_id=None)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(config, dtype=dtype).eval()
    if noise:
        gen = torch.Generator(device).manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) * noise)
    return model


@torch.inference_mode()
def target_only(model, prompt: list[int], n: int) -> list[int]:
    """Exactly n greedy tokens of transformers' generate on the model alone."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def agreement(target, draft, prompts, n: int, spec: TreeSpec, reference=None) -> dict:
    """Greedy speculative outputs (n tokens per prompt) against target-only ones of ``reference`` (None = target):
    {identical: prompts whose tokens all agree, prompts, acceptance_rate: accepted / proposed draft tokens}."""
    engine = SpeculativeEngine(TargetRuntime(target), DraftRuntime(draft), eos_token_ids=[],
                               context_limit=target.config.max_position_embeddings)
    identical = accepted = proposed = 0
    for prompt in prompts:
        out = engine.generate(GenerationRequest(prompt, max_new_tokens=n, spec=spec))
        identical += out.tokens == target_only(reference or target, prompt, n)
        accepted, proposed = accepted + out.stats.accepted_tokens, proposed + out.stats.proposed_tokens
    return {"identical": identical, "prompts": len(prompts), "acceptance_rate": round(accepted / max(proposed, 1), 3)}


def batched_equals_solo(target, draft, prompts, spec: TreeSpec, rounds: int) -> bool:
    """Whether a packed ``verify_batch`` of every prompt's draft tree gives each one's solo ``verify`` result,
    round after round (commits applied to both runtimes)."""
    solo, packed, drafter = TargetRuntime(target, packed=True), TargetRuntime(target, packed=True), DraftRuntime(draft)
    sids = [f"s{i}" for i in range(len(prompts))]
    for sid, prompt in zip(sids, prompts):
        for worker in (solo, packed, drafter):
            worker.start(sid, prompt)
    same = True
    for _ in range(rounds):
        trees = [drafter.propose(sid, spec, spec.gamma) for sid in sids]
        for sid, tree, result in zip(sids, trees, packed.verify_batch(list(zip(sids, trees)))):
            if isinstance(result, Exception):
                raise result
            same = same and result == solo.verify(sid, tree)
            for worker in (solo, packed):
                worker.commit(sid, len(result.tokens))
            drafter.commit(sid, list(result.tokens), list(result.accepted_nodes))
    return same


def costs(target_shape: dict, draft_shape: dict, device: str, contexts) -> dict[int, CostModel]:
    """{context tokens: CostModel} of bf16 models of these shapes: V(n) for n in ROWS, D(p) for p in PARENTS, in ms
    (``measure_worker_costs``: medians of 3 after a warm-up)."""
    target = build(target_shape, 0, torch.bfloat16, device)
    draft = build(draft_shape, 1, torch.bfloat16, device)
    vocab = min(target_shape["vocab_size"], draft_shape["vocab_size"])
    return {ctx: measure_worker_costs(TargetRuntime(target), DraftRuntime(draft, vocab_size=vocab), vocab,
                                      context_tokens=ctx, rows=ROWS, parents=PARENTS) for ctx in contexts}


def acceptance_per_depth(path: Path) -> list[float]:
    """The acceptance per depth in ``path``: ``specdec bench``'s results.json (summary.overall) or
    {"acceptance_by_position": [a_1, a_2, ...]} (a_d: share of rounds whose committed path reached depth d)."""
    data = json.loads(path.read_text())
    return [float(a) for a in data.get("summary", {}).get("overall", data)["acceptance_by_position"]]


def projection(cost: CostModel, acceptance: list[float]) -> list[dict]:
    """Projected speedup of a chain of depth L over target-only decoding: (1 + a_1 + ... + a_L) V(1) /
    (L D(1) + V(L + 1)), one row per L up to the recorded depth."""
    rows = []
    for depth in range(1, len(acceptance) + 1):
        tokens, ms = 1 + sum(acceptance[:depth]), depth * cost.draft_step_ms(1) + cost.verify(depth + 1)
        rows.append({"depth": depth, "tokens_per_round": round(tokens, 3), "round_ms": round(ms, 2),
                     "speedup": round(tokens * cost.verify(1) / ms, 3)})
    return rows


def run(device: str, tiny: bool, acceptance_path: Path = DEFAULT_ACCEPTANCE,
        acceptance: list[float] | None = None) -> dict:
    """Every check and figure as one JSON-ready dict (``main`` writes it); passed: every equality verdict true.
    acceptance: the per-depth acceptance already read from acceptance_path (None: read it here)."""
    gen = torch.Generator().manual_seed(0)
    shape, n_new = (TINY, 16) if tiny else (SMALL, 32)
    prompts = [torch.randint(0, shape["vocab_size"], (int(t),), generator=gen).tolist()
               for t in torch.randint(4, 40, (4 if tiny else 8,), generator=gen)]
    target, draft = build(shape, 0, torch.float32, device), build(shape, 0, torch.float32, device, noise=0.002)
    checks = {f"greedy_{name}_float32": agreement(target, draft, prompts, n_new, spec)
              for name, spec in (("chain", TreeSpec.chain(4)), ("seed", SEED_SPEC))}
    verdicts = {name: c["identical"] == c["prompts"] for name, c in checks.items()}
    verdicts["packed_verify_equals_solo"] = batched_equals_solo(target, draft, prompts, SEED_SPEC, rounds=6)
    bf16 = agreement(*(copy.deepcopy(m).to(torch.bfloat16) for m in (target, draft)), prompts, n_new, SEED_SPEC)
    contexts = (64, 256) if tiny else (512, 4096)
    cost_models = costs(*((shape, shape) if tiny else (QWEN_7B, QWEN_05B)), device, contexts)
    acceptance = acceptance if acceptance is not None else acceptance_per_depth(acceptance_path)
    return {
        "machine": {**machine(), "device": device, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None},
        "passed": all(verdicts.values()), "verdicts": verdicts, "checks": checks,
        "bf16_agreement": {**bf16, "rate": round(bf16["identical"] / bf16["prompts"], 3)},
        "cost_shapes": "tiny" if tiny else "Qwen2.5-7B target, Qwen2.5-0.5B draft, bfloat16",
        "compiled": "absent: no compiled static-shape path yet (issue 59 item 3); figures are eager forwards",
        "verify_ms": [{"context": c, "rows": n, "ms": round(ms, 3), "compiled_ms": None}
                      for c, cm in cost_models.items() for n, ms in cm.verify.points.items()],
        "draft_step_ms": [{"context": c, "parents": p, "ms": round(cm.draft_step_ms(p), 3), "compiled_ms": None}
                          for c, cm in cost_models.items() for p in cm.draft_step.points],
        "acceptance": {"source": str(acceptance_path), "default": acceptance_path == DEFAULT_ACCEPTANCE,
                       "per_depth": [round(a, 4) for a in acceptance]},
        "projected_speedup": {c: projection(cm, acceptance) for c, cm in cost_models.items()},
    }


def markdown(r: dict) -> str:
    """device_check.md: verdicts, bf16 agreement, V(n) and D(p) (a row per context), projected speedups."""
    m, bf16, acc = r["machine"], r["bf16_agreement"], r["acceptance"]

    def grid(corner: str, rows: list[dict], key: str, value: str = "ms") -> list[str]:
        cells = {(x["context"], x[key]): x[value] for x in rows}
        columns, contexts = sorted({k for _, k in cells}), list(dict.fromkeys(c for c, _ in cells))
        return md_table([corner, *map(str, columns)], [[c, *(cells[c, k] for k in columns)] for c in contexts])

    checks = [[name, "pass" if ok else "FAIL", "{identical}/{prompts} identical, acceptance {acceptance_rate}".format(
        **r["checks"][name]) if name in r["checks"] else ""] for name, ok in r["verdicts"].items()]
    return "\n".join([
        f"# Device check ({m['gpu'] or m['device']}, torch {m['torch']}, commit {m['commit']})", "",
        f"Verdict: {'PASS' if r['passed'] else 'FAIL'}.", "", *md_table(["check", "verdict", "detail"], checks), "",
        f"bf16 agreement (seed tree, random models): {bf16['identical']}/{bf16['prompts']} outputs token-identical "
        f"to target-only (rate {bf16['rate']}).", "", f"Costs in ms ({r['cost_shapes']}); compiled: {r['compiled']}.",
        "", *grid("V(n): context \\ rows n", r["verify_ms"], "rows"), "",
        *grid("D(p): context \\ parents p", r["draft_step_ms"], "parents"), "",
        f"Acceptance per depth ({'default: ' if acc['default'] else ''}{acc['source']}): {acc['per_depth']}.", "",
        *grid("projected speedup: context \\ chain depth",
              [dict(x, context=c) for c, rows in r["projected_speedup"].items() for x in rows], "depth", "speedup"),
        ""])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny models everywhere (CI on a CPU)")
    parser.add_argument("--out", type=Path, default=Path("device_check"), help="folder for the JSON and markdown")
    parser.add_argument("--acceptance", type=Path, default=DEFAULT_ACCEPTANCE, help="a `specdec bench` results.json or "
                        "{\"acceptance_by_position\": [...]} (default: the in-repo real-pair bench record)")
    args = parser.parse_args(argv)
    try:  # both before any model is built: a typo must not cost the checks' minutes
        check_device(args.device, "--device")
    except ValueError as exc:
        parser.error(str(exc))
    try:
        acceptance = acceptance_per_depth(args.acceptance)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        parser.error(f"--acceptance {args.acceptance}: not a bench results.json or {{\"acceptance_by_position\": "
                     f"[...]}} ({exc!r})")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 exactness: no TF32 matmuls
    if args.tiny:
        torch.set_num_threads(1)  # tiny models: more threads only add overhead
    result = run(args.device, args.tiny, args.acceptance, acceptance)
    text = markdown(result)
    write_record(args.out, "device_check", result, text)
    print(text)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
