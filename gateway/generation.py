"""What chat and completions share: the OpenAI sampling fields, their translation to the dense
service's GenerateRequest, and running n choices (collected, or merged into one stream) with the
client's disconnect cancelling every call."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import ApiError, from_grpc
from gateway.metrics import Metrics
from tandem.v1 import dense_pb2 as pb

log = logging.getLogger(__name__)
FINISH = {pb.STOP: "stop", pb.LENGTH: "length", pb.ABORT: "abort"}
INT32 = 2**31  # the dense protocol's integer fields hold 32 bits
TokenId = Annotated[int, Field(ge=0, lt=INT32)]
Count = Annotated[int, Field(ge=1, lt=INT32)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The OpenAI parameters both endpoints take, plus the extras clients send via extra_body."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = Field(None, ge=-1, lt=INT32)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, lt=INT32)
    logit_bias: dict[str, float] | None = None

    def check_supported(self) -> None:
        extra = sorted(self.model_extra or {})
        unsupported = {"tools", "tool_choice", "functions", "function_call", "response_format", "audio",
                       "prediction", "web_search_options"}
        for name in extra:
            value = self.model_extra[name]
            if name in unsupported and value not in (None, [], {}, "none", "auto") and value != {"type": "text"}:
                raise ApiError(400, f"{name} is not supported by this server yet", name, "unsupported_parameter")
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported by this server yet", "logit_bias", "unsupported_parameter")
        ignored = [n for n in extra if n not in unsupported]
        if ignored:
            log.warning("ignoring unknown request fields: %s", ", ".join(ignored))

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


def generate_request(req: SamplingFields, prompt: list[int], logprobs: int | None, index: int) -> pb.GenerateRequest:
    """The dense request for choice `index` (a given seed becomes seed + index, so choices differ)."""
    s = pb.SamplingParams()
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if getattr(req, name) is not None:
            setattr(s, name, getattr(req, name))
    if req.top_k is not None:
        s.top_k = max(req.top_k, 0)
    if req.seed is not None:
        s.seed = (req.seed + index) % 2**63
    stopping = pb.StoppingCriteria(min_tokens=req.min_tokens, ignore_eos=req.ignore_eos)
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is not None:
        stopping.max_tokens = max_tokens
    stopping.stop.extend([pb.Stop(text=t) for t in req.stops()] +
                         [pb.Stop(token_id=t) for t in req.stop_token_ids or []])
    out = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=s, stopping=stopping)
    if logprobs is not None:
        out.logprobs = logprobs
    return out


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0


@dataclass
class Piece:
    """One streamed response of one choice."""

    index: int
    response: pb.GenerateResponse

    @property
    def finish_reason(self) -> str | None:
        return FINISH.get(self.response.finish_reason)


class Runner:
    """Runs the dense calls of one HTTP request and records its metrics."""

    def __init__(self, client, metrics: Metrics, retry_after_s: int):
        self.client, self.metrics, self.retry_after_s = client, metrics, retry_after_s

    async def stream(self, requests: list[pb.GenerateRequest]) -> AsyncIterator[Piece]:
        """The n choices' responses merged as they come; raises ApiError on a dense error."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, r, queue)) for i, r in enumerate(requests)]
        clock = _Clock(self.metrics)
        self.metrics.running.inc()
        try:
            for _ in range(len(tasks)):
                while True:
                    item = await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    if item is None:
                        break
                    clock.tick(item)
                    yield item
            clock.done()
        except (GeneratorExit, asyncio.CancelledError):
            self.metrics.disconnects.inc()  # the client went away mid-stream
            raise
        finally:
            self.metrics.running.dec()
            for task in tasks:
                task.cancel()

    async def _pump(self, index: int, request: pb.GenerateRequest, queue: asyncio.Queue) -> None:
        try:
            async for response in self.client.generate(request):
                await queue.put(Piece(index, response))
        except grpc.aio.AioRpcError as exc:
            await queue.put(from_grpc(exc, self.retry_after_s))
            return
        await queue.put(None)

    async def collect(self, requests: list[pb.GenerateRequest], disconnected) -> list[Choice]:
        """All choices whole; cancels everything if the client goes away (then returns [])."""
        task = asyncio.ensure_future(self._collect(requests))
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await disconnected():
                self.metrics.disconnects.inc()
                task.cancel()
                return []

    async def _collect(self, requests) -> list[Choice]:
        choices = [Choice(i) for i in range(len(requests))]
        async for piece in self.stream(requests):
            c, r = choices[piece.index], piece.response
            c.text += r.text
            c.token_ids += r.token_ids
            c.logprobs += r.logprobs
            c.finish_reason = piece.finish_reason or c.finish_reason
            c.prompt_tokens = r.usage.prompt_tokens or c.prompt_tokens
        return choices


class _Clock:
    """Time to first token, inter-token latency, end-to-end latency, token counts, finish reasons."""

    def __init__(self, metrics: Metrics):
        self.metrics, self.start, self.last = metrics, time.monotonic(), None
        self.prompt = self.generated = 0
        self.reasons: list[str] = []

    def tick(self, piece: Piece) -> None:
        now, r = time.monotonic(), piece.response
        if r.token_ids:
            if self.last is None:
                self.metrics.ttft.observe(now - self.start)
            else:
                self.metrics.itl.observe(now - self.last)
            self.last = now
        if piece.finish_reason:
            self.reasons.append(piece.finish_reason)
            self.prompt = max(self.prompt, r.usage.prompt_tokens)  # the same prompt for every choice
            self.generated += r.usage.completion_tokens

    def done(self) -> None:
        m = self.metrics
        m.e2e.observe(time.monotonic() - self.start)
        m.prompt_tokens.inc(self.prompt)
        m.generation_tokens.inc(self.generated)
        for reason in self.reasons:
            m.finished.labels(finished_reason=reason).inc()


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
