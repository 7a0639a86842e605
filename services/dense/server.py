"""The dense service's gRPC servicer: Generate, Tokenize, Detokenize, GetModelInfo.

Requests are translated to engine Requests here; domain errors become status codes through
services.common.grpc_status and nowhere else.
"""

from __future__ import annotations

import itertools
import queue
import time
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from services.common.errors import InvalidRequestError, TandemError
from services.common import telemetry
from services.common.grpc_status import abort, status_of
from services.dense import tracing
from services.dense.constraint import Grammars
from services.dense.engine import Engine
from services.dense.request import Output, Request
from services.dense.sampling import SamplingParams
from services.dense.tokenizer import Tokenizer
from tandem.v1 import dense_pb2 as pb
from tandem.v1 import dense_pb2_grpc as pb_grpc

FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.STOP, "length": pb.LENGTH, "abort": pb.ABORT}
_ids = itertools.count()


@dataclass(frozen=True)
class ModelInfo:
    name: str
    experts: str
    expert_servers: tuple[str, ...]
    dtype: str
    device: str
    generate_port: int = 0  # the grpc++ Generate server's (0: none)


def sampling_params(req: pb.GenerateRequest) -> SamplingParams:
    """The request's sampling and stopping fields, validated (errors name the field)."""
    s, st = req.sampling, req.stopping
    stops, stop_ids = [], []
    for i, stop in enumerate(st.stop):
        kind = stop.WhichOneof("kind")
        if kind == "text":
            stops.append(stop.text)
        elif kind == "token_id":
            stop_ids.append(stop.token_id)
        else:
            raise InvalidRequestError(f"stopping.stop[{i}]: unknown stop type (set text or token_id)")

    def opt(msg, name, default):
        return getattr(msg, name) if msg.HasField(name) else default

    return SamplingParams(
        temperature=opt(s, "temperature", 1.0), top_p=opt(s, "top_p", 1.0), top_k=opt(s, "top_k", 0),
        seed=opt(s, "seed", None), max_tokens=opt(st, "max_tokens", None), min_p=opt(s, "min_p", 0.0),
        repetition_penalty=opt(s, "repetition_penalty", 1.0), presence_penalty=opt(s, "presence_penalty", 0.0),
        frequency_penalty=opt(s, "frequency_penalty", 0.0), min_tokens=st.min_tokens, stop=tuple(stops),
        stop_token_ids=tuple(stop_ids), ignore_eos=st.ignore_eos,
        logprobs=req.logprobs if req.HasField("logprobs") else None, logit_bias=tuple(sorted(s.logit_bias.items())),
    )


class SinkOutputs:
    """A request's outputs onto a grpc++ Generate stream: the engine's thread puts each, serialized
    (an error ends the stream with its status)."""

    def __init__(self, sink, response):
        self.sink, self.response = sink, response

    def put(self, out: Output) -> None:
        if out.error is not None:
            self.sink.fail(status_of(out.error).value[0], str(out.error))
        else:
            self.sink.push(self.response(out).SerializeToString(), out.finished)


class DenseServicer(pb_grpc.DenseServiceServicer):
    def __init__(self, engine: Engine, tokenizer: Tokenizer, info: ModelInfo):
        self.engine, self.tokenizer, self.info = engine, tokenizer, info
        self.grammars = Grammars(tokenizer.path, tokenizer.eos_token_ids)

    def _request(self, req: pb.GenerateRequest, remaining: float | None) -> Request:
        kind = req.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequestError("prompt: set text or token_ids")
        prompt = (self.tokenizer.encode(req.text, add_special_tokens=req.add_special_tokens) if kind == "text"
                  else list(req.token_ids.ids))
        params = sampling_params(req)
        constraint = None
        if req.HasField("constraint") and req.constraint.grammar:
            constraint = self.grammars.constraint(req.constraint.grammar, req.constraint.after)
        return Request(
            request_id=req.request_id or f"req-{next(_ids)}", prompt=prompt, params=params,
            eos_ids=self.tokenizer.eos_token_ids, tokenizer=self.tokenizer,
            deadline=None if remaining is None else time.monotonic() + remaining,
            constraint=constraint, keep_special_tokens=req.keep_special_tokens,
        )

    def _open(self, request: pb.GenerateRequest, remaining: float | None, metadata: dict[str, str],
              outputs=None) -> Request:
        """The request checked, traced and submitted (its outputs into `outputs` when given); raises
        the domain error that refused it."""
        req = self._request(request, remaining)
        if outputs is not None:
            req.outputs = outputs
        tracing.start_request(telemetry.context_from(metadata), req)
        try:
            self.engine.submit(req)
        except TandemError as exc:
            tracing.end_request(req, None, exc)
            raise
        return req

    def Generate(self, request, context):
        try:
            req = self._open(request, context.time_remaining(), dict(context.invocation_metadata()))
        except TandemError as exc:
            abort(context, exc)
        context.add_callback(lambda: self.engine.abort(req))
        while True:
            try:
                out = req.outputs.get(timeout=0.25)
            except queue.Empty:
                if not context.is_active():
                    self.engine.abort(req)
                    return
                continue
            if out.error is not None:
                abort(context, out.error)
            yield self._response(out)
            if out.finished:
                return

    def open_stream(self, sink, request: bytes, metadata: dict[str, str], remaining: float | None):
        """Generate on the grpc++ server (tandem_grpc.GenerateServer): the request submitted with its
        outputs pushed into sink as they come -> (0, "", abort), or (status code, message, None)."""
        try:
            req = self._open(pb.GenerateRequest.FromString(request), remaining, metadata,
                             SinkOutputs(sink, self._response))
        except DecodeError as exc:
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], f"the request did not parse: {exc}", None
        except TandemError as exc:
            return status_of(exc).value[0], str(exc), None
        return 0, "", lambda: self.engine.abort(req)

    def _response(self, out: Output) -> pb.GenerateResponse:
        text_of = self.tokenizer.token_text
        logprobs = [
            pb.TokenLogprob(token_id=lp.token, logprob=lp.logprob, token=text_of(lp.token),
                            top=[pb.TopLogprob(token_id=t, logprob=v, token=text_of(t)) for t, v in lp.top])
            for lp in out.logprobs
        ]
        usage = pb.Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                         cached_tokens=out.cached_tokens)
        timing = None
        if out.timing is not None:
            timing = pb.Timing(queue_s=out.timing[0], prefill_s=out.timing[1], decode_s=out.timing[2])
        return pb.GenerateResponse(token_ids=out.token_ids, text=out.text, logprobs=logprobs,
                                   finish_reason=FINISH[out.finish_reason], usage=usage, timing=timing,
                                   stop_text=out.stop_text)

    def Tokenize(self, request, context):
        return pb.TokenizeResponse(token_ids=self.tokenizer.encode(request.text, request.add_special_tokens))

    def Detokenize(self, request, context):
        vocab = self.engine.model.cfg.vocab_size
        if any(t >= vocab for t in request.token_ids):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token_ids: must be in [0, {vocab})")
        return pb.DetokenizeResponse(text=self.tokenizer.decode(list(request.token_ids), request.skip_special_tokens))

    def GetModelInfo(self, request, context):
        cfg, info = self.engine.model.cfg, self.info
        return pb.GetModelInfoResponse(
            name=info.name, family=cfg.family, context_length=cfg.max_position_embeddings, dtype=info.dtype,
            device=info.device, expert_servers=info.expert_servers, experts=info.experts, vocab_size=cfg.vocab_size,
            kv_cache_tokens=self.engine.pool.num_blocks * self.engine.pool.block_size,
            generate_port=info.generate_port, chat_template=self.tokenizer.chat_template, eos_token_ids=self.tokenizer.eos_token_ids,
            bos_token=self.tokenizer.special_token("bos_token"), eos_token=self.tokenizer.special_token("eos_token"),
        )

    def GetStats(self, request, context):
        e = self.engine
        return pb.GetStatsResponse(running=len(e.running), waiting=len(e.waiting), kv_blocks_used=e.blocks_in_use,
                                   kv_blocks_total=e.pool.num_blocks, preemptions=e.preemptions,
                                   prefix_cache_queries=e.pool.queries, prefix_cache_hits=e.pool.hits)
