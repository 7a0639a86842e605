"""Tools in a chat request: the conversation as the chat template takes it, the tools the answer
may call, the grammar that tool_choice "required" or a named function imposes, and the calls of an
answer as OpenAI's tool_calls."""

from __future__ import annotations

import json

from gateway.chat.schemas import ChatRequest, FunctionCall, ToolCall
from gateway.errors import ApiError
from gateway.parsing.base import Call, call_id


def template_messages(body: ChatRequest) -> list[dict]:
    """Messages as transformers hands them to templates (a call's JSON arguments as a dict)."""
    out = []
    for m in body.messages:
        d = {"role": m.role, "content": m.text()}
        for name in ("name", "tool_call_id", "reasoning_content"):
            if getattr(m, name) is not None:
                d[name] = getattr(m, name)
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
        out.append(d)
    return out


def _arguments(text: str):
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def offered(body: ChatRequest) -> list[dict] | None:
    """The functions the answer may call ({"name", "description", "parameters"}); None: no tool calls."""
    if body.tool_choice is not None and not body.tools and body.tool_choice != "none":
        raise ApiError(400, "tool_choice: needs tools", "tool_choice")
    if not body.tools or body.tool_choice == "none":
        return None
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: function names must be unique", "tools")
    chosen = body.tool_choice
    if not isinstance(chosen, str) and chosen is not None and chosen.function.name not in names:
        raise ApiError(400, f"tool_choice: no tool is named {chosen.function.name!r}", "tool_choice")
    return [t.function.model_dump(exclude_none=True) for t in body.tools]


def template_tools(body: ChatRequest) -> list[dict] | None:
    if not body.tools or body.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def forced_grammar(body: ChatRequest, parser, tools: list[dict] | None) -> str | None:
    """Lark that forces calls, for tool_choice required (any tool) or a named function; else None."""
    chosen = body.tool_choice
    if tools is None or chosen in (None, "auto", "none"):
        return None
    if body._grammar is not None:
        raise ApiError(400, f"tool_choice {chosen!r} and {body._grammar[1]} both constrain the output; use one",
                       "tool_choice")
    if not isinstance(chosen, str):
        tools = [t for t in tools if t["name"] == chosen.function.name]
    return parser.grammar(tools, one=not body.parallel_tool_calls)


def tool_calls(calls: list[Call], parallel: bool) -> list[ToolCall]:
    calls = calls if parallel else calls[:1]
    return [ToolCall(id=call_id(c), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
