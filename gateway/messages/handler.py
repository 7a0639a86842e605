"""Anthropic's Messages API over the same generation as chat: the conversation rendered by the
chat template, one choice, answered whole or as Anthropic's stream of named events."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway.chat_template import render
from gateway.errors import ApiError
from gateway.generation import Runner, SamplingFields, generate_request
from gateway.messages.schemas import CountRequest, MessagesRequest, MessagesResponse, TextBlock, Usage


async def prompt_ids(state, body: CountRequest) -> list[int]:
    info = await state.client.info()
    text = render(info.chat_template, body.chat(), info.bos_token, info.eos_token, add_generation_prompt=True)
    return await state.call(state.client.tokenize(text, False))


def stop_reason(finish: str | None, stop_text: str) -> str | None:
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_text else "end_turn" if finish else None


def sampling(body: MessagesRequest) -> SamplingFields:
    return SamplingFields(model=body.model, max_tokens=body.max_tokens, temperature=body.temperature,
                          top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences)


async def count(body: CountRequest, request: Request) -> dict:
    state = request.app.state
    await state.check_model(body.model)
    return {"input_tokens": len(await prompt_ids(state, body))}


async def create(body: MessagesRequest, request: Request):
    state = request.app.state
    await state.check_model(body.model)
    prompt = await prompt_ids(state, body)
    fields = sampling(body)
    runner = Runner(state, "chat", fields)
    requests = [generate_request(fields, prompt, None, 0)]
    mid = f"msg_{uuid.uuid4().hex}"
    if body.stream:
        return StreamingResponse(_framed(_events(body, runner, requests, len(prompt), mid)),
                                 media_type="text/event-stream")
    choice = (await runner.collect(requests, request.is_disconnected) or [None])[0]
    if choice is None:
        raise ApiError(400, "the client went away")
    return MessagesResponse(
        id=mid, model=body.model, content=[TextBlock(type="text", text=choice.text)],
        stop_reason=stop_reason(choice.finish_reason, choice.stop_text), stop_sequence=choice.stop_text or None,
        usage=Usage(input_tokens=len(prompt), output_tokens=len(choice.token_ids),
                    cache_read_input_tokens=choice.cached_tokens),
    )


async def _framed(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Anthropic's SSE: `event: <type>` then its data; an error mid-stream is an error event."""
    try:
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
    except ApiError as exc:
        error = {"type": "error", "error": {"type": exc.body()["error"]["type"], "message": exc.message}}
        yield f"event: error\ndata: {json.dumps(error, ensure_ascii=False)}\n\n"


async def _events(body: MessagesRequest, runner: Runner, requests, prompt_tokens: int, mid: str
                  ) -> AsyncIterator[dict]:
    message = {"id": mid, "type": "message", "role": "assistant", "model": body.model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
    yield {"type": "message_start", "message": message}
    yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    output, finish, stop_text, cached = 0, None, "", 0
    async for piece in runner.stream(requests):
        r = piece.response
        output += len(r.token_ids)
        if r.text:
            yield {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": r.text}}
        if piece.finish_reason:
            finish, stop_text, cached = piece.finish_reason, r.stop_text, r.usage.cached_tokens
    yield {"type": "content_block_stop", "index": 0}
    yield {"type": "message_delta", "delta": {"stop_reason": stop_reason(finish, stop_text),
                                              "stop_sequence": stop_text or None},
           "usage": {"output_tokens": output, "input_tokens": prompt_tokens, "cache_read_input_tokens": cached}}
    yield {"type": "message_stop"}
