"""Request and response models of POST /v1/completions (OpenAI's shapes)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from gateway.chat.schemas import Usage
from gateway.generation import SamplingFields, TokenId


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=16)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


def completion_logprobs(items, offset: int = 0) -> CompletionLogprobs:
    tokens, offsets = [], []
    for lp in items:
        offsets.append(offset)
        tokens.append(lp.token)
        offset += len(lp.token)
    return CompletionLogprobs(tokens=tokens, token_logprobs=[lp.logprob for lp in items],
                              top_logprobs=[{t.token: t.logprob for t in lp.top} for lp in items], text_offset=offsets)
