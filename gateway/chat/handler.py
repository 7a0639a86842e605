"""Chat completions: render the chat template (with the tools), tokenize, generate n choices, split
each answer into reasoning, content and tool calls, answer or stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway.chat import tools as chat_tools
from gateway.chat.schemas import AssistantMessage, ChatChoice, ChatRequest, ChatResponse, Usage, token_logprobs
from gateway.chat_template import render
from gateway.generation import Runner, cached_tokens, generate_request, usage
from gateway.parsing.base import Parsed, call_id
from gateway.parsing.output import Incremental, OutputParser
from gateway.sse import guarded


async def prompt_text(state, body: ChatRequest) -> tuple[str, str]:
    """(the rendered prompt, the chat template)."""
    info = await state.client.info()
    variables = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        variables.setdefault("reasoning_effort", body.reasoning_effort)
    text = render(info.chat_template, chat_tools.template_messages(body), info.bos_token, info.eos_token,
                  add_generation_prompt=True, tools=chat_tools.template_tools(body), **variables)
    return text, info.chat_template


async def create(body: ChatRequest, request: Request):
    state = request.app.state
    await state.check_model(body.model)
    body.check_supported()
    text, template = await prompt_text(state, body)
    tools = chat_tools.offered(body)
    cfg = state.config
    parser = OutputParser.build(template, text, tools, cfg.tool_parser, cfg.reasoning_parser)
    forced = chat_tools.forced_grammar(body, parser, tools)
    prompt = await state.call(state.client.tokenize(text, False))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    requests = [generate_request(body, prompt, logprobs, i) for i in range(body.n)]
    for r in requests:
        if forced is not None:
            r.constraint.grammar = forced
        if r.HasField("constraint"):
            r.constraint.after = parser.constraint_after(text, for_tools=forced is not None)
        r.keep_special_tokens = parser.needs_special_tokens
    runner = Runner(state, "chat", body)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        events = _events(body, parser, runner, requests, len(prompt), rid, created)
        return StreamingResponse(guarded(events), media_type="text/event-stream")
    choices = await runner.collect(requests, request.is_disconnected)
    return ChatResponse(
        id=rid, created=created, model=body.model, choices=[_choice(body, parser, c) for c in choices],
        usage=Usage(**usage(len(prompt), sum(len(c.token_ids) for c in choices),
                             cached_tokens({c.index: c.cached_tokens for c in choices}, body.n))),
    )


def _choice(body: ChatRequest, parser: OutputParser, c) -> ChatChoice:
    parsed = parser.parse(c.text, final=True) if parser.active else Parsed(c.text)
    calls = chat_tools.tool_calls(parsed.calls, body.parallel_tool_calls) if parsed.calls else None
    message = AssistantMessage(content=parsed.content or (None if calls else ""), tool_calls=calls,
                               reasoning_content=parsed.reasoning or None, reasoning=parsed.reasoning or None)
    return ChatChoice(index=c.index, message=message, logprobs=token_logprobs(c.logprobs) if body.logprobs else None,
                      finish_reason=_finish(c.finish_reason, calls))


def _finish(reason: str | None, calls) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


async def _events(body: ChatRequest, parser: OutputParser, runner: Runner, requests, prompt_tokens: int, rid: str,
                  created: int) -> AsyncIterator[dict]:
    completion, cached = 0, {}
    options = body.stream_options
    streams = [Incremental(parser) for _ in requests]
    calls_sent = [0] * len(requests)

    def chunk(choices, **extra):
        if options and options.continuous_usage_stats and "usage" not in extra:
            extra["usage"] = usage(prompt_tokens, completion, cached_tokens(cached, body.n))
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                "choices": choices, **extra}

    def delta(index, d, lp=None):
        return chunk([{"index": index, "delta": d, "logprobs": lp, "finish_reason": None}])

    for i in range(body.n):
        yield delta(i, {"role": "assistant", "content": ""})
    async for piece in runner.stream(requests):
        r, i = piece.response, piece.index
        completion += len(r.token_ids)
        cached[i] = r.usage.cached_tokens or cached.get(i, 0)
        lp = token_logprobs(r.logprobs).model_dump() if body.logprobs and r.logprobs else None
        if not parser.active:
            if r.text or lp:
                yield delta(i, {"content": r.text}, lp)
        else:
            d = streams[i].feed(r.text, final=piece.finish_reason is not None)
            if d.reasoning:
                yield delta(i, {"reasoning_content": d.reasoning, "reasoning": d.reasoning})
            if d.content or lp:
                yield delta(i, {"content": d.content}, lp)
            for call in d.calls if body.parallel_tool_calls or calls_sent[i] == 0 else ():
                for event in _call_deltas(calls_sent[i], call):
                    yield delta(i, event)
                calls_sent[i] += 1
                if not body.parallel_tool_calls:
                    break
        if piece.finish_reason:
            reason = _finish(piece.finish_reason, calls_sent[i])
            yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}])
    if options and options.include_usage:
        yield chunk([], usage=usage(prompt_tokens, completion, cached_tokens(cached, body.n)))


def _call_deltas(index: int, call) -> list[dict]:
    """A call as OpenAI streams it: its id, type and name first, then the arguments."""
    head = {"index": index, "id": call_id(call), "type": "function", "function": {"name": call.name, "arguments": ""}}
    return [{"tool_calls": [head]}, {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]
