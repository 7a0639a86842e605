"""Every client mistake and backend trouble gets its status and the one error body; never a 500."""

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.checkpoints import checkpoint
from tests.expert_server.servers import ROOT
from tests.gateway.servers import dense, gateway
from tests.services.dense.test_server import SlowExperts
from tests.waiting import wait_for

pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native

PATH = checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def fast():
    running = dense(PATH)
    with gateway(running.port) as (url, app):
        yield url, running
    running.stop(1)


@pytest.fixture(scope="module")
def slow():
    """A dense service that takes its time and holds 256 tokens of KV cache, with no queue."""
    running = dense(PATH, SlowExperts(), kv_tokens=256, max_queue=0)
    with gateway(running.port) as (url, app):
        yield url, running
    running.stop(1)


def error_of(response, status):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


def completion(url, **body):
    return httpx.post(url + "/v1/completions", json={"model": PATH.name, "prompt": "hi", "max_tokens": 4, **body},
                      timeout=30)


def test_malformed_json_is_400(fast):
    url, _ = fast
    r = httpx.post(url + "/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert "malformed JSON" in error_of(r, 400)["message"]


@pytest.mark.parametrize("body, param", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"prompt": []}, "prompt"),
    ({"stop": [""]}, "stop"),
])
def test_bad_parameters_are_400_naming_the_parameter(fast, body, param):
    url, _ = fast
    assert param in error_of(completion(url, **body), 400)["message"]


def test_context_overflow_is_400_with_both_token_counts(fast):
    url, running = fast
    limit = running.engine.model.cfg.max_position_embeddings
    message = error_of(completion(url, max_tokens=limit + 5), 400)["message"]
    assert f"max_tokens ({limit + 5})" in message and str(limit) in message and "prompt (" in message


def test_unknown_model_is_404(fast):
    url, _ = fast
    assert error_of(completion(url, model="gpt-9"), 404)["code"] == "model_not_found"
    assert error_of(httpx.get(url + "/v1/nothing"), 404)


def test_unsupported_features_are_400_and_unknown_fields_are_ignored(fast):
    url, _ = fast
    chat = {"model": PATH.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    functions = [{"name": "f", "parameters": {}}]
    r = httpx.post(url + "/v1/chat/completions", json={**chat, "functions": functions})
    assert "functions is not supported" in error_of(r, 400)["message"]
    r = httpx.post(url + "/v1/completions", json={"model": PATH.name, "prompt": "hi", "tools": [{"type": "function"}]})
    assert error_of(r, 400)["param"] == "tools"
    r = httpx.post(url + "/v1/chat/completions", json={**chat, "response_format": {"type": "json_schema"}})
    assert error_of(r, 400)["param"] == "response_format.json_schema"
    assert httpx.post(url + "/v1/chat/completions", json={**chat, "frobnicate": 3}).status_code == 200


def test_oversized_body_is_413(fast):
    url, _ = fast
    r = httpx.post(url + "/v1/completions", content=b"x" * (5 << 20), headers={"content-type": "application/json"})
    error_of(r, 413)


def test_api_key_is_required_when_set():
    running = dense(PATH)
    try:
        with gateway(running.port, api_key="sekret") as (url, _):
            error_of(httpx.get(url + "/v1/models"), 401)
            error_of(httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"}), 401)
            assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
            assert httpx.get(url + "/health").status_code == 200
    finally:
        running.stop(1)


def test_backend_down_is_503_and_health_says_so():
    with gateway(1) as (url, _):  # nothing listens on port 1
        assert error_of(completion(url), 503)
        assert error_of(httpx.get(url + "/health", timeout=10), 503)



def test_full_dense_service_is_429_with_retry_after(slow):
    url, running = slow
    hog = {"model": PATH.name, "prompt": [5] * 230, "max_tokens": 20, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json=hog) as stream:
        lines = stream.iter_lines()  # kept: a dropped iterator closes the connection (a disconnect)
        next(lines)
        assert len(running.engine.running) == 1 and running.engine.blocks_in_use == 15  # 231 tokens: 15 of 16 blocks
        r = completion(url, max_tokens=4)
        assert error_of(r, 429) and r.headers["retry-after"] == "1"
    assert wait_for(lambda: running.engine.blocks_in_use == 0)


def disconnects(url) -> float:
    line = next(x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith("tandem:client_disconnects_total"))
    return float(line.split()[-1])


def test_client_disconnect_aborts_the_request_and_frees_the_kv_blocks(slow):
    url, running = slow
    before = disconnects(url)
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                      json={"model": PATH.name, "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        next(lines)
        assert wait_for(lambda: running.engine.blocks_in_use > 0)
    assert wait_for(lambda: running.engine.blocks_in_use == 0 and not running.engine.running)
    assert disconnects(url) == before + 1


def test_non_streaming_disconnect_aborts_too(slow):
    url, running = slow
    with pytest.raises(httpx.ReadTimeout):
        completion_slow = httpx.post(url + "/v1/completions", timeout=0.5,
                                     json={"model": PATH.name, "prompt": "hi", "max_tokens": 200, "ignore_eos": True})
        completion_slow.read()
    assert wait_for(lambda: running.engine.blocks_in_use == 0 and not running.engine.running)


@pytest.mark.e2e
def test_sigterm_finishes_requests_in_flight_and_refuses_new_ones(slow):
    _, running = slow
    port = 18000 + (int(time.time() * 1000) % 1000)
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "--dense", f"127.0.0.1:{running.port}", "--port",
                             str(port), "--drain-seconds", "30"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _up(url), 60)
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": PATH.name, "prompt": "hi", "max_tokens": 30, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):
                httpx.get(url + "/health", timeout=2)
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
    finally:
        proc.kill()


def _up(url) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", '{"model": "M", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages[0].content"),
    ("/v1/completions", '{"model": "M", "prompt": "\\udfff", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "M", "prompt": "hi", "stop": ["x\\ud83d"]}', "stop[0]"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(fast, path, body, param):
    url, _ = fast
    body = body.replace('"M"', json.dumps(PATH.name))
    r = httpx.post(url + path, content=body.encode(), headers={"content-type": "application/json"})
    error = error_of(r, 400)
    assert error["param"] == param and "surrogate" in error["message"]
    paired = body.replace("\\ud800", "\\ud83d\\ude00").replace("\\udfff", "\\ud83d\\ude00").replace("\\ud83d\"", "\"")
    assert httpx.post(url + path, content=paired.encode(), headers={"content-type": "application/json"},
                      timeout=30).status_code == 200
