"""Compute's grpc++ server on its own port: named by GetInfo, the same answers as the grpcio server's
Compute, the same spans, and its part in a drain. Bad calls are in test_robustness.py (both servers).
T tokens, D hidden size, K experts per token.
"""

import functools

import grpc
import numpy as np
import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from expert_server import tracing
from expert_server.config import ServerConfig
from services.common import telemetry
from services.common.errors import ConfigError, ExpertBackendError
from services.common.grpc_defaults import parse_port
from services.dense.loader import open_checkpoint
from services.dense.moe.remote import RemoteConfig, RemoteExperts
from services.dense.moe.transport import NativeInlineTransport, native_grpc
from tandem.v1 import expert_pb2 as pb
from tandem.v1 import expert_pb2_grpc as pb_grpc
from tests.checkpoints import checkpoint
from tests.expert_server.servers import in_process
from tests.waiting import wait_for

pytest.importorskip("tandem_native")
pytestmark = [pytest.mark.native,
              pytest.mark.skipif(not native_grpc(), reason="tandem_grpc not built (grpc++ is not installed)")]


@pytest.fixture(scope="module")
def model():
    path = checkpoint("qwen3_moe")
    _, cfg = open_checkpoint(path)
    return path, cfg, [i for i in range(cfg.num_layers) if cfg.is_moe(i)]


@pytest.fixture(scope="module")
def server(model):
    with in_process(model[0], "int8") as running:
        yield running


def info_of(port: int) -> pb.GetInfoResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return pb_grpc.ExpertServiceStub(channel).GetInfo(pb.GetInfoRequest(), timeout=10)


def inputs(cfg, tokens, dtype=torch.float32, seed=0):
    """x [T, D], ids [T, K], weights [T, K] of a valid call."""
    g = torch.Generator().manual_seed(seed)
    k = cfg.moe.top_k
    ids = torch.stack([torch.randperm(cfg.moe.num_experts, generator=g)[:k] for _ in range(tokens)])
    return torch.randn(tokens, cfg.hidden_size, generator=g).to(dtype), ids, torch.rand(tokens, k, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_getinfo_names_the_port_and_it_answers_as_the_grpcio_server_does(server, model, dtype):
    _, cfg, moe = model
    port = info_of(server.port).compute_port
    assert port not in (0, server.port) and port == server.servicer.compute.port
    x, ids, w = inputs(cfg, 5, dtype)
    native, grpcio = (NativeInlineTransport(f"127.0.0.1:{p}", 30.0) for p in (port, server.port))
    for layer in moe:
        out, compute_s = native.wait(native.submit(layer, x, ids, w))
        expected, _ = grpcio.wait(grpcio.submit(layer, x, ids, w))
        assert out.dtype == dtype and torch.equal(out, expected) and compute_s > 0
    native.close(), grpcio.close()


def test_the_grpc_client_goes_to_the_compute_port_unless_it_is_off(model):
    path, cfg, moe = model
    x, ids, w = inputs(cfg, 3)
    outs = []
    for compute_port in (0, None):
        with in_process(path, "int8", compute_port=compute_port) as server:
            remote = RemoteExperts(cfg, RemoteConfig(addresses=(f"127.0.0.1:{server.port}",), transport="grpc",
                                                     grpc_client="native"))
            outs.append(remote.forward(moe[-1], x, ids, w))
            client = remote.servers[0]
            want = server.servicer.compute.port if compute_port == 0 else 0
            assert client.info.compute_port == want
            assert client._compute_address().endswith(f":{want or server.port}")  # asks GetInfo again
            remote.close()
    assert torch.equal(outs[0], outs[1])


@pytest.fixture
def spans(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    return provider.get_tracer("dense"), exporter


def test_traced_calls_become_the_expert_servers_spans(server, model, spans):
    _, cfg, moe = model
    dense, exporter = spans
    step, call = dense.start_span("step"), dense.start_span("expert_call")
    x, ids, w = inputs(cfg, 2)
    t = NativeInlineTransport(f"127.0.0.1:{server.servicer.compute.port}", 30.0)
    for layer in moe:  # one step: its calls make one span, closed by the last layer
        t.wait(t.submit(layer, x, ids, w, telemetry.traceparent(step)))
    t.wait(t.submit(moe[0], x, ids, w, telemetry.traceparent(call), True))  # a span of its own
    t.wait(t.submit(moe[0], x, ids, w))  # not traced
    assert wait_for(lambda: len(exporter.get_finished_spans()) >= 2)
    got = {s.name: s for s in exporter.get_finished_spans()}
    assert sorted(got) == ["expert.compute", "expert.step"] and len(exporter.get_finished_spans()) == 2
    assert got["expert.step"].parent.span_id == step.get_span_context().span_id
    assert got["expert.step"].attributes["tandem.calls"] == len(moe)
    assert got["expert.step"].attributes["tandem.tokens"] == 2 * len(moe)
    assert got["expert.compute"].parent.span_id == call.get_span_context().span_id
    assert dict(got["expert.compute"].attributes) == {"tandem.layer": moe[0], "tandem.tokens": 2}
    t.close()


def test_a_drain_refuses_new_streams_answers_the_open_ones_then_ends_them(model):
    path, cfg, moe = model
    x, ids, w = inputs(cfg, 2)
    with in_process(path, "int8") as server:
        compute = server.servicer.compute
        address = f"127.0.0.1:{compute.port}"
        open_stream = NativeInlineTransport(address, 30.0)
        expected = open_stream.wait(open_stream.submit(moe[0], x, ids, w))[0]
        compute.drain()
        assert torch.equal(open_stream.wait(open_stream.submit(moe[0], x, ids, w))[0], expected)
        late = NativeInlineTransport(address, 30.0)
        with pytest.raises(ExpertBackendError) as info:
            late.wait(late.submit(moe[0], x, ids, w))
        assert info.value.code == "UNAVAILABLE" and "shutting down" in info.value.cause
        compute.stop()
        with pytest.raises(ExpertBackendError) as info:
            open_stream.wait(open_stream.submit(moe[0], x, ids, w))
        assert info.value.code == "UNAVAILABLE", info.value
        open_stream.close(), late.close()


def test_compute_port_flag_is_a_port_or_off():
    port = functools.partial(parse_port, "--compute-port")
    assert port("off") is None and port("0") == 0 and port("50062") == 50062
    for bad in ("x", "70000", "-1"):
        with pytest.raises(ConfigError, match="--compute-port"):
            port(bad)
    with pytest.raises(ConfigError, match="--compute-port"):
        ServerConfig(model=checkpoint("qwen3_moe"), compute_port=70000)


def random_request(rng, cfg, moe) -> pb.ComputeRequest:
    """A call with each part valid or broken at random: dtype codes, shapes, byte counts, layer, ids."""
    t, k = int(rng.integers(0, 4)), int(rng.integers(0, cfg.moe.top_k + 2))
    d = cfg.hidden_size if rng.random() < 0.7 else int(rng.integers(0, 2 * cfg.hidden_size))

    def tensor(dtype, shape, itemsize, fill):
        shape = shape if rng.random() < 0.8 else [int(n) for n in rng.integers(-2, 9, size=int(rng.integers(0, 4)))]
        n = max(0, int(np.prod(shape))) * itemsize if rng.random() < 0.8 else int(rng.integers(0, 64))
        return pb.Tensor(dtype=dtype if rng.random() < 0.8 else int(rng.integers(0, 6)), shape=shape,
                         data=fill(n))

    ids = lambda n: rng.integers(-1, cfg.moe.num_experts + 1, size=n // 8, dtype=np.int64).tobytes()
    floats = lambda n: rng.standard_normal(n // 4, dtype=np.float32).tobytes()
    return pb.ComputeRequest(
        layer=moe[0] if rng.random() < 0.7 else int(rng.integers(0, 2**32)),
        x=tensor(pb.FLOAT32, [t, d], 4, floats), ids=tensor(pb.INT64, [t, k], 8, ids),
        weights=tensor(pb.FLOAT32, [t, k], 4, floats))


def test_random_calls_get_ok_or_invalid_argument_and_the_server_keeps_serving(server, model):
    _, cfg, moe = model
    rng = np.random.default_rng(0)
    codes = {}
    with grpc.insecure_channel(f"127.0.0.1:{server.servicer.compute.port}") as channel:
        stub = pb_grpc.ExpertServiceStub(channel)
        for _ in range(300):
            try:
                (answer,) = stub.Compute(iter([random_request(rng, cfg, moe)]), timeout=10)
                codes["OK"] = codes.get("OK", 0) + 1
                assert len(answer.out.data) == answer.out.shape[0] * answer.out.shape[1] * 4
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
                codes[exc.details().split(":")[0]] = codes.get(exc.details().split(":")[0], 0) + 1
    assert codes.get("OK", 0) > 0 and len(codes) > 6, codes  # both outcomes, many fields named
    x, ids, w = inputs(cfg, 2)
    t = NativeInlineTransport(f"127.0.0.1:{server.servicer.compute.port}", 30.0)
    assert torch.isfinite(t.wait(t.submit(moe[0], x, ids, w))[0]).all()
    t.close()
