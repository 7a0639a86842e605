"""The dense service over gRPC: streaming, stop strings, UTF-8, limits, cancellation, deadlines; each
Generate test on both of its ports, grpcio's and the grpc++ one GetModelInfo names (generate_port)."""

import contextlib
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import ConfigError
from services.common.grpc_defaults import native_grpc, parse_port
from services.dense.app import start
from services.dense.config import DenseConfig
from services.dense.detokenizer import Detokenizer
from services.dense.moe.experts import ExpertBackend
from services.dense.runtime import DenseRuntime
from services.dense.tokenizer import Tokenizer
from tandem.v1 import dense_pb2 as pb
from tandem.v1 import dense_pb2_grpc as pb_grpc
from tests.checkpoints import checkpoint
from tests.waiting import wait_for

pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native

PATH = checkpoint("qwen3_moe")
PORTS = ("grpcio", "grpc++")


class SlowExperts(ExpertBackend):
    """The reference experts, 20 ms slower per layer call: a generation that takes its time."""

    def __init__(self):
        import torch

        from services.dense.loader import open_checkpoint
        from services.dense.moe.reference import TorchExperts

        ckpt, cfg = open_checkpoint(PATH)
        self.inner = TorchExperts(cfg, ckpt, torch.float32, torch.device("cpu"))

    def submit(self, layer, x, ids, weights):
        time.sleep(0.02)
        return self.inner.submit(layer, x, ids, weights)

    def wait(self, handle):
        return self.inner.wait(handle)


def serve(experts=None, **kw):
    cfg = DenseConfig(model=PATH, runtime=DenseRuntime("float32", "cpu"), experts="native", expert_format="int8",
                      threads=2, listen="127.0.0.1:0", **{"kv_tokens": 4096, **kw})
    running = start(cfg, experts)
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    return running, channel, pb_grpc.DenseServiceStub(channel)


class Stubs:
    """The service's stub with Generate on the grpc++ port GetModelInfo names."""

    def __init__(self, stub, port: int):
        self.stub, self.channel = stub, grpc.insecure_channel(f"127.0.0.1:{port}")
        self.Generate = pb_grpc.DenseServiceStub(self.channel).Generate

    def __getattr__(self, name):
        return getattr(self.stub, name)


@contextlib.contextmanager
def served(port: str, experts=None, **kw):
    """(running service, stub) with Generate on its grpcio port or ("grpc++") its own."""
    if port == "grpc++" and not native_grpc():
        pytest.skip("tandem_grpc was not built (grpc++ is not installed)")
    running, channel, stub = serve(experts, **kw)
    if port == "grpc++":
        stub = Stubs(stub, stub.GetModelInfo(pb.GetModelInfoRequest()).generate_port)
    try:
        yield running, stub
    finally:
        channel.close()
        if port == "grpc++":
            stub.channel.close()
        running.stop(1)


@pytest.fixture(scope="module", params=PORTS)
def service(request):
    with served(request.param) as s:
        yield s


@pytest.fixture(scope="module", params=PORTS)
def slow_service(request):
    with served(request.param, SlowExperts(), kv_tokens=256, block_size=16, max_queue=1) as s:
        yield s


def request(text="The quick brown fox", max_tokens=12, **sampling):
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(**{"temperature": 0, **sampling}),
                              stopping=pb.StoppingCriteria(max_tokens=max_tokens))


def collect(responses):
    tokens, text, last = [], "", None
    for r in responses:
        tokens += r.token_ids
        text += r.text
        last = r
    return tokens, text, last



def test_generate_streams_tokens_text_usage_and_logprobs(service):
    running, stub = service
    req = request(max_tokens=10)
    req.logprobs = 3
    responses = list(stub.Generate(req))
    tokens, text, last = collect(responses)
    assert len(tokens) == 10 and last.finish_reason == pb.LENGTH
    assert last.usage.completion_tokens == 10 and last.usage.prompt_tokens > 0
    assert text == Tokenizer(PATH).decode(tokens)
    lp = [x for r in responses for x in r.logprobs]
    assert len(lp) == 10 and all(len(x.top) == 3 and x.top[0].logprob >= x.logprob - 1e-6 for x in lp)
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.family == "qwen3_moe" and info.experts == "native" and info.kv_cache_tokens == 4096
    assert info.chat_template


def test_tokenize_detokenize_round_trip_and_health(service):
    running, stub = service
    ids = stub.Tokenize(pb.TokenizeRequest(text="hello world")).token_ids
    assert stub.Detokenize(pb.DetokenizeRequest(token_ids=ids)).text == "hello world"
    with pytest.raises(grpc.RpcError) as info:
        stub.Detokenize(pb.DetokenizeRequest(token_ids=[10**6]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in info.value.details()
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_stop_string_across_token_boundaries_is_cut_and_never_emitted(service):
    running, stub = service
    responses = list(stub.Generate(request(max_tokens=24)))
    text = "".join(r.text for r in responses)
    # the last character of one token's text and the first of the next one's
    deltas = [r.text for r in responses if len(r.token_ids) == 1]
    i = next(i for i in range(len(deltas) - 1)
             if deltas[i] and deltas[i + 1] and "\ufffd" not in deltas[i][-1] + deltas[i + 1][0])
    stop = deltas[i][-1] + deltas[i + 1][0]
    first = text.find(stop)
    req = request(max_tokens=24)
    req.stopping.stop.add(text=stop)
    responses = list(stub.Generate(req))
    _, stopped_text, last = collect(responses)
    assert last.finish_reason == pb.STOP and stopped_text == text[:first]
    assert all(stop not in r.text for r in responses)


def test_multibyte_utf8_split_across_tokens_streams_whole_characters():
    tok = Tokenizer(PATH)
    text = "naïve café 日本語 🙂 ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split()), "the test needs characters split over several tokens"
    detok = Detokenizer(tok, [])
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces), "some token ended inside a character and was held back"


def test_stop_string_split_over_many_tokens_in_the_detokenizer():
    tok = Tokenizer(PATH)
    text = "alpha beta STOPWORD gamma"
    detok = Detokenizer(tok, [], stop=("STOPWORD",))
    out = "".join(detok.add(t) for t in tok.encode(text, add_special_tokens=False)) + detok.flush()
    assert out == "alpha beta " and detok.stopped_by == "STOPWORD"


def test_context_overflow_is_invalid_argument_with_both_numbers(service):
    running, stub = service
    limit = running.engine.model.cfg.max_position_embeddings
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request(max_tokens=limit)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(limit) in info.value.details() and "prompt (" in info.value.details()


@pytest.mark.parametrize("change, field", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 2.0}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"stop": True}, "stopping.stop[0]"),
    ({"min_tokens": 99}, "min_tokens"),
    ({"prompt": None}, "prompt"),
])
def test_invalid_parameters_are_invalid_argument_naming_the_field(service, change, field):
    running, stub = service
    req = request(max_tokens=8)
    if "stop" in change:
        req.stopping.stop.add()  # neither text nor token_id
    elif "min_tokens" in change:
        req.stopping.min_tokens = 99
    elif "prompt" in change:
        req.ClearField("text")
    else:
        for k, v in change.items():
            setattr(req.sampling, k, v)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()


def test_min_tokens_and_stop_token_ids(service):
    running, stub = service
    tokens, _, _ = collect(stub.Generate(request(max_tokens=12)))
    j = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    req = request(max_tokens=12)
    req.stopping.stop.add(token_id=tokens[j])
    stopped, _, last = collect(stub.Generate(req))
    assert stopped == tokens[:j + 1] and last.finish_reason == pb.STOP
    req.stopping.min_tokens = 12
    barred, _, last = collect(stub.Generate(req))
    assert len(barred) == 12 and tokens[j] not in barred and last.finish_reason == pb.LENGTH


def test_cancellation_mid_stream_frees_every_block(slow_service):
    running, stub = slow_service
    call = stub.Generate(request(max_tokens=100))
    next(call), next(call)
    assert running.engine.blocks_in_use > 0
    call.cancel()
    assert wait_for(lambda: running.engine.blocks_in_use == 0 and not running.engine.running)
    assert collect(stub.Generate(request(max_tokens=2)))[2].finish_reason == pb.LENGTH


def test_deadline_expiring_mid_generation_frees_the_request(slow_service):
    running, stub = slow_service
    call = stub.Generate(request(max_tokens=100), timeout=0.8)
    with pytest.raises(grpc.RpcError) as info:
        collect(call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: running.engine.blocks_in_use == 0 and not running.engine.running)


def test_full_kv_cache_queues_then_refuses_with_resource_exhausted(slow_service):
    running, stub = slow_service
    long = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 230), sampling=pb.SamplingParams(temperature=0),
                              stopping=pb.StoppingCriteria(max_tokens=20, ignore_eos=True))
    hog = stub.Generate(long)  # 256-token cache: this one's 231 tokens hold 15 of its 16 blocks
    next(hog)
    assert running.engine.blocks_in_use == 15
    queued = stub.Generate(request(max_tokens=200))  # waits for the hog's blocks
    assert wait_for(lambda: len(running.engine.waiting) == 1)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request(max_tokens=200)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    hog.cancel()
    assert next(queued).token_ids  # the queued request runs once the hog is gone
    queued.cancel()
    assert wait_for(lambda: running.engine.blocks_in_use == 0)


def test_start_prints_the_memory_it_needs_and_refuses_what_the_machine_lacks(capsys):
    cfg = DenseConfig(model=PATH, runtime=DenseRuntime("float32", "cpu"), experts="native", expert_format="int8",
                      threads=1, listen="127.0.0.1:0", kv_tokens=10**9)
    with pytest.raises(ConfigError, match=r"needs [\d.]+ GiB on cpu \(.* GiB of weights \(float32\), [\d.]+ GiB of KV "
                                          r"cache, .* GiB of int8 experts in host RAM\) but only [\d.]+ GiB is free; "
                                          r"use --dtype bfloat16, fewer --kv-tokens"):
        start(cfg)
    assert "dense service: needs" in capsys.readouterr().err


def test_the_grpc_port_streams_what_the_grpcio_port_streams():
    with served("grpc++") as (running, stubs):
        assert stubs.GetModelInfo(pb.GetModelInfoRequest()).generate_port == running.generate.port
        req = request(max_tokens=10)
        req.logprobs = 2
        fields = [[(r.token_ids, r.text, r.logprobs, r.finish_reason, r.usage) for r in call(req)]
                  for call in (stubs.stub.Generate, stubs.Generate)]
        assert fields[0] == fields[1] and len(fields[0]) == 10
        with pytest.raises(grpc.RpcError) as info:  # its port serves Generate only
            pb_grpc.DenseServiceStub(stubs.channel).Tokenize(pb.TokenizeRequest(text="x"))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_request_that_does_not_parse_is_invalid_argument_on_the_grpc_port():
    with served("grpc++") as (running, stubs):
        raw = stubs.channel.unary_stream("/tandem.v1.DenseService/Generate")  # bytes as they are
        with pytest.raises(grpc.RpcError) as info:
            list(raw(b"\xff\xff\xff", timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "did not parse" in info.value.details()
        assert not running.engine.waiting and not running.engine.running and running.generate.open_streams == 0
        assert collect(stubs.Generate(request(max_tokens=2)))[2].finish_reason == pb.LENGTH


def test_stopping_the_service_ends_a_grpc_stream_under_way():
    with served("grpc++", SlowExperts()) as (running, stubs):
        call = stubs.Generate(request(max_tokens=200))
        next(call)
        running.stop(0.2)
        with pytest.raises(grpc.RpcError) as info:
            collect(call)
        assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        assert running.generate.open_streams == 0 and not running.engine.running


def test_generate_port_off_and_bad_values():
    running, channel, stub = serve(generate_port=None)
    try:
        assert running.generate is None and stub.GetModelInfo(pb.GetModelInfoRequest()).generate_port == 0
        assert collect(stub.Generate(request(max_tokens=2)))[2].finish_reason == pb.LENGTH
    finally:
        channel.close()
        running.stop(1)
    assert parse_port("--generate-port", "off") is None and parse_port("--generate-port", "0") == 0
    for bad in ("x", "70000", "-1"):
        with pytest.raises(ConfigError, match="--generate-port"):
            parse_port("--generate-port", bad)
    with pytest.raises(ConfigError, match="--generate-port"):
        DenseConfig(model=PATH, runtime=DenseRuntime("float32", "cpu"), generate_port=70000)


@pytest.mark.parametrize("open_stream", [lambda *_: 1 / 0, lambda *_: "not a tuple"])
def test_an_open_that_fails_is_internal_and_the_server_goes_on(open_stream):
    if not native_grpc():
        pytest.skip("tandem_grpc was not built (grpc++ is not installed)")
    import tandem_grpc

    server = tandem_grpc.GenerateServer(open_stream, "127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as info:
                list(pb_grpc.DenseServiceStub(channel).Generate(request(), timeout=10))
            assert info.value.code() == grpc.StatusCode.INTERNAL and "opening the stream" in info.value.details()
        assert server.open_streams == 0
    finally:
        channel.close()
        server.stop()
