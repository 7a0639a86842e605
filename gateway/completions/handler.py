"""Completions: one prompt or a list (strings or token ids), n choices each, answered whole or
streamed. Choice i * n + j is prompt i's choice j, as OpenAI numbers them; echo puts each prompt's
text before its choices' text."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway.chat.schemas import Usage
from gateway.completions.schemas import (CompletionChoice, CompletionRequest, CompletionResponse,
                                         completion_logprobs)
from gateway.errors import ApiError
from gateway.generation import Runner, cached_tokens, generate_request, usage
from gateway.sse import guarded

MAX_CHOICES = 128  # prompts x n in one request


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    text: str  # what echo returns: the prompt as sent, or its ids' text


def prompt_list(body: CompletionRequest) -> list[str | list[int]]:
    p = body.prompt
    prompts = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
    if not prompts or any(not q for q in prompts if isinstance(q, list)):
        raise ApiError(400, "prompt: must not be empty", "prompt")
    if len(prompts) * body.n > MAX_CHOICES:
        raise ApiError(400, f"prompt: {len(prompts)} prompts x n={body.n} is more than {MAX_CHOICES} choices", "prompt")
    return prompts


async def prompts_of(state, body: CompletionRequest) -> list[Prompt]:
    out = []
    for p in prompt_list(body):
        if isinstance(p, str):
            out.append(Prompt(await state.call(state.client.tokenize(p, True)), p))
        else:
            text = await state.call(state.client.detokenize(list(p), False)) if body.echo else ""
            out.append(Prompt(list(p), text))
    return out


def check_options(body: CompletionRequest) -> None:
    if body.echo and body.logprobs is not None:
        raise ApiError(400, "echo with logprobs (the prompt's logprobs) is not supported by this server yet", "echo",
                       "unsupported_parameter")
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
    prompts = await prompts_of(state, body)
    requests = [generate_request(body, p.ids, body.logprobs, i * body.n + j)
                for i, p in enumerate(prompts) for j in range(body.n)]
    runner = Runner(state, "text_completion", body)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    prompt_tokens = sum(len(p.ids) for p in prompts)
    if body.stream:
        events = _events(body, runner, requests, prompts, prompt_tokens, rid, created)
        return StreamingResponse(guarded(events), media_type="text/event-stream")
    choices = await runner.collect(requests, request.is_disconnected)
    echo = [prompts[c.index // body.n].text if body.echo else "" for c in choices]
    return CompletionResponse(
        id=rid, created=created, model=body.model,
        choices=[CompletionChoice(index=c.index, text=e + c.text, finish_reason=c.finish_reason,
                                  logprobs=completion_logprobs(c.logprobs) if body.logprobs is not None else None)
                 for c, e in zip(choices, echo)],
        usage=Usage(**usage(prompt_tokens, sum(len(c.token_ids) for c in choices),
                             cached_tokens({c.index: c.cached_tokens for c in choices}, body.n))),
    )


async def _events(body: CompletionRequest, runner: Runner, requests, prompts: list[Prompt], prompt_tokens: int,
                  rid: str, created: int) -> AsyncIterator[dict]:
    completion, cached = 0, {}
    options = body.stream_options

    def chunk(choices, **extra):
        if options and options.continuous_usage_stats and "usage" not in extra:
            extra["usage"] = usage(prompt_tokens, completion, cached_tokens(cached, body.n))
        return {"id": rid, "object": "text_completion", "created": created, "model": body.model,
                "choices": choices, **extra}

    offsets = [0] * len(requests)
    if body.echo:
        for i in range(len(requests)):
            offsets[i] = len(prompts[i // body.n].text)
            yield chunk([{"index": i, "text": prompts[i // body.n].text, "logprobs": None, "finish_reason": None}])
    async for piece in runner.stream(requests):
        r = piece.response
        completion += len(r.token_ids)
        cached[piece.index] = r.usage.cached_tokens or cached.get(piece.index, 0)
        if r.text or r.logprobs or piece.finish_reason:
            lp = None
            if body.logprobs is not None:
                lp = completion_logprobs(r.logprobs, offsets[piece.index]).model_dump()
            offsets[piece.index] += len(r.text)
            yield chunk([{"index": piece.index, "text": r.text, "logprobs": lp,
                          "finish_reason": piece.finish_reason}])
    if options and options.include_usage:
        yield chunk([], usage=usage(prompt_tokens, completion, cached_tokens(cached, body.n)))
