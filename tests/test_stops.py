"""Stop conditions applied one committed token at a time (DESIGN.md "Commit and rollback"): EOS at
every depth of an accepted path and as the bonus token, max_new_tokens and the context limit inside
an accepted path, stop strings spanning tokens. Output equals the target-only greedy output cut at
the stop (checked against transformers ``generate`` where it has the same option), and nothing after
the stop is committed or cached."""

from __future__ import annotations

import functools

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from draft_service.runtime import DraftRuntime
from orchestrator.loop.controller import GenerationRequest
from orchestrator.loop.engine import SpeculativeEngine
from orchestrator.loop.stops import StopChecker
from specdec.tree_spec import SEED_SPEC, TreeSpec
from target_service.runtime import TargetRuntime
from tests.conftest import (
    CHARS,
    OracleDraft,
    RecordingDraft,
    RecordingTarget,
    char_decode,
    hf_greedy,
    random_prompt,
    tiny_model,
)

CHAIN4 = TreeSpec.chain(4)


def _model():
    return tiny_model("qwen2", seed=0)


@functools.lru_cache(maxsize=None)
def _distinct_prompt(model, first: int, n: int = 40):
    """A prompt (and its greedy reference) whose first ``first`` greedy tokens are all distinct."""
    for seed in range(100):
        prompt = random_prompt(seed=9000 + seed, length=6)
        reference = hf_greedy(model, prompt, n)
        if len(set(reference[:first])) == first:
            return tuple(prompt), tuple(reference)
    raise AssertionError("no prompt with distinct greedy tokens")


class DraftState:
    """after-commit hook capturing the draft session (committed tokens, cached length)."""

    def __init__(self):
        self.tokens = None
        self.cached_len = None
        self.cache_slots = None

    def __call__(self, runtime, session_id):
        s = runtime.sessions[session_id]
        self.tokens = list(s.tokens)
        self.cached_len = s.cached_len
        self.cache_slots = s.cache.get_seq_length()


def _engine(model, draft, eos=(), context_limit=512, decode=None):
    target = RecordingTarget(TargetRuntime(model))
    return SpeculativeEngine(target, draft, eos_token_ids=eos, context_limit=context_limit, decode=decode), target


def _assert_nothing_after_stop(prompt, out, target, state=None):
    assert target.committed == prompt + out.tokens
    assert target.final_cache_len == target.final_session_cache_len == len(prompt) + len(out.tokens) - 1
    if state is not None:
        assert state.tokens == prompt + out.tokens
        assert state.cache_slots == state.cached_len <= len(prompt) + len(out.tokens)


# ------------------------------------------------------------------------------------------------
# EOS
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("j", range(10))
def test_eos_at_each_depth(j):
    """draft = target, chain of 4: rounds commit 4 accepted tokens + bonus; EOS = the j-th greedy token
    falls at depth j % 5 + 1 of round j // 5 + 1 (j % 5 == 4: the bonus token)."""
    model = _model()
    prompt, reference = map(list, _distinct_prompt(model, 10))
    eos = reference[j]
    state = DraftState()
    draft = RecordingDraft(DraftRuntime(model), check_after_commit=state)
    engine, target = _engine(model, draft, eos=[eos])
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=40, spec=CHAIN4))

    assert out.tokens == reference[: j + 1]
    assert out.tokens == hf_greedy(model, prompt, 40, eos_token_id=eos)
    assert out.stats.stop_reason == "eos"
    assert out.stats.rounds == j // 5 + 1
    last = draft.log.rounds[-1]
    assert last.tokens == reference[j - j % 5 : j + 1]
    assert last.accepted == list(range(min(j % 5 + 1, 4)))
    assert out.stats.accepted_tokens == 4 * (j // 5) + min(j % 5 + 1, 4)
    _assert_nothing_after_stop(prompt, out, target, state)


@pytest.mark.parametrize("j", [0, 3, 7])
def test_ignore_eos_runs_past_the_eos_token(j):
    """ignore_eos: the j-th greedy token is an EOS id, yet generation goes on to max_new_tokens with the
    target's own greedy tokens (the reference is computed without any EOS)."""
    model = _model()
    prompt, reference = map(list, _distinct_prompt(model, 10))
    engine, _ = _engine(model, DraftRuntime(model), eos=[reference[j]])
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=10, spec=CHAIN4, ignore_eos=True))
    assert out.tokens == reference[:10]
    assert out.stats.stop_reason == "max_new_tokens"
    honoured = engine.generate(GenerationRequest(prompt, max_new_tokens=10, spec=CHAIN4))
    assert honoured.tokens == reference[: j + 1] and honoured.stats.stop_reason == "eos"


@pytest.mark.parametrize("spec", [CHAIN4, None], ids=["chain4", "plain"])
def test_min_tokens_and_stop_token_ids(spec):
    """vLLM's min_tokens: an EOS before the min_tokens-th token does not stop, one at it does; stop_token_ids: the
    token stops and is kept, with ignore_eos too. Inside accepted paths (the draft is the target) as in plain
    decoding, and nothing after the stop is committed or cached."""
    model = _model()
    prompt, reference = map(list, _distinct_prompt(model, 10))
    engine, target = _engine(model, DraftRuntime(model), eos=[reference[2], reference[6]])

    def run(**options):
        out = engine.generate(GenerationRequest(prompt, max_new_tokens=10, spec=spec, **options))
        _assert_nothing_after_stop(prompt, out, target)
        return out.tokens, out.stats.stop_reason

    assert run() == run(min_tokens=3) == (reference[:3], "eos")
    assert run(min_tokens=4) == (reference[:7], "eos")
    assert run(min_tokens=4, stop_token_ids=(reference[1], reference[4])) == (reference[:5], "stop_token")
    assert run(ignore_eos=True, stop_token_ids=(reference[8],)) == (reference[:9], "stop_token")
    assert run(ignore_eos=True, min_tokens=10, stop_token_ids=(reference[8],)) == (reference[:10], "max_new_tokens")


@pytest.mark.parametrize("agree, j", [(0, 0), (0, 3), (2, 2), (2, 5), (1, 3)])
def test_eos_as_bonus_token(agree, j):
    """The scripted draft agrees for ``agree`` tokens a round; EOS = the bonus token of a round."""
    model = _model()
    prompt, reference = map(list, _distinct_prompt(model, 10))
    assert j % (agree + 1) == agree  # the j-th token is a bonus token
    draft = OracleDraft(prompt, reference, agree=agree)
    engine, target = _engine(model, draft, eos=[reference[j]])
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=40, spec=CHAIN4))
    assert out.tokens == reference[: j + 1]
    assert out.stats.stop_reason == "eos"
    assert out.stats.rounds == j // (agree + 1) + 1
    assert draft.log.rounds[-1].accepted == list(range(agree))
    _assert_nothing_after_stop(prompt, out, target)


def test_eos_first_occurrence_among_several_ids():
    model = _model()
    prompt, reference = map(list, _distinct_prompt(model, 10))
    engine, target = _engine(model, DraftRuntime(model), eos=[reference[7], reference[3]])
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=40, spec=SEED_SPEC))
    assert out.tokens == reference[:4]
    assert out.tokens == hf_greedy(model, prompt, 40, eos_token_id=[reference[7], reference[3]])


# ------------------------------------------------------------------------------------------------
# max_new_tokens
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", range(1, 12))
def test_max_new_tokens_inside_accepted_path(n):
    """The scripted draft ignores max_depth and always proposes depth-6 trees the target accepts
    whole, so every budget ends inside an accepted path; the count must still be exact."""
    model = _model()
    prompt = random_prompt(seed=9100, length=5)
    reference = hf_greedy(model, prompt, 20)
    draft = OracleDraft(prompt, reference, agree=6, ignore_max_depth=True)
    engine, target = _engine(model, draft)
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=n, spec=TreeSpec.chain(6)))
    assert out.tokens == reference[:n]
    assert out.stats.new_tokens == n and out.stats.stop_reason == "max_new_tokens"
    # Round 1 commits min(n, 7) tokens: the 6 accepted draft tokens (+ the bonus when n >= 7).
    first = draft.log.rounds[0]
    if n > 1:
        assert first.tokens == reference[: min(n, 7)]
        assert first.accepted == list(range(min(n, 6)))
    _assert_nothing_after_stop(prompt, out, target)


@pytest.mark.parametrize("spec", [SEED_SPEC, CHAIN4, TreeSpec(gamma=2, topKSpec=[[8], [4]], topHead=[1, 1])])
def test_max_new_tokens_exact_counts(spec):
    model = _model()
    prompt = random_prompt(seed=9200, length=7)
    reference = hf_greedy(model, prompt, 12)
    for n in range(1, 12):
        state = DraftState()
        engine, target = _engine(model, RecordingDraft(DraftRuntime(model), check_after_commit=state))
        out = engine.generate(GenerationRequest(prompt, max_new_tokens=n, spec=spec))
        assert out.tokens == reference[:n]
        _assert_nothing_after_stop(prompt, out, target, state)


# ------------------------------------------------------------------------------------------------
# Stop strings
# ------------------------------------------------------------------------------------------------

def _char_tokenizer():
    """A transformers tokenizer for the char-level vocabulary (id i <-> CHARS[i])."""
    tokenizer = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(CHARS)}, unk_token="#"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 7])
def test_stop_string_spanning_two_tokens(k):
    """Stop string = the text of greedy tokens k-1 and k; draft = target, so it ends inside an
    accepted path (or on a bonus token, k = 4)."""
    model = _model()
    for seed in range(200):
        prompt = random_prompt(seed=9300 + seed, length=6)
        reference = hf_greedy(model, prompt, 30)
        text = char_decode(reference)
        stop = text[k - 1 : k + 1]
        if text.find(stop) == k - 1:  # first occurrence ends at token k
            break
    else:
        raise AssertionError("no prompt found")
    state = DraftState()
    engine, target = _engine(model, RecordingDraft(DraftRuntime(model), check_after_commit=state), decode=char_decode)
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=30, stop_strings=(stop,), spec=CHAIN4))
    assert out.tokens == reference[: k + 1]
    assert out.stats.stop_reason == "stop_string"
    assert out.tokens == hf_greedy(model, prompt, 30, stop_strings=[stop], tokenizer=_char_tokenizer())
    _assert_nothing_after_stop(prompt, out, target, state)


def test_stop_checker_multi_char_tokens():
    """Tokens decoding to several characters: matches spanning 3 tokens, inside one token, and a
    match that was already complete earlier does not fire again later."""
    pieces = {0: "ab", 1: "c", 2: "de", 3: "xyz", 4: "q"}

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    def run(tokens, stops):
        checker = StopChecker(prompt_len=3, max_new_tokens=100, context_limit=1000, stop_strings=stops, decode=decode)
        for i, t in enumerate(tokens):
            if checker.push(t):
                return i, checker.reason
        return None, None

    assert run([4, 0, 1, 2, 4], ("bcd",)) == (3, "stop_string")  # "ab" "c" "de": spans 3 tokens
    assert run([4, 4, 3, 4], ("y",)) == (2, "stop_string")  # inside one token
    assert run([4, 4, 4], ("qqq",)) == (2, "stop_string")
    assert run([4, 1, 4, 1], ("cq", "zz")) == (2, "stop_string")
    assert run([4, 1, 4, 1], ("zz",)) == (None, None)


def test_stop_check_costs_the_same_at_every_output_length():
    """Issue 57: every token once decoded the whole output (quadratic in its length). Now each push decodes at
    most 4 x the longest stop string + 9 tokens, and a match spanning the window's tokens is still found."""
    pieces = {0: "ab", 1: "c", 2: "de", 3: "xyz", 4: "q"}
    seen = []

    def decode(ids):
        seen.append(len(ids))
        return "".join(pieces[i] for i in ids)

    checker = StopChecker(prompt_len=3, max_new_tokens=20_000, context_limit=30_000, stop_strings=("qqqqqxy", "cde"),
                          decode=decode, streamed=(4, 4))
    for _ in range(10_000):
        assert not checker.push(4)
    assert max(seen) <= 4 * 7 + 9
    assert checker.push(3) and checker.reason == "stop_string"  # "qqqqq" + "xyz" holds "qqqqqxy" over 6 tokens
    late = StopChecker(prompt_len=3, max_new_tokens=100, context_limit=1000, stop_strings=("qqc",), decode=decode,
                       streamed=(4, 4))
    assert late.push(1) and late.reason == "stop_string"  # spans the streamed tail of an earlier part


def test_stop_checker_order_and_budget():
    checker = StopChecker(prompt_len=5, max_new_tokens=4, context_limit=8, eos_token_ids=frozenset({9}))
    assert checker.budget() == 3  # context: 8 - 5
    assert not checker.push(1)
    assert checker.budget() == 2
    assert not checker.push(2)
    assert checker.push(3) and checker.reason == "context_limit"
    checker = StopChecker(prompt_len=5, max_new_tokens=2, context_limit=7, eos_token_ids=frozenset({9}))
    assert not checker.push(1)
    assert checker.push(9) and checker.reason == "eos"  # EOS wins over the budget stops


# ------------------------------------------------------------------------------------------------
# Context limit
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("room", [1, 2, 3, 5])
def test_context_limit_mid_tree(room):
    """context_limit = len(prompt) + room, smaller than a full SEED_SPEC round (4 tokens) or a
    depth-6 chain the scripted draft proposes whatever the budget."""
    model = _model()
    prompt = random_prompt(seed=9400, length=8)
    reference = hf_greedy(model, prompt, 20)
    limit = len(prompt) + room

    engine, target = _engine(model, DraftRuntime(model), context_limit=limit)
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=50, spec=SEED_SPEC))
    assert out.tokens == reference[:room]
    ids = torch.tensor([prompt])
    hf = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_length=limit, pad_token_id=0)
    assert out.tokens == hf[0, len(prompt):].tolist()
    assert out.stats.stop_reason == "context_limit"
    _assert_nothing_after_stop(prompt, out, target)
    assert target.final_cache_len == limit - 1

    draft = OracleDraft(prompt, reference, agree=6, ignore_max_depth=True)
    engine, target = _engine(model, draft, context_limit=limit)
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=50, spec=TreeSpec.chain(6)))
    assert out.tokens == reference[:room]
    assert out.stats.stop_reason == "context_limit"
    if room > 1:
        assert draft.log.rounds[0].accepted == list(range(room))  # cut inside the accepted path
    _assert_nothing_after_stop(prompt, out, target)


def test_request_validation():
    model = _model()
    engine, target = _engine(model, DraftRuntime(model), context_limit=6)
    with pytest.raises(ValueError, match="prompt"):
        engine.generate(GenerationRequest([], max_new_tokens=4, spec=SEED_SPEC))
    with pytest.raises(ValueError, match="prompt"):
        engine.generate(GenerationRequest([1] * 6, max_new_tokens=4, spec=SEED_SPEC))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(GenerationRequest([1, 2], max_new_tokens=0, spec=SEED_SPEC))
    assert target.runtime.sessions == {} and engine.draft.sessions == {}
    out = engine.generate(GenerationRequest([1] * 5, max_new_tokens=4, spec=SEED_SPEC))
    assert len(out.tokens) == 1 and out.stats.stop_reason == "context_limit"
