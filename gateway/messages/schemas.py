"""Request and response models of POST /v1/messages and /v1/messages/count_tokens (Anthropic's shapes)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import ApiError
from gateway.generation import Count, RequestBody


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations: accepted, not used

    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


BLOCKS = {"text": TextBlock, "thinking": ThinkingBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock}


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[dict] = Field(min_length=1)

    def chat(self, where: str) -> list[dict]:
        """This message as chat-template messages: its text (and calls), then one per tool result."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text, thought, calls, results = [], [], [], []
        for i, raw in enumerate(self.content):
            kind = raw.get("type")
            kind = BLOCKS.get(kind) if isinstance(kind, str) else None
            if kind is None:
                raise ApiError(400, f"{where}.content[{i}]: {raw.get('type')!r} blocks are not supported by this "
                                    "server (text, thinking, tool_use, tool_result)", f"{where}.content",
                               "unsupported_parameter")
            try:
                block = kind(**raw)
            except ValidationError as exc:
                problem = exc.errors()[0]
                field = ".".join(str(x) for x in problem["loc"])
                raise ApiError(400, f"{where}.content[{i}].{field}: {problem['msg']}", f"{where}.content") from exc
            if isinstance(block, TextBlock):
                text.append(block.text)
            elif isinstance(block, ThinkingBlock):
                thought.append(block.thinking)
            elif isinstance(block, ToolUseBlock):
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})
            else:
                results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        out = results + ([{"role": self.role, "content": "".join(text)}] if text or calls else [])
        if calls:
            out[-1]["tool_calls"] = calls
        if thought and (text or calls):
            out[-1]["reasoning_content"] = "".join(thought)
        return out


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control: accepted, not used

    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]

    def function(self) -> dict:
        out = {"name": self.name, "parameters": self.input_schema}
        return out if self.description is None else {**out, "description": self.description}


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class CountRequest(RequestBody):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None

    def chat(self) -> list[dict]:
        """The conversation as chat-template messages (the system prompt first)."""
        out = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        for i, m in enumerate(self.messages):
            out += m.chat(f"messages[{i}]")
        return out

    def offered(self) -> list[dict] | None:
        """The functions the answer may call; None: no tool calls."""
        choice = self.tool_choice
        if not self.tools or (choice is not None and choice.type == "none"):
            if choice is not None and choice.type in ("any", "tool"):
                raise ApiError(400, "tool_choice: needs tools", "tool_choice")
            return None
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ApiError(400, "tools: names must be unique", "tools")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ApiError(400, f"tool_choice: no tool is named {choice.name!r}", "tool_choice.name")
        return [t.function() for t in self.tools]

    def template_tools(self) -> list[dict] | None:
        tools = self.offered()
        return None if tools is None else [{"type": "function", "function": t} for t in tools]


class MessagesRequest(CountRequest):
    max_tokens: Count
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False


class CountResponse(BaseModel):
    input_tokens: int


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextBlock | ToolUseBlock | ThinkingBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: Usage
