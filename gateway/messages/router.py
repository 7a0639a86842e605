"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API, as llama-server and
vLLM serve it)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.errors import ERROR_RESPONSES
from gateway.messages import handler
from gateway.messages.schemas import CountRequest, CountResponse, MessagesRequest, MessagesResponse

router = APIRouter()


@router.post("/v1/messages", response_model=MessagesResponse,
             responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}})
async def messages(body: MessagesRequest, request: Request):
    return await handler.create(body, request)


@router.post("/v1/messages/count_tokens", response_model=CountResponse, responses=ERROR_RESPONSES)
async def count_tokens(body: CountRequest, request: Request):
    return await handler.count(body, request)
