"""Request and response models of POST /v1/chat/completions (OpenAI's shapes)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from gateway.generation import SamplingFields


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


def token_logprobs(items) -> ChoiceLogprobs:
    """Dense TokenLogprob messages -> OpenAI chat logprobs."""
    def top(t):
        return TopLogprob(token=t.token, logprob=t.logprob, bytes=list(t.token.encode()))

    return ChoiceLogprobs(content=[
        TokenLogprob(token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode()), top_logprobs=[top(t) for t in lp.top])
        for lp in items
    ])
