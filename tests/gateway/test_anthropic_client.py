"""The gateway's /v1/messages through the official anthropic client: text, a stream, token counts, and
tool use (forced calls validate, streamed as input_json_delta, a conversation with tool results)."""

import pytest
from pydantic import BaseModel, Field

from tests.checkpoints import checkpoint
from tests.gateway.servers import dense, gateway
from tests.random_model import CONVERSATION_WITH_TOOLS, with_template

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


class Weather(BaseModel):
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)


class Clock(BaseModel):
    zone: str = Field(max_length=6)


MODELS = {"get_weather": Weather, "get_time": Clock}
TOOLS = [{"name": name, "description": f"{name} of a place",  # closed objects: a random model's keys never end
          "input_schema": {**model.model_json_schema(), "additionalProperties": False}} for name, model in MODELS.items()]
ASK = [{"role": "user", "content": "What is the weather?"}]


@pytest.fixture(scope="module")
def tools_client():
    path = with_template(CONVERSATION_WITH_TOOLS + "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    running = dense(path)
    with gateway(running.port) as (url, app):
        yield anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0), path.name
    running.stop(1)


def uses(message) -> list:
    return [b for b in message.content if b.type == "tool_use"]


def test_tool_choice_any_always_gives_a_tool_use_block_that_validates(tools_client):
    client, model = tools_client
    ids = set()
    for _ in range(5):
        reply = client.messages.create(model=model, max_tokens=1000, messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                       extra_body={"temperature": 1})
        assert reply.stop_reason == "tool_use" and len(uses(reply)) == 1
        for block in uses(reply):
            MODELS[block.name].model_validate(block.input, strict=True)
            assert block.id.startswith("toolu_")
            ids.add(block.id)
    assert len(ids) >= 5


def test_a_named_tool_without_parallel_use_is_one_call_streamed_as_the_same_input(tools_client):
    client, model = tools_client
    choice = {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}
    reply = client.messages.create(model=model, max_tokens=1000, messages=ASK, tools=TOOLS, tool_choice=choice,
                                   extra_body={"temperature": 0})
    assert reply.stop_reason == "tool_use" and [b.name for b in uses(reply)] == ["get_time"]
    Clock.model_validate(uses(reply)[0].input, strict=True)
    with client.messages.stream(model=model, max_tokens=1000, messages=ASK, tools=TOOLS, tool_choice=choice,
                                extra_body={"temperature": 0}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in uses(final)] == [(b.name, b.input) for b in uses(reply)]


def test_a_conversation_with_tool_results_renders_and_auto_answers(tools_client):
    client, model = tools_client
    turn = [*ASK, {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo", "days": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"},
                                         {"type": "text", "text": "And now?"}]}]
    counted = client.messages.count_tokens(model=model, messages=turn, tools=TOOLS)
    bare = client.messages.count_tokens(model=model, messages=turn)
    before = client.messages.count_tokens(model=model, messages=turn[:2])
    assert counted.input_tokens > bare.input_tokens + 20  # the tools are in the prompt
    assert bare.input_tokens > before.input_tokens + 5  # and so is the tool's result
    reply = client.messages.create(model=model, max_tokens=8, messages=turn, tools=TOOLS,
                                   extra_body={"temperature": 0})
    assert reply.usage.input_tokens == counted.input_tokens and reply.content


def test_bad_tool_requests_are_400(tools_client):
    client, model = tools_client
    for tools, choice in ((None, {"type": "any"}), (TOOLS, {"type": "tool", "name": "nope"}),
                          (TOOLS * 2, {"type": "auto"})):
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model=model, max_tokens=4, messages=ASK, tools=tools or anthropic.NOT_GIVEN,
                                   tool_choice=choice)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=model, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "tool_result", "content": "x"}]}])
