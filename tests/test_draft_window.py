"""The draft's context window (specdec.config.DraftWindowConfig): a draft session opens with the
attention sinks plus the most recent committed tokens, the target keeps every token, and the output
stays the target's own greedy tokens (float32, tiny models)."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from draft_service.runtime import DraftRuntime
import orchestrator.loop.controller as controller_module
from orchestrator.planning.control import FixedControl
from orchestrator.loop.controller import DraftUnavailableError, GenerationRequest, RoundController, sync_worker
from orchestrator.loop.embedded import make_control
from orchestrator.loop.engine import SpeculativeEngine
from specdec.config import ConfigError, DraftWindowConfig, FallbackConfig, load_config
from specdec.sampling import GREEDY, SamplingParams, derive_seed
from specdec.telemetry import setup_tracing
from specdec.tree_spec import TreeSpec
from target_service.runtime import TargetRuntime
from tests.conftest import SlowPropose, hf_greedy, perturbed_copy, random_prompt, tiny_model

SPEC = TreeSpec(gamma=3, topKSpec=[[2], [1, 1], [1, 1]], topHead=[1, 2, 2])


class StartLog(DraftRuntime):
    """The in-process draft, logging the tokens each session opens with."""

    def __init__(self, model):
        super().__init__(model)
        self.started: list[list[int]] = []
        self.seeds: list[int | None] = []

    def start(self, session_id, prompt_ids, sampling=GREEDY):
        self.started.append(list(prompt_ids))
        self.seeds.append(sampling.seed)
        return super().start(session_id, prompt_ids, sampling)


def test_context_keeps_the_sinks_and_the_most_recent_tokens():
    window = DraftWindowConfig(max_tokens=6, sink_tokens=2)
    assert window.context(list(range(10))) == [0, 1, 6, 7, 8, 9]
    assert window.context([5, 6, 7]) == [5, 6, 7]  # short contexts are kept whole
    assert window.context(list(range(6))) == list(range(6))
    assert DraftWindowConfig(max_tokens=3, sink_tokens=0).context(list(range(5))) == [2, 3, 4]


def test_the_window_applies_where_the_draft_shares_the_target_compute():
    window = DraftWindowConfig()
    assert window.applies(shared_compute=True) and not window.applies(shared_compute=False)
    assert DraftWindowConfig(on_separate_hardware=True).applies(shared_compute=False)
    assert not DraftWindowConfig(max_tokens=None).applies(shared_compute=True)


def test_a_sink_as_long_as_the_window_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("front:\n  draft_window:\n    max_tokens: 16\n    sink_tokens: 16\n")
    with pytest.raises(ConfigError, match="sink_tokens"):
        load_config(path)


@pytest.mark.parametrize("kind, seed", [("qwen2", 0), ("llama", 1)])
def test_windowed_draft_keeps_the_target_greedy_output(kind, seed):
    model = tiny_model(kind, seed=seed)
    prompt = random_prompt(seed=77, length=40)
    n = 24
    reference = hf_greedy(model, prompt, n)
    draft = StartLog(model)  # the target itself, but seeing 12 of the 40 prompt tokens: partial acceptance
    engine = SpeculativeEngine(TargetRuntime(model), draft, eos_token_ids=[], context_limit=512,
                               draft_window=DraftWindowConfig(max_tokens=12, sink_tokens=3))
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=n, spec=SPEC))
    assert out.tokens == reference
    assert draft.started == [prompt[:3] + prompt[-9:]]
    assert 0 < out.stats.accepted_tokens < out.stats.proposed_tokens  # drafted, some rejected


def test_window_lets_a_draft_with_a_short_context_speculate():
    """A draft whose context (16 positions) cannot hold the 40-token prompt: whole, the request falls
    back to plain decoding for its draft context limit; windowed to 8 tokens it drafts while its tree
    fits the draft's positions (8 + generated), and the limit counts in the draft's positions."""
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=78, length=40)
    n = 12
    reference = hf_greedy(model, prompt, n)

    def run(window):
        factory, _ = make_control("fixed", None, None)
        draft = StartLog(model)  # draft = target: every drafted token is accepted
        engine = SpeculativeEngine(TargetRuntime(model), draft, eos_token_ids=[], context_limit=512,
                                   control_factory=factory, draft_context_limit=16, draft_window=window)
        records = []
        engine.controller.on_round = records.append
        out = engine.generate(GenerationRequest(prompt, max_new_tokens=n, spec=SPEC))
        assert out.tokens == reference
        return out, draft, records

    out, draft, _ = run(None)
    assert out.stats.drafted_tokens == 0 and out.stats.rounds == n
    out, draft, records = run(DraftWindowConfig(max_tokens=8, sink_tokens=2, full_after_tokens=4))
    assert draft.started == [prompt[:2] + prompt[-6:]]  # the whole context never fits: no re-open
    assert out.stats.accepted_tokens > 0
    # the draft holds 8 + generated tokens (32 skipped): a tree of depth d fits while 40 + generated + d <= 16 + 32;
    # the fixed control asks for its tree's levels (the budget's, near the end) and decodes plain where they do not fit
    done = 0
    for record in records:
        levels = min(SPEC.gamma, n - done - 1)
        assert record.depth == 0 or 40 + done + record.depth <= 48
        if record.fallback is not None:
            assert record.fallback == "draft_context_limit" and 40 + done + levels > 48
        else:
            assert levels < 1 or 40 + done + levels <= 48
        done += len(record.tokens)
    assert any(record.fallback == "draft_context_limit" for record in records)


@pytest.mark.parametrize("kind, seed", [("qwen2", 0), ("llama", 1)])
def test_a_long_answer_reopens_the_draft_with_the_whole_context(kind, seed):
    """full_after_tokens=6: the first rounds draft from the 12-token window; the first round after
    6 generated tokens re-opens the draft with every committed token; output unchanged."""
    model = tiny_model(kind, seed=seed)
    prompt = random_prompt(seed=79, length=40)
    n = 24
    reference = hf_greedy(model, prompt, n)
    draft = StartLog(model)
    engine = SpeculativeEngine(TargetRuntime(model), draft, eos_token_ids=[], context_limit=512,
                               draft_window=DraftWindowConfig(max_tokens=12, sink_tokens=3, full_after_tokens=6))
    rounds = []
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=n, spec=SPEC), on_tokens=rounds.append)
    assert out.tokens == reference
    assert len(draft.started) == 2 and draft.started[0] == prompt[:3] + prompt[-9:]
    done = [sum(len(r) for r in rounds[:i]) for i in range(len(rounds) + 1)]
    first_due = min(d for d in done if d >= 6)  # generated tokens at the first round that may re-open
    assert draft.started[1] == prompt + reference[:first_due]
    assert out.stats.accepted_tokens > 0


def test_the_reopen_is_an_event_of_its_round_span():
    exporter = InMemorySpanExporter()
    setup_tracing("specdec-test", exporter=exporter, simple=True)
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=80, length=30)
    ctl = RoundController(sync_worker(TargetRuntime(model)), sync_worker(DraftRuntime(model)), [], 512,
                          draft_window=DraftWindowConfig(max_tokens=10, sink_tokens=2, full_after_tokens=5))
    rounds = []

    async def go():
        with trace.get_tracer("test").start_as_current_span("request") as parent:
            await ctl.generate(GenerationRequest(prompt, 16, spec=SPEC), on_tokens=rounds.append)
            return parent.get_span_context().trace_id

    trace_id = asyncio.run(go())
    spans = sorted((s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id and s.name == "round"),
                   key=lambda s: s.start_time)
    marked = [i for i, s in enumerate(spans) if any(e.name == "draft.widen" for e in s.events)]
    done = [sum(len(r) for r in rounds[:i]) for i in range(len(rounds))]
    assert marked == [min(i for i, d in enumerate(done) if d >= 5)]
    (event,) = [e for e in spans[marked[0]].events if e.name == "draft.widen"]
    assert event.attributes["skipped"] == 20 and event.attributes["generated"] == done[marked[0]]


def test_a_reopened_sampled_session_draws_a_fresh_stream_of_the_request_seed():
    """Seeded sampling: the re-opened draft session gets a seed derived from the request's (its old
    stream's draws are not replayed), so the run stays reproducible."""
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=81, length=30)
    window = DraftWindowConfig(max_tokens=10, sink_tokens=2, full_after_tokens=4)
    sampling = SamplingParams(temperature=0.8, seed=11)

    def run():
        draft = StartLog(perturbed_copy(model, seed=5, scale=0.05))
        engine = SpeculativeEngine(TargetRuntime(model), draft, eos_token_ids=[], context_limit=512, draft_window=window)
        return engine.generate(GenerationRequest(prompt, max_new_tokens=16, spec=SPEC, sampling=sampling)), draft

    (first, draft), (again, _) = run(), run()
    assert first.tokens == again.tokens
    assert draft.seeds == [11, derive_seed(11, "draft-reopen/1")] and len(draft.started[1]) > 30


class FailingWhole(StartLog):
    """Fails every propose of a session opened with more than ``window`` tokens (a whole-context
    re-open that, say, ran past its deadline during its prefill)."""

    def __init__(self, model, window: int):
        super().__init__(model)
        self.window = window
        self.opened_with: dict[str, int] = {}  # session id -> tokens it opened with, in the order opened
        self.drafted_nodes: dict[str, int] = {}  # session id -> tree nodes it proposed in all

    def start(self, session_id, prompt_ids, sampling=GREEDY):
        self.opened_with[session_id] = len(prompt_ids)
        return super().start(session_id, prompt_ids, sampling)

    def propose_batch(self, items):
        if any(self.opened_with[item[0]] > self.window for item in items):
            raise DraftUnavailableError("scripted: the whole-context session is too slow")
        trees = super().propose_batch(items)
        for item, tree in zip(items, trees):
            self.drafted_nodes[item[0]] = self.drafted_nodes.get(item[0], 0) + getattr(tree, "size", 0)
        return trees


def test_a_failed_whole_context_session_goes_back_to_the_window_for_good():
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=82, length=30)
    n = 24
    reference = hf_greedy(model, prompt, n)
    draft = FailingWhole(model, window=10)
    control = lambda spec: FixedControl(spec, FallbackConfig(reconnect_s=0.001))
    engine = SpeculativeEngine(TargetRuntime(model), draft, eos_token_ids=[], context_limit=512, control_factory=control,
                               draft_window=DraftWindowConfig(max_tokens=10, sink_tokens=2, full_after_tokens=4))
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=n, spec=SPEC))
    assert out.tokens == reference
    lengths = [len(tokens) for tokens in draft.started]
    assert lengths[0] == 10 and lengths[1] > 30  # windowed, then the whole context once 4 tokens are out
    assert len(lengths) >= 3 and all(length == 10 for length in lengths[2:])  # after its failure: the window only
    # the windowed retries drafted again: trees from the sessions opened after the failed one, verified
    # (whether the target accepts any of them is up to this random model and the CPU's round-off: on an
    # AMD EPYC none was, on an Intel Xeon some)
    retried = list(draft.opened_with)[2:]
    assert sum(draft.drafted_nodes.get(sid, 0) for sid in retried) > 0
    assert out.stats.proposed_tokens == sum(draft.drafted_nodes.values())  # every tree drafted was verified


class LateDraft(FixedControl):
    """Drafts only once 4 tokens are generated (prompt of 30), the draft opened at the first drafted round."""

    def defer_draft_open(self, others: int = 0) -> bool:
        return True

    def speculate(self, now, committed_len, depth):
        self.reason = None if committed_len >= 34 else "cost"
        return committed_len >= 34


@pytest.mark.parametrize("draft_limit", [None, 45, 44])
def test_an_open_after_full_after_tokens_takes_the_whole_context_at_once(draft_limit):
    """Opened at 4 generated tokens (34 committed, 12 more to generate: the request needs 34 + 11
    draft positions): the whole context when the draft holds 45 positions or more, else the window."""
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=83, length=30)
    n = 16
    reference = hf_greedy(model, prompt, n)
    draft = StartLog(model)
    engine = SpeculativeEngine(TargetRuntime(model), draft, eos_token_ids=[], context_limit=512, control_factory=LateDraft,
                               draft_context_limit=draft_limit,
                               draft_window=DraftWindowConfig(max_tokens=10, sink_tokens=2, full_after_tokens=4))
    out = engine.generate(GenerationRequest(prompt, max_new_tokens=n, spec=SPEC))
    assert out.tokens == reference
    committed = prompt + reference[:4]
    if draft_limit == 44:
        assert draft.started == [committed[:2] + committed[-8:]]
    else:
        assert draft.started == [committed]  # no windowed session first


@pytest.mark.parametrize("slow, dropped", [(1, False), (2, True)])
def test_the_first_propose_of_a_session_gets_time_for_its_prefill(slow, dropped, monkeypatch):
    """Deadline 0.1 s: the first propose of a session opened with 30 tokens may take 0.1 + 30 * 0.1
    s (it may still wait for the session's prefill); a later one may not (0.3 s > 0.1 s)."""
    monkeypatch.setattr(controller_module, "FRESH_DRAFT_S_PER_TOKEN", 0.1)
    model = tiny_model("qwen2", seed=0)
    prompt = random_prompt(seed=84, length=30)
    ctl = RoundController(sync_worker(TargetRuntime(model)), SlowPropose(model, 0.3, only=slow), [], 512, draft_deadline_s=0.1)
    result = asyncio.run(ctl.generate(GenerationRequest(prompt, 12, spec=SPEC)))
    assert result.tokens == hf_greedy(model, prompt, 12)
    assert (result.stats.fallback_rounds > 0) == dropped
