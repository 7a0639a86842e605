"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.completions import handler
from gateway.completions.schemas import CompletionRequest, CompletionResponse
from gateway.errors import ERROR_RESPONSES

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse,
             responses={**ERROR_RESPONSES, 200: {"content": {"text/event-stream": {}}}})
async def completions(body: CompletionRequest, request: Request):
    return await handler.create(body, request)
