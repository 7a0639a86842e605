"""What chat and completions share: the OpenAI sampling fields, their translation to the dense
service's GenerateRequest, and running n choices (collected, or merged into one stream) with the
client's disconnect cancelling every call."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated

import grpc
from opentelemetry import trace
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from gateway.errors import ApiError, FieldError, from_grpc
from gateway.metrics import Metrics
from gateway.structured import ConstraintFields
from services.common import telemetry
from tandem.v1 import dense_pb2 as pb

log = logging.getLogger(__name__)
_tracer = telemetry.tracer("tandem.gateway")
FINISH = {pb.STOP: "stop", pb.LENGTH: "length", pb.ABORT: "abort"}
INT32 = 2**31  # the dense protocol's integer fields hold 32 bits
MAX_BIAS = 100.0
TokenId = Annotated[int, Field(ge=0, lt=INT32)]
Count = Annotated[int, Field(ge=1, lt=INT32)]


def lone_surrogate(value, path: str = "") -> str | None:
    """The path of the first string (key or value) in a parsed JSON body that is not valid Unicode:
    JSON's \\ud800 escapes parse to lone surrogates, which no tokenizer or protobuf string takes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        found = lone_surrogate(key, where) if isinstance(key, str) else None
        found = found or lone_surrogate(item, where)
        if found:
            return found
    return None


class RequestBody(BaseModel):
    """A request model whose every string is valid Unicode (else a 400 naming the field)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        where = lone_surrogate(data)
        if where:
            raise FieldError(where, "holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                                    "which is not valid Unicode")
        return data


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage so far on every chunk (vLLM's extension)


Bias = Annotated[float, Field(allow_inf_nan=False)]


class SamplingFields(RequestBody, ConstraintFields):
    """The OpenAI parameters both endpoints take, plus the extras clients send via extra_body."""

    model_config = ConfigDict(extra="allow")
    _grammar: tuple[str, str] | None = PrivateAttr(None)  # (llguidance grammar, its field), set by check_supported

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
    logit_bias: dict[str, Bias] | None = None  # token id (as a string) -> bias, clamped to [-100, 100]

    def check_supported(self) -> None:
        """Refuses what this server cannot do yet; checks the output constraint (a 400 naming its field)."""
        extra = sorted(self.model_extra or {})
        unsupported = {"tools", "tool_choice", "functions", "function_call", "audio", "prediction",
                       "web_search_options"}
        for name in extra:
            value = self.model_extra[name]
            if name in unsupported and value not in (None, [], {}, "none", "auto") and value != {"type": "text"}:
                raise ApiError(400, f"{name} is not supported by this server yet", name, "unsupported_parameter")
        ignored = [n for n in extra if n not in unsupported]
        if ignored:
            log.warning("ignoring unknown request fields: %s", ", ".join(ignored))
        self._grammar = self.constraint()

    def bias(self) -> dict[int, float]:
        """logit_bias with integer keys and values clamped to [-100, 100] (as OpenAI does)."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().isdigit() or int(key) >= INT32:
                raise ApiError(400, f"logit_bias: keys must be token ids, got {key!r}", "logit_bias")
            out[int(key)] = min(max(value, -MAX_BIAS), MAX_BIAS)
        return out

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
    s.logit_bias.update(req.bias())
    stopping = pb.StoppingCriteria(min_tokens=req.min_tokens, ignore_eos=req.ignore_eos)
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is not None:
        stopping.max_tokens = max_tokens
    stopping.stop.extend([pb.Stop(text=t) for t in req.stops()] +
                         [pb.Stop(token_id=t) for t in req.stop_token_ids or []])
    out = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=s, stopping=stopping)
    if req._grammar is not None:
        out.constraint.grammar = req._grammar[0]
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
    cached_tokens: int = 0
    stop_text: str = ""


@dataclass
class Piece:
    """One streamed response of one choice."""

    index: int
    response: pb.GenerateResponse

    @property
    def finish_reason(self) -> str | None:
        return FINISH.get(self.response.finish_reason)


class Runner:
    """Runs the dense calls of one HTTP request, traces it (one span after the GenAI conventions,
    whose context travels to the dense service in gRPC metadata) and records its metrics."""

    def __init__(self, state, operation: str, body: SamplingFields, prompt_text: str = ""):
        self.client, self.metrics = state.client, state.metrics
        self.retry_after_s, self.tracing = state.config.retry_after_s, state.config.tracing
        self.operation, self.body, self.prompt_text = operation, body, prompt_text

    def _span(self):
        b = self.body
        attributes = {"gen_ai.operation.name": self.operation, "gen_ai.provider.name": "tandem",
                      "gen_ai.request.model": b.model}
        for key, value in (("max_tokens", b.max_completion_tokens or b.max_tokens), ("temperature", b.temperature),
                           ("top_p", b.top_p), ("seed", b.seed), ("choice.count", b.n)):
            if value is not None:
                attributes[f"gen_ai.request.{key}"] = value
        if self.tracing.record_content and self.prompt_text:
            attributes["gen_ai.prompt"] = self.prompt_text
        return _tracer.start_span(f"{self.operation} {b.model}", kind=trace.SpanKind.CLIENT, attributes=attributes)

    async def stream(self, requests: list[pb.GenerateRequest]) -> AsyncIterator[Piece]:
        """The n choices' responses merged as they come; raises ApiError on a dense error."""
        span = self._span()
        clock = _Clock(self.metrics)
        self.metrics.running.inc()
        try:
            async with contextlib.aclosing(self._merged(requests, telemetry.metadata(span))) as pieces:
                async for piece in pieces:
                    clock.tick(piece)
                    yield piece
            clock.done()
        except ApiError as exc:
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
            raise
        except (GeneratorExit, asyncio.CancelledError):
            self.metrics.disconnects.inc()  # the client went away mid-stream
            clock.reasons.append("abort")
            raise
        finally:
            self.metrics.running.dec()
            clock.annotate(span, self.tracing.record_content)
            span.end()

    async def _merged(self, requests: list[pb.GenerateRequest], metadata) -> AsyncIterator[Piece]:
        """One choice's stream as it is (no task and queue between it and the client: a streamed
        token crosses the event loop once); several merged through a queue, a task each."""
        if len(requests) == 1:
            async with contextlib.aclosing(self._responses(0, requests[0], metadata)) as pieces:
                async for piece in pieces:
                    yield piece
            return
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, r, queue, metadata)) for i, r in enumerate(requests)]
        try:
            for _ in range(len(tasks)):
                while (item := await queue.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    async def _responses(self, index: int, request: pb.GenerateRequest, metadata) -> AsyncIterator[Piece]:
        """One choice's responses; a dense error raises ApiError."""
        try:
            async for response in self.client.generate(request, metadata):
                yield Piece(index, response)
        except grpc.aio.AioRpcError as exc:
            raise from_grpc(exc, self.retry_after_s) from None

    async def _pump(self, index: int, request: pb.GenerateRequest, queue: asyncio.Queue, metadata) -> None:
        try:
            async for piece in self._responses(index, request, metadata):
                await queue.put(piece)
        except Exception as exc:  # an ApiError, or a bug: raised by the merge, which would wait otherwise
            await queue.put(exc)
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
            c.cached_tokens = r.usage.cached_tokens or c.cached_tokens
            c.stop_text = r.stop_text or c.stop_text
        return choices


class _Clock:
    """Time to first token, inter-token latency, end-to-end latency, token counts, finish reasons."""

    def __init__(self, metrics: Metrics):
        self.metrics, self.start, self.last = metrics, time.monotonic(), None
        self.prompt = self.generated = 0
        self.reasons: list[str] = []
        self.ttft: float | None = None
        self.timing = (0.0, 0.0, 0.0)
        self.text: list[str] = []

    def tick(self, piece: Piece) -> None:
        now, r = time.monotonic(), piece.response
        if r.token_ids:
            if self.last is None:
                self.ttft = now - self.start
                self.metrics.ttft.observe(self.ttft)
            else:
                self.metrics.itl.observe(now - self.last)
            self.last = now
        self.text.append(r.text)
        if piece.finish_reason:
            self.reasons.append(piece.finish_reason)
            self.prompt = max(self.prompt, r.usage.prompt_tokens)  # the same prompt for every choice
            self.generated += r.usage.completion_tokens
            t = r.timing
            self.timing = tuple(max(a, b) for a, b in zip(self.timing, (t.queue_s, t.prefill_s, t.decode_s)))

    def done(self) -> None:
        m = self.metrics
        m.e2e.observe(time.monotonic() - self.start)
        m.prompt_tokens.inc(self.prompt)
        m.generation_tokens.inc(self.generated)
        for reason in self.reasons:
            m.finished.labels(finished_reason=reason).inc()

    def annotate(self, span, record_content: bool) -> None:
        """The GenAI usage and finish reasons, and where the time went, on the request's span."""
        span.set_attributes({
            "gen_ai.usage.input_tokens": self.prompt, "gen_ai.usage.output_tokens": self.generated,
            "gen_ai.response.finish_reasons": self.reasons or ["error"],
            "tandem.latency.queue_s": self.timing[0], "tandem.latency.prefill_s": self.timing[1],
            "tandem.latency.decode_s": self.timing[2], "tandem.latency.e2e_s": time.monotonic() - self.start,
        })
        if self.ttft is not None:
            span.set_attribute("tandem.latency.time_to_first_token_s", self.ttft)
        if record_content:
            span.set_attribute("gen_ai.completion", "".join(self.text))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def cached_tokens(by_choice: dict[int, int], n: int) -> int:
    """Prompt tokens served from the prefix cache: each prompt's (choices i * n + j share prompt i)
    best choice, summed over the prompts."""
    best: dict[int, int] = {}
    for index, cached in by_choice.items():
        best[index // n] = max(best.get(index // n, 0), cached)
    return sum(best.values())
