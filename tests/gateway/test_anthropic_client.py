"""The gateway's /v1/messages through the official anthropic client: text, a stream, token counts."""

import pytest

from tests.checkpoints import checkpoint
from tests.gateway.servers import dense, gateway

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native

PATH = checkpoint("qwen3_moe")
MESSAGES = [{"role": "user", "content": "Name a fox."}]


@pytest.fixture(scope="module")
def client():
    running = dense(PATH)
    with gateway(running.port) as (url, app):
        yield anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    running.stop(1)


def test_text_and_a_stream_give_the_same_answer(client):
    reply = client.messages.create(model=PATH.name, max_tokens=8, messages=MESSAGES, system="Be terse.",
                                   extra_body={"temperature": 0})
    assert reply.type == "message" and reply.role == "assistant" and reply.stop_reason == "max_tokens"
    assert reply.usage.output_tokens == 8 and reply.usage.input_tokens > 0
    with client.messages.stream(model=PATH.name, max_tokens=8, messages=MESSAGES, system="Be terse.",
                                extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == reply.content[0].text == final.content[0].text and final.stop_reason == "max_tokens"


def test_a_stop_sequence_is_named(client):
    reply = client.messages.create(model=PATH.name, max_tokens=16, messages=MESSAGES, extra_body={"temperature": 0})
    stop = reply.content[0].text[3:5]
    cut = client.messages.create(model=PATH.name, max_tokens=16, messages=MESSAGES, extra_body={"temperature": 0},
                                 stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == reply.content[0].text[:reply.content[0].text.find(stop)]


def test_count_tokens_matches_the_usage(client):
    counted = client.messages.count_tokens(model=PATH.name, messages=MESSAGES)
    reply = client.messages.create(model=PATH.name, max_tokens=1, messages=MESSAGES)
    assert counted.input_tokens == reply.usage.input_tokens


def test_unsupported_blocks_and_bad_fields_are_400(client):
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=PATH.name, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}])
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=PATH.name, max_tokens=0, messages=MESSAGES)
