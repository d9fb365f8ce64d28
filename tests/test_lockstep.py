"""RoundClock (orchestrator.planning.lockstep): the barriers that keep concurrent requests' rounds in step."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.planning.lockstep import START, VERIFY, RoundClock
from specdec.tree_spec import TreeSpec


async def _rounds(clock: RoundClock, sid: str, draft_s: float, rounds: int, log: list, join_after_s: float = 0.0):
    """A request: joins (unless it already has), then per round START turn, 'drafts' draft_s, VERIFY
    turn (logged), 'commits'."""
    await asyncio.sleep(join_after_s)
    clock.join(sid)  # a set: joining twice is once
    try:
        for r in range(rounds):
            await clock.turn(sid, START)
            await asyncio.sleep(draft_s)
            await clock.turn(sid, VERIFY)
            log.append((asyncio.get_running_loop().time(), sid, r))
            await asyncio.sleep(0.01)
    finally:
        clock.leave(sid)


def _verify_groups(log: list, tolerance: float = 0.005) -> list[set[str]]:
    """The requests whose verifies went out together (within tolerance seconds), in time order."""
    groups: list[tuple[float, set[str]]] = []
    for at, sid, _ in sorted(log):
        if groups and at - groups[-1][0] <= tolerance:
            groups[-1][1].add(sid)
        else:
            groups.append((at, {sid}))
    return [g for _, g in groups]


def test_requests_with_different_draft_times_verify_together_every_round():
    async def main():
        clock, log = RoundClock(max_wait_s=2.0), []
        clock.join("a"), clock.join("b"), clock.join("c")  # all in their rounds before the first turn
        tasks = [_rounds(clock, sid, d, 4, log) for sid, d in (("a", 0.0), ("b", 0.03), ("c", 0.08))]
        await asyncio.gather(*tasks)
        return clock, log

    clock, log = asyncio.run(main())
    # without the clock "a" (no draft) would verify 30 and 80 ms before the others, every round
    assert _verify_groups(log) == [{"a", "b", "c"}] * 4
    assert clock.timeouts == 0 and clock.members == set()


def test_a_request_that_joins_mid_round_lets_the_others_verify_then_keeps_step_with_them():
    async def main():
        clock, log = RoundClock(max_wait_s=2.0), []
        clock.join("a"), clock.join("b")
        await asyncio.gather(_rounds(clock, "a", 0.05, 4, log), _rounds(clock, "b", 0.05, 4, log),
                             _rounds(clock, "x", 0.0, 3, log, join_after_s=0.08))
        return clock, log

    clock, log = asyncio.run(main())
    groups = _verify_groups(log)
    # x joins while a and b are mid-round (their second, at the planned timing): it waits at START
    # while they verify without it, then verifies with them in every round they have left (its
    # first two or three), and alone after they are done; nobody waits out max_wait_s
    joined = next(i for i, g in enumerate(groups) if "x" in g)
    assert joined >= 1 and groups[:joined] == [{"a", "b"}] * joined
    together = 4 - joined  # a and b verify 4 times in all
    assert groups[joined:joined + together] == [{"a", "b", "x"}] * together
    assert groups[joined + together:] == [{"x"}] * (3 - together)
    assert clock.timeouts == 0


def test_a_straggler_is_not_waited_for_past_max_wait():
    async def main():
        clock = RoundClock(max_wait_s=0.05)
        clock.join("a"), clock.join("slow")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await clock.turn("a", VERIFY)  # "slow" never arrives
        return clock, loop.time() - t0

    clock, waited = asyncio.run(main())
    assert 0.05 <= waited < 0.5
    assert clock.timeouts == 1


def test_a_straggler_costs_the_others_one_max_wait_not_one_a_turn():
    async def main():
        clock = RoundClock(max_wait_s=0.05)
        clock.join("a"), clock.join("slow")
        await clock.turn("slow", START)  # alone at START? no: a is a member too; it times out first
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for _ in range(10):  # "slow" is drafting for a long while: ten rounds of "a" meanwhile
            await clock.turn("a", START)
            await clock.turn("a", VERIFY)
        a_rounds = loop.time() - t0
        await clock.turn("slow", VERIFY)  # "slow" is back: from now on the turns wait for it again
        waiter = asyncio.create_task(clock.turn("a", START))
        await asyncio.sleep(0.02)
        waits_again = not waiter.done()
        await waiter
        return clock, a_rounds, waits_again

    clock, a_rounds, waits_again = asyncio.run(main())
    assert a_rounds < 0.3  # one max_wait at most (20 turns x 0.05 s = 1 s without forgetting the straggler)
    assert waits_again


def test_leaving_ends_the_turn_the_others_wait_at():
    async def main():
        clock = RoundClock(max_wait_s=5.0)
        clock.join("a"), clock.join("b")
        waiter = asyncio.create_task(clock.turn("a", START))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # b is still mid-round
        clock.leave("b")  # b finished its request
        await asyncio.wait_for(waiter, 0.5)
        return clock

    clock = asyncio.run(main())
    assert clock.timeouts == 0 and clock.members == {"a"}


def test_a_cancelled_waiter_no_longer_counts_as_there():
    async def main():
        clock = RoundClock(max_wait_s=5.0)
        for sid in ("a", "b", "c"):
            clock.join(sid)
        a = asyncio.create_task(clock.turn("a", VERIFY))
        await asyncio.sleep(0.01)
        a.cancel()
        await asyncio.gather(a, return_exceptions=True)
        b = asyncio.create_task(clock.turn("b", VERIFY))
        await asyncio.sleep(0.01)
        # a is a member again not waiting (its request goes on or leaves): b must still wait for it
        # and for c; with a's cancelled wait counted, c's arrival alone would end b's turn
        c = asyncio.create_task(clock.turn("c", VERIFY))
        await asyncio.sleep(0.01)
        stuck = not b.done() and not c.done()
        clock.leave("a")
        await asyncio.wait_for(asyncio.gather(b, c), 0.5)
        return stuck

    assert asyncio.run(main())


def test_a_request_alone_or_not_joined_never_waits():
    async def main():
        clock = RoundClock(max_wait_s=5.0)
        clock.join("a")
        await asyncio.wait_for(clock.turn("a", VERIFY), 0.1)  # alone
        await asyncio.wait_for(clock.turn("stranger", START), 0.1)  # not a member
        return clock

    assert asyncio.run(main()).ticks == 0


def test_an_inactive_clock_holds_no_one_and_lets_go_the_requests_waiting_from_before():
    """RoundClock.active: while it answers False every turn returns at once (verifies go out at
    each request's own pace, the drafts' 30 and 80 ms apart), and the first such turn releases a
    request that was already waiting (it does not sit out max_wait_s)."""
    async def main():
        on = {"v": False}
        clock, log = RoundClock(max_wait_s=5.0, active=lambda: on["v"]), []
        clock.join("a"), clock.join("b"), clock.join("c")
        await asyncio.gather(*[_rounds(clock, sid, d, 3, log) for sid, d in (("a", 0.0), ("b", 0.03), ("c", 0.08))])
        inactive_groups = _verify_groups(log)
        counted = (clock.ticks, clock.timeouts, clock.waited_s)
        on["v"] = True
        clock.join("a"), clock.join("b")
        loop = asyncio.get_running_loop()
        waiter = asyncio.ensure_future(clock.turn("a", START))  # b never comes while the clock is on
        await asyncio.sleep(0.05)
        assert not waiter.done()
        on["v"] = False
        t0 = loop.time()
        assert await clock.turn("b", START) == 0.0
        waited = await waiter
        return inactive_groups, loop.time() - t0, waited, counted

    groups, release_s, waited, counted = asyncio.run(main())
    assert counted == (0, 0, 0.0)  # no tick, no timeout, no wait while inactive
    assert len(groups) >= 2  # the verifies went out at each request's own pace, not all together
    assert release_s < 0.5 and 0.04 < waited < 0.5  # let go at b's turn, not after max_wait_s (5 s)


def test_a_turn_that_times_out_after_the_clock_went_inactive_marks_no_straggler():
    async def main():
        on = {"v": True}
        clock = RoundClock(max_wait_s=0.1, active=lambda: on["v"])
        clock.join("a"), clock.join("b")
        waiter = asyncio.ensure_future(clock.turn("a", START))  # b never comes
        await asyncio.sleep(0.02)
        on["v"] = False  # and nobody takes a turn to let a go
        await waiter
        return clock

    clock = asyncio.run(main())
    assert clock.timeouts == 0 and clock._late == set() and clock._waiting == {START: {}, VERIFY: {}}


def test_max_wait_must_be_positive():
    with pytest.raises(ValueError, match="max_wait_s"):
        RoundClock(max_wait_s=0)


# ------------------------------------------------------------------ in the round controller

def _run_pair(clock: RoundClock | None, third_fails_after: int | None = None, fast_spec: TreeSpec | None = TreeSpec.chain(1),
              slow_spec: TreeSpec | None = TreeSpec.chain(3), plain_load=None):
    """Two requests on one RoundController over in-process tiny models: "slow" drafts a chain (each
    proposal after its first 30 ms late), "fast" a chain of one step with no delay (fast_spec None:
    decodes plain, no_spec); third_fails_after: a third request, "fail", whose verify raises after
    that many; plain_load: the controller's (no_spec requests in step). Returns (outputs, verify
    order, target model, prompts); a failed request's output is its exception."""
    fail_after = third_fails_after
    from draft_service.runtime import DraftRuntime
    from orchestrator.loop.controller import GenerationRequest, RoundController, sync_worker
    from specdec.tree_spec import TreeSpec
    from target_service.runtime import TargetRuntime
    from tests.conftest import perturbed_copy, random_prompt, tiny_model

    target_model = tiny_model("qwen2", seed=5, init_std=0.2)
    draft_model = perturbed_copy(target_model, seed=1, scale=0.05)  # partial acceptance
    target, draft, order, proposed = TargetRuntime(target_model), DraftRuntime(draft_model), [], []

    class Target:
        def __getattr__(self, name):
            return getattr(sync_worker(target), name)

        async def verify(self, sid, tree):
            order.append(sid.split("/")[0])
            return await sync_worker(target).verify(sid, tree)

    class SlowDraft:
        def __getattr__(self, name):
            return getattr(sync_worker(draft), name)

        async def propose(self, sid, spec, max_depth):
            proposed.append(sid)
            if not sid.startswith("fast") and proposed.count(sid) > 1:  # the first round stays quick
                await asyncio.sleep(0.03)
            return await sync_worker(draft).propose(sid, spec, max_depth)

    class FailingTarget(Target):
        async def verify(self, sid, tree):
            if sid.startswith("fail/") and order.count("fail") >= fail_after:
                raise RuntimeError("target: verify failed")
            return await super().verify(sid, tree)

    controller = RoundController(FailingTarget(), SlowDraft(), eos_token_ids=[], context_limit=256, clock=clock,
                                 plain_load=plain_load)
    prompts = {"slow": random_prompt(seed=3, length=8), "fast": random_prompt(seed=4, length=8)}
    specs = {"slow": slow_spec, "fast": fast_spec}

    names = ("slow", "fast") + (("fail",) if fail_after is not None else ())
    prompts["fail"], specs["fail"] = random_prompt(seed=5, length=8), TreeSpec.chain(2)

    async def main():
        return await asyncio.gather(*[
            controller.generate(GenerationRequest(prompts[k], max_new_tokens=24, spec=specs[k]), session_id=f"{k}/0")
            for k in names], return_exceptions=True)

    results = asyncio.run(main())
    outputs = {k: r if isinstance(r, Exception) else r.tokens for k, r in zip(names, results)}
    return outputs, order, target_model, prompts


def test_the_controller_with_a_clock_sends_the_requests_verifies_in_step_and_output_is_unchanged():
    from tests.conftest import hf_greedy

    free, free_order, model, prompts = _run_pair(None)
    clock = RoundClock(max_wait_s=2.0)
    stepped, order, _, _ = _run_pair(clock)
    expected = {k: hf_greedy(model, prompts[k], 24) for k in ("slow", "fast")}
    assert free == expected and stepped == expected  # float32 greedy: the clock changes timing only
    # while both run, "fast" verifies once per "slow" round with the clock (it waits for "slow"'s
    # draft, then both verify together, in either order), several times per "slow" round without it
    first, last = order.index("fast"), len(order) - 1 - order[::-1].index("fast")
    stepped_window = order[first:last + 1]
    assert abs(stepped_window.count("fast") - stepped_window.count("slow")) <= 1, order
    assert clock.ticks > 0 and clock.timeouts == 0 and clock.members == set()  # both left at their end
    first, last = free_order.index("fast"), len(free_order) - 1 - free_order[::-1].index("fast")
    window = free_order[first:last + 1]
    assert window.count("fast") >= 2 * (window.count("slow") + 1), free_order


def test_a_request_that_fails_mid_round_leaves_the_clock_and_the_others_finish_without_waiting():
    import time

    from tests.conftest import hf_greedy

    clock = RoundClock(max_wait_s=30.0)  # a failed request still counted would hold each turn 30 s
    started = time.monotonic()
    out, order, model, prompts = _run_pair(clock, third_fails_after=3)
    assert time.monotonic() - started < 20
    assert isinstance(out["fail"], RuntimeError)
    assert out["slow"] == hf_greedy(model, prompts["slow"], 24) and out["fast"] == hf_greedy(model, prompts["fast"], 24)
    assert clock.timeouts == 0 and clock.members == set()


def test_requests_without_a_draft_do_not_join_a_clock_without_plain_load():
    """Without the controller's plain_load (cost_aware.in_step_no_spec false) no_spec requests never
    join, so no turn holds them (two of them together: no tick, no wait); output the target's own."""
    from tests.conftest import hf_greedy

    clock = RoundClock(max_wait_s=2.0)
    out, order, model, prompts = _run_pair(clock, fast_spec=None, slow_spec=None)
    assert out == {k: hf_greedy(model, prompts[k], 24) for k in ("slow", "fast")}
    assert clock.ticks == 0 and clock.timeouts == 0 and clock.waited_s == 0.0 and clock.members == set()
    assert order.count("slow") == order.count("fast") >= 23  # plain: a verify per token after the first


@pytest.mark.parametrize("change, clocked", [
    ({}, True),
    ({"cost_aware": {"in_step": False}}, False),  # off: no clock
    ({"cost_aware": {"in_step": True, "enabled": False}}, False),  # no cost-aware plan to keep in step
    ({"cost_aware": {"in_step": True}, "pipeline": True}, False),  # an ahead drafts beside the verify
], ids=["default", "off", "not_cost_aware", "pipelined"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "separate"])
def test_the_front_runs_a_clock_only_for_in_step_rounds_on_shared_compute(change, clocked, shared):
    from orchestrator.loop.service import Orchestrator, control_factory
    from specdec.config import FrontConfig, GrpcConfig

    settings = {"cost_aware": {"in_step_wait_ms": 250.0}}  # in_step: on by default
    settings.update(change)
    config = FrontConfig.model_validate(settings)
    front = Orchestrator(config, GrpcConfig(), control_factory=control_factory(config))
    clock = front._clock(shared)
    assert (clock is not None) == (clocked and shared)
    if clock is not None:  # its turns hold only while the in-step plan applies (below in_step_max_load)
        state = front.control_factory.shared
        state.shared_compute, state.load = True, 2.0
        assert clock.active() is True
        state.load = 4.0  # under the default cap, 8.5
        assert clock.active() is True
        state.load = 9.0
        assert clock.active() is False
        state.load = 2.0  # a stale load (learnt only from the rounds of requests that plan) ...
        clock.members |= {f"r{i}" for i in range(9)}  # ... holds no more than in_step_max_load members in step
        assert clock.active() is False
    assert Orchestrator(config, GrpcConfig())._clock(shared) is None  # no cost-aware factory: no in-step plan
    # no_spec requests keep in step where the clock runs (cost_aware.in_step_no_spec, on by default)
    plain_load = front._plain_load(clock)
    assert (plain_load is not None) == (clock is not None)
    if plain_load is not None:
        state.load = 1.0
        plain_load(4)  # their verifies teach the load the clock holds its turns by
        assert state.load == 4.0
        off = FrontConfig.model_validate({**settings, "cost_aware": {**settings["cost_aware"], "in_step_no_spec": False}})
        assert Orchestrator(off, GrpcConfig(), control_factory=control_factory(off))._plain_load(clock) is None
    if clock is not None:
        assert clock.max_wait_s == 0.25


def test_requests_without_a_draft_keep_in_step_with_plain_load_and_teach_it_each_verify():
    """With plain_load (cost_aware.in_step_no_spec, the default) no_spec requests join the clock: a
    no_spec request beside one that drafts with a 30 ms late draft verifies once per round of it (it
    waits for the other's draft at the VERIFY turn), where alone it would verify several times per
    such round; each of its verifies reports its forward's sessions to plain_load; output unchanged."""
    from tests.conftest import hf_greedy

    loads: list[int] = []
    clock = RoundClock(max_wait_s=2.0)
    out, order, model, prompts = _run_pair(clock, fast_spec=None, plain_load=loads.append)
    assert out == {k: hf_greedy(model, prompts[k], 24) for k in ("slow", "fast")}  # float32 greedy
    first, last = order.index("slow"), len(order) - 1 - order[::-1].index("slow")
    window = order[first:last + 1]  # while both run
    assert abs(window.count("fast") - window.count("slow")) <= 1, order
    assert clock.ticks > 0 and clock.timeouts == 0 and clock.members == set()
    # one report per verify of "fast" (its first round reuses the prefill: no forward, no report),
    # in-process each forward holds one session
    assert len(loads) == order.count("fast") - 1 and set(loads) == {1}, (loads, order)

    free, free_order, _, _ = _run_pair(RoundClock(max_wait_s=2.0), fast_spec=None)  # no plain_load: not in step
    first, last = free_order.index("fast"), len(free_order) - 1 - free_order[::-1].index("fast")
    window = free_order[first:last + 1]  # "fast" is done within a few of "slow"'s rounds
    assert free == out and window.count("fast") >= 2 * (window.count("slow") + 1), free_order
