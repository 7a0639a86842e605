"""Several dense services behind one gateway (--dense A,B): requests spread over both by load, a
killed one is skipped (no 5xx to new requests, /health, /v1/models and /metrics stay right), and it
takes traffic again once it is back on its address."""

import asyncio
import concurrent.futures
import time

import httpx
import pytest

from gateway.config import GatewayConfig
from services.common.errors import ConfigError
from tests.checkpoints import checkpoint
from tests.gateway.servers import dense, gateway

pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native

PATH = checkpoint("qwen3_moe")
BODY = {"model": PATH.name, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}


def served(running) -> int:
    """Prompt tokens the service has looked up in its prefix cache: one count per prompt it took."""
    return running.engine.pool.queries


def burst(url: str, n: int) -> list[int]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=BODY, timeout=120).status_code,
                             range(n)))


def test_requests_spread_a_killed_service_is_skipped_and_taken_back():
    a, b = dense(PATH), dense(PATH)
    try:
        with gateway(f"127.0.0.1:{a.port},127.0.0.1:{b.port}") as (url, _):
            assert burst(url, 8) == [200] * 8
            assert served(a) > 0 and served(b) > 0  # least-loaded: concurrent requests land on both
            text = httpx.post(url + "/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
            port = b.port
            b.stop(0)
            assert burst(url, 6) == [200] * 6  # all on a now, none refused
            assert httpx.get(url + "/health").status_code == 200
            assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == PATH.name
            metrics = httpx.get(url + "/metrics")
            assert metrics.status_code == 200 and "tandem:num_requests_running" in metrics.text
            b = dense(PATH, listen=f"127.0.0.1:{port}")
            start = time.monotonic()
            while served(b) == 0:  # skipped for a few seconds after it failed, then tried again
                assert burst(url, 4) == [200] * 4 and time.monotonic() - start < 15
                time.sleep(0.2)
            again = httpx.post(url + "/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
            assert again == text  # the same model on both
            a.stop(0)
            b.stop(0)
            assert httpx.get(url + "/health").status_code == 503
            assert httpx.post(url + "/v1/completions", json=BODY, timeout=60).status_code == 503
    finally:
        a.stop(0)
        b.stop(0)


@pytest.mark.parametrize("addresses", ["127.0.0.1", "a:1,a:1", "a:1,", "a:x"])
def test_bad_dense_lists_are_config_errors(addresses):
    with pytest.raises(ConfigError, match="--dense"):
        GatewayConfig(dense=addresses)


def test_generate_goes_to_the_grpc_port_and_finds_it_again_after_a_restart():
    from gateway.dense_client import DenseClient
    from tandem.v1 import dense_pb2 as pb

    request = pb.GenerateRequest(text="Once upon a time", sampling=pb.SamplingParams(temperature=0),
                                 stopping=pb.StoppingCriteria(max_tokens=6, ignore_eos=True))

    async def tokens(client):
        return [t async for r in client.generate(request) for t in r.token_ids]

    async def run():
        a = dense(PATH)
        client = DenseClient(f"127.0.0.1:{a.port}")
        try:
            first, port = await tokens(client), a.generate.port
            assert list(client._generate) == [port] and a.engine.pool.queries > 0
            a.stop(0)
            a = dense(PATH, listen=f"127.0.0.1:{a.port}")  # the same address, another grpc++ port
            assert a.generate.port != port
            assert await tokens(client) == first  # its old grpc++ port refused: the call went to the service's own
            assert await tokens(client) == first and list(client._generate) == [port, a.generate.port]
        finally:
            await client.close()
            a.stop(0)

    asyncio.run(run())
