"""Renders a checkpoint's chat template the way transformers' apply_chat_template does: a sandboxed
jinja2 environment with trim_blocks/lstrip_blocks, loop controls, `tojson`, `raise_exception` and
`strftime_now`, fed the messages, add_generation_prompt and the special tokens."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.errors import ApiError


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render(source: str, messages: list[dict], bos_token: str, eos_token: str, add_generation_prompt: bool = True,
           tools: list[dict] | None = None, **variables) -> str:
    """The prompt text; tools (OpenAI's {"type": "function", "function": {...}} entries) and any other
    template variables (reasoning_effort, enable_thinking...) go to the template as transformers passes them."""
    if not source:
        raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
    reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"} & set(variables)
    if reserved:
        raise ApiError(400, f"chat_template_kwargs: {sorted(reserved)[0]} is set by the server", "chat_template_kwargs")
    try:
        return compile_template(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                               bos_token=bos_token, eos_token=eos_token, tools=tools, **variables)
    except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise ApiError(400, f"the chat template refused the messages: {exc}", "messages") from exc
