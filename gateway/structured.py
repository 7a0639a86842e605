"""Structured output: OpenAI's response_format and vLLM's constraint extras (guided_json, guided_regex,
guided_choice, guided_grammar, structured_outputs) become one llguidance grammar, checked here so
that a bad schema, regex or grammar is a 400 naming its field. The dense service applies it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import llguidance
from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import ApiError

ANY_OBJECT = {"type": "object"}
# No free whitespace (a model could pad forever), the separators of json.dumps; a schema's own
# "x-guidance" may override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one kind."""

    model_config = ConfigDict(populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


class ConstraintFields(BaseModel):
    """The request fields that constrain the output (mixed into SamplingFields)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None

    def constraint(self) -> tuple[str, str] | None:
        """(llguidance grammar, the field it came from), or None for free output."""
        asked = [c for c in self._kinds() if c is not None]
        if len(asked) > 1:
            raise ApiError(400, f"only one output constraint at a time, got {', '.join(p for p, _, _ in asked)}",
                           asked[1][0])
        if not asked:
            return None
        param, kind, value = asked[0]
        return build(kind, value, param), param

    def _kinds(self):
        rf, so = self.response_format, self.structured_outputs
        if rf is not None and rf.type == "json_object":
            yield "response_format", "json", ANY_OBJECT
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ApiError(400, "response_format: type json_schema needs json_schema.schema",
                               "response_format.json_schema")
            yield "response_format.json_schema.schema", "json", rf.json_schema.schema_
        for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                yield field, kind, getattr(self, field)
        if so is not None:
            for field, kind in (("json_", "json"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar")):
                if getattr(so, field) is not None:
                    yield f"structured_outputs.{field.rstrip('_')}", kind, getattr(so, field)
            if so.json_object:
                yield "structured_outputs.json_object", "json", ANY_OBJECT


def build(kind: str, value, param: str) -> str:
    """The llguidance grammar for one constraint, validated; ApiError 400 naming param if bad."""
    try:
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object or a boolean")
            schema = schema if isinstance(schema, dict) else {} if schema else {"not": {}}
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(value)
        elif kind == "choice":
            grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
        else:
            grammar = llguidance.grammar_from("grammar", value)
    except (ValueError, TypeError, RecursionError) as exc:
        raise ApiError(400, f"{param}: {exc}", param) from exc
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ApiError(400, f"{param}: {error}", param)
    return grammar
