"""Request and response models of POST /v1/messages and /v1/messages/count_tokens (Anthropic's shapes)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import ApiError
from gateway.generation import Count, RequestBody


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations: accepted, not used

    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[dict] = Field(min_length=1)

    def text(self, where: str) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for i, block in enumerate(self.content):
            if block.get("type") != "text":
                raise ApiError(400, f"{where}.content[{i}]: {block.get('type')!r} blocks are not supported by this "
                                    "server yet (text only)", f"{where}.content", "unsupported_parameter")
            parts.append(TextBlock(**block).text)
        return "".join(parts)


class CountRequest(RequestBody):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None

    def chat(self) -> list[dict]:
        """The conversation as chat-template messages (the system prompt first)."""
        if self.model_extra and self.model_extra.get("tools"):
            raise ApiError(400, "tools are not supported by this server yet", "tools", "unsupported_parameter")
        out = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        out += [{"role": m.role, "content": m.text(f"messages[{i}]")} for i, m in enumerate(self.messages)]
        return out


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
    content: list[TextBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence"] | None
    stop_sequence: str | None = None
    usage: Usage
