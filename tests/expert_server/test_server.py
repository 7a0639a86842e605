"""The expert service's control plane: health, reflection, info, TLS, and the command line."""

import subprocess
import sys

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from expert_server.config import ServerConfig
from expert_server.server import SERVICE, ExpertServicer, build_server, set_serving
from services.dense.loader import open_checkpoint
from services.dense.moe.native import NativeExperts
from services.dense.moe.remote import RemoteConfig, RemoteExperts
from tandem.v1 import expert_pb2 as pb
from tandem.v1 import expert_pb2_grpc as pb_grpc
from tests.checkpoints import checkpoint
from tests.expert_server.servers import ROOT, in_process

pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native


def health_of(channel, service=SERVICE):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_is_not_serving_until_the_weights_are_loaded():
    cfg = ServerConfig(model=checkpoint("deepseek_v3"), listen="127.0.0.1:0")
    servicer = ExpertServicer(cfg, "deepseek_v3", 2)
    server, health, port = build_server(cfg, servicer)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        assert health_of(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.ExpertServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        set_serving(health, True)
        assert health_of(channel) == health_of(channel, "") == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()
        server.stop(None)


def test_info_and_reflection_describe_the_server():
    import tandem_native

    path = checkpoint("qwen3_moe")
    _, cfg = open_checkpoint(path)
    with in_process(path, "int4", layers=(0, 0)) as server:
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        info = pb_grpc.ExpertServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)
        assert list(info.layers) == [0] and info.format == "int4" and info.isa == tandem_native.active_isa()
        assert (info.hidden_size, info.num_experts, info.top_k) == (cfg.hidden_size, cfg.moe.num_experts, cfg.moe.top_k)
        assert info.memory_bytes == tandem_native.packed_bytes("int4", cfg.moe.num_experts, cfg.hidden_size,
                                                               cfg.moe.intermediate_size)
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answer = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in answer.list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health"} <= names
        channel.close()


def test_tls_inline_transport_gives_the_native_result(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    path = checkpoint("mixtral")
    ckpt, cfg = open_checkpoint(path)
    x, ids = torch.randn(3, cfg.hidden_size), torch.tensor([[0, 1], [2, 3], [1, 2]])
    w = torch.rand(3, 2)
    expected = NativeExperts(cfg, ckpt, "int8", threads=2).forward(0, x, ids, w)
    with in_process(path, "int8", tls_cert=cert, tls_key=key) as server:
        remote = RemoteExperts(cfg, RemoteConfig(addresses=(f"localhost:{server.port}",), transport="grpc",
                                                 tls_root=cert))
        assert torch.equal(remote.forward(0, x, ids, w), expected)
        remote.close()
        with pytest.raises(Exception, match="expert server"):
            RemoteExperts(cfg, RemoteConfig(addresses=(f"localhost:{server.port}",), transport="grpc",
                                            connect_timeout_s=2))  # plaintext against TLS: refused


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "expert_server", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.e2e
@pytest.mark.parametrize("args, message", [
    (["--model", "/nonexistent"], "/nonexistent"),
    (["--layers", "2-1"], "--layers"),
    (["--layers", "0-0"], "no MoE layer"),         # deepseek_v3's layer 0 is dense
    (["--layers", "0-9"], "past the model"),
    (["--layers", "1-2,3-3"], "needs --shard"),
    (["--layers", "1-2,3-3", "--shard", "2"], "--shard: 2"),
    (["--threads", "0"], "--threads"),
    (["--format", "fp8"], "--format"),
    (["--tls-cert", "/x.pem"], "--tls-key"),
    (["--spin-us", "-1"], "--spin-us"),
    (["--compute-port", "fast"], "--compute-port"),
])
def test_bad_command_line_is_a_clear_error(args, message):
    if "--model" not in args:
        args = ["--model", str(checkpoint("deepseek_v3")), *args]
    result = run_cli(*args, "--listen", "127.0.0.1:0")
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_refuses_to_load_more_than_the_memory_available(monkeypatch):
    from expert_server import app, store
    from services.common.checkpoint import Checkpoint
    from services.common.errors import ConfigError

    path = checkpoint("deepseek_v3")
    monkeypatch.setattr(store, "available_memory", lambda: 1000)
    ckpt = Checkpoint(path)
    _, cfg = open_checkpoint(path)
    with pytest.raises(ConfigError, match="only 0.00 GiB of memory is available"):
        app.announce(ServerConfig(model=path), ckpt, cfg)
