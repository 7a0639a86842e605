"""Structured output through the official openai client against the real stack (a tiny random
checkpoint): response_format json_schema / json_object, vLLM's constraint extras, 400s for bad ones.

The random model's strings only end when a quote happens to win, so the schemas bound every string
and list; the grammar, not luck, has to make every answer valid.
"""

import concurrent.futures
import json
import re
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

from tests.checkpoints import checkpoint
from tests.gateway.servers import openai_stack

openai = pytest.importorskip("openai")
pytest.importorskip("tandem_native")
pytestmark = pytest.mark.native

PATH = checkpoint("qwen3_moe")
MESSAGES = [{"role": "user", "content": "Describe a user."}]
Word = Annotated[str, Field(max_length=6)]


class Address(BaseModel):
    city: Word
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: Word
    role: Literal["admin", "user", "guest"]
    age: int = Field(ge=0, le=120)
    tags: list[Annotated[list[Word], Field(max_length=2)]] = Field(max_length=2)
    home: Address  # a $defs reference in the schema the client sends


@pytest.fixture(scope="module")
def stack():
    with openai_stack(PATH) as served:
        yield served


def test_the_client_sends_defs_patterns_lengths_enums():
    schema = openai.lib._pydantic.to_strict_json_schema(Person)
    text = json.dumps(schema)
    assert "$defs" in text and "pattern" in text and "maxLength" in text and "enum" in text and "maxItems" in text


def test_parse_with_a_pydantic_model_always_validates(stack):
    client, model = stack
    seen = set()
    for seed in range(20):
        reply = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=Person, seed=seed,
                                              max_tokens=200)
        person = reply.choices[0].message.parsed
        assert isinstance(person, Person) and reply.choices[0].finish_reason == "stop"
        seen.add(person.model_dump_json())
    assert len(seen) > 10  # the seeds sampled different answers: the mask did not pin one


def test_a_streamed_parse_always_validates(stack):
    client, model = stack
    for seed in range(20):
        with client.chat.completions.stream(model=model, messages=MESSAGES, response_format=Person, seed=seed,
                                            max_tokens=200) as stream:
            deltas = [e.delta for e in stream if e.type == "content.delta"]
            final = stream.get_final_completion()
        assert isinstance(final.choices[0].message.parsed, Person)
        assert "".join(deltas) == final.choices[0].message.content and len(deltas) > 5


def test_greedy_constrained_output_is_the_same_streamed_and_not(stack):
    client, model = stack
    kw = dict(model=model, messages=MESSAGES, response_format=Person, temperature=0, max_tokens=200)
    whole = client.chat.completions.parse(**kw).choices[0].message.content
    with client.chat.completions.stream(**kw) as stream:
        assert stream.get_final_completion().choices[0].message.content == whole


def test_json_object_always_parses_to_an_object(stack):
    client, model = stack
    schema = {"type": "object", "properties": {"k": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
              "required": ["k"], "additionalProperties": False}
    for seed in range(10):
        reply = client.chat.completions.create(model=model, messages=MESSAGES, seed=seed, max_tokens=200,
                                               response_format={"type": "json_object"})
        content, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert reason == "length" or isinstance(json.loads(content), dict)
        assert content.startswith("{")
        bounded = client.chat.completions.create(
            model=model, messages=MESSAGES, seed=seed, max_tokens=200,
            extra_body={"structured_outputs": {"json": schema}})
        assert isinstance(json.loads(bounded.choices[0].message.content)["k"], list)


def test_regex_choice_and_grammar_extras(stack):
    client, model = stack
    for seed in range(5):
        kw = dict(model=model, messages=MESSAGES, seed=seed, max_tokens=40)
        text = client.chat.completions.create(**kw, extra_body={"guided_regex": r"[a-f]{3}-[0-9]{2}"}).choices[0]
        assert re.fullmatch(r"[a-f]{3}-[0-9]{2}", text.message.content) and text.finish_reason == "stop"
        picked = client.chat.completions.create(**kw, extra_body={"guided_choice": ["red", "green", "blue"]})
        assert picked.choices[0].message.content in ("red", "green", "blue")
        lark = client.chat.completions.create(**kw, extra_body={"structured_outputs": {"grammar": 'start: "x" ("+" "x")*'}})
        assert re.fullmatch(r"x(\+x)*", lark.choices[0].message.content)
        completion = client.completions.create(model=model, prompt="Pick:", seed=seed, max_tokens=10,
                                               extra_body={"guided_choice": ["yes", "no"]})
        assert completion.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_json": {"type": "array", "minItems": 3, "maxItems": 1}}, "guided_json"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(stack, extra, param):
    client, model = stack
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert err.value.body["param"] == param


def test_unconstrained_batch_mates_are_unchanged(stack):
    client, model = stack

    def plain():
        return client.chat.completions.create(model=model, messages=MESSAGES, temperature=0,
                                              max_tokens=48).choices[0].message.content

    alone = plain()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(client.chat.completions.parse, model=model, messages=MESSAGES,
                                   response_format=Person, seed=s, max_tokens=200) for s in range(3)]
        together = pool.submit(plain)
        assert together.result() == alone
        assert all(isinstance(f.result().choices[0].message.parsed, Person) for f in constrained)
