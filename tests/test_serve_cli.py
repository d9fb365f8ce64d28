"""``specdec serve`` starts three services and prints one ready line each (and the front's
``http ready on`` line with ``--http-port``); ``specdec generate --server`` is a client of the front
whose greedy output equals in-process target-only decoding, and so is a plain HTTP POST to its
OpenAI-compatible API; bad input and an unreachable server end with a message and exit 2 (the CLI's typer app in
this process, ``cli_in_process``); SIGTERM stops everything."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from specdec.harness.tiny_pair import save_tiny_pair, write_config
from tests.conftest import cli_in_process

ROOT = Path(__file__).resolve().parents[1]  # the repository root
READY = re.compile(r"^(\S+) ready on (\S+:\d+)$")


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    pair = save_tiny_pair(root / "models")
    config = write_config(root / "serve.yaml", pair, front={"port": 0})
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "serve", "--config", str(config), "--no-ray",
                             "--http-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    lines: list[str] = []
    done = threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "all services ready" in line:
                done.set()
        done.set()

    threading.Thread(target=pump, daemon=True).start()
    done.wait(240)
    ready = dict(m.groups() for line in lines if (m := READY.match(line)))
    assert set(ready) == {"draft-service", "target-service", "generation-front", "http"}, lines
    yield pair, ready, proc, lines
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def test_generate_over_the_front_equals_target_only(served):
    pair, ready, _, _ = served
    remote = cli("generate", "--server", ready["generation-front"], "--raw", "--max-new-tokens", "16", "the quick brown fox")
    local = cli("generate", "--target", str(pair.target), "--dtype", "float32", "--raw", "--no-spec",
                "--max-new-tokens", "16", "--threads", "1", "the quick brown fox")
    assert remote.returncode == 0, remote.stderr
    assert local.returncode == 0, local.stderr
    assert remote.stdout == local.stdout and remote.stdout.strip()
    assert "acceptance rate" in remote.stderr and "mean accepted length" in remote.stderr
    body = json.dumps({"prompt": "the quick brown fox", "max_tokens": 16, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://{ready['http']}/v1/completions", body, {"Content-Type": "application/json"})
    completion = json.loads(urllib.request.urlopen(request, timeout=60).read())
    assert completion["choices"][0]["text"] == local.stdout.removesuffix("\n")


def test_bad_input_to_the_front_exits_2_naming_the_field(served):
    _, ready, _, _ = served
    bad_tree = cli_in_process("--server", ready["generation-front"], "--tree",
                              '{"gamma": 2, "topKSpec": [[1]], "topHead": [1, 1]}', "hi")
    assert bad_tree.returncode == 2 and "topKSpec" in bad_tree.stderr and "Traceback" not in bad_tree.stderr
    bad_temp = cli_in_process("--server", ready["generation-front"], "--temperature", "-1", "hi")
    assert bad_temp.returncode == 2 and "temperature" in bad_temp.stderr


def test_unreachable_server_exits_2():
    result = cli_in_process("--server", "127.0.0.1:9", "hi")
    assert result.returncode == 2 and "UNAVAILABLE" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("flag, needle", [(["--no-argmax-screen"], "--no-argmax-screen: an in-process option"),
                                          (["--draft-window", "0"], "--draft-window: an in-process option"),
                                          (["--pipeline"], "--pipeline: an in-process option"),
                                          (["--control", "fixed"], "--control fixed: an in-process option"),
                                          (["--control", "bogus"], "--control: expected cost-aware"),
                                          (["--max-context", "64"], "--max-context: an in-process option")])
def test_in_process_flags_with_server_exit_2(flag, needle):
    # refused before any connection (nothing listens on port 9: a connection attempt would fail with UNAVAILABLE)
    result = cli_in_process("--server", "127.0.0.1:9", *flag, "hi")
    assert result.returncode == 2 and needle in result.stderr and "UNAVAILABLE" not in result.stderr, result.stderr


def test_sigterm_stops_all_services(served):
    _, _, proc, _ = served
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    assert proc.wait(60) == 0
    assert time.monotonic() - started < 30
