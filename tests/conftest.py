"""Shared helpers for the test suite: tiny random models, plain reference forwards, scripted workers.

Everything runs on the CPU in float32 with fixed seeds. The tiny models use a large
``initializer_range`` (0.5) so that their greedy continuations are diverse and argmax margins are
far above float32 noise (with the default 0.02 they loop on 2-3 tokens and near-ties abound).
"""

from __future__ import annotations

import asyncio
import copy
import os
import string
import traceback
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from draft_service.tree_builder import build_tree
from specdec.interfaces import DraftWorker
from specdec.sampling import GREEDY
from specdec.tree import DraftTree, additive_mask
from specdec.tree_spec import TreeSpec

torch.set_num_threads(1)  # tiny models: threads only add overhead on a 2-core machine

# pytest-xdist (`-n 2 --dist loadgroup` in pyproject.toml, tests/README.md). Each worker keeps its Ray clusters
# apart: ray.init() without an address attaches to the last cluster recorded under RAY_TMPDIR, so a worker's fronts
# must not find the other's. Kept short: Ray's socket paths must fit 107 bytes. A GCS starting beside the other
# worker's load may take longer than Ray's 30 s.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["RAY_TMPDIR"] = f"{os.environ.get('RAY_TMPDIR', '/tmp')}/ray-{os.environ['PYTEST_XDIST_WORKER']}"
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(items):
    """xdist groups: the real-pair tests on one worker (never two copies of the 1.5B target at once: ~8 GB each); a
    file's tests that use a module- or class-scoped fixture (a service stack, models) on one worker, so it starts
    once; every other test wherever a worker is free. Nothing to do in one process."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for item in items:
        shared = any(defs[-1].scope in ("module", "class", "package")
                     for defs in item._fixtureinfo.name2fixturedefs.values())
        if item.get_closest_marker("real_models"):
            item.add_marker(pytest.mark.xdist_group("real_pair"))
        elif shared:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """In-process runs (embedded engine, services) size torch's threads from the CPUs; the next test starts at 1 again,
    so float32 round-off does not depend on which tests ran before."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


VOCAB = 64
_KINDS = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}
_MODEL_CACHE: dict = {}


def tiny_model(kind: str = "qwen2", seed: int = 0, vocab: int = VOCAB, layers: int = 2, hidden: int = 32,
               init_std: float = 0.5):
    """A tiny random causal LM (float32, eval mode), identical for identical arguments.

    hidden 32, 4 attention heads, 2 kv heads (GQA), intermediate 64. Models are memoised: do not
    mutate them (use ``perturbed_copy``).
    """
    key = (kind, seed, vocab, layers, hidden, init_std)
    if key not in _MODEL_CACHE:
        config_cls, model_cls = _KINDS[kind]
        config = config_cls(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            tie_word_embeddings=False, initializer_range=init_std,
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )
        torch.manual_seed(seed)
        model = model_cls(config).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = None
        _MODEL_CACHE[key] = model
    return _MODEL_CACHE[key]


def perturbed_copy(model, seed: int, scale: float):
    """A draft model close to ``model``: every weight plus N(0, scale^2) noise (partial acceptance)."""
    key = ("perturbed", id(model), seed, scale)
    if key not in _MODEL_CACHE:
        draft = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * scale)
        _MODEL_CACHE[key] = draft
    return _MODEL_CACHE[key]


def random_prompt(seed: int, length: int | None = None, vocab: int = VOCAB) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    if length is None:
        length = int(torch.randint(1, 12, (1,), generator=gen))
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


# ----------------------------------------------------------------------------------------------
# Plain (non-speculative) references
# ----------------------------------------------------------------------------------------------

def _cache_kwarg(model) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def causal_logits(model, ids: list[int]) -> torch.Tensor:
    """Plain causal forward over ``ids`` from scratch: [len(ids), V] float32."""
    return model(torch.tensor([ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def prefill_kv(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KV of a fresh causal prefill of ``ids``: per layer (keys, values), each (1, H, len(ids), D)."""
    cache = DynamicCache(config=model.config)
    if ids:
        model(torch.tensor([ids]), use_cache=True, **{_cache_kwarg(model): cache})
    return cache_kv(cache)


def cache_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) of a DynamicCache; empty tensors for uninitialised layers."""
    out = []
    for layer in cache.layers:
        if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
            out.append((layer.keys.detach().clone(), layer.values.detach().clone()))
        else:
            out.append((torch.empty(0), torch.empty(0)))
    return out


def tree_mask(cached: int, parents: list[int]) -> torch.Tensor:
    """[1, 1, P, cached + P] additive float32 mask: every row sees the cache, its ancestors among the P
    rows and itself. Built here, not with ``specdec.tree.tree_attention_mask``, so the forward tests
    do not take the product's mask on trust."""
    p = len(parents)
    visible = torch.zeros(p, cached + p, dtype=torch.bool)
    visible[:, :cached] = True
    for row, parent in enumerate(parents):
        visible[row, cached + row] = True
        while parent >= 0:
            visible[row, cached + parent] = True
            parent = parents[parent]
    return additive_mask(visible, torch.float32)


def assert_kv_equal(actual, expected, atol: float = 3e-5, rtol: float = 1e-5, what: str = "cache") -> None:
    """Compare per-layer KV lists (lengths included).

    rtol: the tiny models' KV entries reach ~10 in magnitude, where float32 round-off of a different
    but equivalent computation is ~1e-5 (atol: an unmasked decode step against a masked prefill, other
    kernels, reached 1.2e-5 on an entry near 0); a wrong slot differs by O(1).
    """
    assert len(actual) == len(expected), f"{what}: {len(actual)} layers != {len(expected)}"
    for layer, ((ka, va), (ke, ve)) in enumerate(zip(actual, expected)):
        if ke.numel() == 0:
            assert ka.numel() == 0, f"{what}: layer {layer} should be empty, has {tuple(ka.shape)}"
            continue
        assert ka.shape == ke.shape, f"{what}: layer {layer} keys {tuple(ka.shape)} != {tuple(ke.shape)}"
        assert va.shape == ve.shape, f"{what}: layer {layer} values {tuple(va.shape)} != {tuple(ve.shape)}"
        torch.testing.assert_close(ka, ke, atol=atol, rtol=rtol, msg=lambda m: f"{what}: layer {layer} keys: {m}")
        torch.testing.assert_close(va, ve, atol=atol, rtol=rtol, msg=lambda m: f"{what}: layer {layer} values: {m}")


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int, eos_token_id=None, **kwargs) -> list[int]:
    """The target model alone: transformers ``generate`` greedy; returns the new tokens only.

    With ``eos_token_id=None`` exactly ``n`` tokens are produced (min_new_tokens = n).
    """
    ids = torch.tensor([prompt])
    extra = dict(min_new_tokens=n) if eos_token_id is None else {}
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
        eos_token_id=eos_token_id, pad_token_id=0, **extra, **kwargs,
    )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def qwen():
    return tiny_model("qwen2", seed=0)


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama", seed=1)


# ----------------------------------------------------------------------------------------------
# Char-level decoding for stop strings: id i <-> CHARS[i]
# ----------------------------------------------------------------------------------------------

CHARS = string.ascii_letters + string.digits + "#@"  # 64 distinct single characters
assert len(CHARS) == VOCAB


def char_decode(ids) -> str:
    return "".join(CHARS[i] for i in ids)


# ----------------------------------------------------------------------------------------------
# Scripted drafts (DraftWorker protocol of specdec.interfaces)
# ----------------------------------------------------------------------------------------------

def path_tokens(tokens, parents, node: int) -> list[int]:
    """Tokens from the root (exclusive) down to ``node`` (inclusive); [] for the root (-1)."""
    out = []
    while node != -1:
        out.append(tokens[node])
        node = parents[node]
    return out[::-1]


def logprob_row(top: list[int], vocab: int, gen: torch.Generator, bottom: list[int] = ()) -> torch.Tensor:
    """A [V] log-prob row whose top-len(top) tokens are ``top`` in that order, ``bottom`` ranked last.

    All other tokens get distinct random values in between (no ties, so top-k is unambiguous).
    """
    scores = torch.rand(vocab, generator=gen)  # (V,) in [0, 1)
    for rank, token in enumerate(top):
        scores[token] = 10.0 - rank
    for rank, token in enumerate(bottom):
        scores[token] = -10.0 - rank
    return torch.log_softmax(scores, dim=-1)


@dataclass
class Round:
    tree: DraftTree | None  # None when the engine did not call propose (no budget for a tree)
    max_depth: int | None
    tokens: list[int]  # committed this round
    accepted: list[int]  # accepted node indices committed this round


class RoundLog:
    """Per-round record of a draft worker's propose/commit calls."""

    def __init__(self):
        self.rounds: list[Round] = []
        self._tree = None
        self._max_depth = None

    def proposed(self, tree, max_depth):
        assert self._tree is None, "two proposes without a commit"
        self._tree, self._max_depth = tree, max_depth

    def committed(self, tokens, accepted):
        self.rounds.append(Round(self._tree, self._max_depth, list(tokens), list(accepted)))
        self._tree = self._max_depth = None


class RecordingDraft(DraftWorker):
    """Wraps a DraftWorker and logs its rounds; ``check_after_commit(inner, session_id)`` optional."""

    def __init__(self, inner, check_after_commit=None):
        self.inner = inner
        self.check = check_after_commit
        self.log = RoundLog()

    def start(self, session_id, prompt_ids, sampling=GREEDY):
        self.inner.start(session_id, prompt_ids, sampling)

    def propose(self, session_id, spec, max_depth):
        tree = self.inner.propose(session_id, spec, max_depth)
        self.log.proposed(tree, max_depth)
        return tree

    def commit(self, session_id, tokens, accepted_nodes):
        self.log.committed(tokens, accepted_nodes)
        self.inner.commit(session_id, tokens, accepted_nodes)
        if self.check:
            self.check(self.inner, session_id)

    def release(self, session_id):
        self.inner.release(session_id)


class SlowPropose:
    """An async in-process draft worker (orchestrator.loop.controller.sync_worker over a DraftRuntime of
    ``model``) whose proposes take ``delay_s`` seconds more: every one, or only the ``only``-th
    (1-based). ``proposes`` counts them. A draft whose replies queue behind other sessions' work,
    or miss a deadline."""

    def __init__(self, model, delay_s: float, only: int | None = None):
        from draft_service.runtime import DraftRuntime  # noqa: PLC0415
        from orchestrator.loop.controller import sync_worker  # noqa: PLC0415

        self.inner = sync_worker(DraftRuntime(model))
        self.delay_s, self.only, self.proposes = delay_s, only, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def propose(self, session_id, spec, max_depth):
        self.proposes += 1
        if self.only is None or self.proposes == self.only:
            await asyncio.sleep(self.delay_s)
        return await self.inner.propose(session_id, spec, max_depth)


class OracleDraft(DraftWorker):
    """A draft that knows the target's greedy continuation and agrees with it for exactly ``agree``
    tokens per round, then proposes only wrong tokens (DraftWorker protocol).

    ``reference``: the target's greedy continuation of ``prompt`` (long enough to cover every round).
    Along the reference path the child with the reference token is the top-1 with a high
    probability (so it is the highest path-probability node at its depth and gets expanded); at
    depth ``agree`` the reference token is ranked last, so it is never among the children.
    ``ignore_max_depth``: build the full spec depth whatever the engine allows (for stop tests).
    Records every round in ``rounds`` (see RoundLog).
    """

    def __init__(self, prompt, reference, agree: int, vocab: int = VOCAB, seed: int = 0, ignore_max_depth=False):
        self.prompt = list(prompt)
        self.reference = list(reference)
        self.agree = agree
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(seed)
        self.ignore_max_depth = ignore_max_depth
        self.tokens: list[int] = []
        self.log = RoundLog()
        self.released = False

    def start(self, session_id, prompt_ids, sampling=GREEDY):
        assert list(prompt_ids) == self.prompt and sampling.greedy
        self.tokens = list(prompt_ids)

    def _expand(self, nodes, tokens, parents):
        done = len(self.tokens) - len(self.prompt)
        assert self.tokens[len(self.prompt):] == self.reference[:done], "committed tokens left the greedy path"
        want = self.reference[done:]
        rows = []
        for node in nodes:
            path = path_tokens(tokens, parents, node)
            d = len(path)
            on_ref = path == want[:d]
            if on_ref and d < self.agree:
                rows.append(logprob_row([want[d]], self.vocab, self.gen))
            elif on_ref:
                rows.append(logprob_row([], self.vocab, self.gen, bottom=[want[d]]))
            else:
                rows.append(logprob_row([], self.vocab, self.gen))
        return torch.stack(rows)  # (P, V)

    def propose(self, session_id, spec: TreeSpec, max_depth: int) -> DraftTree:
        depth = None if self.ignore_max_depth else max_depth
        tree = build_tree(spec, self._expand, max_depth=depth, vocab_size=self.vocab)
        self.log.proposed(tree, max_depth)
        return tree

    def commit(self, session_id, tokens, accepted_nodes):
        self.log.committed(tokens, accepted_nodes)
        self.tokens.extend(tokens)

    def release(self, session_id):
        self.released = True


class RecordingTarget:
    """Wraps a TargetRuntime; records the committed tokens and the cache state at release.

    ``check_after_commit(runtime, session_id, committed)`` (optional) runs after each commit.
    """

    def __init__(self, runtime, check_after_commit=None):
        self.runtime = runtime
        self.check = check_after_commit
        self.committed: list[int] = []
        self.final_cache_len = None  # cache slots held just before release
        self.final_session_cache_len = None
        self.verify_results = []

    def start(self, session_id, prompt_ids, sampling=GREEDY):
        self.committed = list(prompt_ids)
        self.runtime.start(session_id, prompt_ids, sampling)

    def verify(self, session_id, tree):
        result = self.runtime.verify(session_id, tree)
        self.verify_results.append(result)
        return result

    def commit(self, session_id, num_tokens):
        self.committed.extend(self.verify_results[-1].tokens[:num_tokens])
        self.runtime.commit(session_id, num_tokens)
        if self.check:
            self.check(self.runtime, session_id, self.committed)

    def release(self, session_id):
        s = self.runtime.sessions.get(session_id)
        if s is not None:
            self.final_cache_len = s.cache.get_seq_length()
            self.final_session_cache_len = s.cache_len
        self.runtime.release(session_id)


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------

def chi2_pvalue(counts: dict, expected_probs: dict, n: int) -> float:
    """Pearson chi-square p-value of observed counts against expected probabilities.

    Bins with expected count < 5 are merged into one (itself merged into the smallest bin if still
    under 5). Fails if an outcome of probability 0 was observed.
    """
    for outcome, count in counts.items():
        assert count == 0 or expected_probs.get(outcome, 0) > 0, f"observed an impossible outcome {outcome}"
    obs, exp, rest_obs, rest_exp = [], [], 0, 0.0
    for outcome, prob in expected_probs.items():
        if prob * n >= 5:
            obs.append(counts.get(outcome, 0))
            exp.append(prob * n)
        else:
            rest_obs += counts.get(outcome, 0)
            rest_exp += prob * n
    if rest_exp >= 5 or (rest_exp > 0 and not exp):
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif rest_exp > 0:
        smallest = int(np.argmin(exp))
        obs[smallest] += rest_obs
        exp[smallest] += rest_exp
    exp = np.array(exp) * (sum(obs) / sum(exp))  # float round-off of the expected total
    return float(stats.chisquare(obs, exp).pvalue) if len(obs) > 1 else 1.0


CUDA_CALLS = ("mem_get_info", "get_device_properties", "set_device", "current_device", "synchronize", "init",
              "memory_allocated", "empty_cache")


def forbid_cuda(monkeypatch) -> None:
    """Pretend CUDA is there (is_available True, 4 devices) but make every call that would open a context raise."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for name in CUDA_CALLS:
        def refuse(*args, _name=name, **kwargs):
            raise AssertionError(f"torch.cuda.{_name} called in the coordinator")
        monkeypatch.setattr(torch.cuda, name, refuse)


def cli_in_process(*args, stdin: str | None = None, command: str = "generate") -> SimpleNamespace:
    """``specdec <command> *args`` through the CLI's typer app in this process (no interpreter start: seconds of
    imports each): (returncode, stdout, stderr); an unexpected exception is exit 1 with its traceback in stderr."""
    from typer.testing import CliRunner

    from orchestrator.cli.main import app

    result = CliRunner().invoke(app, [command, *args], input=stdin)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=stderr)
