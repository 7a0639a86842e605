"""Generation for one sequence, synchronously: the engine with a single request and a cache sized
for it (the same code path the service runs, minus the threads)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from services.dense.engine import Engine, EngineConfig
from services.dense.models.decoder import MoeDecoder
from services.dense.request import Output, Request
from services.dense.sampling import SamplingParams

BLOCK = 16


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    finish_reason: str  # "stop" (an EOS or stop token, or a stop string) or "length"
    text: str = ""


def outputs(model: MoeDecoder, prompt: list[int], params: SamplingParams, eos_ids=(), tokenizer=None
            ) -> Iterator[Output]:
    """Streams the request's outputs; a failure raises its domain error."""
    limit = model.cfg.max_position_embeddings
    blocks = -(-min(len(prompt) + (params.max_tokens or limit), limit) // BLOCK)
    engine = Engine(model, EngineConfig(kv_blocks=max(blocks, 1), block_size=BLOCK,
                                        max_batch_tokens=max(len(prompt), 1), max_queue=0))
    request = engine.submit(Request("local", list(prompt), params, tuple(eos_ids), tokenizer))
    while True:
        engine.step()
        while not request.outputs.empty():
            out = request.outputs.get()
            if out.error is not None:
                raise out.error
            yield out
            if out.finished:
                return


def stream(model: MoeDecoder, prompt: list[int], params: SamplingParams, eos_ids=()) -> Iterator[int]:
    """Yields generated token ids; an EOS token is yielded, then the stream ends."""
    for out in outputs(model, prompt, params, eos_ids):
        yield from out.token_ids


def generate(model: MoeDecoder, prompt: list[int], params: SamplingParams, eos_ids=(), tokenizer=None) -> Generation:
    tokens, text, reason = [], "", "length"
    for out in outputs(model, prompt, params, eos_ids, tokenizer):
        tokens += out.token_ids
        text += out.text
        reason = out.finish_reason or reason
    return Generation(tokens, reason, text)
