"""``specdec`` command line (typer + rich); user mistakes end with a one-line message and exit 2. Commands import
what they run inside their bodies, so --help starts fast."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from draft_service.cli import draft_server
from orchestrator.cli.launcher import serve as launch
from specdec.config import CONTROLS, ConfigError, DraftWindowConfig, FrontConfig, load_config
from specdec.process_entry import (AUTH_TOKEN_FILE_HELP, CONFIG_HELP, DEVICE_HELP, HEALTH_PORT_HELP, TLS_CA_HELP,
                                   TLS_CERT_HELP, TLS_KEY_HELP, device_option, tls_flags, tls_overrides)
from specdec.sampling import SamplingParams, SamplingParamsError
from specdec.stats import position_rates
from specdec.tree_spec import DEFAULT_SPEC, parse_tree_spec
from target_service.cli import target_server

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Tree speculative decoding (draft + target).")
err = Console(stderr=True)

DEMO_PROMPT = "Write a Python function that checks whether a string is a palindrome."


class UsageError(ValueError):
    """A bad command-line value; the message names the option."""


def fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False)  # a message's [text] is not markup
    raise typer.Exit(2)


def check_positive(**options) -> None:
    """Each option (name=value, None allowed) must be >= 1; raises UsageError naming it."""
    for name, value in options.items():
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")


def check_control(control: str) -> None:
    if control not in CONTROLS:
        raise UsageError(f"--control: expected {', '.join(CONTROLS)}, got {control!r}")


def check_run(dtype: str, draft_quant: str, control: str, device: str, draft_device: Optional[str],
              **positive) -> None:
    """The model flags of an in-process run (--device / --draft-device: bad name, no such GPU) and the options
    that must be >= 1; raises UsageError naming the first bad one."""
    from specdec.process_entry import check_device

    check_control(control)
    if dtype not in ("auto", "bfloat16", "float32", "float16"):
        raise UsageError(f"--dtype: expected auto, bfloat16, float32 or float16, got {dtype!r}")
    if draft_quant not in ("auto", "none", "int8"):
        raise UsageError(f"--draft-quant: expected auto, none or int8, got {draft_quant!r}")
    for flag, value in (("--device", device), ("--draft-device", draft_device)):
        if value is not None:
            try:
                check_device(value, flag)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
    check_positive(**positive)


def tree_option(tree: Optional[str], default=DEFAULT_SPEC):
    """``--tree``: inline JSON or a JSON file; TreeSpecError names the field."""
    return parse_tree_spec(tree) if tree is not None else default


_DEVICE_HELP = "The target's device: cpu, cuda or cuda:N (and the draft's, unless --draft-device)."
_DRAFT_DEVICE_HELP = "The draft's device: cpu, cuda or cuda:N (default: --device)."


_DRAFT_WINDOW_HELP = ("Tokens a draft session opens with: the first 32 plus the most recent (a long prompt costs the "
                      "draft a short prefill; output unchanged); 0 = the whole context; default: 256, as "
                      "front.draft_window.max_tokens (in-process only: with --server the front's config decides).")


def draft_window_option(value: Optional[int]) -> DraftWindowConfig | None:
    """``--draft-window``: None = service default, 0 = whole context, else that many tokens; raises UsageError."""
    if value is None:
        return FrontConfig().draft_window
    if value == 0:
        return None
    sink = DraftWindowConfig().sink_tokens
    if value <= sink:
        raise UsageError(f"--draft-window: must be 0 (whole context) or > {sink} (the sink tokens), got {value}")
    return DraftWindowConfig(max_tokens=value, sink_tokens=sink)


def sampling_params(temperature: float, top_p: float, top_k: int, seed: Optional[int]) -> SamplingParams:
    """Validated SamplingParams; a bad value raises UsageError naming its option (--top-p, ...)."""
    try:
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    except SamplingParamsError as exc:
        raise UsageError(f"--{exc.field.replace('_', '-')}: {exc.detail}") from None


def read_prompt(prompt: Optional[str], prompt_file: Optional[Path]) -> str:
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise UsageError(f"--prompt-file: no such file {prompt_file}")
        try:
            text = prompt_file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--prompt-file: cannot read {prompt_file}: {exc}") from None
    elif prompt == "-":
        text = sys.stdin.read()
    elif prompt is None:
        piped = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
        text = piped if piped.strip() else DEMO_PROMPT
    else:
        text = prompt
    if not text.strip():
        raise UsageError("prompt: empty prompt")
    return text


def stats_table(stats, speculate: bool, sampling: SamplingParams = SamplingParams(), cost: dict | None = None) -> Table:
    """The end-of-run table; cost: the cost model's snapshot (CostModel.snapshot) when cost-aware."""
    table = Table(title="speculation stats" if speculate else "target-only stats", show_header=False)
    rows = [("sampling", sampling.describe()), ("new tokens", f"{stats.new_tokens}"), ("rounds", f"{stats.rounds}")]
    if speculate:
        rows += [("acceptance rate", f"{stats.acceptance_rate:.3f}  ({stats.accepted_tokens}/{stats.proposed_tokens} "
                                     "draft tokens)"),
                 ("mean accepted length", f"{stats.mean_accepted_length:.2f} tokens/round")]
        proposed = list(getattr(stats, "position_proposed", ()))  # GenerationStats or FinalStats
        if proposed:  # '1: 0.82 (55), 2: ...': rate (rounds reaching it) of the first 8 positions
            rates = position_rates(proposed, list(stats.position_accepted))
            more = f", ... ({len(proposed) - 8} deeper)" if len(proposed) > 8 else ""
            rows.append(("acceptance by position", ", ".join(
                f"{d + 1}: {rate:.2f} ({p})" for d, (p, rate) in enumerate(zip(proposed[:8], rates))) + more))
    if speculate and (stats.pipeline_ahead_hits or stats.predraft_hits or stats.pipeline_ahead_misses):
        rows.append(("pipelining", f"{stats.pipeline_ahead_hits} ahead trees adopted, "
                                   f"{stats.predraft_hits} pre-drafted ones, {stats.pipeline_ahead_misses} discarded"))
    if speculate and cost is not None:
        rows += [("tree decisions", f"{stats.drafted_tokens} drafted nodes, {stats.proposed_tokens} verified, "
                                    f"{stats.cost_plain_rounds} rounds without the draft (did not pay)"),
                 ("context branches", f"{stats.context_accepted_tokens}/{stats.context_proposed_tokens} n-gram "
                                      "tokens accepted"),
                 ("expected vs accepted", f"{stats.expected_accepted_tokens:.1f} expected, "
                                          f"{stats.accepted_tokens} accepted"),
                 ("cost model", _cost_line(cost))]
    if speculate and stats.total_s > 0 and stats.verify_s > 0:  # 0: one round, or a front without the fields
        phases = [("first token", stats.ttft_ms / 1000), ("draft", stats.draft_s), ("verify", stats.verify_s)]
        rows.append(("time by phase", ", ".join(f"{name} {s:.2f} s ({s / stats.total_s:.0%})" for name, s in phases)
                     + f" of {stats.total_s:.2f} s"))
    rtts = {"draft": stats.draft_link_rtt_ms, "target": stats.target_link_rtt_ms}  # None / unset (0): in-process
    if any(rtts.values()):
        rows.append(("link round trips", ", ".join(f"{name} {ms:.1f} ms" for name, ms in rtts.items() if ms)))
    rows += [("TTFT", f"{stats.ttft_ms:.0f} ms"), ("throughput", f"{stats.tokens_per_s:.2f} tokens/s"),
             ("stop reason", str(stats.stop_reason))]
    for k, v in rows:
        table.add_row(k, v)
    return table


_CONTROL_HELP = ("Per-request control: cost-aware (each round's tree from measured costs and calibrated "
                 "acceptance, context n-gram branches, no draft when it does not pay) or fixed (the tree every "
                 "round).")


def _cost_line(cost: dict) -> str:
    verify = ", ".join(f"{n}: {ms:.0f}" for n, ms in cost["verify_ms"].items())
    draft = ", ".join(f"{p}: {ms:.0f}" for p, ms in cost["draft_step_ms"].items())
    return f"verify ms by rows {{{verify}}}; draft step ms by parents {{{draft}}} ({cost['source']})"


def check_remote_options(draft_window: Optional[int], argmax_screen: bool, pipeline: bool, control: str,
                         max_context: Optional[int]) -> None:
    """With --server the front decides these: raises UsageError naming the first in-process option given."""
    check_control(control)
    refused = [(draft_window is not None, "--draft-window", "a front's draft window is its front.draft_window"),
               (not argmax_screen, "--no-argmax-screen", "a front's target decides (models.argmax_screen)"),
               (pipeline, "--pipeline", "a front pipelines when its front.pipeline is on"),
               (control != "cost-aware", f"--control {control}",
                "a front's control is set by front.cost_aware.enabled"),
               (max_context is not None, "--max-context",
                "a front's limits are its own (front.max_prompt_tokens, the target's context)")]
    for given, option, why in refused:
        if given:
            raise UsageError(f"{option}: an in-process option; {why}")


@app.command()
def generate(
    prompt: Optional[str] = typer.Argument(None, help="Prompt text; '-' or piped stdin reads stdin; default: a demo prompt."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", "-f", help="Read the prompt from a file."),
    target: Optional[str] = typer.Option(None, help="Target model: transformers directory or .gguf file (default: Qwen2.5-Coder-1.5B-Instruct)."),
    draft: Optional[str] = typer.Option(None, help="Draft model: transformers directory or .gguf file (default: Qwen2.5-Coder-0.5B-Instruct)."),
    dtype: str = typer.Option("auto", help="auto (float32 on CPU, bfloat16 on GPU), bfloat16, float32 (exact greedy equality) or float16."),
    draft_quant: str = typer.Option("auto", help="auto (int8 on CPU), none or int8: a dynamic-int8 draft drafts cheaper; output unchanged."),
    device: str = typer.Option("cpu", help=_DEVICE_HELP),
    draft_device: Optional[str] = typer.Option(None, help=_DRAFT_DEVICE_HELP),
    tree: Optional[str] = typer.Option(None, help="TreeSpec as inline JSON or a JSON file (default: top-3 at the root, then a chain of 3)."),
    max_new_tokens: int = typer.Option(128, help="Maximum new tokens."),
    temperature: float = typer.Option(0.0, help="0 = greedy (output equals the target alone); > 0 samples, with exactly the target's distribution."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass in (0, 1]; 1 = off."),
    top_k: int = typer.Option(0, help="Sample among the k most likely tokens; 0 = off."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling (same seed, same output); default: random."),
    stop: list[str] = typer.Option([], help="Stop string (repeatable); output ends with the token that completes it."),
    no_spec: bool = typer.Option(False, "--no-spec", help="Target-only autoregressive decoding (baseline)."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    max_context: Optional[int] = typer.Option(None, help="Context limit in tokens (default: the target's)."),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: the CPUs usable by this process)."),
    control: str = typer.Option("cost-aware", help=_CONTROL_HELP),
    pipeline: bool = typer.Option(False, "--pipeline", help="Draft round r+1 from round r's likely outcome while the target verifies round r (output unchanged; in-process the two take turns, so it pays with the services)."),
    draft_window: Optional[int] = typer.Option(None, help=_DRAFT_WINDOW_HELP),
    argmax_screen: bool = typer.Option(True, help="Greedy rows of a float32 CPU target take their argmax from an int8 screen of the LM head (same tokens; ~1.2 GB more for the default target)."),
    server: Optional[str] = typer.Option(None, help="host:port of a generation front (specdec serve): run the request there instead of in-process (the request flags apply; model, dtype, draft-quant and thread flags are the server's, and the in-process options --pipeline, a --control other than cost-aware, --draft-window, --no-argmax-screen and --max-context are refused)."),
    tls_ca: Optional[str] = typer.Option(None, help="With --server: PEM CA bundle that verifies a TLS front."),
    auth_token_file: Optional[str] = typer.Option(None, help="With --server: bearer token file (first line); $SPECDEC_TOKEN takes precedence."),
) -> None:
    """Generate text with the target model, accelerated by the draft model."""
    from orchestrator.loop.controller import GenerationRequest
    from orchestrator.loop.embedded import build_pipeline, encode_prompt, set_threads
    from orchestrator.serving.runner import TextDeltas

    try:
        if server is not None:  # the remote run ends here, exiting 2 with a message on its own errors
            check_remote_options(draft_window, argmax_screen, pipeline, control, max_context)
            return _generate_remote(server, prompt, prompt_file, tree, max_new_tokens, temperature, top_p, top_k,
                                    seed, stop, no_spec, raw, tls_ca, auth_token_file)
        check_run(dtype, draft_quant, control, device, draft_device, max_new_tokens=max_new_tokens, threads=threads)
        sampling = sampling_params(temperature, top_p, top_k, seed)
        spec = tree_option(tree)
        window = draft_window_option(draft_window)
        text = read_prompt(prompt, prompt_file)
        set_threads(threads)
        pipe = build_pipeline(target, draft, dtype, device=device, speculate=not no_spec, max_context=max_context,
                              draft_quant=draft_quant, control=control, pipeline=pipeline, draft_window=window,
                              argmax_screen=argmax_screen, draft_device=draft_device)
        prompt_ids = encode_prompt(pipe.tokenizer, text, raw)
        request = GenerationRequest(prompt_ids, max_new_tokens, tuple(stop), None if no_spec else spec, sampling)
        deltas = TextDeltas(pipe.tokenizer)  # the committed tokens' text, as the front streams it
        result = pipe.engine.generate(request, on_tokens=lambda tokens: print(deltas.push(tokens), end="", flush=True))
    except ValueError as exc:  # UsageError, TreeSpecError, ModelError, ...: each names its option
        fail(str(exc))
    sys.stdout.write("\n")
    err.print(stats_table(result.stats, not no_spec, sampling, pipe.shared.cost.snapshot() if pipe.shared else None))


@app.command()
def bench(
    per_category: int = typer.Option(2, help="Questions per category."),
    offset: int = typer.Option(0, help="Skip the first N questions of each category (held-out runs)."),
    questions: Optional[Path] = typer.Option(None, help="A Spec-Bench question.jsonl (default: the built-in prompt set, 7 per category)."),
    max_new_tokens: int = typer.Option(64, help="New tokens per question."),
    target: Optional[str] = typer.Option(None, help="Target model: transformers directory or .gguf file (default: Qwen2.5-Coder-1.5B-Instruct)."),
    draft: Optional[str] = typer.Option(None, help="Draft model: transformers directory or .gguf file (default: Qwen2.5-Coder-0.5B-Instruct)."),
    tree: Optional[str] = typer.Option(None, help="TreeSpec (inline JSON or file; default: top-3 at the root, then a chain of 3)."),
    dtype: str = typer.Option("auto", help="Model dtype (auto, bfloat16, float32, float16)."),
    draft_quant: str = typer.Option("auto", help="auto (int8 on CPU), none or int8 draft."),
    device: str = typer.Option("cpu", help=_DEVICE_HELP),
    draft_device: Optional[str] = typer.Option(None, help=_DRAFT_DEVICE_HELP),
    out: Path = typer.Option(Path("bench_out"), help="Directory for results.json and results.md."),
    hf_assisted: bool = typer.Option(True, "--hf-assisted/--no-hf-assisted", help="Also run HF assisted generation (the draft as assistant_model)."),
    prompt_lookup: bool = typer.Option(True, "--prompt-lookup/--no-prompt-lookup", help="Also run HF prompt-lookup decoding (prompt_lookup_num_tokens=10, no draft)."),
    temperature: float = typer.Option(0.7, help="Temperature of the sampled speculative pass (acceptance under sampling); 0 = skip it."),
    top_p: float = typer.Option(1.0, help="top-p of the sampled pass."),
    top_k: int = typer.Option(0, help="top-k of the sampled pass (0 = off)."),
    seed: Optional[int] = typer.Option(0, help="Seed of the sampled pass (question i uses seed + i)."),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: the CPUs usable by this process)."),
    control: str = typer.Option("cost-aware", help=_CONTROL_HELP),
    draft_window: Optional[int] = typer.Option(None, help=_DRAFT_WINDOW_HELP),
    category: list[str] = typer.Option([], help="Only this category (repeatable; default: every category)."),
    argmax_screen: bool = typer.Option(True, help="Greedy rows of a float32 CPU target take their argmax from an int8 screen of the LM head (our engine's passes, speculative and plain; the HF methods run the model's own head)."),
    plain: bool = typer.Option(True, "--plain/--no-plain", help="Also run our engine without a draft (plain (ours)): spec / plain (ours) is then what speculation alone gains, apart from our forwards' own gain over transformers' generate."),
    repeats: int = typer.Option(1, help="Run every greedy method this many times per question (the next order of a balanced Latin square each pass) and record each method's median pass (odd values: for 2, the faster pass), so that no figure comes from a single disturbed pass on a noisy machine."),
) -> None:
    """Benchmark on one pair, side by side: target-only, our plain decoding, speculative, HF assisted
    generation and HF prompt-lookup decoding (greedy: TTFT, decode and end-to-end tokens/s, speedups),
    plus a sampled speculative pass (default temperature 0.7) for acceptance under sampling."""
    from orchestrator.measure.bench import run_bench

    try:
        check_run(dtype, draft_quant, control, device, draft_device, per_category=per_category,
                  max_new_tokens=max_new_tokens, threads=threads, repeats=repeats)
        if offset < 0:
            raise UsageError(f"--offset: must be >= 0, got {offset}")
        sampling = sampling_params(temperature, top_p, top_k, seed)
        run_bench(tree_option(tree), questions, per_category, max_new_tokens, dtype, draft_quant, out, hf_assisted,
                  threads, sampling, control, offset=offset, prompt_lookup=prompt_lookup, target=target, draft=draft,
                  draft_window=draft_window_option(draft_window), categories=tuple(category),
                  argmax_screen=argmax_screen, repeats=repeats, plain=plain, device=device, draft_device=draft_device)
    except ValueError as exc:  # UsageError, TreeSpecError, ModelError, ...: each names its option
        fail(str(exc))


app.command("draft-server")(draft_server)  # the same command as ``python -m draft_service``
app.command("target-server")(target_server)  # the same command as ``python -m target_service``


def _generate_remote(server, prompt, prompt_file, tree, max_new_tokens, temperature, top_p, top_k, seed, stop, no_spec, raw,
                     tls_ca=None, auth_token_file=None):
    from orchestrator.cli.remote import RemoteError, client_token, generate_remote

    check_positive(max_new_tokens=max_new_tokens)  # a ValueError naming its option: generate's to report
    sampling = sampling_params(temperature, top_p, top_k, seed)
    spec = tree_option(tree, None)
    text = read_prompt(prompt, prompt_file)
    try:
        stats = generate_remote(server, text, max_new_tokens=max_new_tokens, sampling=sampling, spec=spec,
                                no_spec=no_spec, raw=raw, stop=tuple(stop), tls_ca=tls_ca,
                                token=client_token(auth_token_file))
    except RemoteError as exc:
        fail(f"--server {server}: {exc}")
    sys.stdout.write("\n")
    err.print(stats_table(stats, not no_spec, sampling))


_HTTP_PORT_HELP = ("Also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) on this "
                   "port of front.host (0 = ephemeral); overrides front.http_port (default: off).")


@app.command()
def front(
    config: Optional[Path] = typer.Option(None, help=CONFIG_HELP),
    port: Optional[int] = typer.Option(None, help="Listen port (0 = ephemeral); overrides front.port."),
    host: Optional[str] = typer.Option(None, help="Listen address; overrides front.host."),
    target: Optional[str] = typer.Option(None, help="Target model directory, for the tokenizer; overrides models.target."),
    draft_address: Optional[str] = typer.Option(None, help="Draft service host:port; overrides front.draft_address."),
    target_address: Optional[str] = typer.Option(None, help="Target service host:port; overrides front.target_address."),
    ray_address: Optional[str] = typer.Option(None, help="Attach to this Ray cluster ('auto' inside one); default: start a local Ray."),
    no_ray: bool = typer.Option(False, "--no-ray", help="Run requests in this process instead of Ray actors."),
    http_port: Optional[int] = typer.Option(None, help=_HTTP_PORT_HELP),
    tls_cert: Optional[str] = typer.Option(None, help=TLS_CERT_HELP),
    tls_key: Optional[str] = typer.Option(None, help=TLS_KEY_HELP),
    tls_ca: Optional[str] = typer.Option(None, help=TLS_CA_HELP),
    auth_token_file: Optional[str] = typer.Option(None, help=AUTH_TOKEN_FILE_HELP),
    health_port: Optional[int] = typer.Option(None, help=HEALTH_PORT_HELP),
) -> None:
    """Serve the public GenerationService (orchestrator on Ray) until SIGTERM; with --http-port also
    the OpenAI-compatible HTTP API."""
    from orchestrator.serving.front import run

    overrides = {"front.port": port, "front.host": host, "models.target": target, "front.draft_address": draft_address,
                 "front.target_address": target_address, "front.use_ray": False if no_ray else None,
                 "front.ray_address": ray_address, "front.http_port": http_port,
                 "front.auth_token_file": auth_token_file, **tls_overrides(tls_cert, tls_key, tls_ca),
                 "grpc.health_port": health_port}
    raise typer.Exit(run(str(config) if config else None, overrides))


@app.command()
def serve(
    config: Optional[Path] = typer.Option(None, help=CONFIG_HELP),
    target: Optional[str] = typer.Option(None, help="Target model; overrides models.target."),
    draft: Optional[str] = typer.Option(None, help="Draft model; overrides models.draft."),
    dtype: Optional[str] = typer.Option(None, help="auto, float32, bfloat16 or float16; overrides models.dtype."),
    tp: Optional[int] = typer.Option(None, help="Tensor-parallel ranks of the target; overrides target.tp."),
    device: Optional[str] = typer.Option(None, help=DEVICE_HELP),
    draft_device: Optional[str] = typer.Option(None, help="The draft's device: cpu, cuda or cuda:N (default: the first of "
                                                          "--device when given); overrides draft.device."),
    no_ray: bool = typer.Option(False, "--no-ray", help="The front runs requests in its own process instead of Ray actors."),
    http_port: Optional[int] = typer.Option(None, help=_HTTP_PORT_HELP),
    tls_cert: Optional[str] = typer.Option(None, help=TLS_CERT_HELP),
    tls_key: Optional[str] = typer.Option(None, help=TLS_KEY_HELP),
    tls_ca: Optional[str] = typer.Option(None, help=TLS_CA_HELP),
    auth_token_file: Optional[str] = typer.Option(None, help=AUTH_TOKEN_FILE_HELP),
) -> None:
    """Start the draft service, the target service and the generation front on this machine.

    Prints one line per service (name and host:port) once it is ready, and ``http ready on HOST:PORT`` when the
    front serves HTTP too; SIGTERM or Ctrl-C stops all three. No --health-port (one server per pod)."""
    try:
        check_positive(tp=tp)
        target_devices = device_option(device)
        draft_device = draft_device or (target_devices[0] if isinstance(target_devices, list) else target_devices)
        cfg = load_config(config, {"target.tp": tp, "target.device": target_devices, "draft.device": draft_device,
                                   "front.http_port": http_port, "front.auth_token_file": auth_token_file,
                                   **tls_overrides(tls_cert, tls_key, tls_ca)})
        if cfg.grpc.health_port is not None:
            raise UsageError(f"grpc.health_port: {cfg.grpc.health_port} is set, but `specdec serve` runs three servers on "
                             "this host and they cannot share one health port; leave it unset here and pass --health-port "
                             "to each `specdec draft-server` / `target-server` / `front` instead")
    except (UsageError, ConfigError) as exc:
        fail(str(exc))
    raise typer.Exit(launch(str(config) if config else None, target, draft, dtype, tp=tp, no_ray=no_ray, device=device,
                            draft_device=draft_device,
                            grace_s=cfg.grpc.shutdown_grace_s, http_port=http_port,
                            http=cfg.front.http_port is not None, security_flags=tls_flags(tls_cert, tls_key, tls_ca),
                            auth_token_file=auth_token_file or None))


@app.command("eval")
def eval_(
    out: Path = typer.Option(..., help="Directory for report.json, report.md and the PNG figures."),
    questions: Optional[Path] = typer.Option(None, help="A Spec-Bench style question.jsonl (default: the built-in prompt set, 7 per category)."),
    per_category: int = typer.Option(2, help="Questions per category."),
    max_new_tokens: int = typer.Option(96, help="New tokens per question."),
    server: Optional[str] = typer.Option(None, help="host:port of a generation front (specdec serve): run there; the model, dtype and control flags are the server's."),
    service_pid: list[int] = typer.Option([], help="With --server: a local service process (draft, target, front) whose peak memory to report (repeatable)."),
    target: Optional[str] = typer.Option(None, help="Target model: transformers directory or .gguf file (default: Qwen2.5-Coder-1.5B-Instruct)."),
    draft: Optional[str] = typer.Option(None, help="Draft model: transformers directory or .gguf file (default: Qwen2.5-Coder-0.5B-Instruct)."),
    tree: Optional[str] = typer.Option(None, help="TreeSpec (inline JSON or file; default: top-3 at the root, then a chain of 3)."),
    dtype: str = typer.Option("auto", help="Model dtype (auto, bfloat16, float32, float16)."),
    draft_quant: str = typer.Option("auto", help="auto (int8 on CPU), none or int8 draft."),
    device: str = typer.Option("cpu", help=_DEVICE_HELP),
    draft_device: Optional[str] = typer.Option(None, help=_DRAFT_DEVICE_HELP),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: the CPUs usable by this process)."),
    control: str = typer.Option("cost-aware", help=_CONTROL_HELP),
) -> None:
    """Evaluation report: target-only vs speculation per question (greedy), SpeculativeReport overall and
    per slice (category, prompt length, output length, language), tables and figures."""
    from orchestrator.loop.embedded import set_threads
    from orchestrator.measure.eval_report import run_eval

    try:
        check_run(dtype, draft_quant, control, device, draft_device, per_category=per_category,
                  max_new_tokens=max_new_tokens, threads=threads)
        if service_pid and server is None:
            raise UsageError("--service-pid: only with --server (embedded runs measure this process)")
        spec = tree_option(tree)
        set_threads(threads)
        reports = run_eval(spec, questions, per_category, max_new_tokens, out, target=target, draft=draft, dtype=dtype,
                           draft_quant=draft_quant, control=control, server=server, service_pids=tuple(service_pid),
                           device=device, draft_device=draft_device)
    except ValueError as exc:  # UsageError, TreeSpecError, ModelError, QuestionsError
        fail(str(exc))
    overall = reports[0]
    err.print(f"overall: {overall.speedup:.2f}x speedup, acceptance {overall.acceptance_rate:.3f}, "
              f"outputs equal on {overall.output_equivalent_fraction:.0%}; report in {escape(str(out))}", highlight=False)


@app.command("trace-report")
def trace_report(
    spans_file: list[Path] = typer.Argument(..., help="OTLP JSON spans file(s): the Collector file exporter's format, or what "
                                                      "OTEL_TRACES_EXPORTER=otlp_json_file SPECDEC_TRACES_FILE=... writes."),
    out: Path = typer.Option(..., help="Directory for trace_report.json, trace_report.md and trace_report.png."),
) -> None:
    """Latency breakdown of speculation rounds from OpenTelemetry spans: per phase (draft compute and wire,
    verify queue, compute and wire, commit, control) mean / p50 / p95, shares, per request and overall."""
    from orchestrator.measure.trace_report import TraceFileError, write_trace_report

    try:
        report = write_trace_report(spans_file, out)
    except TraceFileError as exc:
        fail(str(exc))
    shares = ", ".join(f"{p} {s['share']:.0%}" for p, s in report["overall"].items())
    err.print(f"{report['requests_count']} requests, {report['rounds_count']} rounds: {shares}; report in {escape(str(out))}",
              highlight=False)


@app.command("profile-draft")
def profile_draft(
    candidate: list[str] = typer.Option(..., help="A draft to profile, PATH\\[@none|@int8] (PATH: model directory, .gguf file "
                                                  "or 'default'; repeatable), e.g. --candidate default@none --candidate default@int8."),
    out: Path = typer.Option(..., help="Directory for profile.json and profile.md."),
    target: Optional[str] = typer.Option(None, help="Target model: transformers directory or .gguf file (default: Qwen2.5-Coder-1.5B-Instruct)."),
    questions: Optional[Path] = typer.Option(None, help="A Spec-Bench style question.jsonl (default: the built-in prompt set)."),
    per_category: int = typer.Option(1, help="Questions per category."),
    max_new_tokens: int = typer.Option(64, help="New tokens per question."),
    draft_quant: str = typer.Option("none", help="Quantization of candidates given without @QUANT: none or int8."),
    tree: Optional[str] = typer.Option(None, help="TreeSpec (inline JSON or file; default: top-3 at the root, then a chain of 3)."),
    dtype: str = typer.Option("auto", help="Model dtype (auto, bfloat16, float32, float16)."),
    device: str = typer.Option("cpu", help=_DEVICE_HELP),
    draft_device: Optional[str] = typer.Option(None, help=_DRAFT_DEVICE_HELP),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: the CPUs usable by this process)."),
    control: str = typer.Option("cost-aware", help=_CONTROL_HELP),
) -> None:
    """DraftProfile of each candidate draft against the target: parameters, the draft's own tokens/s,
    acceptance rate, tokenizer compatibility (with the reason when not) and the end-to-end speedup."""
    from orchestrator.measure.draft_profile import parse_candidate, run_profile
    from orchestrator.loop.embedded import set_threads

    try:
        if draft_quant == "auto":
            raise UsageError("--draft-quant: none or int8 (each candidate is profiled as given)")
        check_run(dtype, draft_quant, control, device, draft_device, per_category=per_category,
                  max_new_tokens=max_new_tokens, threads=threads)
        candidates = [parse_candidate(c, draft_quant) for c in candidate]
        spec = tree_option(tree)
        set_threads(threads)
        profiles = run_profile(candidates, out, target=target, questions_path=questions, per_category=per_category,
                               max_new_tokens=max_new_tokens, dtype=dtype, control=control, spec=spec,
                               device=device, draft_device=draft_device)
    except ValueError as exc:  # UsageError, TreeSpecError, ModelError, QuestionsError
        fail(str(exc))
    for p in profiles:
        err.print(f"{p.name}: " + (f"{p.end_to_end_speedup:.2f}x, acceptance {p.acceptance_rate:.3f}" if p.compatible_tokenizer
                                   else f"incompatible ({p.tokenizer_reason})"), highlight=False, markup=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
