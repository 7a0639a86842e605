"""Bad calls get INVALID_ARGUMENT naming the field and the server keeps serving; dead peers,
deadlines and SIGTERM end calls with the right status, never a hang; nothing stays in /dev/shm.
T tokens, D hidden size, K experts per token.
"""

import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import numpy as np
import pytest
import torch

from services.common import shm_layout as shm
from services.common.errors import ConfigError, ExpertBackendError
from services.dense.loader import open_checkpoint
from services.dense.moe.remote import RemoteConfig, RemoteExperts
from services.dense.moe.transport import GrpcioInlineTransport, NativeInlineTransport, ShmTransport, native_grpc
from tandem.v1 import expert_pb2 as pb
from tandem.v1 import expert_pb2_grpc as pb_grpc
from tests.checkpoints import checkpoint
from tests.expert_server.servers import ROOT, Spawned, in_process
from tests.waiting import wait_for

pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native

CAPACITY = 16


@pytest.fixture(scope="module")
def model():
    path = checkpoint("deepseek_v3")
    _, cfg = open_checkpoint(path)
    layer = next(i for i in range(cfg.num_layers) if cfg.is_moe(i))
    return path, cfg, layer


@pytest.fixture(scope="module")
def server(model):
    with in_process(model[0], "int8", max_tokens=CAPACITY) as running:
        yield running


@pytest.fixture
def stub(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield pb_grpc.ExpertServiceStub(channel)
    channel.close()


NEEDS_GRPC_CPP = pytest.mark.skipif(not native_grpc(), reason="tandem_grpc not built (grpc++ is not installed)")
# (client, server) of an inline stream: grpc++ or grpcio's client, to the grpc++ Compute server on its
# own port or to the grpcio server's Compute on --listen's port
INLINE_PATHS = [pytest.param(("native", "compute"), marks=NEEDS_GRPC_CPP),
                pytest.param(("native", "listen"), marks=NEEDS_GRPC_CPP),
                pytest.param(("grpcio", "compute"), marks=NEEDS_GRPC_CPP), ("grpcio", "listen")]
# routes, as (transport, grpc_client) of RemoteConfig: shared memory, inline on grpc++, inline on grpcio
REMOTE_PATHS = [("shm", "auto"), pytest.param(("grpc", "native"), marks=NEEDS_GRPC_CPP), ("grpc", "grpcio")]


@pytest.fixture(params=INLINE_PATHS, ids="-".join)
def inline(request, server, stub):
    """Makes inline transports to the module's server on one client and one of its two Compute servers."""
    client, side = request.param
    address = f"127.0.0.1:{server.servicer.compute.port if side == 'compute' else server.port}"
    if client == "native":
        return lambda: NativeInlineTransport(address, 30.0)
    channel = grpc.insecure_channel(address)
    request.addfinalizer(channel.close)
    return lambda: GrpcioInlineTransport(pb_grpc.ExpertServiceStub(channel), 30.0)


def inputs(cfg, tokens, seed=0):
    """x [T, D], ids [T, K], weights [T, K] of a valid call."""
    g = torch.Generator().manual_seed(seed)
    k = cfg.moe.top_k
    ids = torch.stack([torch.randperm(cfg.moe.num_experts, generator=g)[:k] for _ in range(tokens)])
    return torch.randn(tokens, cfg.hidden_size, generator=g), ids, torch.rand(tokens, k, generator=g)


def shm_transport(stub, cfg, timeout_s=30.0):
    return ShmTransport(stub, cfg.hidden_size, cfg.moe.top_k, CAPACITY, 50.0, timeout_s)


def expect_invalid(call, field):
    with pytest.raises(ExpertBackendError) as info:
        call()
    assert info.value.code == "INVALID_ARGUMENT", info.value
    assert field in info.value.cause, info.value.cause


def valid_request(t: ShmTransport, cfg, moe_layer, **change) -> shm.Request:
    """A descriptor for a 2-token call whose data is already in the slots, with some fields changed."""
    x, ids, w = inputs(cfg, 2)
    s = t.slots
    t.segment.array("x", s.x, np.dtype(np.float32), (2, cfg.hidden_size))[...] = x.numpy()
    t.segment.array("ids", s.ids, np.dtype(np.int64), (2, cfg.moe.top_k))[...] = ids.numpy()
    t.segment.array("w", s.weights, np.dtype(np.float32), (2, cfg.moe.top_k))[...] = w.numpy()
    fields = dict(layer=moe_layer, tokens=2, hidden=cfg.hidden_size, top_k=cfg.moe.top_k, x_dtype=1,
                  x_offset=s.x, ids_offset=s.ids, weights_offset=s.weights, out_offset=s.out)
    fields.update({k: getattr(s, v) if isinstance(v, str) else v for k, v in change.items()})  # "x": that slot
    return shm.Request(**fields)


@pytest.mark.parametrize("change, field", [
    ({"x_offset": 1 << 40}, "x_offset"),
    ({"ids_offset": 8}, "ids_offset"),            # inside the header
    ({"weights_offset": shm.HEADER_BYTES + 2}, "weights_offset"),  # misaligned
    ({"out_offset": -1 & (2**64 - 1)}, "out_offset"),
    ({"out_offset": "x"}, "out_offset"),          # out would overwrite x
    ({"layer": 0}, "layer"),                      # a dense layer: no experts here
    ({"layer": 99}, "layer"),
    ({"hidden": 96}, "hidden"),
    ({"tokens": CAPACITY + 1}, "tokens"),
    ({"top_k": 0}, "top_k"),
    ({"x_dtype": 7}, "x_dtype"),
])
def test_bad_shm_descriptor_is_invalid_argument_and_the_session_keeps_serving(stub, model, change, field):
    _, cfg, layer = model
    t = shm_transport(stub, cfg)
    try:
        seq = t.publish(valid_request(t, cfg, layer, **change))
        expect_invalid(lambda: t.check(layer, seq), field)
        x, ids, w = inputs(cfg, 3, seed=1)
        good = t.wait(t.submit(layer, x, ids, w))[0]
        again = t.wait(t.submit(layer, x, ids, w))[0]
        assert torch.isfinite(good).all() and torch.equal(good, again)
    finally:
        t.close()


def test_shm_converts_strided_or_other_dtype_inputs_first(stub, model):
    _, cfg, layer = model
    t = shm_transport(stub, cfg)
    try:
        x, ids, w = inputs(cfg, 3, seed=2)
        expected = t.wait(t.submit(layer, x, ids, w))[0]
        strided = x.T.contiguous().T
        got = t.wait(t.submit(layer, strided, ids.int(), w.double()))[0]
        assert not strided.is_contiguous() and torch.equal(got, expected)
    finally:
        t.close()


def test_expert_id_out_of_range_is_invalid_argument(stub, model, inline):
    _, cfg, layer = model
    x, ids, w = inputs(cfg, 2)
    ids[1, 0] = cfg.moe.num_experts
    for t in (shm_transport(stub, cfg), inline()):
        expect_invalid(lambda: t.wait(t.submit(layer, x, ids, w))[0], "ids")
        t.close()


def test_an_answer_nobody_waited_for_is_dropped_and_the_next_call_gets_its_own(stub, model, inline):
    _, cfg, layer = model
    (x1, ids1, w1), (x2, ids2, w2) = inputs(cfg, CAPACITY, seed=1), inputs(cfg, 3, seed=2)
    for t in (shm_transport(stub, cfg), inline()):
        expected = t.wait(t.submit(layer, x2, ids2, w2))[0]
        t.submit(layer, x1, ids1, w1)  # abandoned (the caller failed between submit and wait)
        assert torch.equal(t.wait(t.submit(layer, x2, ids2, w2))[0], expected)
        t.close()


@pytest.mark.parametrize("case, field", [("layer", "layer"), ("hidden", "hidden"), ("tokens", "tokens"),
                                         ("ids_dtype", "ids.dtype"), ("shape", "weights")])
def test_bad_inline_call_is_invalid_argument_and_the_server_keeps_serving(stub, model, inline, case, field):
    _, cfg, layer = model
    x, ids, w = inputs(cfg, CAPACITY + 1 if case == "tokens" else 2)
    if case == "hidden":
        x = torch.randn(2, cfg.hidden_size + 32)
    bad_layer = 0 if case == "layer" else layer
    t = inline()
    if case == "ids_dtype" and isinstance(t, NativeInlineTransport):  # float32 ids, as sent
        t._stream.submit(layer, x.numpy(), ids.float().numpy(), w.numpy())
        handle = (layer, torch.float32, torch.device("cpu"))
    elif case == "ids_dtype":
        t._queue.put(pb.ComputeRequest(layer=layer, x=pb.Tensor(dtype=pb.FLOAT32, shape=list(x.shape),
                                                                data=x.numpy().tobytes()),
                                       ids=pb.Tensor(dtype=pb.FLOAT32, shape=list(ids.shape),
                                                     data=ids.float().numpy().tobytes())))
        handle = (layer, torch.float32, torch.device("cpu"))
    else:
        handle = t.submit(bad_layer, x, ids, w[:, :1] if case == "shape" else w)
    expect_invalid(lambda: t.wait(handle), field)
    t.close()
    fresh = inline()
    x, ids, w = inputs(cfg, 2)
    assert torch.isfinite(fresh.wait(fresh.submit(layer, x, ids, w))[0]).all()
    fresh.close()


@pytest.mark.parametrize("change, field", [
    ({"segment_name": "../../etc/passwd"}, "segment_name"),
    ({"segment_name": "tandem-does-not-exist"}, "segment_name"),
    ({"layout_version": 99}, "layout_version"),
    ({"max_tokens": 10**6}, "max_tokens"),
])
def test_bad_session_open_is_invalid_argument(stub, change, field):
    segment = shm.Segment.create(shm.HEADER_BYTES + 4096, 4)
    try:
        fields = dict(segment_name=segment.name, byte_size=segment.size, layout_version=shm.LAYOUT_VERSION,
                      max_tokens=4)
        fields.update(change)
        call = stub.OpenSession(iter([pb.SessionRequest(open=pb.SessionOpen(**fields))]), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            next(call)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in info.value.details()
    finally:
        segment.close()



CLIENT = textwrap.dedent("""
    import sys, threading, grpc
    from services.common import shm_layout as shm
    from tandem.v1 import expert_pb2 as pb, expert_pb2_grpc as pb_grpc
    segment = shm.Segment.create(shm.HEADER_BYTES + 4096, 4)
    stub = pb_grpc.ExpertServiceStub(grpc.insecure_channel(sys.argv[1]))
    def requests():
        yield pb.SessionRequest(open=pb.SessionOpen(segment_name=segment.name, byte_size=segment.size,
                                                    layout_version=shm.LAYOUT_VERSION, max_tokens=4))
        threading.Event().wait()
    call = stub.OpenSession(requests())
    next(call)
    print(segment.name, flush=True)
    threading.Event().wait()
""")


def test_a_client_that_dies_leaves_no_segment_and_no_session(server):
    """The client is killed before it unlinked its segment: the server notices and removes it."""
    before = server.servicer.session_count
    child = subprocess.Popen([sys.executable, "-c", CLIENT, f"127.0.0.1:{server.port}"], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    try:
        name = child.stdout.readline().strip()
        assert name in shm.leftover_segments()
        assert server.servicer.session_count == before + 1
    finally:
        child.kill()
        child.wait()
    assert wait_for(lambda: name not in shm.leftover_segments() and server.servicer.session_count == before)


@pytest.fixture
def spawned(model):
    with Spawned(model[0], "int8") as s:
        yield s


@pytest.mark.e2e
@pytest.mark.parametrize("route", REMOTE_PATHS)
def test_a_killed_server_fails_the_call_in_flight_with_unavailable_then_the_client_reconnects(
        model, spawned, route):
    path, cfg, layer = model
    remote = RemoteExperts(cfg, RemoteConfig(addresses=(spawned.address,), transport=route[0],
                                             grpc_client=route[1], timeout_s=20))
    x, ids, w = inputs(cfg, 2)
    expected = remote.forward(layer, x, ids, w)
    spawned.pause()
    handle = remote.submit(layer, x, ids, w)
    spawned.kill()
    start = time.monotonic()
    with pytest.raises(ExpertBackendError) as info:
        remote.wait(handle)
    assert info.value.code == "UNAVAILABLE" and time.monotonic() - start < 20
    with pytest.raises(ExpertBackendError) as info:
        remote.forward(layer, x, ids, w)
    assert info.value.code == "UNAVAILABLE"
    with Spawned(path, "int8", port=spawned.port):
        assert wait_for(lambda: _succeeds(remote, layer, x, ids, w))
        assert torch.equal(remote.forward(layer, x, ids, w), expected)
    remote.close()


def test_forward_over_shared_memory_is_one_native_call_counted_in_the_step_stats(model, server):
    """RemoteExperts.forward over a shared-memory session is ShmTransport.call (no submit), gives what
    submit and wait give and counts in the step's stats; over a call's capacity it runs in pieces."""
    _, cfg, layer = model
    remote = RemoteExperts(cfg, RemoteConfig(addresses=(f"127.0.0.1:{server.port}",), transport="shm"))
    try:
        x, ids, w = inputs(cfg, CAPACITY + 3, seed=4)
        expected = torch.cat([remote.wait(remote.submit(layer, *part)) for part in zip(*(
            t.split(CAPACITY) for t in (x, ids, w)))])
        remote.take_step_stats()
        transport = remote.owner[layer].transport(layer)
        transport.submit = None  # forward must not split the call
        assert torch.equal(remote.forward(layer, x[:2], ids[:2], w[:2]), expected[:2])
        stats = remote.take_step_stats()
        assert stats["calls"] == 1 and stats["expert_s"] > 0
        assert stats["bytes"] == x[:2].nbytes + ids[:2].nbytes + w[:2].nbytes + expected[:2].nbytes
        assert torch.equal(remote.forward(layer, x, ids, w), expected)
        assert remote.take_step_stats()["calls"] == 2
    finally:
        remote.close()


@pytest.mark.e2e
def test_a_killed_server_fails_a_forward_in_flight_over_shared_memory_with_unavailable(model, spawned):
    _, cfg, layer = model
    remote = RemoteExperts(cfg, RemoteConfig(addresses=(spawned.address,), transport="shm", timeout_s=20))
    x, ids, w = inputs(cfg, 2)
    remote.forward(layer, x, ids, w)
    spawned.pause()
    threading.Timer(0.5, spawned.kill).start()  # the call is published and waited for by then
    start = time.monotonic()
    with pytest.raises(ExpertBackendError) as info:
        remote.forward(layer, x, ids, w)
    assert info.value.code == "UNAVAILABLE" and time.monotonic() - start < 15
    remote.close()


def _succeeds(remote, layer, x, ids, w) -> bool:
    try:
        remote.forward(layer, x, ids, w)
        return True
    except ExpertBackendError as exc:
        assert exc.code == "UNAVAILABLE", exc
        return False


@pytest.mark.e2e
@pytest.mark.parametrize("route", REMOTE_PATHS)
def test_a_call_past_its_deadline_is_deadline_exceeded_and_the_next_call_works(model, spawned, route):
    _, cfg, layer = model
    remote = RemoteExperts(cfg, RemoteConfig(addresses=(spawned.address,), transport=route[0],
                                             grpc_client=route[1], timeout_s=1.0))
    x, ids, w = inputs(cfg, 2)
    expected = remote.forward(layer, x, ids, w)
    spawned.pause()
    start = time.monotonic()
    with pytest.raises(ExpertBackendError) as info:
        remote.forward(layer, x, ids, w)
    assert info.value.code == "DEADLINE_EXCEEDED" and time.monotonic() - start < 3
    spawned.signal(signal.SIGCONT)
    assert torch.equal(remote.forward(layer, x, ids, w), expected)
    remote.close()


@pytest.mark.e2e
@pytest.mark.parametrize("route", REMOTE_PATHS)
def test_sigterm_drains_the_call_in_flight_then_exits_without_waiting_out_the_drain_time(model, route):
    path, cfg, layer = model
    with Spawned(path, "int8", extra=("--drain-seconds", "60")) as spawned:
        remote = RemoteExperts(cfg, RemoteConfig(addresses=(spawned.address,), transport=route[0],
                                                 grpc_client=route[1], timeout_s=20))
        x, ids, w = inputs(cfg, 2)
        expected = remote.forward(layer, x, ids, w)
        spawned.pause()  # the server may not even have run on after its last answer: the drain waits for it
        handle = remote.submit(layer, x, ids, w)
        spawned.signal(signal.SIGTERM)
        spawned.signal(signal.SIGCONT)
        assert torch.equal(remote.wait(handle), expected)
        answered = time.monotonic()
        assert spawned.proc.wait(30) == 0
        assert time.monotonic() - answered < 20, "the server waited out its drain time with every stream quiet"
        with pytest.raises(ExpertBackendError) as info:
            remote.forward(layer, x, ids, w)
        assert info.value.code == "UNAVAILABLE"
        remote.close()


def test_remote_config_refuses_an_unknown_grpc_client():
    with pytest.raises(ConfigError, match="--grpc-client"):
        RemoteConfig(addresses=("127.0.0.1:1",), grpc_client="grpc++")


@NEEDS_GRPC_CPP
def test_native_stream_checks_its_arrays_and_names_the_argument(server, model):
    _, cfg, layer = model
    x, ids, w = (t.numpy() for t in inputs(cfg, 2))
    t = NativeInlineTransport(f"127.0.0.1:{server.port}", 30.0)
    with pytest.raises(ValueError, match="x: dtype"):
        t._stream.submit(layer, x.astype(np.float64), ids, w)
    with pytest.raises(ValueError, match="ids: must be a C-contiguous 2-D array"):
        t._stream.submit(layer, x, ids[:, ::2], w)
    expect_invalid(lambda: t.submit(layer, torch.from_numpy(x[0]), torch.from_numpy(ids), torch.from_numpy(w)), "x")
    t._stream.submit(layer, x, ids, w)  # nothing went out before: this call's answer is the next
    out, _ = t._stream.wait(30.0)
    assert out.shape == x.shape and np.isfinite(out).all() and not t.dead.is_set()
    t.close()


@NEEDS_GRPC_CPP
def test_native_stream_to_no_server_is_unavailable():
    with pytest.raises(ExpertBackendError) as info:
        NativeInlineTransport("127.0.0.1:1", 5.0, connect_timeout_s=5.0)
    assert info.value.code == "UNAVAILABLE" and "127.0.0.1:1" in info.value.cause
