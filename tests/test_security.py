"""Transport security and authentication (specdec.security): TLS on every port, mutual TLS between
the services, bearer tokens on the public GenerationService, the plaintext health-only port for
kubelet's probes (grpc.health_port). Real draft, target and front processes
on loopback ports with tiny models; certificates made here with ``cryptography`` (a test CA, a
server/client certificate for 127.0.0.1 signed by it, and one signed by another CA).
"""

from __future__ import annotations

import logging
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.harness.pki import make_pki
from specdec.harness.servers import launch_service, stop_service, wait_address, wait_for_exit, wait_ready
from specdec.security import BearerAuth, is_loopback, token_accepted, warn_plaintext
from specdec.config import ConfigError, GrpcConfig, load_config
from specdec.v1 import generation_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.harness.tiny_pair import save_tiny_pair, write_config

TOKEN = "s3cret-token-for-tests"


def _make_pki(root):
    """{ca.pem, cert.pem, key.pem, other_...}: a CA, a certificate it signed for 127.0.0.1 (servers and clients
    both use it), and the same from an unrelated CA."""
    return {f"{label}{name}.pem": str(path) for label in ("", "other_")
            for name, path in make_pki(root, label).items()}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return _make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secure_stack(pki, tmp_path_factory):
    """Draft, target and front with TLS (mutual between the services) and a bearer token file."""
    root = tmp_path_factory.mktemp("secure")
    pair = save_tiny_pair(root / "models")
    tokens = root / "tokens.txt"
    tokens.write_text(f"other-token\n{TOKEN}\n")
    config = write_config(root / "serve.yaml", pair, front={"port": 0, "use_ray": False},
                          grpc={"tls_cert": pki["cert.pem"], "tls_key": pki["key.pem"], "tls_ca": pki["ca.pem"]})
    draft, target = launch_service("draft", config), launch_service("target", config)
    wait_ready(draft), wait_ready(target)
    front = wait_ready(launch_service("front", config, draft_address=draft.address, target_address=target.address,
                                      auth_token_file=str(tokens), no_ray=True))
    yield {"draft": draft, "target": target, "front": front}
    for service in (front, draft, target):
        stop_service(service)


def _credentials(pki, ca="ca.pem", cert=None):
    key = cert.replace("cert", "key") if cert else None
    read = lambda name: open(pki[name], "rb").read() if name else None  # noqa: E731
    return grpc.ssl_channel_credentials(root_certificates=read(ca), private_key=read(key), certificate_chain=read(cert))


def _generate(address, credentials, token=None, prompt_ids=(1, 2, 3, 4)):
    with grpc.secure_channel(address, credentials) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        metadata = [("authorization", f"Bearer {token}")] if token else None
        replies = list(stub.Generate(generation_pb2.GenerateRequest(prompt_ids=list(prompt_ids), max_new_tokens=6),
                                     timeout=60, metadata=metadata))
    return [t for r in replies for t in r.token_ids], replies[-1].stats


def test_tls_client_with_the_ca_and_token_generates(secure_stack, pki):
    tokens, stats = _generate(secure_stack["front"].address, _credentials(pki), TOKEN)
    assert len(tokens) == stats.new_tokens > 0  # the front reached draft and target over mutual TLS


def test_client_without_the_ca_cannot_connect(secure_stack, pki):
    with pytest.raises(grpc.RpcError) as err:
        _generate(secure_stack["front"].address, _credentials(pki, ca="other_ca.pem"), TOKEN)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails: the server is not trusted
    with grpc.insecure_channel(secure_stack["front"].address) as channel:  # plaintext to a TLS port
        with pytest.raises(grpc.RpcError) as err:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x"])
def test_missing_or_wrong_token_is_unauthenticated_and_health_stays_open(secure_stack, pki, token):
    with pytest.raises(grpc.RpcError) as err:
        _generate(secure_stack["front"].address, _credentials(pki), token)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.secure_channel(secure_stack["front"].address, _credentials(pki)) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_target_refuses_clients_without_a_certificate_from_the_ca(secure_stack, pki):
    address = secure_stack["target"].address
    for credentials in (_credentials(pki), _credentials(pki, cert="other_cert.pem")):  # none / wrong CA
        with grpc.secure_channel(address, credentials) as channel:
            with pytest.raises(grpc.RpcError) as err:
                target_pb2_grpc.TargetServiceStub(channel).Info(target_pb2.InfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(address, _credentials(pki, cert="cert.pem")) as channel:  # a certificate the CA signed
        info = target_pb2_grpc.TargetServiceStub(channel).Info(target_pb2.InfoRequest(), timeout=5)
    assert info.vocab_size > 0


def test_the_token_never_appears_in_logs(secure_stack, pki):
    _generate(secure_stack["front"].address, _credentials(pki), TOKEN)
    with pytest.raises(grpc.RpcError):
        _generate(secure_stack["front"].address, _credentials(pki), "wrong-token")
    for service in secure_stack.values():
        assert TOKEN not in service.stderr and TOKEN not in "\n".join(service.stdout_lines)
        assert "wrong-token" not in service.stderr


def test_token_check_and_loopback_rules(caplog):
    accepted = (b"alpha", b"beta")
    assert token_accepted(accepted, "Bearer beta") and token_accepted(accepted, "bearer alpha")
    assert not token_accepted(accepted, "Bearer gamma") and not token_accepted(accepted, "beta")
    assert not token_accepted(accepted, "Basic beta") and not token_accepted(accepted, "")
    assert not BearerAuth([]).tokens and BearerAuth(["a"]).tokens == (b"a",)
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("my-host")
    with caplog.at_level(logging.WARNING, logger="specdec.security"):
        warn_plaintext("target-service", "127.0.0.1", GrpcConfig())
        assert not caplog.records
        warn_plaintext("target-service", "0.0.0.0", GrpcConfig())
    assert "without TLS" in caplog.text


def test_generate_cli_over_tls_with_the_token_from_the_environment(secure_stack, pki, tmp_path):
    import os
    import subprocess
    import sys

    argv = [sys.executable, "-m", "orchestrator", "generate", "--server", secure_stack["front"].address,
            "--tls-ca", pki["ca.pem"], "--raw", "--max-new-tokens", "4", "hello world"]
    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_TOKEN"}
    ok = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**env, "SPECDEC_TOKEN": TOKEN})
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    from_file = subprocess.run([*argv[:-1], "--auth-token-file", str(token_file), argv[-1]], capture_output=True,
                               text=True, timeout=120, env=env)
    assert from_file.returncode == 0, from_file.stderr


def _check(address, service="", credentials=None):
    """Health/Check status of ``service`` at ``address`` (plaintext unless ``credentials``)."""
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_port_serves_plaintext_health_alone_and_follows_the_drain(pki, tmp_path):
    """A target with mutual TLS and --health-port 0: kubelet-style plaintext probes get the service's
    statuses on the health port (SERVING, then NOT_SERVING while it drains); nothing else is there."""
    pair = save_tiny_pair(tmp_path / "models")
    config = write_config(tmp_path / "serve.yaml", pair, grpc={
        "tls_cert": pki["cert.pem"], "tls_key": pki["key.pem"], "tls_ca": pki["ca.pem"], "shutdown_grace_s": 3.0})
    target = wait_ready(launch_service("target", config, health_port=0))
    try:
        health_address = wait_address(target, "health")
        assert health_address != target.address
        assert _check(health_address) == _check(health_address, "specdec.v1.TargetService") \
            == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(target.address) as channel, pytest.raises(grpc.RpcError) as err:  # the TLS port
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(health_address) as channel, pytest.raises(grpc.RpcError) as err:
            target_pb2_grpc.TargetServiceStub(channel).Info(target_pb2.InfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED  # the service itself is not on the health port
        # A watch on the TLS port stays in flight, so the drain lasts shutdown_grace_s: probes meanwhile.
        with grpc.secure_channel(target.address, _credentials(pki, cert="cert.pem")) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            target.proc.send_signal(signal.SIGTERM)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING  # the drain began
            assert _check(health_address) == _check(health_address, "specdec.v1.TargetService") \
                == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
        code, _ = wait_for_exit(target, 30)
        assert code == 0
        with pytest.raises(grpc.RpcError) as err:  # the health port closed with the service
            _check(health_address)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stop_service(target)


def test_health_port_is_validated_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"grpc.health_port: 50062 is already target.port"):
        load_config(None, {"grpc.health_port": 50062})
    with pytest.raises(ConfigError, match=r"grpc.health_port: 9464 is already front.metrics_port"):
        load_config(None, {"grpc.health_port": 9464, "front.metrics_port": 9464})
    with pytest.raises(ConfigError, match=r"grpc.health_port: Input should be less than or equal to 65535"):
        load_config(None, {"grpc.health_port": 70000})
    assert load_config(None, {"grpc.health_port": 0}).grpc.health_port == 0  # ephemeral: never a clash
    assert load_config(None, {"grpc.health_port": 50070}).grpc.health_port == 50070


def test_serve_refuses_a_health_port(tmp_path):
    """``specdec serve`` runs three servers on one host: one grpc.health_port cannot serve them all."""
    import subprocess
    import sys

    config = write_config(tmp_path / "serve.yaml", grpc={"health_port": 50070})
    result = subprocess.run([sys.executable, "-m", "orchestrator", "serve", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "grpc.health_port" in result.stderr and "--health-port" in result.stderr
    assert "ready on" not in result.stdout  # refused before any server started


@pytest.mark.parametrize("kind", ["target", "draft"])
def test_a_service_with_a_certificate_but_no_ca_refuses_to_start(pki, tmp_path, kind):
    """Issue 57: a target given a certificate and key but no CA served any TLS client, with no warning. Now it
    exits before loading anything, naming grpc.tls_ca, unless grpc.tls_client_auth says otherwise."""
    pair = save_tiny_pair(tmp_path / "models")
    config = write_config(tmp_path / "serve.yaml", pair, grpc={"tls_cert": pki["cert.pem"], "tls_key": pki["key.pem"]})
    service = launch_service(kind, config)
    try:
        code, _ = wait_for_exit(service, 60)
        assert code == 2 and f"grpc.tls_ca: the {kind} service serves TLS" in service.stderr
    finally:
        stop_service(service)
    if kind == "draft":
        return  # the same check (specdec.security.check_client_auth); the allowed start is shown once
    allowed = write_config(tmp_path / "allowed.yaml", pair, grpc={
        "tls_cert": pki["cert.pem"], "tls_key": pki["key.pem"], "tls_client_auth": False})
    service = wait_ready(launch_service(kind, allowed))
    try:
        assert "tls_client_auth: false): any client that reaches the port" in service.stderr
    finally:
        stop_service(service)
