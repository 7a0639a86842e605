"""Tool calling through the official openai client against the real stack (the tests' random
model, read with the Hermes format): forced calls always validate, none and auto behave, streams rebuild
the same calls, the conversation with calls and tool answers renders, bad tool requests are 400s."""

import json

import pytest
from pydantic import BaseModel, Field

from tests.gateway.servers import openai_stack
from tests.random_model import random_model

openai = pytest.importorskip("openai")
pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native

PATH = random_model()  # 2048 tokens of context: room for a random model's run of parallel calls
MESSAGES = [{"role": "user", "content": "What is the weather?"}]


class Weather(BaseModel):
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)
    unit: str = Field(pattern=r"^(C|F)$")


class Clock(BaseModel):
    zone: str = Field(max_length=6)


TOOLS = [openai.pydantic_function_tool(Weather, name="get_weather"), openai.pydantic_function_tool(Clock, name="get_time")]
MODELS = {"get_weather": Weather, "get_time": Clock}  # the schemas the tools were made from


@pytest.fixture(scope="module")
def stack():
    with openai_stack(PATH) as served:
        yield served


def valid(call) -> bool:
    MODELS[call.function.name].model_validate_json(call.function.arguments, strict=True)
    return isinstance(json.loads(call.function.arguments), dict)


def test_required_always_calls_a_tool_with_valid_arguments(stack):
    client, model = stack
    ids = set()
    for seed in range(10):
        reply = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                               seed=seed, max_tokens=1500)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        assert all(valid(c) for c in choice.message.tool_calls)
        ids |= {c.id for c in choice.message.tool_calls}
    assert len(ids) >= 10


def test_a_named_tool_is_always_the_one_called_and_parse_reads_it(stack):
    client, model = stack
    for seed in range(10):
        reply = client.chat.completions.parse(model=model, messages=MESSAGES, tools=TOOLS, seed=seed, max_tokens=1500,
                                              tool_choice={"type": "function", "function": {"name": "get_time"}})
        calls = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls"
        assert calls and all(c.function.name == "get_time" and isinstance(c.function.parsed_arguments, Clock)
                             for c in calls)


def test_parallel_tool_calls_false_gives_at_most_one(stack):
    client, model = stack
    for seed in range(6):
        reply = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, seed=seed, max_tokens=1500)
        assert len(reply.choices[0].message.tool_calls) == 1


def test_a_stream_rebuilds_the_same_calls(stack):
    client, model = stack
    kw = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=1500)
    whole = client.chat.completions.create(**kw).choices[0]
    with client.chat.completions.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
           [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    starts = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert starts and [e.index for e in events if e.type == "tool_calls.function.arguments.done"] == \
           list(range(len(whole.message.tool_calls)))
    assert len({c.id for c in final.message.tool_calls}) == len(final.message.tool_calls)


def test_none_never_calls_and_auto_is_free_text(stack):
    client, model = stack
    for choice in ("none", "auto"):
        reply = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                               temperature=0, max_tokens=24)
        assert not reply.choices[0].message.tool_calls and reply.choices[0].finish_reason in ("stop", "length")


def test_a_conversation_with_calls_and_tool_answers_is_accepted(stack):
    client, model = stack
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=8)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("kw, param", [
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=TOOLS + TOOLS[:1]), "tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools.0.function.name"),
])
def test_bad_tool_requests_are_400s(stack, kw, param):
    client, model = stack
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **kw)
    assert err.value.body["param"] == param


def test_a_user_message_without_content_is_a_400(stack):
    client, model = stack
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": None}], max_tokens=4)
