"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.chat import handler
from gateway.chat.schemas import ChatRequest, ChatResponse
from gateway.errors import ERROR_RESPONSES

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatResponse,
             responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}})
async def chat_completions(body: ChatRequest, request: Request):
    return await handler.create(body, request)
