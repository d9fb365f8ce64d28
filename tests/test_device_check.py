"""scripts/device_check.py (issue 59 item 4): the CPU smoke run of ``--device cpu --tiny``, a run whose target-only
reference comes from a perturbed target (the check must fail), and the projected speedup's formula."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from orchestrator.planning.cost_model import CostModel

_SPEC = importlib.util.spec_from_file_location("device_check", Path(__file__).parents[1] / "scripts/device_check.py")
dc = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(dc)


def test_tiny_cpu_run_passes_and_reports_costs(tmp_path):
    acceptance = tmp_path / "acc.json"
    acceptance.write_text(json.dumps({"acceptance_by_position": [0.8, 0.6, 0.4]}))
    assert dc.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--acceptance", str(acceptance)]) == 0
    result = json.loads((tmp_path / "device_check.json").read_text())
    assert result["passed"] and result["verdicts"] == {
        "greedy_chain_float32": True, "greedy_seed_float32": True, "packed_verify_equals_solo": True}
    assert 0 < result["checks"]["greedy_chain_float32"]["acceptance_rate"] < 1  # partial acceptance: a real test
    assert {(x["context"], x["rows"]) for x in result["verify_ms"]} == {(c, n) for c in (64, 256) for n in dc.ROWS}
    assert {(x["context"], x["parents"]) for x in result["draft_step_ms"]} == {
        (c, p) for c in (64, 256) for p in dc.PARENTS}
    assert all(x["ms"] > 0 and x["compiled_ms"] is None for x in result["verify_ms"] + result["draft_step_ms"])
    assert result["acceptance"] == {"source": str(acceptance), "default": False, "per_depth": [0.8, 0.6, 0.4]}
    assert [len(rows) for rows in result["projected_speedup"].values()] == [3, 3]
    assert 0 <= result["bf16_agreement"]["rate"] <= 1
    assert "Verdict: PASS" in (tmp_path / "device_check.md").read_text()


def test_perturbed_target_fails_the_check(tmp_path, monkeypatch):
    """Target-only from a perturbed copy of the target: greedy outputs differ, the verdicts are false, exit 1."""
    real = dc.target_only

    def perturbed_reference(model, prompt, n):
        wrong = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            wrong.lm_head.weight.add_(torch.randn(wrong.lm_head.weight.shape, generator=gen, dtype=wrong.dtype))
        return real(wrong, prompt, n)

    monkeypatch.setattr(dc, "target_only", perturbed_reference)
    monkeypatch.setattr(dc, "costs", lambda *args: {64: CostModel({1: 1.0}, {1: 1.0}, source="measured")})
    assert dc.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 1
    result = json.loads((tmp_path / "device_check.json").read_text())
    assert not result["passed"]
    assert result["verdicts"]["greedy_chain_float32"] is False and result["verdicts"]["greedy_seed_float32"] is False
    assert result["verdicts"]["packed_verify_equals_solo"] is True  # it does not use the reference
    assert result["acceptance"]["default"] and len(result["acceptance"]["per_depth"]) > 0
    assert "Verdict: FAIL" in (tmp_path / "device_check.md").read_text()


def test_projection_formula():
    """(1 + a_1 + ... + a_L) V(1) / (L D(1) + V(L + 1)): V(1) 10, V(2) 15, V(3) 20 ms, D(1) 5 ms."""
    cost = CostModel({1: 10.0, 3: 20.0}, {1: 5.0}, source="measured")
    rows = dc.projection(cost, [1.0, 0.5])
    assert [(r["tokens_per_round"], r["round_ms"], r["speedup"]) for r in rows] == [(2.0, 20.0, 1.0),
                                                                                 (2.5, 30.0, 0.833)]


def test_bad_flags_exit_2_naming_the_flag_before_any_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dc, "run", lambda *a, **k: pytest.fail("ran the checks despite a bad flag"))
    (tmp_path / "bad.json").write_text('{"summary": {}}')
    cases = [(["--device", "tpu"], "--device: 'tpu'"),
             (["--device", "cpu", "--acceptance", str(tmp_path / "missing.json")], "--acceptance"),
             (["--device", "cpu", "--acceptance", str(tmp_path / "bad.json")], "--acceptance")]
    for argv, named in cases:
        with pytest.raises(SystemExit) as exit_:
            dc.main([*argv, "--out", str(tmp_path)])
        assert exit_.value.code == 2
        assert named in capsys.readouterr().err
