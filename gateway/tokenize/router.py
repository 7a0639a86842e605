"""POST /tokenize and /detokenize (vLLM's shapes)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from gateway.errors import ERROR_RESPONSES
from gateway.generation import RequestBody, TokenId

router = APIRouter()


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    prompt: str


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    app = request.app.state
    await app.check_model(body.model)
    ids = await app.call(app.client.tokenize(body.prompt, body.add_special_tokens))
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=(await app.client.info()).context_length)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    app = request.app.state
    await app.check_model(body.model)
    return DetokenizeResponse(prompt=await app.call(app.client.detokenize(body.tokens)))
