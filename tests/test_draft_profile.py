"""``specdec profile-draft`` (orchestrator.measure.draft_profile) on tiny models: a close draft in float32
and int8 and a draft with another tokenizer (refused with the reason), one shared target."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.measure.draft_profile import Candidate, count_parameters, parse_candidate
from specdec.harness.tiny_pair import save_tiny, save_tiny_pair

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [{"question_id": 1, "category": "writing", "turns": ["the quick brown fox"]},
             {"question_id": 2, "category": "coding", "turns": ["def add(a, b):"]}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("profile_models")
    pair = save_tiny_pair(root, max_pos=512)
    other = save_tiny(root / "other", 2, corpus=["an entirely different corpus of words", "zebra yak xylophone"],
                      max_pos=512)
    questions = root / "question.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    return pair, other, questions


def test_profile_draft_float_int8_and_incompatible_tokenizer(models, tmp_path):
    pair, other, questions = models
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "profile-draft", "--target", str(pair.target),
         "--candidate", f"{pair.draft}@none", "--candidate", f"{pair.draft}@int8", "--candidate", str(other),
         "--questions", str(questions), "--max-new-tokens", "8", "--dtype", "float32", "--threads", "1",
         "--control", "fixed", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    drafts = {d["name"]: d for d in json.loads((out / "profile.json").read_text())["drafts"]}
    float32, int8, foreign = drafts[f"{pair.draft}@none"], drafts[f"{pair.draft}@int8"], drafts[f"{other}@none"]
    for d in (float32, int8):
        assert d["compatibleTokenizer"] is True and d["tokenizerReason"] is None
        assert type(d["parameters"]) is int and d["tokensPerSecond"] > 0 and 0 < d["acceptanceRate"] <= 1
        assert d["endToEndSpeedup"] > 0 and d["outputEquivalent"] is True  # float32 target: exact whatever the draft
    assert float32["parameters"] == int8["parameters"]  # the same weights, int8 linears counted from their packing
    assert float32["parameters"] == foreign["parameters"]  # same shapes: the size is counted, not looked up
    assert foreign["compatibleTokenizer"] is False and "incompatible tokenizers" in foreign["tokenizerReason"]
    assert foreign["acceptanceRate"] is None and foreign["endToEndSpeedup"] is None and foreign["tokensPerSecond"] is None
    md = (out / "profile.md").read_text()
    assert "no: incompatible tokenizers" in md and "| draft | parameters |" in md


def test_count_parameters_of_a_float_and_int8_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from specdec.cpu_linear import prepack_linears
    from specdec.model_setup import quantize_draft

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    # embeddings 100x32 + lm_head 32x100 + per layer (q 32x32+32, k 32x16+16, v 32x16+16, o 32x32, mlp 3 x 32x64, 2 norms x 32) + final norm
    layer = (32 * 32 + 32) + 2 * (32 * 16 + 16) + 32 * 32 + 3 * 32 * 64 + 2 * 32
    expected = 100 * 32 * 2 + 2 * layer + 32
    assert count_parameters(model) == expected
    assert count_parameters(quantize_draft(copy.deepcopy(model))) == expected
    if prepack_linears(model) == 0:
        pytest.skip("no oneDNN: linears are not packed here")
    assert count_parameters(model) == expected


@pytest.mark.parametrize("text, expected", [("default", Candidate(None, "none")), ("default@int8", Candidate(None, "int8")),
                                            ("/m/d@none", Candidate("/m/d", "none")), ("/m/d", Candidate("/m/d", "none"))])
def test_parse_candidate(text, expected):
    assert parse_candidate(text, "none") == expected


def test_parse_candidate_bad_quant_names_the_option():
    with pytest.raises(ValueError, match="--candidate default@fp4"):
        parse_candidate("default@fp4", "none")
