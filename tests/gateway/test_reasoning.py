"""Reasoning through the real stack on the random model with a DeepSeek-R1-style template (the
prompt opens <think>, tools rendered by the template): the output is reasoning_content until
</think>, streamed and not, through the openai and anthropic clients; the template's thinking
switch (chat_template_kwargs) closes the reasoning in the prompt, so the answer is content and a
JSON constraint applies from the first token."""

import json

import pytest

from tests.gateway.servers import dense, gateway
from tests.random_model import CONVERSATION_WITH_TOOLS, with_template

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native

TEMPLATE = CONVERSATION_WITH_TOOLS + (
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Think, then answer."}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def stack():
    path = with_template(TEMPLATE)
    running = dense(path)
    with gateway(running.port) as (url, app):
        yield url, path.name
    running.stop(1)


def test_an_open_think_makes_the_output_reasoning_streamed_and_not(stack):
    url, model = stack
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model=model, messages=MESSAGES, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message
    assert whole.reasoning_content and whole.content in (None, "")
    assert whole.model_extra["reasoning"] == whole.reasoning_content
    parts, content = [], []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            parts.append(c.delta.model_extra.get("reasoning_content") or "")
            content.append(c.delta.content or "")
    assert "".join(parts) == whole.reasoning_content and "".join(content) == ""


def test_the_thinking_switch_gives_content_and_a_constraint_from_the_first_token(stack):
    url, model = stack
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0,
                                           extra_body=off).choices[0].message
    assert plain.content and not plain.model_extra.get("reasoning_content")
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=400, temperature=0,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "a", "schema": schema}},
                                           extra_body=off)
    assert json.loads(reply.choices[0].message.content)["a"] in ("x", "y")


def test_tools_are_rendered_by_the_template_and_a_forced_call_is_valid(stack):
    url, model = stack
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    kw = dict(model=model, messages=MESSAGES, max_tokens=1500, temperature=0, extra_body=off)
    reply = client.chat.completions.create(**kw, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    bare = client.chat.completions.create(**{**kw, "max_tokens": 1})
    assert reply.usage.prompt_tokens > bare.usage.prompt_tokens + 10  # the tools' JSON is in the prompt
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "f"
    assert isinstance(json.loads(call.function.arguments), dict)


def test_the_anthropic_client_gets_a_thinking_block(stack):
    url, model = stack
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    reply = client.messages.create(model=model, max_tokens=24, messages=MESSAGES, extra_body={"temperature": 0})
    assert reply.content[0].type == "thinking" and reply.content[0].thinking
    with client.messages.stream(model=model, max_tokens=24, messages=MESSAGES, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == reply.content[0].thinking
