"""Anthropic's Messages API over the same generation as chat: the conversation (and tools) rendered
by the chat template, one choice split by the model's output parser into thinking, text and
tool_use blocks, answered whole or as Anthropic's stream of named events."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway.chat_template import render
from gateway.errors import ApiError
from gateway.generation import Runner, SamplingFields, generate_request
from gateway.messages.schemas import (CountRequest, MessagesRequest, MessagesResponse, TextBlock, ThinkingBlock,
                                      ToolUseBlock, Usage)
from gateway.parsing.base import Call, Parsed
from gateway.parsing.output import Incremental, OutputParser
from gateway.sse import dumps


async def prompt_text(state, body: CountRequest) -> tuple[str, str]:
    """(the rendered prompt, the chat template)."""
    info = await state.client.info()
    text = render(info.chat_template, body.chat(), info.bos_token, info.eos_token, add_generation_prompt=True,
                  tools=body.template_tools())
    return text, info.chat_template


def stop_reason(finish: str | None, stop_text: str, calls: bool) -> str | None:
    if finish == "length":
        return "max_tokens"
    if calls and finish == "stop":
        return "tool_use"
    return "stop_sequence" if stop_text else "end_turn" if finish else None


def sampling(body: MessagesRequest) -> SamplingFields:
    return SamplingFields(model=body.model, max_tokens=body.max_tokens, temperature=body.temperature,
                          top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences)


def forced_grammar(body: MessagesRequest, parser: OutputParser, tools: list[dict] | None) -> str | None:
    """Lark that forces calls for tool_choice any (any tool) or tool (the named one); else None."""
    choice = body.tool_choice
    if tools is None or choice is None or choice.type in ("auto", "none"):
        return None
    if choice.type == "tool":
        tools = [t for t in tools if t["name"] == choice.name]
    return parser.grammar(tools, one=choice.disable_parallel_tool_use)


def _single(body: MessagesRequest) -> bool:
    return body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use


async def count(body: CountRequest, request: Request) -> dict:
    state = request.app.state
    await state.check_model(body.model)
    text, _ = await prompt_text(state, body)
    return {"input_tokens": len(await state.call(state.client.tokenize(text, False)))}


async def create(body: MessagesRequest, request: Request):
    state = request.app.state
    await state.check_model(body.model)
    text, template = await prompt_text(state, body)
    tools = body.offered()
    parser = OutputParser.build(template, text, tools, state.config.tool_parser, state.config.reasoning_parser)
    forced = forced_grammar(body, parser, tools)
    prompt = await state.call(state.client.tokenize(text, False))
    fields = sampling(body)
    runner = Runner(state, "chat", fields)
    req = generate_request(fields, prompt, None, 0)
    if forced is not None:
        req.constraint.grammar = forced
        req.constraint.after = parser.constraint_after(text, for_tools=True)
    req.keep_special_tokens = parser.needs_special_tokens
    mid = f"msg_{uuid.uuid4().hex}"
    if body.stream:
        return StreamingResponse(_framed(_events(body, parser, runner, [req], len(prompt), mid)),
                                 media_type="text/event-stream")
    choice = (await runner.collect([req], request.is_disconnected) or [None])[0]
    if choice is None:
        raise ApiError(400, "the client went away")
    parsed = parser.parse(choice.text, final=True) if parser.active else Parsed(choice.text)
    calls = parsed.calls[:1] if _single(body) else parsed.calls
    return MessagesResponse(
        id=mid, model=body.model, content=_blocks(parsed, calls),
        stop_reason=stop_reason(choice.finish_reason, choice.stop_text, bool(calls)),
        stop_sequence=choice.stop_text or None,
        usage=Usage(input_tokens=len(prompt), output_tokens=len(choice.token_ids),
                    cache_read_input_tokens=choice.cached_tokens),
    )


def _blocks(parsed: Parsed, calls: list[Call]) -> list:
    out = [ThinkingBlock(thinking=parsed.reasoning)] if parsed.reasoning else []
    if parsed.content or not calls:
        out.append(TextBlock(type="text", text=parsed.content))
    return out + [ToolUseBlock(type="tool_use", id=_use_id(), name=c.name, input=json.loads(c.arguments))
                  for c in calls]


def _use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


async def _framed(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Anthropic's SSE: `event: <type>` then its data; an error mid-stream is an error event."""
    try:
        async for event in events:
            yield b"event: " + event["type"].encode() + b"\ndata: " + dumps(event) + b"\n\n"
    except ApiError as exc:
        error = {"type": "error", "error": {"type": exc.body()["error"]["type"], "message": exc.message}}
        yield b"event: error\ndata: " + dumps(error) + b"\n\n"


class _Blocks:
    """Anthropic's content blocks as a stream: each opened when its first delta comes, closed when
    another kind starts or the message ends."""

    START = {"thinking": {"type": "thinking", "thinking": "", "signature": ""}, "text": {"type": "text", "text": ""}}
    DELTA = {"thinking": "thinking_delta", "text": "text_delta"}

    def __init__(self):
        self.index, self.open = -1, None

    def switch(self, kind: str | None, start: dict | None = None) -> list[dict]:
        out = [{"type": "content_block_stop", "index": self.index}] if self.open else []
        self.open = kind
        if kind is not None:
            self.index += 1
            out.append({"type": "content_block_start", "index": self.index,
                        "content_block": start or dict(self.START[kind])})
        return out

    def text(self, kind: str, text: str) -> list[dict]:
        out = self.switch(kind) if self.open != kind else []
        delta = {"type": self.DELTA[kind], kind: text}
        return out + [{"type": "content_block_delta", "index": self.index, "delta": delta}]

    def call(self, call: Call) -> list[dict]:
        out = self.switch("tool_use", {"type": "tool_use", "id": _use_id(), "name": call.name, "input": {}})
        delta = {"type": "input_json_delta", "partial_json": call.arguments}
        return out + [{"type": "content_block_delta", "index": self.index, "delta": delta}] + self.switch(None)

    def close(self) -> list[dict]:
        """The last block closed; an answer with no block at all gets one empty text block."""
        return self.switch(None) if self.index >= 0 else self.switch("text") + self.switch(None)


async def _events(body: MessagesRequest, parser: OutputParser, runner: Runner, requests, prompt_tokens: int,
                  mid: str) -> AsyncIterator[dict]:
    message = {"id": mid, "type": "message", "role": "assistant", "model": body.model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
    yield {"type": "message_start", "message": message}
    blocks, stream = _Blocks(), Incremental(parser)
    output, finish, stop_text, cached, calls = 0, None, "", 0, 0
    async for piece in runner.stream(requests):
        r = piece.response
        output += len(r.token_ids)
        d = stream.feed(r.text, final=piece.finish_reason is not None) if parser.active else None
        events = (blocks.text("text", r.text) if r.text else []) if d is None else _delta_events(blocks, d)
        for call in (d.calls if d is not None else []):
            if calls == 0 or not _single(body):
                events += blocks.call(call)
                calls += 1
        for event in events:
            yield event
        if piece.finish_reason:
            finish, stop_text, cached = piece.finish_reason, r.stop_text, r.usage.cached_tokens
    for event in blocks.close():
        yield event
    yield {"type": "message_delta", "delta": {"stop_reason": stop_reason(finish, stop_text, calls > 0),
                                              "stop_sequence": stop_text or None},
           "usage": {"output_tokens": output, "input_tokens": prompt_tokens, "cache_read_input_tokens": cached}}
    yield {"type": "message_stop"}


def _delta_events(blocks: _Blocks, d) -> list[dict]:
    out = blocks.text("thinking", d.reasoning) if d.reasoning else []
    return out + (blocks.text("text", d.content) if d.content else [])
