"""Completions: a prompt string or token ids, n choices, answered whole or streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway.chat.schemas import Usage
from gateway.completions.schemas import (CompletionChoice, CompletionRequest, CompletionResponse,
                                         completion_logprobs)
from gateway.errors import ApiError
from gateway.generation import Runner, generate_request, usage
from gateway.sse import guarded


async def prompt_ids(state, body: CompletionRequest) -> list[int]:
    p = body.prompt
    if isinstance(p, list) and p and not isinstance(p[0], int):
        if len(p) != 1:
            raise ApiError(400, "prompt: one prompt per request is supported (use n for several choices)", "prompt")
        p = p[0]
    if isinstance(p, str):
        return await state.call(state.client.tokenize(p, True))
    if not p:
        raise ApiError(400, "prompt: must not be empty", "prompt")
    return list(p)


def check_options(body: CompletionRequest) -> None:
    if body.echo:
        raise ApiError(400, "echo is not supported by this server yet", "echo", "unsupported_parameter")
    if body.suffix:
        raise ApiError(400, "suffix is not supported by this server yet", "suffix", "unsupported_parameter")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "best_of other than n is not supported by this server yet", "best_of",
                       "unsupported_parameter")


async def create(body: CompletionRequest, request: Request):
    state = request.app.state
    await state.check_model(body.model)
    body.check_supported()
    check_options(body)
    prompt = await prompt_ids(state, body)
    requests = [generate_request(body, prompt, body.logprobs, i) for i in range(body.n)]
    runner = Runner(state, "text_completion", body)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        return StreamingResponse(guarded(_events(body, runner, requests, rid, created)), media_type="text/event-stream")
    choices = await runner.collect(requests, request.is_disconnected)
    return CompletionResponse(
        id=rid, created=created, model=body.model,
        choices=[CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                  logprobs=completion_logprobs(c.logprobs) if body.logprobs is not None else None)
                 for c in choices],
        usage=Usage(**usage(len(prompt), sum(len(c.token_ids) for c in choices))),
    )


async def _events(body: CompletionRequest, runner: Runner, requests, rid: str, created: int) -> AsyncIterator[dict]:
    def chunk(choices, **extra):
        return {"id": rid, "object": "text_completion", "created": created, "model": body.model,
                "choices": choices, **extra}

    completion, prompt = 0, 0
    offsets = [0] * body.n
    async for piece in runner.stream(requests):
        r = piece.response
        completion += len(r.token_ids)
        prompt = r.usage.prompt_tokens or prompt
        if r.text or r.logprobs or piece.finish_reason:
            lp = None
            if body.logprobs is not None:
                lp = completion_logprobs(r.logprobs, offsets[piece.index]).model_dump()
            offsets[piece.index] += len(r.text)
            yield chunk([{"index": piece.index, "text": r.text, "logprobs": lp,
                          "finish_reason": piece.finish_reason}])
    if body.stream_options and body.stream_options.include_usage:
        yield chunk([], usage=usage(prompt, completion))
