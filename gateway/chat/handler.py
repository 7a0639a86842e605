"""Chat completions: render the chat template, tokenize, generate n choices, answer or stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway.chat.schemas import AssistantMessage, ChatChoice, ChatRequest, ChatResponse, Usage, token_logprobs
from gateway.chat_template import render
from gateway.generation import Runner, cached_tokens, generate_request, usage
from gateway.sse import guarded


async def prompt_ids(state, body: ChatRequest) -> list[int]:
    info = await state.client.info()
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    text = render(info.chat_template, messages, info.bos_token, info.eos_token, add_generation_prompt=True)
    return await state.call(state.client.tokenize(text, False))


async def create(body: ChatRequest, request: Request):
    state = request.app.state
    await state.check_model(body.model)
    body.check_supported()
    prompt = await prompt_ids(state, body)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    requests = [generate_request(body, prompt, logprobs, i) for i in range(body.n)]
    runner = Runner(state, "chat", body)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        events = _events(body, runner, requests, len(prompt), rid, created)
        return StreamingResponse(guarded(events), media_type="text/event-stream")
    choices = await runner.collect(requests, request.is_disconnected)
    return ChatResponse(
        id=rid, created=created, model=body.model,
        choices=[ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                            logprobs=token_logprobs(c.logprobs) if body.logprobs else None,
                            finish_reason=c.finish_reason) for c in choices],
        usage=Usage(**usage(len(prompt), sum(len(c.token_ids) for c in choices),
                             cached_tokens({c.index: c.cached_tokens for c in choices}, body.n))),
    )


async def _events(body: ChatRequest, runner: Runner, requests, prompt_tokens: int, rid: str, created: int
                  ) -> AsyncIterator[dict]:
    completion, cached = 0, {}
    options = body.stream_options

    def chunk(choices, **extra):
        if options and options.continuous_usage_stats and "usage" not in extra:
            extra["usage"] = usage(prompt_tokens, completion, cached_tokens(cached, body.n))
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                "choices": choices, **extra}

    for i in range(body.n):
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    async for piece in runner.stream(requests):
        r = piece.response
        completion += len(r.token_ids)
        cached[piece.index] = r.usage.cached_tokens or cached.get(piece.index, 0)
        if r.text or r.logprobs:
            lp = token_logprobs(r.logprobs).model_dump() if body.logprobs else None
            yield chunk([{"index": piece.index, "delta": {"content": r.text}, "logprobs": lp, "finish_reason": None}])
        if piece.finish_reason:
            yield chunk([{"index": piece.index, "delta": {}, "logprobs": None, "finish_reason": piece.finish_reason}])
    if options and options.include_usage:
        yield chunk([], usage=usage(prompt_tokens, completion, cached_tokens(cached, body.n)))
