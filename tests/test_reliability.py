"""benchmarks/reliability.py, short versions of each part on one tiny deployment secured as the harness's own
deployment is by default: TLS on every port (a throwaway CA, mutual TLS between the services), bearer tokens on
the front, its HTTP API on, Ray with 2 orchestrator actors; real subprocesses on loopback. Load (a share over
HTTPS; no failures; greedy = its solo target-only run, seeded sampled = the same request's solo run), soak
(aborts, cancels and short deadlines: only the statuses each plan allows, outputs equal to or prefixes of their
solo runs, target and draft sessions and cached KV back to 0 with none left to the idle reaper, RSS growth within
its bound), chaos (draft, target and an actor killed under load: nothing hangs, no wrong output, serves again, no
session or KV left after). The checks alone on made-up outcomes first; the chaos test runs last: it restarts
services.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import ssl
import sys
import urllib.error
import urllib.request
from argparse import Namespace
from pathlib import Path

import grpc
import pytest

from specdec.v1 import generation_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


def _load_reliability():
    spec = importlib.util.spec_from_file_location("reliability", ROOT / "benchmarks" / "reliability.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["reliability"] = module
    spec.loader.exec_module(module)
    return module


rel = _load_reliability()
IDLE_S = 10.0  # the deployment's session_idle_s: the chaos leak check waits for the reaper


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    dep = rel.LocalDeployment.start(tmp_path_factory.mktemp("reliability"),
                                    rel.parse_args(["load", "--idle-s", str(IDLE_S)]))
    yield dep
    dep.stop()


def run_part(argv: list[str], deployment):
    args = rel.parse_args(argv)
    return asyncio.run(rel.PARTS[args.part](args, deployment.endpoints, deployment))


def _out(rid, status, tokens, stop="", greedy=True, fallback_rounds=0, failovers=0):
    return rel.Outcome(rid, greedy, status, tokens, 0.0, 1.0, 1.0, 0.1, stop_reason=stop,
                       fallback_rounds=fallback_rounds, failovers=failovers)


# ----------------------------------------------------------------------------------------- the checks alone

def test_wrong_outputs_flags_greedy_and_sampled_outputs_unequal_to_their_solo_runs():
    plans = [rel.Plan(f"r{i}", [1, 2], 4) for i in range(4)]
    plans += [rel.Plan(f"s{i}", [1, 2], 4, temperature=0.8, seed=i % 2) for i in range(4)]
    refs = {plans[0].key: _out("g", "OK", [5, 6, 7, 8]), plans[4].key: _out("a", "OK", [9, 9, 1, 2], greedy=False),
            plans[5].key: _out("b", "OK", [3, 4, 5, 6], greedy=False)}
    assert len(refs) == 3  # one greedy key; the sampled keys differ by seed, not by request id
    outcomes = [_out("r0", "OK", [5, 6, 7, 8]), _out("r1", "OK", [5, 6, 9, 8]),
                _out("r2", "DEADLINE_EXCEEDED", [5, 6]), _out("r3", "OK", [5, 7], stop="aborted"),
                _out("s0", "OK", [9, 9, 1, 2], greedy=False), _out("s1", "OK", [9, 9, 1, 2], greedy=False),  # seed 1's
                _out("s2", "CANCELLED", [9, 9], greedy=False), _out("s3", "OK", [3, 4], stop="aborted", greedy=False)]
    assert rel.wrong_outputs(plans, outcomes, refs) == ["r1", "r3", "s1"]
    figures = rel.output_figures(plans, outcomes, refs)
    assert (figures["greedy_mismatches"], figures["sampled_mismatches"], figures["sampled_rerouted"]) == (2, 1, 0)
    outcomes[5] = _out("s1", "OK", [9, 9, 1, 2], greedy=False, fallback_rounds=2)  # rounds without the draft: rerouted
    figures = rel.output_figures(plans, outcomes, refs)
    assert (figures["greedy_mismatches"], figures["sampled_mismatches"], figures["sampled_rerouted"]) == (2, 0, 1)


def test_chaos_verdict_checks_sampled_outputs_and_names_the_rerouted():
    ref = _out("solo", "OK", [1, 2, 3], greedy=False, fallback_rounds=1)
    assert rel.chaos_verdict(_out("a", "OK", [1, 2, 3], greedy=False, fallback_rounds=1), ref) == "sampled_equal"
    assert rel.chaos_verdict(_out("b", "OK", [1, 2, 4], greedy=False, fallback_rounds=1), ref) == "sampled_different"
    assert rel.chaos_verdict(_out("c", "OK", [1, 2, 4], greedy=False, fallback_rounds=3), ref) == "sampled_rerouted"
    assert rel.chaos_verdict(_out("d", "OK", [1, 2, 4], greedy=False, fallback_rounds=1, failovers=1), ref) == "sampled_rerouted"
    assert rel.chaos_verdict(_out("e", "OK", [1, 2, 4], fallback_rounds=3), ref) == "greedy_different"  # no excuse for greedy
    assert rel.chaos_verdict(_out("f", "UNAVAILABLE", [1]), ref) == "UNAVAILABLE"
    assert "sampled_rerouted" not in rel.CHAOS_ALLOWED["none"] and "UNAVAILABLE" not in rel.CHAOS_ALLOWED["actor"]


def test_a_request_over_several_windows_is_counted_under_one_and_may_be_what_any_allows():
    windows = [rel.Disruption("draft", 1.0, 2.0, 0.5), rel.Disruption("target", 3.0, 4.0, 0.5)]
    span = lambda start, end: rel.Outcome("r", False, "OK", [1], start, end)  # noqa: E731
    assert rel.overlapped(span(1.5, 3.5), windows) == ("target", {"greedy_equal", "sampled_equal", "UNAVAILABLE",
                                                                  "sampled_rerouted"})
    assert rel.overlapped(span(2.5, 3.5), windows) == ("target", {"greedy_equal", "sampled_equal", "UNAVAILABLE"})
    assert rel.overlapped(span(1.5, 1.8), windows) == ("draft", {"greedy_equal", "sampled_equal", "sampled_rerouted"})
    assert rel.overlapped(span(2.2, 2.8), windows) == ("none", {"greedy_equal", "sampled_equal"})


def test_soak_statuses_must_be_what_each_plan_allows():
    plans = [rel.Plan("plain", [1], 4), rel.Plan("rpc", [1], 4, abort="rpc"), rel.Plan("cancel", [1], 4, abort="cancel"),
             rel.Plan("short", [1], 4, deadline_s=0.3)]
    assert rel.allowed_statuses(plans[3], deadline_s=120.0) == {"OK", "DEADLINE_EXCEEDED"}
    ended = [_out("plain", "OK", [1]), _out("rpc", "OK", [1], stop="aborted"), _out("cancel", "CANCELLED", []),
             _out("short", "OK", [1, 2, 3, 4])]
    assert rel.unexpected_statuses(plans, ended, deadline_s=120.0) == {}
    ended = [_out("plain", "CANCELLED", []), _out("rpc", "UNAVAILABLE", []), _out("cancel", "OK", [1], stop="aborted"),
             _out("short", "HUNG", [])]
    assert rel.unexpected_statuses(plans, ended, 120.0) == {"plain": "CANCELLED", "rpc": "UNAVAILABLE",
                                                            "cancel": "aborted", "short": "HUNG"}


def test_soak_verdict_fails_on_rss_growth_over_the_bound_and_on_a_reaped_session():
    args = Namespace(requests=2, concurrency=1, abort_rate=0.0, deadline_rate=0.0, short_deadline_s=0.5,
                     deadline_s=120.0, max_rss_growth_mib=32.0)
    plans = [rel.Plan("a", [1], 2), rel.Plan("b", [1], 2)]
    refs = {plans[0].key: _out("solo", "OK", [7, 8])}
    outcomes = [_out("a", "OK", [7, 8]), _out("b", "OK", [7, 8])]
    leaks = {"counts_baseline": {"target_sessions": 0}, "counts_end": {"target_sessions": 0}, "settle_s": 0.0,
             "reaped_sessions": 0}
    mib = 2**20

    def verdict(middle_mib, end_mib, reaped=0):
        rss = {"rss_baseline_bytes": {"draft": 100 * mib}, "rss_end_bytes": {"draft": end_mib * mib},
               "rss_samples": [{"t_s": 0.0, "draft": 100 * mib}, {"t_s": 5.0, "draft": middle_mib * mib},
                               {"t_s": 10.0, "draft": end_mib * mib}]}
        return rel.soak_figures(args, plans, outcomes, refs, {**leaks, "reaped_sessions": reaped}, rss)

    warm = verdict(middle_mib=190, end_mib=200)  # +100 MiB in all, +10 MiB in the second half: caches warming
    assert warm["ok"] is True and warm["rss_growth_second_half_bytes"] == {"draft": 10 * mib}
    leak = verdict(middle_mib=150, end_mib=200)  # +50 MiB in the second half
    assert leak["ok"] is False and leak["rss_over_bound_bytes"] == {"draft": 50 * mib}
    assert leak["checks"]["rss_growth_within_bound"] is False and leak["checks"]["statuses_as_planned"] is True
    assert verdict(190, 200, reaped=1)["ok"] is False


# ----------------------------------------------------------------------------------------- the deployment

def test_the_own_deployment_runs_tls_tokens_http_and_ray(deployment):
    ep = deployment.endpoints
    request = generation_pb2.GenerateRequest(prompt_ids=[1, 2, 3], max_new_tokens=2)
    with grpc.insecure_channel(ep.front) as channel, pytest.raises(grpc.RpcError) as plaintext:
        list(generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=10))
    assert plaintext.value.code() == grpc.StatusCode.UNAVAILABLE  # TLS only
    with grpc.secure_channel(ep.front, ep.credentials) as channel, pytest.raises(grpc.RpcError) as no_token:
        list(generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=10))
    assert no_token.value.code() == grpc.StatusCode.UNAUTHENTICATED
    without_cert = grpc.ssl_channel_credentials(deployment.pki["ca"].read_bytes())
    with grpc.secure_channel(ep.target, without_cert) as channel, pytest.raises(grpc.RpcError) as mutual:
        target_pb2_grpc.TargetServiceStub(channel).Info(target_pb2.InfoRequest(), timeout=10)
    assert mutual.value.code() == grpc.StatusCode.UNAVAILABLE  # the target wants a client certificate
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
    post = urllib.request.Request(f"https://{ep.http}/v1/completions", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as http:
        urllib.request.urlopen(post, timeout=10, context=ep.ssl_context)
    assert http.value.code == 401
    with pytest.raises(urllib.error.URLError) as untrusted:  # HTTPS from a client that does not trust the CA
        urllib.request.urlopen(post, timeout=10, context=ssl.create_default_context())
    assert isinstance(untrusted.value.reason, ssl.SSLCertVerificationError), untrusted.value
    assert len(deployment.actor_pids()) == 2 and ep.token != ep.http_token


def test_seeded_solo_runs_repeat_and_differ_by_seed(deployment):
    """The sampled check is not vacuous: a seeded request repeats alone, and another seed changes its tokens."""
    ep = deployment.endpoints

    async def solo_runs():
        client = rel.Client(ep)
        try:
            plans = [rel.Plan(f"seeded-{i}", [5, 17, 42, 9], 24, temperature=0.8, seed=i % 2) for i in range(3)]
            return [(await client.references([p]))[p.key] for p in plans]
        finally:
            await client.close()

    first, other_seed, again = asyncio.run(solo_runs())
    assert len(first.tokens) > 1 and first.tokens == again.tokens and first.tokens != other_seed.tokens


def test_load_short_checks_greedy_and_seeded_sampled_outputs_over_grpc_and_https(deployment):
    figures = run_part(["load", "--clients", "12", "--max-new-tokens", "12", "--http-share", "0.4"], deployment)
    assert figures["greedy"] > 0 and figures["sampled"] > 0
    assert figures["via"]["http"] > 0 and figures["via"]["grpc"] > 0, figures["via"]
    assert figures["failures"] == 0, figures["statuses"]
    assert figures["statuses"] == {"OK": 12} and figures["statuses_http"] == {"OK": figures["via"]["http"]}
    assert figures["greedy_mismatches"] == 0 and figures["sampled_mismatches"] == 0, figures["mismatches"]
    assert 0 < figures["ttft_p50_s"] <= figures["latency_p50_s"] <= figures["latency_p95_s"]
    assert figures["ok"] is True


def test_cli_load_against_a_running_front_writes_json_and_markdown(deployment, tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_TOKEN", raising=False)
    ep, pki = deployment.endpoints, deployment.pki
    code = rel.main(["load", "--front", ep.front, "--target", ep.target, "--draft", ep.draft, "--http", ep.http,
                     "--tls-ca", str(pki["ca"]), "--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"]),
                     "--auth-token-file", str(deployment.token_file), "--clients", "4", "--http-share", "0.5",
                     "--max-new-tokens", "6", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "reliability_load.json").read_text())
    assert result["load"]["failures"] == 0 and result["meta"]["deployment"] == f"front {ep.front}"
    assert result["load"]["via"]["http"] > 0 and result["meta"]["cpu_model"]
    md = (tmp_path / "reliability_load.md").read_text()
    assert "| failures | 0 |" in md and "| latency_p95_s |" in md and result["meta"]["cpu_model"] in md


def test_soak_short_statuses_as_planned_sessions_and_kv_back_to_zero(deployment):
    figures = run_part(["soak", "--requests", "40", "--concurrency", "4", "--abort-rate", "0.3", "--deadline-rate", "0.3",
                        "--short-deadline-s", "0.4", "--abort-within-s", "0.3", "--max-new-tokens", "24",
                        "--settle-s", "5", "--rss-every-s", "1"], deployment)
    statuses = figures["statuses"]
    assert figures["hung"] == 0 and figures["unexpected_statuses"] == {}, statuses
    # the stops really happened: aborted by RPC (stop reason "aborted") or by the client, deadlines passed
    assert statuses.get("aborted", 0) + statuses.get("CANCELLED", 0) > 0, statuses
    assert statuses.get("DEADLINE_EXCEEDED", 0) > 0, statuses
    assert figures["sampled"] > 0 and figures["greedy_mismatches"] == figures["sampled_mismatches"] == 0, figures["mismatches"]
    end = figures["counts_end"]
    assert set(end) == {"target_sessions", "target_cached_tokens", "draft_streams", "draft_runtime_sessions",
                        "draft_cached_tokens"}
    assert not any(end.values()) and figures["reaped_sessions"] == 0, end
    assert set(figures["rss_growth_bytes"]) == {"front", "actors", "draft", "target"}
    assert figures["rss_baseline_bytes"]["actors"] > 0  # the actor workers were found and measured
    assert figures["rss_samples"] and set(figures["rss_growth_second_half_bytes"]) == set(figures["rss_growth_bytes"])
    assert figures["checks"]["rss_growth_within_bound"] is True, figures["rss_growth_second_half_bytes"]
    assert figures["ok"] is True


def test_chaos_short_nothing_hangs_outputs_checked_serves_again_no_leaks(deployment):
    figures = run_part(["chaos", "--clients", "4", "--max-new-tokens", "12", "--down-s", "0.5", "--settle-s", "2",
                        "--deadline-s", "20", "--leak-timeout-s", str(3 * IDLE_S)], deployment)
    assert [w["kind"] for w in figures["windows"]] == ["draft", "target", "actor"]
    table = figures["outcomes_by_window"]
    assert figures["hung"] == 0 and figures["wrong_outputs"] == 0, table
    assert figures["not_allowed"] == {}, table
    assert figures["sampled_checked"] > 0 and table.get("none", {}).get("sampled_equal", 0) > 0, table
    assert sum(table.get("draft", {}).values()) > 0, "no request ran while the draft was down"
    assert sum(table.get("actor", {}).values()) > 0, "no request ran while the actor was down"
    assert figures["max_latency_s"] < 20 + 10
    assert figures["recovery"]["serves_again"] is True, figures["recovery"]
    assert not any(figures["leaks_after"]["end"].values()), figures["leaks_after"]
    assert figures["ok"] is True
